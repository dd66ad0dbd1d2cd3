"""HierarchicalProposer's rounds with a scripted drafter and verifier: pending tokens, the cap, stop
tokens, max_tokens, and what reuse across levels keeps (no engine)."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_sparsever.compat.runner import request_limits
from vllm_sparsever.drafting.drafter import DraftRequests
from vllm_sparsever.drafting.hierarchical import HierarchicalProposer
from vllm_sparsever.step import DraftPlan, DraftStep, RequestLimits, draft_budgets

POSITION = 5  # the sampled token's position


def _step(h, sampled=10, max_tokens=100, stops=(99,)) -> DraftStep:
    """One request, row 0, that sampled `sampled` at POSITION, with the budget of hierarchy `h`'s
    lookahead (its limits read as compat reads a runner's)."""
    params = SimpleNamespace(all_stop_token_ids=set(stops), stop_token_ids=[], ignore_eos=False, max_tokens=max_tokens)
    num_tokens = np.array([POSITION + 1])
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["r0"], num_tokens_no_spec=num_tokens),
                             requests={"r0": SimpleNamespace(sampling_params=params, num_prompt_tokens=3)})
    tokens = np.array([list(range(1, POSITION + 1)) + [sampled]])
    budgets, slot_limited = draft_budgets([[sampled]], num_tokens, np.array([64]), h.lookahead, max_model_len=1000)
    assert budgets.tolist() == [h.lookahead] and slot_limited == 0
    return DraftStep(req_ids=["r0"], sampled=[[sampled]], num_tokens=num_tokens, budgets=budgets, depth=h.cap,
                     token_ids=tokens, limits=[RequestLimits(*limits) for limits in request_limits(runner, [0])])


class Drafter:
    """Drafts `next_of[t]` chains: after token t, the tokens t+1, t+2, ..."""

    num_speculative_tokens = 3

    def plan(self):
        return DraftPlan()

    def __init__(self):
        self.calls = []

    def requests(self, step, cap=None):
        assert cap is None  # the hierarchy drafts within the step's budgets
        return DraftRequests(rows=[0], tokens=[step.sampled[0][-1]], positions=[POSITION],
                             budgets=[int(step.budgets[0])],
                             req_ids=["r0"], histories=[step.history(0)])

    def draft(self, sub, pending):
        self.calls.append((sub.tokens[0], sub.positions[0], list(pending[0])))
        t = sub.tokens[0]
        return [[t + 1 + i for i in range(sub.budgets[0])]]

    def stats_by_level(self):
        return {}

    def reset_stats(self):
        pass


class Verifier:
    """Agrees with the drafter except on tokens in `wrong` (predicts `t + 100` there)."""

    name = "early_exit"
    layer = 2

    def __init__(self, wrong=()):
        self.wrong = set(wrong)

    def predict(self, rows, seqs, firsts, with_streams=False):
        preds = [[t + 1 if t + 1 not in self.wrong else t + 101 for t in seq] for seq in seqs]
        if not with_streams:
            return preds
        # The "stream" of a token: its position, so what reuse keeps can be read back.
        return preds, [torch.tensor([[float(first + j)] for j in range(len(seq))]) for seq, first in zip(seqs, firsts)]


def test_rounds_accumulate_pending_tokens_up_to_the_cap():
    drafter = Drafter()
    h = HierarchicalProposer(drafter, Verifier(wrong={13}), cap=6, rounds=3)
    out = h.propose(_step(h))
    # Round 1: drafts 11 12 13, the verifier keeps 11 12 and corrects 13 -> 113. Round 2 from 113
    # (position 8): drafts 114 115 116, all kept, plus a bonus 117: capped at 6 pending tokens.
    assert out == [[11, 12, 113, 114, 115, 116]]
    assert drafter.calls == [(10, 5, []), (113, 8, [11, 12, 113])]
    assert h.stats.intermediate_drafts == 6 and h.stats.intermediate_accepted == 5


def test_rounds_stop_at_a_stop_token_and_at_max_tokens():
    h = HierarchicalProposer(Drafter(), Verifier(), cap=8, rounds=3)
    assert h.propose(_step(h, stops=(12,))) == [[11, 12]]  # nothing after the stop token
    assert h.stats.stopped_at_stop_token == 1
    # Pending + the full target's own token must not pass max_tokens: 6 committed tokens, 3 of
    # them the prompt, so 3 emitted of 6 and at most 2 pending.
    h = HierarchicalProposer(Drafter(), Verifier(), cap=8, rounds=3)
    assert h.propose(_step(h, max_tokens=6)) == [[11, 12]]
    assert h.stats.stopped_at_max_tokens == 1


def test_reuse_drops_the_verifier_correction_and_keeps_the_streams_of_the_rest():
    h = HierarchicalProposer(Drafter(), Verifier(wrong={13}), cap=8, rounds=1, reuse=True)
    out = h.propose(_step(h))
    # Kept 11 12, correction 113 dropped: no pass ran it through the first layers.
    assert out == [[11, 12]]
    assert h.stats.reuse_dropped_corrections == 1
    saved = h._reusable["r0"]
    assert saved.first_position == POSITION and saved.token_ids == (10, 11, 12)
    assert saved.states.flatten().tolist() == [5.0, 6.0, 7.0]  # the streams of positions 5, 6, 7


class StatesDrafter(Drafter):
    """A drafter that reads the target's states (an EAGLE head): records what it is handed."""

    state_layers = (1, 2)

    def plan(self):
        return DraftPlan(after_bookkeeping=True, target_states=True)

    def __init__(self):
        super().__init__()
        self.observed = []

    def observe_target_states(self, req_id, first, tokens, states):
        self.observed.append((req_id, first, list(tokens), states[:, 0].tolist()))


class SparseVerifier(Verifier):
    name = "sparse"

    def predict(self, rows, seqs, firsts, with_states=False, state_layers=None):
        assert with_states and state_layers == (1, 2)
        return Verifier.predict(self, rows, seqs, firsts, with_streams=True)


def test_a_drafter_reading_target_states_gets_each_intermediate_pass_states():
    """Before each next round, the EAGLE head is handed the sparse target's states of the tokens the
    intermediate pass ran ([last pending token, drafts]), so it can draft after the pending tokens."""
    import pytest

    drafter = StatesDrafter()
    h = HierarchicalProposer(drafter, SparseVerifier(wrong={13}), cap=6, rounds=3)
    assert h.plan() == DraftPlan(after_bookkeeping=True, target_states=True) and h.state_layers == (1, 2)
    assert h.propose(_step(h)) == [[11, 12, 113, 114, 115, 116]]
    assert drafter.observed == [("r0", 5, [10, 11, 12, 13], [5.0, 6.0, 7.0, 8.0]),
                                ("r0", 8, [113, 114, 115, 116], [8.0, 9.0, 10.0, 11.0])]
    with pytest.raises(ValueError, match="only the sparse target"):
        HierarchicalProposer(StatesDrafter(), Verifier(), cap=6, rounds=3)
