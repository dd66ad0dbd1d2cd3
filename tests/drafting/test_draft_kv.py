"""Where the draft model's K/V is valid: per request (the positions the drafter ran, `DraftKV`) and
per KV block (`SharedDraftBlocks`: blocks vLLM's prefix cache hands a later request)."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_sparsever.drafting.draft_kv import DraftKV, SharedDraftBlocks
from vllm_sparsever.drafting.draft_model import DraftModelDrafter
from vllm_sparsever.drafting.drafter import DraftRequests


def test_kv_of_accepted_pending_tokens_stays_valid():
    # Written for committed [0..9] and then tail tokens 7, 8 at positions 10, 11 (pending + a draft).
    kv = DraftKV(length=12, tail_start=10, tail=[7, 8])
    history = np.arange(10)
    assert kv.valid_for(history, [7, 8, 9]) == 12  # both still there, as pending
    assert kv.valid_for(np.concatenate([history, [7, 8]]), [5]) == 12  # both committed since
    assert kv.valid_for(np.concatenate([history, [7]]), [4]) == 11  # position 11 holds 4 now
    assert kv.valid_for(np.concatenate([history, [3]]), []) == 10  # the first tail token was rejected


def test_kv_never_claims_positions_the_sequence_does_not_have():
    kv = DraftKV(length=12, tail_start=10, tail=[7, 8])
    assert kv.valid_for(np.arange(10), [7]) == 11
    assert kv.valid_for(np.arange(10), []) == 10
    # Committed tokens are valid up to what was written, whatever came after.
    assert DraftKV(length=6, tail_start=6, tail=[]).valid_for(np.arange(10), [1, 2]) == 6


def test_a_later_request_finds_the_blocks_an_earlier_one_filled():
    shared = SharedDraftBlocks()
    prompt = np.arange(100, 111)  # 11 tokens, blocks of 4
    shared.record("a", prompt, 11, [5, 6, 7], 4)  # blocks 5 and 6 filled; 7 holds 3 positions
    assert len(shared) == 2
    # The same prefix in the same blocks (a prefix-cache hit): both blocks; never the last token's.
    assert shared.matched("b", prompt, [5, 6, 9], 4)[0] == 8
    assert shared.matched("b", prompt[:9], [5, 6, 9], 4)[0] == 8
    assert shared.matched("b", prompt[:8], [5, 6, 9], 4)[0] == 4
    # Another block id, or other tokens before or in a block: the K/V there is not this prefix's.
    assert shared.matched("c", prompt, [5, 8, 9], 4)[0] == 4
    assert shared.matched("c", prompt, [6, 5, 9], 4)[0] == 0
    other = prompt.copy()
    other[1] = 0
    assert shared.matched("c", other, [5, 6, 9], 4)[0] == 0
    other = prompt.copy()
    other[6] = 0
    assert shared.matched("c", other, [5, 6, 9], 4)[0] == 4


def test_a_draft_write_into_a_block_drops_it_and_records_continue_where_they_stopped():
    shared = SharedDraftBlocks()
    tokens = np.arange(16)
    shared.record("a", tokens, 6, [1, 2, 3, 4], 4)
    assert shared.matched("x", tokens, [1, 2, 3, 4], 4)[0] == 4
    shared.record("a", tokens, 16, [1, 2, 3, 4], 4)  # the rest of "a" caught up
    assert shared.matched("x", tokens, [1, 2, 3, 4], 4)[0] == 12  # the last token's block never counts
    shared.written([2])  # e.g. block 2 freed and handed to another request, whose draft wrote there
    assert shared.matched("x", tokens, [1, 2, 3, 4], 4)[0] == 4
    shared.forget("a")
    shared.record("a", tokens, 16, [1, 2, 3, 4], 4)  # recorded afresh from the first block
    assert shared.matched("x", tokens, [1, 2, 3, 4], 4)[0] == 12


def _drafter(table: torch.Tensor, block_size: int, window: int | None = None) -> DraftModelDrafter:
    drafter = DraftModelDrafter(num_speculative_tokens=3, max_model_len=64, attention_window=window)
    drafter.target = SimpleNamespace(block_table=lambda names: (table, block_size))
    drafter._stack = SimpleNamespace(attention_layer_names=["draft.layers.0.attn"])
    return drafter


def _requests(rows, histories) -> DraftRequests:
    n = len(rows)
    return DraftRequests(rows=rows, tokens=[int(h[-1]) for h in histories],
                         positions=[len(h) - 1 for h in histories], budgets=[3] * n,
                         req_ids=[f"r{row}" for row in rows], histories=histories)


def test_drafter_starts_a_prefix_cache_hit_after_the_shared_blocks():
    table = torch.tensor([[5, 6, 7, 0], [5, 6, 9, 0], [5, 8, 9, 0]], dtype=torch.int32)
    drafter = _drafter(table, 4)
    history = np.arange(20, 31)  # 11 tokens
    first = _requests([0], [history])
    assert drafter._catch_up(first, 0, [])[1] == 0  # nothing registered yet
    drafter._committed(first, 0, 11)  # its catch-up ran: blocks 5 and 6 hold its prefix
    later = _requests([1, 2], [history, history])
    assert drafter._catch_up(later, 0, [])[1] == 8  # row 1 shares both blocks
    assert drafter._catch_up(later, 1, [])[1] == 4  # row 2 shares the first only
    assert drafter.stats.shared_prefix_tokens == 12
    # A pass writing row 2's positions 4..7 (block 8) and row 1's 8..10 (block 9) drops nothing shared;
    # one writing row 0's block 6 does.
    drafter._writing([2, 1], torch.tensor([4, 5, 6, 7, 8, 9, 10]), [4, 3])
    assert drafter._shared.matched("new", history, table[1], 4)[0] == 8
    drafter._writing([0], torch.tensor([6]), [1])
    assert drafter._shared.matched("new", history, table[1], 4)[0] == 4


def test_drafter_without_one_block_table_for_the_draft_layers_matches_nothing():
    drafter = _drafter(torch.zeros(1, 4, dtype=torch.int32), 4)
    drafter.target = SimpleNamespace(block_table=lambda names: None)
    requests = _requests([0], [np.arange(11)])
    drafter._committed(requests, 0, 11)
    assert drafter._catch_up(requests, 0, []) == (None, 0, -1) and len(drafter._shared) == 0


def test_a_windowed_drafter_catches_up_on_its_first_block_and_its_window_only():
    """With `draft_attention_window` the draft reads the first block and the blocks from the
    window's start on, which only moves forward: the stale positions between are never run."""
    table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    drafter = _drafter(table, 4, window=6)
    fresh = _requests([0], [np.arange(30)])  # 30 tokens: the window (6) starts in block 6 (position 24)
    assert drafter._catch_up(fresh, 0, []) == ((0, 4), 24, 4)
    assert drafter._catch_up_size(fresh, 0, []) == 4 + 29 - 24
    # Pending tokens move the window on; a short sequence has nothing to skip.
    assert drafter._catch_up(fresh, 0, [7, 8, 9]) == ((0, 4), 24, 4)
    assert drafter._catch_up(_requests([0], [np.arange(12)]), 0, []) == (None, 0, -1)
    # Its K/V valid up to 9: the rest of block 2 and blocks 3..5 are skipped, not the first block.
    drafter._kv["r0"] = DraftKV(length=9, tail_start=9, tail=[])
    assert drafter._catch_up(fresh, 0, []) == (None, 24, 9)
    without = _drafter(table, 4)
    assert without._catch_up(fresh, 0, []) == (None, 0, -1)


