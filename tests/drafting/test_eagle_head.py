"""The EAGLE head drafter of the hierarchy (drafting/eagle_head.py): which target states and head K/V
it keeps per request, and which positions each head pass runs, with a stand-in head (the engine
tests in tests/e2e/test_vllm_drafters.py run a real one)."""

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sparsever.drafting.drafter import DraftRequests
from vllm_sparsever.drafting.eagle_head import EagleHeadDrafter, HeadRecord

VOCAB = 50


def _states(tokens, first):
    """A stand-in target state per token: (position, token)."""
    return torch.tensor([[first + j, t] for j, t in enumerate(tokens)], dtype=torch.float32)


def test_new_states_replace_what_follows_and_make_the_head_kv_there_stale():
    record = HeadRecord()
    record.add_states(0, [5, 6, 7, 8], _states([5, 6, 7, 8], 0))
    record.ran(0, [6, 7, 8], committed_last=3)  # positions 0..2 with next tokens 6, 7, 8
    assert record.kv_len == 3
    assert record.states_base == 2  # states before the last committed position's predecessor: not needed again
    record.add_states(2, [7, 9], _states([7, 9], 2))  # a later pass from position 2
    assert record.kv_len == 2 and record.state_tokens == [7, 9]
    assert record.states[:, 0].tolist() == [2, 3]
    # A pass that leaves a gap after what is kept starts the record over.
    record.add_states(10, [1], _states([1], 10))
    assert record.states_base == 10 and record.state_tokens == [1]


def test_head_kv_is_valid_only_while_its_next_tokens_are_the_sequence():
    record = HeadRecord()
    record.add_states(0, list(range(6)), _states(range(6), 0))
    record.ran(0, [1, 2, 3, 4, 5], committed_last=3)  # positions 0..4; next tokens 1..3 committed
    seq = [0, 1, 2, 3, 4, 5]
    assert record.kv_valid(lambda p: seq[p], 6) == 5
    changed = [0, 1, 2, 3, 9, 5]  # position 4 holds another token now: position 3's K/V is stale
    assert record.kv_valid(lambda p: changed[p], 6) == 3
    assert record.kv_valid(lambda p: seq[p], 4) == 3  # never past the sequence


def test_states_must_cover_the_positions_and_match_their_tokens():
    record = HeadRecord()
    record.add_states(4, [1, 2, 3], _states([1, 2, 3], 4))
    seq = {4: 1, 5: 2, 6: 3}
    first, states = record.states_for(2, 7, seq.get)  # nothing kept before 4: start there
    assert first == 4 and states[:, 0].tolist() == [4, 5, 6]
    assert record.states_for(4, 8, seq.get) is None  # position 7 has no state
    assert record.states_for(4, 7, {4: 1, 5: 8, 6: 3}.get) is None  # position 5's state is of another token
    record.ran(4, [2, 3], committed_last=6)  # states before position 5 are not needed again
    assert record.states_base == 5


class _Head:
    """Next token = (input token + position) % VOCAB; its hidden state passes the input state on."""

    layer_names = ["head.attn"]
    reads_aux_streams = False

    def __init__(self):
        self.passes = []
        self.hidden_in = []

    def combine(self, states):
        return states

    def forward(self, input_ids, positions, hidden_states):
        self.passes.append((positions.tolist(), input_ids.tolist()))
        self.hidden_in.append(hidden_states.clone())
        return (input_ids + positions).float().unsqueeze(1), hidden_states + 100

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[:, 0].long() % VOCAB, VOCAB).float()


@pytest.fixture
def drafter(monkeypatch):
    head = _Head()
    target = SimpleNamespace(device=torch.device("cpu"), vllm_config=None, model=None,
                             eagle_head=lambda: head,
                             attention_context=lambda *a, **k: ({}, {}))
    monkeypatch.setattr("vllm_sparsever.compat.forward_context.query_forward_context", lambda *a: nullcontext())
    d = EagleHeadDrafter(num_speculative_tokens=3, max_model_len=1024)
    d.load(target)
    return d, head


def _reqs(history, budget=3):
    return DraftRequests(rows=[0], tokens=[int(history[-1])], positions=[len(history) - 1], budgets=[budget],
                         req_ids=["r"], histories=[np.asarray(history)])


