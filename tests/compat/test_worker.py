"""vLLM's workers as the sparsever worker extends them (compat.worker)."""

import pytest

from vllm_sparsever.compat import check_signature
from vllm_sparsever.compat import worker as compat_worker


def test_cpu_worker_builds_its_runner_by_module_global_name():
    import vllm.v1.worker.cpu_worker as cpu_worker_module

    cpu_worker, cpu_runner = compat_worker.cpu_worker_classes()
    for name, params in compat_worker.CPU_WORKER_HOOKS.items():
        assert check_signature(cpu_worker, name, params) is None
    # init_device looks `CPUModelRunner` up as a global of its module: the override works only so.
    assert compat_worker.CPU_RUNNER_GLOBAL in cpu_worker.init_device.__code__.co_names
    assert getattr(cpu_worker_module, compat_worker.CPU_RUNNER_GLOBAL) is cpu_runner


def test_cpu_runner_class_override_swaps_and_restores():
    import vllm.v1.worker.cpu_worker as cpu_worker_module

    _, cpu_runner = compat_worker.cpu_worker_classes()

    class Mine(cpu_runner):
        pass

    with compat_worker.cpu_runner_class_override(Mine):
        assert cpu_worker_module.CPUModelRunner is Mine
    assert cpu_worker_module.CPUModelRunner is cpu_runner
    with pytest.raises(KeyError), compat_worker.cpu_runner_class_override(Mine):
        raise KeyError
    assert cpu_worker_module.CPUModelRunner is cpu_runner


def test_gpu_worker_runner_factory_and_v2_flag():
    """GPU worker: checked by import and signature only (no GPU here)."""
    gpu_worker, gpu_runner = compat_worker.gpu_worker_classes()
    cpu_worker, _ = compat_worker.cpu_worker_classes()
    for name, params in compat_worker.GPU_WORKER_HOOKS.items():
        assert check_signature(gpu_worker, name, params) is None
    assert "GPUModelRunnerV1" in gpu_worker._make_model_runner.__code__.co_varnames
    # `use_v2_model_runner` is set by the worker's __init__ (CPUWorker is a GPU Worker subclass).
    assert issubclass(cpu_worker, gpu_worker)
    assert "use_v2_model_runner" in gpu_worker.__init__.__code__.co_names


def test_uses_v2_model_runner():
    from types import SimpleNamespace

    assert compat_worker.uses_v2_model_runner(SimpleNamespace(use_v2_model_runner=True))
    assert not compat_worker.uses_v2_model_runner(SimpleNamespace(use_v2_model_runner=False))
    assert not compat_worker.uses_v2_model_runner(SimpleNamespace())


def test_sparsever_worker_is_built_on_the_platform_worker():
    from vllm_sparsever.integration import worker

    cpu_worker, cpu_runner = compat_worker.cpu_worker_classes()
    assert compat_worker.is_cpu_platform()
    assert issubclass(worker.SparseverWorker, cpu_worker)
    assert issubclass(worker.SparseverCPUModelRunner, cpu_runner)
