"""vLLM's environment check (`Platform.validate_environ`, run by `EngineArgs.create_engine_config`)
warns about every unknown `VLLM_*` variable, and refuses to start under
`--fail-on-environ-validation`; sparsever's own variables are declared to it here."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable


def declare_environment_variables(names: Iterable[str]) -> None:
    """Add `names` to `vllm.envs.environment_variables` (read as plain strings; vLLM's names win)."""
    from vllm import envs

    for name in names:
        envs.environment_variables.setdefault(name, functools.partial(os.environ.get, name))
