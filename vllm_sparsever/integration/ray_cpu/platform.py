"""`SparseverRayCpuPlatform`: vLLM-CPU's platform plus a Ray resource key (opt-in, see __init__)."""

from __future__ import annotations

import os
from typing import Any

from vllm_sparsever.compat.ray_executor import cpu_platform_cls, uses_ray_v2_executor
from vllm_sparsever.integration.ray_cpu import (
    OPT_IN_ENV,
    RESOURCE_ENV,
    WORKER_HOOK_QUALNAME,
    ray_resource_name,
)

# Variables every Ray worker process needs from its start (the platform is chosen at import,
# LD_PRELOAD acts at exec); vLLM's own copy of the driver environment comes too late for them.
START_ENV_VARS = (OPT_IN_ENV, RESOURCE_ENV, "VLLM_PLUGINS", "LD_PRELOAD")

_CpuPlatform = cpu_platform_cls()


class SparseverRayCpuPlatform(_CpuPlatform):
    """Same as vLLM's CpuPlatform (`is_cpu()` stays true) except that Ray can place workers."""

    ray_device_key: str = ray_resource_name()

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        parallel_config = vllm_config.parallel_config
        if parallel_config.use_ray:
            check_ray_parallel_config(parallel_config)
            parallel_config.ray_runtime_env = with_worker_setup(parallel_config.ray_runtime_env)


def check_ray_parallel_config(parallel_config: Any) -> None:
    if not uses_ray_v2_executor():
        raise ValueError(
            "VLLM_USE_RAY_V2_EXECUTOR_BACKEND: Ray on vLLM-CPU (VLLM_SPARSEVER_RAY_CPU=1) runs on "
            "vLLM's V2 Ray executor only (allowed: 1, the default)")
    if getattr(parallel_config, "data_parallel_size", 1) > 1:
        raise ValueError(
            "data_parallel_size: Ray on vLLM-CPU (VLLM_SPARSEVER_RAY_CPU=1) supports tensor and "
            f"pipeline parallelism (allowed: 1), got {parallel_config.data_parallel_size}")


def with_worker_setup(runtime_env: Any) -> Any:
    """`runtime_env` plus our worker set-up hook and the start-up variables (user keys win)."""
    from ray.runtime_env import RuntimeEnv

    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, WORKER_HOOK_QUALNAME):
        raise ValueError(
            f"ray_runtime_env.worker_process_setup_hook: Ray on vLLM-CPU needs its own hook "
            f"{WORKER_HOOK_QUALNAME!r} (allowed: unset or that value), got {hook!r}")
    env["worker_process_setup_hook"] = WORKER_HOOK_QUALNAME
    env_vars = dict(env.get("env_vars") or {})
    for name in START_ENV_VARS:
        if name in os.environ:
            env_vars.setdefault(name, os.environ[name])
    env["env_vars"] = env_vars
    return RuntimeEnv(**env)
