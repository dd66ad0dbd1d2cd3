"""vLLM's Ray executor (V2) and CPU platform internals that Ray on vLLM-CPU needs.

Private symbols touched:
- `vllm.platforms.cpu_platform_plugin()` (which CPU platform class vLLM would pick) and
  `vllm.platforms.cpu.CpuPlatform` (the class our Ray platform extends);
- `vllm.envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND` (only the V2 executor is supported);
- `ParallelConfig.ray_runtime_env` (vLLM passes it to `ray.init` and to every worker actor);
- `vllm.v1.executor.ray_executor_v2.RayWorkerProc`, patched class-wide inside Ray worker processes
  only (never in the engine or the front end):
  `get_node_and_physical_gpu_ids(self)` (stock: `get_accelerator_ids()[ray_device_key]`, a
  KeyError for a custom resource, which Ray does not list as an accelerator) and
  `initialize_worker(self, local_rank, env_vars, distributed_init_method, driver_env_vars,
  assigned_physical_gpu_ids)` (wrapped to bind CPU threads before the CPU worker starts),
  attribute `_is_driver_node`;
- `vllm.v1.worker.cpu_worker.init_worker_distributed_environment` (module global, wrapped) and the
  `VLLM_DIST_IDENT` variable `CPUWorker.init_device` sets just before calling it: vLLM's CPU
  shared-memory all-reduce is keyed by that name alone, so ranks on different hosts would pick
  shared memory; a per-Ray-node suffix makes them fall back to gloo (vLLM checks that all ranks
  agree on the name);
- `vllm.utils.cpu_resource_utils.get_allowed_cpu_list()` and `LogicalCPUInfo(id, physical_core,
  numa_node)` (the CPUs and cores this process may use).
"""

from __future__ import annotations

from typing import Any

# RayWorkerProc.initialize_worker(self, <these>)
INITIALIZE_WORKER_PARAMS = (
    "local_rank", "env_vars", "distributed_init_method", "driver_env_vars",
    "assigned_physical_gpu_ids",
)
GET_NODE_AND_IDS = "get_node_and_physical_gpu_ids"
DIST_IDENT_ENV = "VLLM_DIST_IDENT"


def builtin_cpu_platform_qualname() -> str | None:
    """The platform class vLLM's own CPU plugin would activate (None: not a CPU build)."""
    from vllm.platforms import cpu_platform_plugin

    return cpu_platform_plugin()


def cpu_platform_cls() -> type:
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform


def uses_ray_v2_executor() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND)


def ray_worker_proc_cls() -> type:
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    return RayWorkerProc


def is_driver_node(worker_proc: Any) -> bool:
    return bool(getattr(worker_proc, "_is_driver_node", False))


def cpu_worker_module() -> Any:
    import vllm.v1.worker.cpu_worker as cpu_worker

    return cpu_worker


def allowed_cpus() -> list[tuple[int, int, int]]:
    """(cpu id, physical core, NUMA node) of every CPU this process may run on."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    return [(c.id, c.physical_core, c.numa_node) for c in get_allowed_cpu_list()]
