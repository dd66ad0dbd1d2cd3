"""The attention planner: a verify step's AttentionStepPlan from the batch alone (no engine).

Batch (block size 32, top-k 2 + 1 sink + 1 local = 4 blocks kept):
  row 0: verify, 3 drafts, 300 tokens of context (10 context blocks) -> sparse, keeps 4
  row 1: plain decode, 200 tokens of context (7 blocks)              -> dense, reads all 7
  row 2: verify, 1 draft, 40 tokens of context (2 blocks)            -> below min_context_len: dense
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.plan import build_verification_plan
from vllm_sparsever.verification.sparse.attention import AttentionPlanner
from vllm_sparsever.verification.sparse.runtime import SparseVerificationRuntime, install_runtime

BS, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 64


@pytest.fixture
def runtime():
    config = SparseverConfig.from_dict({
        "num_speculative_tokens": 3, "profile": "none",
        "attention": {"enabled": True, "top_k_blocks": 2, "num_sink_blocks": 1, "num_local_blocks": 1,
                      "min_context_len": 256},
    })
    rt = SparseVerificationRuntime(config)
    install_runtime(rt)
    yield rt
    install_runtime(None)


def _planner(kernel):
    builder = SimpleNamespace(sparse_kernel=kernel, isa="vec", block_size=BS, num_heads=HEADS,
                              num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                              kv_cache_dtype="auto")
    return AttentionPlanner(builder)


def _plan(planner, num_scheduled=(4, 1, 2), computed=(300, 200, 40), drafts=None):
    drafts = {"a": [1, 2, 3], "c": [4]} if drafts is None else drafts
    return build_verification_plan(
        step=1, req_ids=["a", "b", "c"], num_scheduled_tokens=np.array(num_scheduled),
        num_computed_tokens=np.array(computed), scheduled_spec_decode_tokens=drafts,
        block_table=torch.arange(3 * 16, dtype=torch.int32).view(3, 16), block_size=BS,
        attention_planner=planner,
    )


def test_rows_kept_blocks_and_compacted_lengths(runtime):
    step = _plan(_planner("sparsever")).attention
    assert step.run_sparse
    assert step.query_lens.tolist() == [4, 1, 2]
    assert step.sparse_rows.tolist() == [True, False, False]
    assert step.kept_blocks.tolist() == [4, 7, 2]
    # Row 0 drops 6 of its 10 context blocks: 304 tokens -> 304 - 6 * 32; the others are unchanged.
    assert step.compacted_seq_lens.tolist() == [304 - 6 * BS, 201, 42]
    assert (step.kv_blocks_read, step.kv_blocks_dense) == ((4 + 7 + 2) * KV_HEADS, (10 + 7 + 2) * KV_HEADS)
    assert step.kernel_metadata is None  # sparsever's kernel needs no work split
    assert step.geometry == (BS, HEADS, KV_HEADS, HEAD_DIM)  # layers of other shapes fall back


def test_vllm_kernel_gets_its_work_split_for_the_compacted_lengths(runtime):
    step = _plan(_planner("vllm")).attention
    assert isinstance(step.kernel_metadata, torch.Tensor) and step.kernel_metadata.numel() > 0


def test_dense_when_nothing_to_save_or_a_prefill_chunk_shares_the_step(runtime):
    planner = _planner("sparsever")
    short = _plan(planner, computed=(100, 200, 40))  # every verify row below min_context_len
    assert short.is_verify_step and short.attention is None
    prefill = _plan(planner, num_scheduled=(4, 16, 2))  # row 1 is a prefill chunk
    assert prefill.is_verify_step and prefill.attention is None


def test_knobs_in_force_are_read_each_step(runtime):
    planner = _planner("sparsever")
    runtime.set_sections({"attention": {"enabled": True, "top_k_blocks": 5, "num_sink_blocks": 1,
                                        "num_local_blocks": 1, "min_context_len": 256}})
    assert _plan(planner).attention.kept_blocks.tolist() == [7, 7, 2]
