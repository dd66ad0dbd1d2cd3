"""CUDA kernel bodies of KV block summaries, block selection and block-sparse tree attention, run by the SIMT
executor and compared with vllm_sparsever.reference on random small shapes (hypothesis) and edge cases."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_inputs import make_kv_cache, make_requests, make_tree_mask
from simt_build import kernel_ops

from vllm_sparsever import reference

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = dict(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def run_attention(ops, case, use_selection, use_tree, forced_splits, num_sms=4, tensor_cores=True):
    gen = torch.Generator().manual_seed(case["seed"])
    bs, d, hkv, group, dtype = case["block_size"], case["head_dim"], case["hkv"], case["group"], case["dtype"]
    table, seq_lens, query_lens, qsl, nb = make_requests(case["seqs"], bs, gen)
    k_cache, v_cache = make_kv_cache(nb, hkv, bs, d, dtype, case["layout"], gen)
    total = int(qsl[-1])
    query = torch.randn(total, hkv * group, d, generator=gen).to(dtype)
    selected = num_selected = None
    if use_selection:
        kmin = torch.zeros(nb, hkv, d)
        kmax = torch.zeros(nb, hkv, d)
        slots = torch.arange(nb * bs, dtype=torch.int64)
        reference.update_block_key_summaries(k_cache, slots, bs, kmin, kmax)
        pooled = reference.pool_queries(query, qsl)
        budget = case["top_k"] + case["sink"] + case["local"]
        selected = torch.empty(len(case["seqs"]), hkv, max(budget, 1), dtype=torch.int32)
        num_selected = torch.empty(len(case["seqs"]), hkv, dtype=torch.int32)
        reference.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, case["top_k"],
                                   case["sink"], case["local"], selected, num_selected)
    tree = make_tree_mask(query_lens, gen) if use_tree else None
    scale = d**-0.5
    expected = torch.full_like(query, 7.0)
    reference.block_sparse_tree_attention(expected, query, k_cache, v_cache, table, seq_lens, qsl, selected,
                                          num_selected, tree, scale)
    out = torch.full_like(query, 7.0)
    ops.block_sparse_tree_attention(out, query, k_cache, v_cache, table, seq_lens, qsl, selected, num_selected,
                                    tree, scale, num_sms, forced_splits, tensor_cores)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    return out


seq_strategy = st.lists(st.tuples(st.integers(0, 150), st.integers(1, 6)), min_size=1, max_size=3)


@settings(**SETTINGS)
@given(
    seqs=seq_strategy,
    block_size=st.sampled_from([16, 32]),
    head_dim=st.sampled_from([32, 64, 80]),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["gpu", "cpu"]),
    use_selection=st.booleans(),
    use_tree=st.booleans(),
    forced_splits=st.sampled_from([0, 1, 3]),
    top_k=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_attention_matches_reference(ops, seqs, block_size, head_dim, hkv, group, dtype, layout, use_selection,
                                     use_tree, forced_splits, top_k, seed):
    case = dict(seqs=seqs, block_size=block_size, head_dim=head_dim, hkv=hkv, group=group, dtype=dtype,
                layout=layout, top_k=top_k, sink=1, local=1, seed=seed)
    run_attention(ops, case, use_selection, use_tree, forced_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_attention_edge_cases(ops, dtype, layout):
    # One query token and no context; context a multiple of the block size; a partial last block that also
    # holds query tokens; more rows than one CTA pass (q_len * group > 32); 5 splits over few tiles.
    case = dict(seqs=[(0, 1), (64, 3), (37, 12)], block_size=16, head_dim=64, hkv=2, group=3, dtype=dtype,
                layout=layout, top_k=1, sink=1, local=1, seed=3)
    for use_selection in (False, True):
        for use_tree in (False, True):
            for splits in (1, 5):
                run_attention(ops, case, use_selection, use_tree, splits)


def test_attention_head_dim_256_and_heuristic_splits(ops):
    case = dict(seqs=[(300, 4)], block_size=32, head_dim=256, hkv=1, group=2, dtype=torch.bfloat16, layout="gpu",
                top_k=4, sink=1, local=1, seed=5)
    run_attention(ops, case, use_selection=True, use_tree=True, forced_splits=0, num_sms=8)


@pytest.mark.parametrize("use_tree", [False, True])
def test_attention_wide_ctas_and_row_passes(ops, use_tree):
    # 10 tokens x GQA 8 = 80 rows: the 8-warp CTA (64 rows per pass) and a second row pass; the 1-token
    # request beside it runs in the same wide launch with one row chunk.
    case = dict(seqs=[(200, 10), (45, 1)], block_size=16, head_dim=64, hkv=1, group=8, dtype=torch.bfloat16,
                layout="gpu", top_k=2, sink=1, local=1, seed=9)
    for use_selection in (False, True):
        for splits in (0, 3):
            run_attention(ops, case, use_selection, use_tree, splits)


def emulated_mma_tiles(ops) -> int:
    """mma.sync tiles the SIMT emulation has run; 0 through the device adapter (real GPUs count nothing)."""
    counters = getattr(ops, "emulated_instructions", None)
    return counters()[0] if counters is not None else 0


def simt_counts(ops) -> bool:
    return not os.environ.get("SPARSEVER_SIMT_DEVICE")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,group", [(1, 4), (4, 4), (8, 4), (16, 4), (10, 8)])
def test_attention_tensor_cores(ops, dtype, head_dim, q_len, group):
    # 4 / 16 / 32 / 64 / 80 query rows: every CTA shape of the tensor-core kernel (16, 32, 64 rows per
    # pass) and a second row pass; beside it a shorter request in the same launch. On a GPU (the kit) the same
    # cases compare the tensor-core kernel with the CUDA-core one, without the instruction counts.
    case = dict(seqs=[(150, q_len), (37, max(1, q_len // 2))], block_size=16, head_dim=head_dim, hkv=2, group=group,
                dtype=dtype, layout="gpu", top_k=2, sink=1, local=1, seed=q_len * 7 + head_dim)
    for use_selection, use_tree, splits in [(False, False, 1), (True, True, 3), (False, True, 0), (True, False, 2)]:
        before = emulated_mma_tiles(ops)
        mma_out = run_attention(ops, case, use_selection, use_tree, splits)
        assert emulated_mma_tiles(ops) > before or not simt_counts(ops), "the tensor-core kernel did not run"
        before = emulated_mma_tiles(ops)
        cuda_core_out = run_attention(ops, case, use_selection, use_tree, splits, tensor_cores=False)
        assert emulated_mma_tiles(ops) == before, "tensor_cores=False still ran mma"
        tol = TOL[dtype]
        torch.testing.assert_close(mma_out.float(), cuda_core_out.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim,layout,dtype", [(80, "gpu", torch.bfloat16), (64, "cpu", torch.bfloat16),
                                                   (64, "gpu", torch.float32)])
def test_attention_cuda_core_kernel_where_tensor_cores_do_not_apply(ops, head_dim, layout, dtype):
    # Head dims other than 64/128, vLLM-CPU's transposed K (no 16-byte key rows), fp32: the CUDA-core kernel.
    if not simt_counts(ops):
        pytest.skip("which kernel ran is counted by the SIMT emulation only; the case itself runs in the other tests")
    case = dict(seqs=[(90, 4)], block_size=16, head_dim=head_dim, hkv=1, group=4, dtype=dtype, layout=layout,
                top_k=2, sink=1, local=1, seed=1)
    before = emulated_mma_tiles(ops)
    run_attention(ops, case, use_selection=True, use_tree=True, forced_splits=2)
    assert emulated_mma_tiles(ops) == before


def launches(ops) -> int:
    return ops.emulated_instructions()[3]


@pytest.mark.parametrize("splits", [1, 3])
def test_selection_plus_attention_is_two_launches(ops, splits):
    # Issue 60: selection and tensor-core attention are one launch each (the block scores' top-k runs in the
    # last scoring CTA of a row, the splits merge in the last split to finish), so a CUDA graph captures two
    # kernels. The arrival counters reset themselves: the second round reuses them.
    if not simt_counts(ops):
        pytest.skip("launches are counted by the SIMT executor only")
    gen = torch.Generator().manual_seed(4)
    bs, d, hkv, group, top_k = 16, 64, 2, 4, 3
    table, seq_lens, query_lens, qsl, nb = make_requests([(300, 4), (170, 2)], bs, gen)
    k_cache, v_cache = make_kv_cache(nb, hkv, bs, d, torch.bfloat16, "gpu", gen)
    query = torch.randn(int(qsl[-1]), hkv * group, d, generator=gen).to(torch.bfloat16)
    kmin, kmax = torch.zeros(nb, hkv, d), torch.zeros(nb, hkv, d)
    reference.update_block_key_summaries(k_cache, torch.arange(nb * bs, dtype=torch.int64), bs, kmin, kmax)
    pooled = reference.pool_queries(query, qsl)
    want_sel, want_n = torch.empty(2, hkv, top_k + 2, dtype=torch.int32), torch.empty(2, hkv, dtype=torch.int32)
    reference.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, top_k, 1, 1, want_sel, want_n)
    want = torch.empty_like(query)
    reference.block_sparse_tree_attention(want, query, k_cache, v_cache, table, seq_lens, qsl, want_sel, want_n,
                                          None, d**-0.5)
    for _ in range(2):
        sel, nsel = torch.full_like(want_sel, 99), torch.full_like(want_n, 99)
        out = torch.full_like(query, 7.0)
        before = launches(ops)
        ops.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, top_k, 1, 1, sel, nsel)
        ops.block_sparse_tree_attention(out, query, k_cache, v_cache, table, seq_lens, qsl, sel, nsel, None,
                                        d**-0.5, 4, splits, True)
        assert launches(ops) - before == 2
        assert torch.equal(sel, want_sel) and torch.equal(nsel, want_n)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    before = launches(ops)
    ops.block_sparse_tree_attention(out, query, k_cache, v_cache, table, seq_lens, qsl, sel, nsel, None, d**-0.5, 4,
                                    splits, False)
    assert launches(ops) - before == (2 if splits > 1 else 1)  # the CUDA-core kernel keeps its combine launch
