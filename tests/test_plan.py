"""The verification plan: contents on a known batch, and reading it under torch.compile."""

import numpy as np
import torch

from vllm_sparsever.plan import active_plan, build_verification_plan, current_plan, verify_token_mask


def _known_plan(step=7):
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
    )


def test_plan_contents_on_a_known_batch():
    plan = _known_plan()
    assert plan.step == 7 and plan.num_reqs == 4 and plan.num_tokens == 17
    assert plan.is_verify_step and plan.total_draft_tokens == 4
    assert plan.query_start_loc.tolist() == [0, 4, 14, 15, 17]
    assert plan.seq_lens.tolist() == [13, 10, 6, 15]
    assert plan.num_draft_tokens.tolist() == [3, 0, 0, 1]
    assert plan.token_is_verify.tolist() == [True] * 4 + [False] * 11 + [True] * 2

    a, d = plan.requests
    assert (a.req_id, a.batch_index, a.query_start, a.num_query_tokens) == ("a", 0, 0, 4)
    assert (a.num_draft_tokens, a.context_len, a.seq_len) == (3, 9, 13)
    assert a.draft_token_ids == (11, 12, 13)
    assert list(a.draft_token_positions) == [1, 2, 3]
    assert (d.batch_index, d.query_start, d.context_len, d.seq_len) == (3, 15, 13, 15)
    assert list(d.draft_token_positions) == [16]
    # seq_len 13 with block size 4 spans 4 blocks of row 0; 15 spans 4 blocks of row 3.
    assert plan.kv_block_ids(a).tolist() == [100, 101, 102, 103]
    assert plan.kv_block_ids(d).tolist() == [118, 119, 120, 121]
    assert plan.request("b") is None


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
    assert plan.token_is_verify.sum().item() == 0


def test_active_plan_is_scoped():
    plan = _known_plan()
    assert current_plan() is None
    with active_plan(plan):
        assert current_plan() is plan
    assert current_plan() is None


def test_compiled_graph_reads_the_plan_of_each_step():
    """A compiled function must not freeze the plan it was traced with."""
    torch._dynamo.reset()
    counter = {"compiles": 0}

    def backend(gm, example_inputs):
        counter["compiles"] += 1
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def layer(h):
        # dense path for non-verify tokens, a different path for verify tokens
        mask = verify_token_mask(h).unsqueeze(-1)
        return h * (1 + mask)

    h = torch.ones(17, 2)
    with active_plan(_known_plan()):
        out1 = layer(h)
    with active_plan(None):
        out2 = layer(h)
    other = build_verification_plan(
        step=8,
        req_ids=["a", "b"],
        num_scheduled_tokens=np.array([15, 2]),
        num_computed_tokens=np.array([0, 4]),
        scheduled_spec_decode_tokens={"b": [5]},
        block_table=torch.zeros(2, 4, dtype=torch.int32),
        block_size=16,
    )
    with active_plan(other):
        out3 = layer(h)

    assert counter["compiles"] == 1
    assert out1[:, 0].tolist() == [2.0] * 4 + [1.0] * 11 + [2.0] * 2
    assert out2[:, 0].tolist() == [1.0] * 17
    assert out3[:, 0].tolist() == [1.0] * 15 + [2.0] * 2
