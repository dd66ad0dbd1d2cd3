"""Ray `worker_process_setup_hook`: runs in every Ray worker process of the vLLM job, before it
creates any actor (the platform puts it in `parallel_config.ray_runtime_env`, which vLLM passes to
`ray.init`). It adapts vLLM's Ray worker (`RayWorkerProc`) to a CPU node:

1. its resource lookup reads the custom Ray resource instead of Ray's accelerator ids;
2. before the CPU worker starts, the process is bound to its CPUs (`binding`);
3. the shared-memory all-reduce name gets the Ray node id, so ranks on different nodes use gloo;
4. gloo binds to the interface that holds this node's Ray address (`GLOO_SOCKET_IFNAME`), unless the
   node's own environment names one: by default gloo binds to the address the host name resolves
   to, often the loopback (`127.0.1.1 myhost` in /etc/hosts), which a rank on another host cannot
   reach;
5. vLLM's own address for this worker (`VLLM_HOST_IP`, which its tensor-parallel message queue
   advertises to the other ranks) is the node's Ray address unless the node's environment sets
   it: vLLM otherwise takes the default route's address, which on a host with several interfaces
   may not be the one the other nodes reach (seen: a rank on another host waited forever).
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("vllm_sparsever")

_installed = False
# OMP_NUM_THREADS as the user set it: Ray sets it to 1 for actors later (at actor creation).
_user_omp_threads: int | None = None
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
# GLOO_SOCKET_IFNAME as this node's `ray start` environment set it (vLLM later copies the driver's
# environment into the worker with setdefault: the head's interface name, maybe not this host's).
_node_gloo_ifname: str | None = None
HOST_IP_ENV = "VLLM_HOST_IP"
_node_host_ip: str | None = None  # VLLM_HOST_IP of this node's `ray start` environment


def install() -> None:
    global _installed, _user_omp_threads, _node_gloo_ifname, _node_host_ip
    if _installed:
        return
    _node_gloo_ifname = os.environ.get(GLOO_IFNAME_ENV) or None
    _node_host_ip = os.environ.get(HOST_IP_ENV) or None
    from vllm_sparsever.compat import ray_executor as compat
    from vllm_sparsever.integration.ray_cpu import binding

    _user_omp_threads = binding.env_int("OMP_NUM_THREADS")
    proc = compat.ray_worker_proc_cls()
    if getattr(proc, "_sparsever_ray_cpu", False):
        _installed = True
        return
    original_initialize = proc.initialize_worker

    def get_node_and_physical_gpu_ids(self):  # noqa: ARG001 - method
        import ray

        from vllm_sparsever.integration.ray_cpu import ray_resource_name

        context = ray.get_runtime_context()
        key = ray_resource_name()
        if context.get_assigned_resources().get(key, 0) <= 0:
            raise RuntimeError(
                f"this Ray worker holds no {key!r} resource; start every Ray node with "
                f"`ray start --resources='{{\"{key}\": <workers on the node>}}'` "
                f"(docs/serving.md: Ray on CPU)")
        # vLLM groups workers per node by these ids; a CPU worker never reads them otherwise.
        return context.get_node_id(), [os.getpid()]

    @functools.wraps(original_initialize)
    def initialize_worker(self, local_rank, env_vars, distributed_init_method,
                          driver_env_vars=None, assigned_physical_gpu_ids=None):
        # vLLM applies these the same way (node values win over the driver's) just before the
        # worker starts; the binding must see them first.
        for key, value in (driver_env_vars or {}).items():
            os.environ.setdefault(key, value)
        os.environ.update(env_vars)
        workers_on_node = len(assigned_physical_gpu_ids or ()) or 1
        chosen = binding.cpu_binding_for(
            os.environ.get(binding.BIND_ENV), local_rank, workers_on_node,
            compat.is_driver_node(self), compat.allowed_cpus(),
            binding.env_int(binding.RESERVED_ENV), _user_omp_threads)
        binding.apply(chosen)
        logger.info("sparsever Ray CPU worker pid %d: local rank %d of %d on its node, CPUs %s, "
                    "%d threads", os.getpid(), local_rank, workers_on_node,
                    "unbound" if chosen.cpus is None else list(chosen.cpus), chosen.num_threads)
        _suffix_dist_ident()
        _set_node_addresses()
        return original_initialize(self, local_rank, env_vars, distributed_init_method,
                                   driver_env_vars, assigned_physical_gpu_ids)

    proc.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids
    proc.initialize_worker = initialize_worker
    proc._sparsever_ray_cpu = True
    _installed = True


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this host, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def _set_node_addresses() -> None:
    """VLLM_HOST_IP: the node's own value, else this node's Ray address (the address the other
    ranks reach it at). GLOO_SOCKET_IFNAME: the node's own value, else the interface of that
    address, else whatever was there (left alone)."""
    import ray

    address = ray.util.get_node_ip_address()
    os.environ[HOST_IP_ENV] = _node_host_ip or address
    if _node_gloo_ifname:
        os.environ[GLOO_IFNAME_ENV] = _node_gloo_ifname
        return
    name = interface_of(address)
    if name is None:
        logger.warning("sparsever Ray CPU worker: no interface holds this node's Ray address %s; gloo "
                       "binds where %s=%r says (unset: the host name's address)", address,
                       GLOO_IFNAME_ENV, os.environ.get(GLOO_IFNAME_ENV))
        return
    os.environ[GLOO_IFNAME_ENV] = name
    logger.info("sparsever Ray CPU worker pid %d: gloo on %s (%s, this node's Ray address)",
                os.getpid(), name, address)


def _suffix_dist_ident() -> None:
    """Give the CPU shared-memory group name this Ray node's id (see compat.ray_executor)."""
    import ray

    from vllm_sparsever.compat import ray_executor as compat

    module = compat.cpu_worker_module()
    original = module.init_worker_distributed_environment
    if getattr(original, "_sparsever_node_suffix", False):
        return
    node = ray.get_runtime_context().get_node_id()[:16]

    @functools.wraps(original)
    def init_worker_distributed_environment(*args, **kwargs):
        ident = os.environ.get(compat.DIST_IDENT_ENV)
        if ident is not None and not ident.endswith(node):
            os.environ[compat.DIST_IDENT_ENV] = f"{ident}-{node}"
        return original(*args, **kwargs)

    init_worker_distributed_environment._sparsever_node_suffix = True
    module.init_worker_distributed_environment = init_worker_distributed_environment