def test_rounds_catch_up_from_stale_kv_then_draft_one_pass_per_token(drafter):
    d, head = drafter
    prompt = [3, 1, 4, 1, 5]
    d.observe_target_states("r", 0, prompt, _states(prompt, 0))  # the prompt's prefill
    history = prompt + [9]  # the target's token after it, at position 5
    drafts = d.draft(_reqs(history))
    # Positions 0..4 with their next tokens in one pass, then a pass per further draft.
    assert head.passes[0] == ([0, 1, 2, 3, 4], [1, 4, 1, 5, 9])
    assert drafts == [[(9 + 4) % VOCAB, (13 + 5) % VOCAB, (18 + 6) % VOCAB]]
    assert head.passes[1:] == [([5], [13]), ([6], [18])]
    # Round 2 after pending [13, 7] (the intermediate verifier ran [9, 13, 18] at 5..7 and kept 13):
    head.passes.clear()
    d.observe_target_states("r", 5, [9, 13, 18], _states([9, 13, 18], 5))
    drafts = d.draft(_reqs(history, 2).subset([0], tokens=[7], positions=[7], budgets=[2]), [[13, 7]])
    # Positions 0..4 hold K/V; 5 and 6 have new states (the verifier's): they run, 6 drafting.
    assert head.passes[0] == ([5, 6], [13, 7])
    assert drafts == [[(7 + 6) % VOCAB, (13 + 7) % VOCAB]]
    assert d.stats.missing_states == 0


def test_a_request_without_the_states_of_its_last_tokens_gets_no_drafts(drafter):
    d, head = drafter
    assert d.draft(_reqs([1, 2, 3])) == [[]]  # nothing observed
    d.observe_target_states("r", 0, [1, 2], _states([1, 2], 0))
    assert d.draft(_reqs([1, 2, 3, 4])) == [[]]  # position 2's state missing
    assert d.stats.missing_states == 2 and not head.passes
    d.forget({"r"})
    assert d.request_state() == {"draft_trees": 0, "eagle_head_records": 0}


def test_the_last_position_always_runs_its_output_drafts(drafter):
    d, head = drafter
    d.observe_target_states("r", 0, [1, 2, 3], _states([1, 2, 3], 0))
    d.draft(_reqs([1, 2, 3, 4], budget=1))
    head.passes.clear()
    d.draft(_reqs([1, 2, 3, 4], budget=1))  # nothing new: the K/V holds, position 2 reruns
    assert head.passes == [([2], [4])]


def test_trees_run_each_node_a_slot_before_its_own_fed_its_parents_hidden_state(monkeypatch):
    """EAGLE-2 style trees: the root's pass is the catch-up, then one pass per level over the nodes
    so far, each node at its depth's position - 1 (the head reads the state before it and the node
    as next token), K/V one slot before the node's, its parent's head state as input."""
    from vllm_sparsever.config import DraftTreeConfig

    head = _Head()
    contexts = []
    target = SimpleNamespace(device=torch.device("cpu"), vllm_config=None, model=None, eagle_head=lambda: head,
                             attention_context=lambda names, rows, positions, lens, kv_positions=None:
                             contexts.append((positions.tolist(), None if kv_positions is None
                                              else kv_positions.tolist())) or ({}, {}))
    monkeypatch.setattr("vllm_sparsever.compat.forward_context.query_forward_context", lambda *a: nullcontext())
    d = EagleHeadDrafter(num_speculative_tokens=4, max_model_len=1024,
                         tree=DraftTreeConfig(enabled=True, branching=2, expand=1, depth=3))
    d.load(target)
    prompt = [3, 1, 4, 1, 5]
    d.observe_target_states("r", 0, prompt, _states(prompt, 0))
    history = prompt + [9]  # the root, at position 5
    reqs = d.requests(SimpleNamespace(req_ids=["r"], slot_limited=0, sampled=[[9]], budgets=np.array([4]),
                                      num_tokens=np.array([6]), history=lambda row: np.asarray(history)))
    trees, passes = d.grow_trees(reqs, 3, None)
    tree = trees[0]
    assert head.passes[0] == ([0, 1, 2, 3, 4], [1, 4, 1, 5, 9])  # the root's pass: catch-up up to it
    best = (9 + 4) % VOCAB  # the head's favourite after the root
    assert tree.tokens[0] == best and tree.parents[0] == -1
    # Level 1: the expanded child of the root, at the root's position (5), K/V at slot 5.
    assert head.passes[1] == ([5], [best]) and contexts[1] == ([5], [5])
    assert torch.equal(head.hidden_in[1], head.hidden_in[0][-1:] + 100)  # the root's output state
    # Level 2: that node again (its K/V under the tree mask), then its expanded child, fed the node's output.
    child = (best + 5) % VOCAB
    assert head.passes[2] == ([5, 6], [best, child]) and contexts[2] == ([5, 6], [5, 6])
    assert torch.equal(head.hidden_in[2][1:], head.hidden_in[1] + 100)
    assert len(passes) == 3 and d.stats.missing_states == 0
