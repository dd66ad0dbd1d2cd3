"""The verification plan: contents on a known batch, anchor selections, topology, the attention plan."""

import numpy as np
import pytest
import torch

from vllm_sparsever.plan import (
    AnchorSelection,
    AnchorSelections,
    AnchorSelectionUnavailable,
    VerifyLevel,
    build_verification_plan,
)
from vllm_sparsever.trees import DraftTopology


def _known_plan(step=7, **kwargs):
    # Batch of 4 rows: a verify row (3 drafts), a prefill chunk, a decode without drafts,
    # a verify row (1 draft). Block size 4.
    block_table = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6) + 100
    return build_verification_plan(
        step=step,
        req_ids=["a", "b", "c", "d"],
        num_scheduled_tokens=np.array([4, 10, 1, 2]),
        num_computed_tokens=np.array([9, 0, 5, 13]),
        scheduled_spec_decode_tokens={"a": [11, 12, 13], "d": [44]},
        block_table=block_table,
        block_size=4,
        **kwargs,
    )


def test_plan_contents_on_a_known_batch():
    plan = _known_plan()
    assert plan.step == 7 and plan.num_reqs == 4 and plan.num_tokens == 17
    assert plan.is_verify_step and plan.total_draft_tokens == 4
    assert plan.level is VerifyLevel.FULL

    a, d = plan.requests
    assert (a.req_id, a.batch_index, a.query_start, a.num_query_tokens) == ("a", 0, 0, 4)
    assert (a.num_draft_tokens, a.context_len, a.seq_len) == (3, 9, 13)
    assert a.draft_token_ids == (11, 12, 13)
    assert list(a.draft_token_positions) == [1, 2, 3]
    assert a.topology.is_chain and a.topology.parents == (-1, 0, 1, 2)
    assert (d.batch_index, d.query_start, d.context_len, d.seq_len) == (3, 15, 13, 15)
    assert list(d.draft_token_positions) == [16]

    groups = plan.groups
    assert not groups.all_tokens_verify and groups.num_groups == 2
    assert groups.token_index.tolist() == [0, 1, 2, 3, 15, 16]
    assert groups.other_index.tolist() == list(range(4, 15))
    assert groups.group_start_loc.tolist() == [0, 4, 6]
    assert groups.batch_rows == (0, 3)
    assert groups.dense_index(19).tolist() == list(range(4, 15)) + [17, 18]  # + padding rows
    assert plan.attention is None  # no attention planner given


def test_all_verify_step_needs_no_gather():
    plan = build_verification_plan(
        step=1, req_ids=["a", "b"], num_scheduled_tokens=np.array([3, 2]),
        num_computed_tokens=np.array([5, 6]), scheduled_spec_decode_tokens={"a": [1, 2], "b": [3]},
        block_table=torch.zeros(2, 4, dtype=torch.int32), block_size=16,
    )
    assert plan.groups.all_tokens_verify and plan.groups.other_index.numel() == 0
    assert not plan.has_prefill_rows  # the dense verify kernel may take this step


def test_a_prefill_chunk_beside_verify_rows_is_flagged():
    plan = _known_plan()  # row "b" is a 10-token prefill chunk
    assert plan.is_verify_step and plan.has_prefill_rows
    decode_beside = build_verification_plan(
        step=1, req_ids=["a", "c"], num_scheduled_tokens=np.array([3, 1]),
        num_computed_tokens=np.array([5, 6]), scheduled_spec_decode_tokens={"a": [1, 2]},
        block_table=torch.zeros(2, 4, dtype=torch.int32), block_size=16,
    )
    assert decode_beside.is_verify_step and not decode_beside.has_prefill_rows


def test_prefill_row_with_drafts_is_not_a_verify_row():
    plan = build_verification_plan(
        step=1,
        req_ids=["x"],
        num_scheduled_tokens=np.array([8]),
        num_computed_tokens=np.array([0]),
        scheduled_spec_decode_tokens={"x": [1, 2]},
        block_table=torch.zeros(1, 4, dtype=torch.int32),
        block_size=16,
    )
    assert not plan.is_verify_step
    assert plan.groups is None and plan.attention is None


def test_attention_planner_is_called_once_per_verify_step_with_the_batch():
    calls = []

    def planner(batch, requests, query_start_loc):
        calls.append((list(batch.req_ids), [r.req_id for r in requests], query_start_loc.tolist()))
        return "attention-plan"

    # The known batch holds a prefill chunk (row b): vLLM's kernel runs that step, so no attention plan.
    plan = _known_plan(attention_planner=planner)
    assert plan.has_prefill_rows and plan.attention is None and calls == []
    # Without it (a verify row, a decode row, a verify row): one call with the batch.
    plan = build_verification_plan(
        step=3, req_ids=["a", "c", "d"], num_scheduled_tokens=np.array([4, 1, 2]),
        num_computed_tokens=np.array([9, 5, 13]), scheduled_spec_decode_tokens={"a": [11, 12, 13], "d": [44]},
        block_table=torch.arange(3 * 6, dtype=torch.int32).reshape(3, 6), block_size=4, attention_planner=planner)
    assert not plan.has_prefill_rows and plan.attention == "attention-plan"
    assert calls == [(["a", "c", "d"], ["a", "d"], [0, 4, 5, 7])]


def _selection(layer):
    return AnchorSelection(layer=layer, selected=torch.zeros(1, 1, 1, dtype=torch.int32),
                           num_selected=torch.ones(1, 1, dtype=torch.int32))


def test_layers_read_the_selection_of_their_own_anchor():
    store = AnchorSelections([4, 10])  # layer 0 always anchors
    assert [store.is_anchor(i) for i in (0, 1, 4, 5, 10, 11)] == [True, False, True, False, True, False]
    assert [store.anchor_of(i) for i in (0, 3, 4, 9, 10, 27)] == [0, 0, 4, 4, 10, 10]
    first, second = _selection(0), _selection(4)
    store.publish(first)
    store.publish(second)
    assert store.for_layer(3) is first and store.for_layer(7) is second
    with pytest.raises(AnchorSelectionUnavailable, match="anchor layer 10"):
        store.for_layer(12)  # anchor 10 published nothing (e.g. it verified densely)
    with pytest.raises(ValueError, match="already published"):
        store.publish(_selection(4))
    with pytest.raises(ValueError, match="not an anchor"):
        store.publish(_selection(5))


def test_every_layer_anchors_without_a_profile():
    store = AnchorSelections(None)
    assert all(store.is_anchor(i) and store.anchor_of(i) == i for i in range(5))


def test_draft_topology_ancestor_mask():
    chain = DraftTopology.chain(3)
    assert chain.ancestor_mask().tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    tree = DraftTopology((-1, 0, 0, 1))  # root, two children, a grandchild under the first
    assert not tree.is_chain
    assert tree.ancestor_mask().tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    with pytest.raises(ValueError, match="precede"):
        DraftTopology((-1, 2, 0)).ancestor_mask()
