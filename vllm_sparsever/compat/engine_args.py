"""vLLM engine arguments: where `{"method": "sparsever"}` enters before `SpeculativeConfig` exists.

Private symbols touched:
- `vllm.engine.arg_utils.EngineArgs.create_speculative_config(self, target_model_config,
  target_parallel_config)`: wrapped class-wide, once per process (the only hook that sees the raw
  speculative dict before vLLM's pydantic `SpeculativeConfig` rejects unknown methods/fields; the
  wrapper passes every non-sparsever request straight to vLLM's method);
- `EngineArgs.spec_method` / `spec_model` / `spec_tokens` (the `--spec-*` flags) and vLLM's merge of
  them into `speculative_config`, which is inline in `create_speculative_config` (no function to
  call): `merge_spec_cli_aliases` follows it step for step, and tests/compat checks it against
  vLLM's own method on the same inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# vLLM's `--spec-*` flags: (flag, speculative_config key, EngineArgs attribute), in vLLM's order.
SPEC_CLI_ALIASES: tuple[tuple[str, str, str], ...] = (
    ("--spec-method", "method", "spec_method"),
    ("--spec-model", "model", "spec_model"),
    ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
)

# create_speculative_config(self, <these>)
CREATE_SPECULATIVE_CONFIG_PARAMS = ("target_model_config", "target_parallel_config")

# handler(engine_args, call_vllm, target_model_config, target_parallel_config); `call_vllm(...)` runs
# vLLM's own create_speculative_config on the same arguments.
SpeculativeConfigHandler = Callable[[Any, Callable[[], Any], Any, Any], Any]


def engine_args_cls() -> type:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def uses_cuda_graphs(engine_args: Any) -> bool:
    """Whether the engine will capture CUDA graphs on a GPU: not `enforce_eager`, and the compilation
    config's cudagraph_mode unset (vLLM's default turns graphs on) or other than NONE."""
    if getattr(engine_args, "enforce_eager", False):
        return False
    compilation = getattr(engine_args, "compilation_config", None)
    mode = (compilation.get("cudagraph_mode") if isinstance(compilation, dict)
            else getattr(compilation, "cudagraph_mode", None))
    if mode is None:
        return True
    return str(getattr(mode, "name", mode)).upper() != "NONE"


def spec_method_flag(engine_args: Any) -> str | None:
    """The `--spec-method` value, if any."""
    return getattr(engine_args, "spec_method", None)


def merge_spec_cli_aliases(engine_args: Any) -> dict[str, Any] | None:
    """vLLM's merge of `--spec-*` flags into `speculative_config`, consuming the flags.

    Same rules as vLLM: a flag and the same key in the dict are mutually exclusive (ValueError, vLLM's
    message), "-" in keys becomes "_". The flags are reset to None afterwards, so that when vLLM's
    own method runs later on the rewritten config it does not merge them a second time.
    """
    spec = engine_args.speculative_config
    spec = None if spec is None else dict(spec)
    for flag, key, attr in SPEC_CLI_ALIASES:
        value = getattr(engine_args, attr, None)
        if value is None:
            continue
        if spec is None:
            spec = {}
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    if spec is None:
        return None
    for _, _, attr in SPEC_CLI_ALIASES:
        if hasattr(engine_args, attr):
            setattr(engine_args, attr, None)
    return {k.replace("-", "_"): v for k, v in spec.items()}


def wrap_create_speculative_config(handler: SpeculativeConfigHandler) -> bool:
    """Route `EngineArgs.create_speculative_config` through `handler` (class-wide, idempotent).

    Returns False when it was already wrapped in this process."""
    cls = engine_args_cls()
    original = cls.create_speculative_config
    if getattr(original, "_sparsever_wrapped", False):
        return False

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        def call_vllm():
            return original(self, target_model_config, target_parallel_config)

        return handler(self, call_vllm, target_model_config, target_parallel_config)

    create_speculative_config._sparsever_wrapped = True  # type: ignore[attr-defined]
    cls.create_speculative_config = create_speculative_config
    return True
