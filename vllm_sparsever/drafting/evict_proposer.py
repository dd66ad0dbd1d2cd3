"""EVICT over a tree drafter (config section adaptive): `EvictProposer` wraps a drafter that grows
draft trees or chains (drafting/tree_drafter.py: the draft model, the self-drafter, an EAGLE head
sparsever runs, n-gram lookup, vLLM's own drafter's chains), as `HierarchicalProposer` wraps its
levels, and asks EVICT only through its facade (adaptive/policy.py, `EvictPolicy`):

- `plan`: where the drafter's plan runs vLLM's own drafter first, EVICT plans the step's depth before
  it runs (at least one draft step: its first pass also writes the head's KV);
- `plan_depth`: otherwise EVICT's depth from the step (its catch-up, less what rides with prompts the
  target computed; the requests' remaining tokens);
- while the drafter grows (it calls this proposer as its `GrowthRule`): whether one more level pays,
  then the step's trees cut to what pays for their verification;
- after verification: each request's verdict and the decode step's time calibrate EVICT.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm_sparsever.adaptive.policy import DraftShape, EvictPolicy
from vllm_sparsever.drafting.drafter import DraftRequests, collect_draft_requests
from vllm_sparsever.drafting.proposer import Proposer
from vllm_sparsever.step import DraftPlan, DraftStep, TargetView
from vllm_sparsever.trees import DraftTopology, DraftTree


class EvictProposer(Proposer):
    def __init__(self, drafter: Any, adaptive: Any) -> None:
        """`drafter`: a `TreeDrafting` drafter with a tree config (`tree_drafter.chain_tree` for
        chains); `adaptive`: the config's AdaptiveVerificationConfig."""
        self.drafter = drafter
        self.adaptive = adaptive
        self.evict: EvictPolicy | None = None  # once the target's cost profile is loaded
        self.target: Any = None
        self._prompts: dict[str, int] = {}  # req id -> prompt tokens the target computed, until it drafts
        self._planned: int | None = None  # this step's depth, planned before vLLM's drafter ran
        self._catch_up = 0  # the catch-up of the step being drafted
        drafter.grow_under(self)

    def check_scheduling(self, async_scheduling: bool) -> None:
        self.drafter.check_scheduling(async_scheduling)

    def load(self, target: TargetView) -> None:
        self.drafter.load(target)
        self.target = target
        config = target.model_config
        self.evict = EvictPolicy.for_target(self.adaptive, config.model, config.dtype, target.moe_routing,
                                            depth_prior=self.drafter.depth_prior, draft_cost=self.drafter.draft_cost,
                                            agree=_agreed)

    @property
    def lookahead(self) -> int:
        return self.drafter.lookahead

    def experts_observer(self) -> Any:
        return self.evict.experts_observer()

    # ---- per step -------------------------------------------------------------------------

    def plan(self) -> DraftPlan:
        plan = self.drafter.plan()
        self._planned = None
        if plan.vllm_depth:  # vLLM's drafter drafts first: EVICT plans how deep before it runs
            contexts = self.target.step_contexts()
            k = plan.vllm_depth
            shape = DraftShape(cap=k, budgets=(k,) * len(contexts), first=1, later=1, mask="chain", one_pass=False)
            seeded = any(self.target.seeded_sampling(row) for row in range(len(contexts)))
            self._planned = self.evict.plan_depth(contexts, shape, 0, seeded=seeded) if contexts else k
            depth = max(1, self._planned)
            self.drafter.run_vllm_drafter(depth)
            plan = replace(plan, vllm_depth=depth)
        return plan

    def plan_depth(self, step: DraftStep) -> int:
        """EVICT's depth for this step (0: skip drafting)."""
        drafter = self.drafter
        reqs = collect_draft_requests(step, drafter.num_speculative_tokens)
        if not reqs.rows:
            return 0
        if self._planned is not None:
            return min(self._planned, drafter.tree.depth)
        catch_up = self._catch_up_to_plan(reqs)
        prompts = max(drafter.catch_up_tokens(reqs) - catch_up, 0)
        remaining = [lim.remaining_tokens for lim in step.limits_of(reqs.rows)]
        horizon = max(remaining) if remaining and all(r is not None for r in remaining) else None
        return self.evict.plan_depth(list(reqs.positions), drafter.draft_shape(reqs), catch_up,
                                     seeded=any(drafter.seeded(reqs)), prompt_tokens=prompts, horizon_tokens=horizon)

    def propose(self, step: DraftStep) -> list[list[int]]:
        return self.drafter.propose(step)  # it grows under this proposer's rule (begin, keep_growing, cut)

    def topologies(self, scheduled: dict[str, list[int]]) -> dict[str, DraftTopology]:
        return self.drafter.topologies(scheduled)

    def observe_acceptance(self, req_id: str, verified: int, accepted_nodes: list[int]) -> None:
        """Calibrates EVICT: per node by path probability, per depth for the next step's depth."""
        self.drafter.observe_acceptance(req_id, verified, accepted_nodes)
        tree = self.drafter.proposed_tree(req_id)
        if tree is not None:
            self.evict.observe_acceptance(tree, verified, accepted_nodes)

    def observe_step_time(self, query_tokens: list[int], contexts: list[int], seconds: float, mask: str,
                          gap_s: float | None) -> None:
        self.evict.observe_step(query_tokens, contexts, seconds, mask, gap_s)

    @property
    def state_layers(self) -> tuple[int, ...] | None:
        return self.drafter.state_layers

    def observe_target_states(self, req_id: str, first_position: int, token_ids: list[int], states: Any) -> None:
        self.drafter.observe_target_states(req_id, first_position, token_ids, states)

    # ---- the drafter's growth rule (tree_drafter.GrowthRule) ----------------------------------

    def begin(self, reqs: DraftRequests) -> bool:
        """The step's requests draft: their prompts' credit (`_catch_up_to_plan`) is spent."""
        self._catch_up = self.drafter.catch_up_tokens(reqs)
        credit = self._prompt_credit(reqs)
        for req_id in reqs.req_ids:
            self._prompts.pop(req_id, None)
        return EvictPolicy.catch_up_rides_with_prompt(self._catch_up, credit)

    def keep_growing(self, reqs: DraftRequests, shape: DraftShape, idx: list[int], passes: int,
                     trees: list[DraftTree], frontiers: list[list[int]]) -> bool:
        return self.evict.keep_drafting([reqs.positions[i] for i in idx],
                                        replace(shape, budgets=tuple(shape.budgets[i] for i in idx)), passes, trees,
                                        frontiers)

    def cut(self, reqs: DraftRequests, trees: list[DraftTree], passes: list[float], seconds: float) -> list[DraftTree]:
        self.evict.observe_drafting(len(reqs.rows), passes, seconds, self._catch_up)
        # A step of chains only is verified without a tree mask (vLLM's attention path).
        mask = "chain" if all(t.is_chain() for t in trees) else "tree"
        # A request's verify step has its root (last committed token) at `position`: the context
        # before it is `position` tokens.
        return self.evict.truncate(trees, list(reqs.positions), passes=len(passes), mask=mask,
                                   whole=self.drafter.seeded(reqs))

    def _catch_up_to_plan(self, reqs: DraftRequests) -> int:
        """The catch-up EVICT weighs this step (rent or buy: adaptive/evict.py): the drafter's
        catch-up less the prompt tokens the target itself computed for the step's requests that
        have not drafted yet. That part rides with the prompt: the draft's prefill of it is no more
        work than the target's was, run on their first drafting step, as vLLM's draft_model
        prefills its draft. What is left is a prompt the prefix cache supplied, or the tokens
        decoded plainly since the prompt (each plain step adds one: a credit compared with the
        whole catch-up would never cover it again)."""
        return max(self.drafter.catch_up_tokens(reqs) - self._prompt_credit(reqs), 0)

    def _prompt_credit(self, reqs: DraftRequests) -> int:
        return sum(self._prompts.get(req_id, 0) for req_id in reqs.req_ids)

    # ---- requests and counters --------------------------------------------------------------

    def forget(self, req_ids: set[str]) -> None:
        self.drafter.forget(req_ids)
        for req_id in req_ids:
            self._prompts.pop(req_id, None)

    def note_prompts(self, to_compute: dict[str, int]) -> None:
        self.drafter.note_prompts(to_compute)
        self._prompts.update(to_compute)

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        levels = self.drafter.stats_by_level()
        if self.evict is not None:
            levels["evict"] = self.evict.summary()
        return levels

    def reset_stats(self) -> None:
        self.drafter.reset_stats()
        if self.evict is not None:
            self.evict.reset_stats()

    def request_state(self) -> dict[str, int]:
        return self.drafter.request_state()


def _agreed(decision: Any) -> Any:
    """EVICT's `decision` as tensor-parallel rank 0 took it, on every rank: its times are measured on
    each rank, and ranks that drafted different depths would run different passes (the draft's
    collectives would hang) and verify different trees."""
    from vllm_sparsever.compat.sampling import same_on_every_tp_rank

    return same_on_every_tp_rank(decision)
