"""The draft-model drafter's record of which positions hold its K/V for which tokens."""

import numpy as np

from vllm_sparsever.drafting.draft_model import _DraftKV


def test_kv_of_accepted_pending_tokens_stays_valid():
    # Written for committed [0..9] and then tail tokens 7, 8 at positions 10, 11 (pending + a draft).
    kv = _DraftKV(length=12, tail_start=10, tail=[7, 8])
    history = np.arange(10)
    assert kv.valid_for(history, [7, 8, 9]) == 12  # both still there, as pending
    assert kv.valid_for(np.concatenate([history, [7, 8]]), [5]) == 12  # both committed since
    assert kv.valid_for(np.concatenate([history, [7]]), [4]) == 11  # position 11 holds 4 now
    assert kv.valid_for(np.concatenate([history, [3]]), []) == 10  # the first tail token was rejected


def test_kv_never_claims_positions_the_sequence_does_not_have():
    kv = _DraftKV(length=12, tail_start=10, tail=[7, 8])
    assert kv.valid_for(np.arange(10), [7]) == 11
    assert kv.valid_for(np.arange(10), []) == 10
    # Committed tokens are valid up to what was written, whatever came after.
    assert _DraftKV(length=6, tail_start=6, tail=[]).valid_for(np.arange(10), [1, 2]) == 6