def test_skipped_positions_are_never_registered_for_later_requests():
    table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    drafter = _drafter(table, 4, window=6)
    history = np.arange(30)
    requests = _requests([0], [history])
    drafter._holes["r0"] = [(4, 24)]  # a catch-up ran block 0 and positions 24..29 only
    drafter._committed(requests, 0, 30)
    assert drafter._shared.matched("later", history, table[0], 4)[0] == 4
    # A windowed request reads the first block and the blocks from its window's start on: those hold
    # its K/V (block 6, positions 24..27; the last token's block never counts), the hole is skipped.
    assert drafter._shared.matched("later", history, table[0], 4, window_from=24) == (28, (4, 24), None)
    # A window from block 5 on: block 5 is the gap to run, block 6 still holds its K/V.
    assert drafter._shared.matched("later", history, table[0], 4, window_from=20) == (28, (4, 20), (20, 24))
    later = _drafter(table, 4, window=6)
    later._shared = drafter._shared
    requests = _requests([0], [history])
    assert later._catch_up(requests, 0, []) == (None, 28, -1)
    assert later._holes["r0"] == [(4, 24)] and later.stats.shared_prefix_tokens == 4 + 4


def test_a_window_that_begins_before_the_matched_blocks_runs_only_the_blocks_between(monkeypatch):
    """An earlier request for the same prompt whose window began a block later (it first drafted a
    step later) left blocks 6..7 (positions 24..31) filled: a request whose window starts at
    block 5 runs block 5 before its catch-up, not its whole window again."""
    table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    history = np.arange(33)  # the last token's block (8) never counts; blocks 0..7 can
    earlier = _drafter(table, 4, window=10)
    earlier._holes["r0"] = [(4, 24)]
    earlier._committed(_requests([0], [history]), 0, 33)
    later = _drafter(table, 4, window=10)
    later._shared = earlier._shared
    requests = _requests([0], [history[:-2]])  # 31 tokens: the window starts at block 5 (20)
    assert later._catch_up(requests, 0, []) == ((20, 24), 28, -1)
    assert later._catch_up_size(requests, 0, []) == 4 + 30 - 28
    assert later._holes["r0"] == [(4, 20)] and later.stats.shared_prefix_tokens == 28 - 16 - 4
    assert later.stats.window_gap_tokens == 4
    # The span runs in one pass before the catch-up, attending to the first block and itself.
    passes = []
    later.target.device = "cpu"
    monkeypatch.setattr("vllm_sparsever.drafting.draft_model.final_hidden",
                        lambda target, stack, rows, tokens, positions, lens, **query:
                        passes.append((rows, tokens.tolist(), positions.tolist(), query)))
    assert later._catch_up_runs(requests, [0], [[]]) == [28]
    assert passes == [([0], [20, 21, 22, 23], [20, 21, 22, 23], {"window": (1, 1)})]
    assert later._catch_up(requests, 0, []) == (None, 28, -1)  # it ran once
    # Once the round records the request, block 5 holds its K/V too: a later request has no gap.
    later._committed(requests, 0, 31)
    assert later._shared.matched("third", history[:-2], table[0], 4, window_from=20) == (28, (4, 20), None)


def test_a_gap_is_never_taken_without_matched_blocks_after_it():
    shared = SharedDraftBlocks()
    tokens = np.arange(17)
    shared.record("a", tokens, 8, [1, 2, 3, 4], 4)  # blocks 0..1 only
    assert shared.matched("x", tokens, [1, 2, 3, 4], 4, window_from=8) == (8, None, None)
    assert shared.matched("x", tokens, [1, 2, 3, 4], 4) == (8, None, None)
