"""Draft budgets as the proposer's input: per-request budgets from the step (KV slots, max_model_len)
and the step's depth (the cap, or EVICT's plan) bound what a proposer drafts (no engine)."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from vllm_sparsever.step import DraftStep, RequestLimits, draft_budgets
from vllm_sparsever.drafting.drafter import RoundDrafter, collect_draft_requests
from vllm_sparsever.drafting.evict_proposer import EvictProposer
from vllm_sparsever.drafting.tree_drafter import TreeDrafting, chain_tree


def _step(sampled, num_tokens, allocated, lookahead, depth, max_model_len=1000, remaining=None) -> DraftStep:
    num_tokens = np.array(num_tokens)
    budgets, slot_limited = draft_budgets(sampled, num_tokens, np.array(allocated), lookahead, max_model_len)
    tokens = np.zeros((len(sampled), max(num_tokens) + 1), dtype=np.int64)
    for row, s in enumerate(sampled):
        if s:
            tokens[row, num_tokens[row] - 1] = s[-1]
    return DraftStep(req_ids=[f"r{i}" for i in range(len(sampled))], sampled=sampled, num_tokens=num_tokens,
                     budgets=budgets, depth=depth, token_ids=tokens,
                     limits=[RequestLimits(frozenset(), remaining) for _ in sampled],
                     slot_limited=slot_limited)


def test_budgets_are_cut_by_max_model_len_and_allocated_slots():
    # Sampled tokens at positions 9, 9, 9 and one row that sampled nothing (mid-prefill).
    budgets, slot_limited = draft_budgets([[1], [2], [], [3]], np.array([10, 10, 10, 10]),
                                          np.array([100, 12, 100, 100]), lookahead=5, max_model_len=1000)
    assert budgets.tolist() == [5, 3, 0, 5] and slot_limited == 1  # row 1: slots 9, 10, 11 only
    budgets, slot_limited = draft_budgets([[1]], np.array([10]), np.array([100]), lookahead=5, max_model_len=13)
    assert budgets.tolist() == [3] and slot_limited == 0  # max_model_len 13: up to position 12


def test_collect_draft_requests_cuts_budgets_to_a_cap_and_skips_empty_rows():
    step = _step([[7], [], [8]], [4, 3, 6], [64, 64, 8], lookahead=4, depth=4)
    reqs = collect_draft_requests(step)
    assert reqs.rows == [0, 2] and reqs.tokens == [7, 8] and reqs.positions == [3, 5]
    assert reqs.budgets == [4, 3] and reqs.req_ids == ["r0", "r2"]
    assert collect_draft_requests(step, cap=2).budgets == [2, 2]


@dataclass
class _Stats:
    slot_limited: int = 0

    def summary(self):
        return {"slot_limited": self.slot_limited}


class _Counting(RoundDrafter):
    """Drafts `position + 1, position + 2, ...` up to each request's budget."""

    def draft(self, reqs, pending=None):
        return [[p + 1 + j for j in range(b)] for p, b in zip(reqs.positions, reqs.budgets)]


def test_a_chain_proposer_drafts_within_the_budget_and_the_steps_depth():
    drafter = _Counting(_Stats(), num_speculative_tokens=4, max_model_len=1000)
    assert drafter.lookahead == 4
    step = _step([[7], [8]], [4, 6], [64, 8], lookahead=drafter.lookahead, depth=4)
    assert drafter.plan_depth(step) == 4  # no EVICT: the cap
    assert drafter.propose(step) == [[4, 5, 6, 7], [6, 7, 8]]  # row 1: slots 5, 6, 7 left
    assert drafter.stats.slot_limited == 1
    assert drafter.propose(step.with_depth(1)) == [[4], [6]]
    assert drafter.propose(step.with_depth(0)) == [[], []]


