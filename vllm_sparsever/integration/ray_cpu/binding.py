"""Which CPUs a vLLM CPU worker started by Ray runs on, and with how many threads.

vLLM binds CPU workers only in its multiprocessing executor (it sets the OpenMP variables before
forking); a Ray actor starts with Ray's `OMP_NUM_THREADS=1` and no affinity, i.e. single-threaded.
This module applies vLLM's `VLLM_CPU_OMP_THREADS_BIND` rules per Ray node instead:

- `"auto"` (vLLM's default): one logical CPU per physical core; a NUMA node per worker when the
  node has at least as many NUMA nodes as workers, else an even split of the cores; the driver
  node keeps `VLLM_CPU_NUM_OF_RESERVED_CPU` cores (default 1) for the engine core;
- `"0-3|4-7"`: explicit per-worker lists, indexed by the worker's rank *on its Ray node* (set it
  in each node's `ray start` environment: nodes differ);
- `"nobind"`: no affinity; threads from the user's `OMP_NUM_THREADS` (as it was before Ray set
  it), else the allowed CPUs divided by the workers on the node.

Binding is per process (OpenMP threads inherit the mask and float inside it), not per thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


@dataclass(frozen=True)
class CpuBinding:
    cpus: tuple[int, ...] | None  # None: leave the affinity alone
    num_threads: int


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{BIND_ENV}: {text!r} is not a CPU list like '0-3,6'") from None
        if first < 0 or last < first:
            raise ValueError(f"{BIND_ENV}: bad CPU range {part!r} in {text!r}")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{BIND_ENV}: empty CPU list in {text!r}")
    return cpus


def cpu_binding_for(
    spec: str | None,
    local_rank: int,
    workers_on_node: int,
    is_driver_node: bool,
    allowed: list[tuple[int, int, int]],
    reserved: int | None = None,
    user_omp_threads: int | None = None,
) -> CpuBinding:
    """The binding of worker `local_rank` of `workers_on_node` on one Ray node.

    `allowed`: (cpu id, physical core, NUMA node) of the CPUs the process may use.
    """
    spec = (spec or "auto").strip()
    if not 0 <= local_rank < workers_on_node:
        raise ValueError(f"local rank {local_rank} outside 0..{workers_on_node - 1}")
    if spec == "nobind":
        threads = user_omp_threads or max(1, len(allowed) // workers_on_node)
        return CpuBinding(None, threads)
    if spec != "auto":
        lists = spec.split("|")
        if len(lists) != workers_on_node:
            raise ValueError(
                f"{BIND_ENV}: {spec!r} gives {len(lists)} CPU list(s) but this Ray node runs "
                f"{workers_on_node} vLLM worker(s); give one list per worker on the node "
                f"(separated by '|'), 'auto' or 'nobind'")
        cpus = parse_cpu_list(lists[local_rank])
        allowed_ids = {c[0] for c in allowed}
        outside = sorted(set(cpus) - allowed_ids)
        if outside:
            raise ValueError(f"{BIND_ENV}: CPUs {outside} are not available to this process "
                             f"(allowed: {sorted(allowed_ids)})")
        return CpuBinding(tuple(cpus), len(cpus))
    # auto: the first logical CPU of every physical core, in NUMA order.
    seen: set[tuple[int, int]] = set()
    cores: list[tuple[int, int]] = []  # (numa node, cpu id)
    for cpu, core, numa in sorted(allowed, key=lambda c: (c[2], c[0])):
        if (numa, core) not in seen:
            seen.add((numa, core))
            cores.append((numa, cpu))
    keep = (1 if reserved is None else reserved) if is_driver_node else 0
    keep = min(keep, max(0, len(cores) - workers_on_node))  # every worker gets a core
    pool = cores[: len(cores) - keep] if keep else cores
    numa_nodes = sorted({numa for numa, _ in pool})
    if len(numa_nodes) >= workers_on_node:
        mine = [cpu for numa, cpu in pool if numa == numa_nodes[local_rank]]
    else:
        per = len(pool) // workers_on_node
        mine = [cpu for _, cpu in pool[local_rank * per:(local_rank + 1) * per]]
    return CpuBinding(tuple(mine), len(mine))


def apply(binding: CpuBinding) -> None:
    """Bind every thread of this process and size torch's thread pool.

    Must run before vLLM's CPU worker starts (it replaces `torch.set_num_threads` by a no-op).
    """
    import torch

    if binding.cpus is not None:
        mask = set(binding.cpus)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), mask)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile, or one we may not touch
    os.environ["OMP_NUM_THREADS"] = str(binding.num_threads)
    torch.set_num_threads(binding.num_threads)


def env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None
