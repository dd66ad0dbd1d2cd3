"""Where built models and data live: `$VLLM_SPARSEVER_HOME` (default `~/.cache/vllm-sparsever`)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "VLLM_SPARSEVER_HOME"


def sparsever_home() -> Path:
    """Root of everything this package builds; resolved at call time so tests can redirect it."""
    home = os.environ.get(HOME_ENV)
    return Path(home).expanduser() if home else Path.home() / ".cache" / "vllm-sparsever"


def models_root(root: str | os.PathLike | None = None) -> Path:
    return Path(root).expanduser() if root is not None else sparsever_home() / "models"


def data_root(root: str | os.PathLike | None = None) -> Path:
    return Path(root).expanduser() if root is not None else sparsever_home() / "data"