class _TreeCounting(TreeDrafting, _Counting):
    """A tree drafter that grows chains as deep as it is told."""

    def __init__(self):
        super().__init__(_Stats(), num_speculative_tokens=4, max_model_len=1000)
        self.init_trees(chain_tree(4))  # EVICT over chains: one-branch trees
        self.grown_levels = []
        self.target = SimpleNamespace(tree_sampling_supported=lambda row: True, seeded_sampling=lambda row: False)

    def propose(self, step):
        return self.propose_trees(step)

    def grow_trees(self, reqs, levels, shape):
        from vllm_sparsever.trees import DraftTree

        self.grown_levels.append(levels)
        chains = [c[:levels] for c in self.draft(reqs)]
        return [DraftTree(c, list(range(-1, len(c) - 1)), [1.0] * len(c)) for c in chains], []


class _PlannedEvict:
    """EVICT's facade (adaptive.policy.EvictPolicy) planning a fixed depth, keeping every tree; it
    records what it is handed."""

    def __init__(self, planned):
        self.planned = planned
        self.weighed, self.handed, self.resets, self.observed = [], [], 0, []

    def plan_depth(self, contexts, shape, catch_up, *, seeded, **kw):
        self.weighed.append(catch_up)
        self.handed.append(kw)
        return self.planned

    def observe_drafting(self, rows, passes, seconds, catch_up):
        pass

    def truncate(self, trees, contexts, *, passes, mask, whole):
        return trees

    def reset_stats(self):
        self.resets += 1

    def observe_acceptance(self, tree, verified, accepted_nodes):
        self.observed.append(("acceptance", list(tree.tokens), verified, accepted_nodes))

    def observe_step(self, query_tokens, contexts, seconds, mask, gap_s):
        self.observed.append(("step", query_tokens, contexts, mask))

    def summary(self):
        return {"evict_steps": 0}


def _evict_over(drafter, planned=2) -> EvictProposer:
    proposer = EvictProposer(drafter, adaptive=None)
    proposer.evict = _PlannedEvict(planned)  # in place of load(), which reads a cost profile
    return proposer


def test_evicts_planned_depth_is_handed_in_with_the_step():
    drafter = _TreeCounting()
    proposer = _evict_over(drafter, planned=2)
    step = _step([[7]], [4], [64], lookahead=4, depth=4)
    assert drafter.plan_depth(step) == 4  # the drafter alone: the cap
    depth = proposer.plan_depth(step)
    assert depth == 2
    assert proposer.propose(step.with_depth(depth)) == [[4, 5]]
    assert drafter.grown_levels == [2]
    # A step handed depth 0 (EVICT skips drafting) drafts nothing and grows nothing.
    assert proposer.propose(step.with_depth(0)) == [[]]
    assert drafter.grown_levels == [2]


def test_evict_hears_the_verdict_on_the_tree_proposed_and_each_steps_time():
    drafter = _TreeCounting()
    proposer = _evict_over(drafter)
    step = _step([[7]], [4], [64], lookahead=4, depth=4)
    proposer.propose(step.with_depth(proposer.plan_depth(step)))
    proposer.observe_acceptance("r0", 2, [0])
    proposer.observe_acceptance("r9", 1, [])  # no tree proposed for it: nothing to calibrate
    proposer.observe_step_time([3], [4], 0.1, "chain", None)
    assert proposer.evict.observed == [("acceptance", [4, 5], 2, [0]), ("step", [3], [4], "chain")]
    assert proposer.topologies({"r0": [4, 5]}) == {}  # a chain


def test_evict_plans_vllms_drafter_depth_before_it_runs():
    """Over vLLM's own drafter (its plan runs it first): EVICT's depth is planned in `plan()`, vLLM's
    drafter runs at least one step, and `plan_depth` hands the planned depth on."""
    from vllm_sparsever.step import DraftPlan

    class VllmChains(_TreeCounting):
        def plan(self):
            return DraftPlan(after_bookkeeping=True, vllm_depth=4)

        def run_vllm_drafter(self, depth):
            self.vllm_depth = depth

    for planned, runs in ((3, 3), (0, 1)):
        drafter = VllmChains()
        proposer = _evict_over(drafter, planned=planned)
        proposer.target = SimpleNamespace(step_contexts=lambda: [4], seeded_sampling=lambda row: False)
        assert proposer.plan() == DraftPlan(after_bookkeeping=True, vllm_depth=runs) and drafter.vllm_depth == runs
        assert proposer.plan_depth(_step([[7]], [4], [64], lookahead=4, depth=4)) == planned
        assert proposer.evict.weighed == [0]  # planned once, before vLLM drafted


