"""A model's own maximum length, and the lengths a command uses fitted to it.

Every command that runs a model (generate, calibrate, train-exits, profile-verify) takes its lengths
through `fit_length`: a default that does not fit the model is clamped and said in one line; a value
the user gave that does not fit is a one-line error naming the flag, the model's limit and the
largest value allowed (ModelArgumentError: the CLI exits 2 before any engine starts).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_sparsever.models.builder import ModelArgumentError


def model_max_len(model: str | Path) -> int | None:
    """The model's own maximum length (config.json: max_position_embeddings), if it says."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def fit_length(command: str, flag: str, given: int | None, default: int, limit: int | None,
               headroom: int = 0) -> int:
    """The value of `flag` to use: `given` (the user's) or `default`, at most `limit - headroom`
    (`limit`: the model's maximum length, None: unknown; `headroom`: tokens the command adds)."""
    allowed = None if limit is None else limit - headroom
    why = f"the model's maximum length is {limit}" + (f", less {headroom} tokens the command adds" if headroom else "")
    if allowed is not None and allowed < 1:
        raise ModelArgumentError(f"{flag}: no length fits ({why})")
    if given is not None:
        if allowed is not None and given > allowed:
            raise ModelArgumentError(f"{flag} {given}: {why}; the largest {flag} allowed is {allowed}")
        return given
    if allowed is not None and default > allowed:
        print(f"{command}: {flag} {allowed} ({why})", flush=True)
        return allowed
    return default
