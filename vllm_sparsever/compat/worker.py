"""vLLM's V1 workers: which worker the sparsever worker extends and how its runner is installed.

Private symbols touched:
- `vllm.v1.worker.cpu_worker.CPUWorker.init_device(self)`: builds the runner as
  `CPUModelRunner(vllm_config, device)`, looking the class up by its *module-global* name;
- the module global `vllm.v1.worker.cpu_worker.CPUModelRunner`: swapped for the duration of
  `init_device` (start-up is single-threaded), `cpu_runner_class_override`;
- `vllm.v1.worker.gpu_worker.Worker._make_model_runner(self)`: the GPU worker's runner factory,
  overridden by the sparsever GPU worker;
- `Worker.use_v2_model_runner` (instance attribute): sparsever drives the V1 runner only.
Public: `vllm.platforms.current_platform.is_cpu()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm_sparsever.compat import replaced

# GPU worker hook overridden by the sparsever worker, with the parameters it assumes (after self).
GPU_WORKER_HOOKS: dict[str, tuple[str, ...]] = {"_make_model_runner": (), "init_device": ()}
CPU_WORKER_HOOKS: dict[str, tuple[str, ...]] = {"init_device": ()}
# The name CPUWorker.init_device resolves the runner class by (a module global).
CPU_RUNNER_GLOBAL = "CPUModelRunner"


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_worker_classes() -> tuple[type, type]:
    """(CPUWorker, CPUModelRunner)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    return CPUWorker, CPUModelRunner


def gpu_worker_classes() -> tuple[type, type]:
    """(GPU Worker, GPUModelRunner); importable without a GPU."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    return Worker, GPUModelRunner


@contextlib.contextmanager
def cpu_runner_class_override(runner_cls: type) -> Iterator[None]:
    """Make `CPUWorker.init_device` construct `runner_cls` instead of `CPUModelRunner`."""
    import vllm.v1.worker.cpu_worker as cpu_worker_module

    with replaced(cpu_worker_module, CPU_RUNNER_GLOBAL, runner_cls):
        yield


def uses_v2_model_runner(worker: Any) -> bool:
    return bool(getattr(worker, "use_v2_model_runner", False))