def test_a_catch_up_no_longer_than_the_prompt_the_target_computed_rides_with_it():
    """EVICT weighs no catch-up while a request that has not drafted yet had at least that many prompt
    tokens computed by the target (the draft prefills with the prompt, as vLLM's draft_model does),
    through steps it decodes plainly; the credit is spent when the request drafts. A prompt the
    prefix cache supplied leaves the catch-up to rent or buy."""
    drafter = _TreeCounting()
    proposer = _evict_over(drafter)
    weighed, handed = proposer.evict.weighed, proposer.evict.handed
    catch_up = {"tokens": 1100}
    drafter.catch_up_tokens = lambda reqs: catch_up["tokens"]
    step = _step([[7]], [4], [64], lookahead=4, depth=4)  # request r0

    proposer.note_prompts({"r0": 4000})  # computed by the target: longer than the catch-up
    proposer.plan_depth(step)
    proposer.plan_depth(step)  # a step decoded plainly (e.g. a plain check) keeps the credit
    assert weighed == [0, 0] and drafter.tree_stats.catch_ups_with_prompt == 0
    # The prompt's part is handed in apart (weighed against the tokens left, not rented), and the
    # horizon is unbounded here (no max_tokens).
    assert handed[-1] == {"prompt_tokens": 1100, "horizon_tokens": None}
    proposer.propose(step.with_depth(2))  # it drafts: the credit is spent
    assert drafter.tree_stats.catch_ups_with_prompt == 1
    proposer.plan_depth(step)
    assert weighed[-1] == 1100

    proposer.note_prompts({"r0": 97})  # resumed, its prompt mostly from the prefix cache
    catch_up["tokens"] = 28000
    proposer.plan_depth(step)
    assert weighed[-1] == 28000 - 97  # only the part the prefix cache supplied is rented or bought
    proposer.propose(step.with_depth(2))
    assert drafter.tree_stats.catch_ups_with_prompt == 1

    # A prompt tail the target computed (its prefix cached with the draft's K/V, as a document asked
    # again), then steps decoded plainly: each adds a token to the catch-up, none of them a prompt.
    proposer.note_prompts({"r0": 97})
    for plain_steps in range(3):
        catch_up["tokens"] = 97 + plain_steps
        proposer.plan_depth(step)
        assert weighed[-1] == plain_steps
    proposer.propose(step.with_depth(2))
    assert drafter.tree_stats.catch_ups_with_prompt == 2

    proposer.note_prompts({"r0": 40000})
    proposer.forget({"r0"})  # finished before it drafted
    proposer.plan_depth(step)
    assert weighed[-1] == 99


def test_reset_stats_zeroes_the_tree_and_evict_counters():
    drafter = _TreeCounting()
    proposer = _evict_over(drafter)
    drafter.tree_stats.trees = 3
    drafter.tree_stats.catch_ups_with_prompt = 1
    proposer.reset_stats()
    assert drafter.tree_stats.trees == 0 and drafter.tree_stats.catch_ups_with_prompt == 0
    assert proposer.evict.resets == 1
    assert proposer.request_state()["draft_trees"] == 0
    assert proposer.stats_by_level()["evict"] == {"evict_steps": 0}


def test_the_horizon_is_the_most_tokens_a_request_may_still_emit():
    """EVICT weighs a catch-up against what drafting can save before the requests end: the step hands
    in the largest remaining max_tokens of its requests, or None when one has no max_tokens."""
    proposer = _evict_over(_TreeCounting())
    handed = proposer.evict.handed
    proposer.plan_depth(_step([[7], [8]], [4, 6], [64, 64], lookahead=4, depth=4, remaining=40))
    assert handed[-1]["horizon_tokens"] == 40
    proposer.plan_depth(_step([[7], [8]], [4, 6], [64, 64], lookahead=4, depth=4, remaining=None))
    assert handed[-1]["horizon_tokens"] is None
