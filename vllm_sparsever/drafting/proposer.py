"""The proposer protocol: what the runner calls on sparsever's proposer, declared once.

One proposer class per method, as vLLM's `v1/spec_decode`: the draft model (draft_model.py), n-gram
prompt lookup (prompt_lookup.py), the target's own early exit (self_draft.py), an EAGLE head run by
sparsever (eagle_head.py), drafting off (no_draft.py), and hierarchical
verification over one of them (hierarchical.py). `factory.make_proposer` builds the one a config asks
for. Proposers are driven by the runner once per step; the defaults here are those of a proposer
that drafts chains and learns nothing from verification.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_sparsever.step import DraftStep, TargetView
from vllm_sparsever.trees import DraftTopology


class Proposer:
    # True for a proposer that prices steps (EVICT): the runner then hands it each decode step's
    # measured time (observe_step_time), computing the step's shape only then.
    wants_step_times = False
    # True for a proposer that cuts what vLLM's own drafter proposed (EVICT over an EAGLE head): the
    # runner has vLLM's drafter run as deep as `plan_before_vllm_drafts` says, then calls `propose`
    # after the step's bookkeeping.
    cuts_vllm_drafts = False
    # True for a proposer that needs the step's committed tokens (the draft model's drafter; EVICT's
    # cut of vLLM's drafts): the runner calls `propose` after the step's bookkeeping (sample_tokens),
    # which needs synchronous scheduling.
    proposes_late = False
    # True for a proposer that drafts from the target's states (an EAGLE head in the hierarchy): the
    # runner hands it every target pass's states of the step's tokens (observe_target_states).
    wants_target_states = False

    def load(self, target: TargetView) -> None:
        """After the target loaded: keep `target`, the part of the runner drafting may use."""
        raise NotImplementedError

    @property
    def lookahead(self) -> int:
        """KV positions from a request's sampled token on that its drafting may write in a step (the
        scheduler reserves them: `integration.speculative.self_draft_lookahead`); the step's
        per-request budgets are cut from it."""
        raise NotImplementedError

    def plan_depth(self, step: DraftStep) -> int:
        """The draft levels for `step` (its `depth` is the fixed cap): EVICT's plan where the proposer
        prices drafts, else the cap; 0 skips drafting. The runner hands the result back in
        `propose`'s step."""
        return step.depth

    def propose(self, step: DraftStep) -> list[list[int]]:
        """The next step's drafts per batch row of `step` (what vLLM sampled and committed), within
        each row's budget and the step's depth."""
        raise NotImplementedError

    def plan_before_vllm_drafts(self) -> int:
        """(cuts_vllm_drafts) The draft steps vLLM's drafter is to run this step (>= 1)."""
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
        it (only where `wants_step_times`)."""

    def experts_observer(self) -> Callable[[int, int], None] | None:
        """What the target's MoE layers report each verify step's routed experts to (EVICT over an
        MoE target: (tokens, distinct experts) per request and layer), wired by the runner after `load`;
        None: not wanted."""
        return None

    @property
    def state_layers(self) -> tuple[int, ...] | None:
        """(wants_target_states) The target layers whose incoming streams it reads (EAGLE-3), or None:
        the final hidden states (EAGLE)."""
        return None

    def observe_target_states(self, req_id: str, first_position: int, token_ids: list[int], states: Any) -> None:
        """(wants_target_states) The target's states of `token_ids` at positions `first_position`, ...
        of request `req_id`, from the step's full pass."""

    def streams_for_step(self, num_scheduled_tokens: Any) -> tuple[int, Any] | None:
        """(layer, residual streams of every scheduled token) when the full pass about to run may
        start from saved hidden states (hierarchical verification); else None."""
        return None
