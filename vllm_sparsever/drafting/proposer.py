"""The proposer protocol: what the runner calls on sparsever's proposer, declared once.

One proposer class per method, as vLLM's `v1/spec_decode`: the draft model (draft_model.py), n-gram
prompt lookup (prompt_lookup.py), the target's own early exit (self_draft.py), an EAGLE head run by
sparsever (eagle_head.py), EVICT's cut of vLLM's own drafter's chains (vllm_drafter.py), drafting off
(no_draft.py), and hierarchical verification over one of them (hierarchical.py).
`factory.make_proposer` builds the one a config asks for.

The runner (integration/model_runner.py) calls only the methods below, at fixed points; no proposer
steers it by flags. Once, at start: `check_scheduling`; after the target loaded: `load`, then
`experts_observer`. Every step, in this order (docs/architecture.md, "Per-step call order", draws it):

1. `execute_model`: `forget(finished request ids)` and `note_prompts(new prompts)`, where there are any.
2. `_prepare_inputs`: `topologies(scheduled drafts)` (for the step's verification plan), then
   `streams_for_step(scheduled tokens)`.
3. `_model_forward`: `forward_from_streams(streams, positions)` where step 2 gave streams, else the
   target's own forward.
4. `_sample` (in vLLM's sample_tokens): on a verify step `observe_acceptance` per request, then
   `plan()`, the step's `DraftPlan`.
5. `propose_draft_token_ids` (vLLM calls it inside sample_tokens, unless the batch does not fit its
   drafter): vLLM's own drafter runs `plan.vllm_depth` draft steps if that is > 0; with
   `plan.target_states`, `observe_target_states` per request; unless `plan.after_bookkeeping`,
   `plan_depth(step)` then `propose(step)` here.
6. After vLLM's sample_tokens: with `plan.after_bookkeeping`, `plan_depth(step)` then `propose(step)`
   (from the committed tokens); on a decode step `observe_step_time`; then `stats_by_level` (metrics).

The defaults here are those of a proposer that drafts chains inside the step and learns nothing
from verification.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_sparsever.step import DraftPlan, DraftStep, TargetView
from vllm_sparsever.trees import DraftTopology


class Proposer:
    def check_scheduling(self, async_scheduling: bool) -> None:
        """At start: ValueError where this proposer cannot run under the engine's scheduling."""

    def load(self, target: TargetView) -> None:
        """After the target loaded: keep `target`, the part of the runner drafting may use."""
        raise NotImplementedError

    @property
    def lookahead(self) -> int:
        """KV positions from a request's sampled token on that its drafting may write in a step (the
        scheduler reserves them: `integration.speculative.self_draft_lookahead`); the step's
        per-request budgets are cut from it."""
        raise NotImplementedError

    def plan(self) -> DraftPlan:
        """How this step's drafting runs, asked once the step's tokens are sampled (before the
        step's bookkeeping and before vLLM's drafter would run)."""
        return DraftPlan()

    def plan_depth(self, step: DraftStep) -> int:
        """The draft levels for `step` (its `depth` is the fixed cap): EVICT's plan where the proposer
        prices drafts, else the cap; 0 skips drafting. The runner hands the result back in
        `propose`'s step."""
        return step.depth

    def propose(self, step: DraftStep) -> list[list[int]]:
        """The next step's drafts per batch row of `step` (what vLLM sampled and committed), within
        each row's budget and the step's depth."""
        raise NotImplementedError

    def forget(self, req_ids: set[str]) -> None:
        """Drop what is kept for these (finished) requests."""

    def note_prompts(self, to_compute: dict[str, int]) -> None:
        """Requests scheduled for the first time: the prompt tokens the target computes for each (its
        prompt less what the prefix cache supplied)."""

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        """Counters per drafting level (the metrics' drafting section)."""
        return {}

    def reset_stats(self) -> None:
        """Zero the counters."""

    def request_state(self) -> dict[str, int]:
        """Entries kept per request, by kind (0 once every request has finished)."""
        return {}

    # ---- what verification and the proposer tell each other, per step ----------------------

    def topologies(self, scheduled: dict[str, list[int]]) -> dict[str, DraftTopology]:
        """req id -> the topology of its scheduled drafts where they are a tree (chains: absent)."""
        return {}

    def observe_acceptance(self, req_id: str, verified: int, accepted_nodes: list[int]) -> None:
        """Verification's verdict on the drafts proposed for `req_id`: the first `verified` nodes were
        verified, `accepted_nodes` (node indices) accepted."""

    def observe_step_time(self, query_tokens: list[int], contexts: list[int], seconds: float, mask: str,
                          gap_s: float | None) -> None:
        """A decode step's measured time (drafting excluded), its shape, and the engine's time before
        it."""

    def experts_observer(self) -> Callable[[int, int], None] | None:
        """What the target's MoE layers report each verify step's routed experts to (EVICT over an
        MoE target: (tokens, distinct experts) per request and layer), wired by the runner after `load`;
        None: not wanted."""
        return None

    @property
    def state_layers(self) -> tuple[int, ...] | None:
        """(`DraftPlan.target_states`) The target layers whose incoming streams it reads (EAGLE-3), or
        None: the final hidden states (EAGLE)."""
        return None

    def observe_target_states(self, req_id: str, first_position: int, token_ids: list[int], states: Any) -> None:
        """(`DraftPlan.target_states`) The target's states of `token_ids` at positions
        `first_position`, ... of request `req_id`, from the step's full pass."""

    def streams_for_step(self, num_scheduled_tokens: Any) -> Any:
        """Saved residual streams of every scheduled token when the full pass about to run may start
        from them (hierarchical verification), for `forward_from_streams`; else None."""
        return None

    def forward_from_streams(self, streams: Any, positions: Any) -> Any:
        """The target's forward for the step from `streams_for_step`'s streams (inside vLLM's forward
        context and the step's verification plan)."""
        raise NotImplementedError


class ProposesAfterBookkeeping:
    """Mixin, before `Proposer`: a proposer that drafts from the step's committed tokens (the draft
    model's drafter, an EAGLE head sparsever runs), so after vLLM's bookkeeping, which needs
    synchronous scheduling."""

    def check_scheduling(self, async_scheduling: bool) -> None:
        if async_scheduling:
            raise ValueError(f"{type(self).__name__} drafts from the step's committed tokens, after the step's "
                             "bookkeeping")

    def plan(self) -> DraftPlan:
        return DraftPlan(after_bookkeeping=True)
