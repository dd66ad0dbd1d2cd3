"""block_sparse_tree_attention vs the PyTorch reference (and the reference vs SDPA)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from op_inputs import start_loc

from .kv_cache_utils import make_paged_kv

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _random_tree_mask(q_lens, gen):
    """Ancestor masks of random trees (node i's parent is some j < i), packed [T, max_q_len]."""
    max_q = max(q_lens) if q_lens else 1
    rows = []
    for q in q_lens:
        m = torch.zeros(q, max_q, dtype=torch.bool)
        for i in range(q):
            m[i, i] = True
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                m[i, :q] |= m[parent, :q]
        rows.append(m)
    return torch.cat(rows) if rows else torch.zeros(0, max_q, dtype=torch.bool)


def _run_both(query, kc, vc, bt, sl, qsl, scale, sel=None, nsel=None, mask=None):
    out = ops.block_sparse_tree_attention(query, kc, vc, bt, sl, qsl, scale, sel, nsel, mask)
    expected = torch.empty_like(query)
    ref.block_sparse_tree_attention(expected, query, kc, vc, bt, sl, qsl, sel, nsel, mask, scale)
    return out, expected


def test_reference_matches_sdpa_dense_causal():
    gen = torch.Generator().manual_seed(0)
    seq_len, q_len, hkv, group, d, bs = 100, 5, 2, 3, 32, 16
    kc, vc, bt, _ = make_paged_kv([seq_len], hkv, d, bs, torch.float32, "gpu", gen)
    q = torch.randn(q_len, hkv * group, d, generator=gen)
    out = torch.empty_like(q)
    ref.block_sparse_tree_attention(out, q, kc, vc, bt, torch.tensor([seq_len], dtype=torch.int32),
                                    start_loc([q_len]), None, None, None, 0.3)
    phys = bt[0].long()
    k = kc[phys].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :seq_len]
    v = vc[phys].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :seq_len]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(["cpu", "gpu"]),
    dtype=st.sampled_from(list(TOL)),
    block_size=st.sampled_from([16, 32, 48]),
    head_dim=st.sampled_from([8, 40, 64, 128]),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 7]),
    reqs=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 9)), min_size=1, max_size=3),
    sparse=st.booleans(),
    tree=st.booleans(),
    top_k=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_attention_matches_reference(layout, dtype, block_size, head_dim, hkv, group, reqs, sparse, tree,
                                     top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for _, q in reqs]
    seq_lens = [c + q for c, q in reqs]
    kc, vc, bt, _ = make_paged_kv(seq_lens, hkv, head_dim, block_size, dtype, layout, gen)
    query = torch.randn(sum(q_lens), hkv * group, head_dim, generator=gen).to(dtype)
    sl, qsl = torch.tensor(seq_lens, dtype=torch.int32), start_loc(q_lens)
    sel = nsel = None
    if sparse:
        nb = kc.shape[0]
        kmin, kmax = torch.zeros(nb, hkv, head_dim), torch.zeros(nb, hkv, head_dim)
        for r, s in enumerate(seq_lens):
            slots = [int(bt[r, p // block_size]) * block_size + p % block_size for p in range(s)]
            ref.update_block_key_summaries(kc, torch.tensor(slots, dtype=torch.long), block_size, kmin, kmax)
        qp = ref.pool_queries(query, qsl)
        sel, nsel = ops.select_kv_blocks(qp, kmin, kmax, bt, sl, torch.tensor(q_lens, dtype=torch.int32),
                                         block_size, top_k, 1, 1)
    mask = _random_tree_mask(q_lens, gen) if tree else None
    out, expected = _run_both(query, kc, vc, bt, sl, qsl, 1 / math.sqrt(head_dim), sel, nsel, mask)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", list(TOL))
def test_long_context_split_k(dtype):
    # 4K context, 8 draft tokens, GQA 7: many split-K items per head, merged at the end.
    gen = torch.Generator().manual_seed(3)
    seq_lens, q_lens, hkv, group, d, bs = [4096 + 8, 300], [8, 3], 2, 7, 64, 128
    kc, vc, bt, _ = make_paged_kv(seq_lens, hkv, d, bs, dtype, "cpu", gen)
    query = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
    out, expected = _run_both(query, kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32), start_loc(q_lens),
                              0.125)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def test_rows_without_keys_are_zero():
    # No context and a tree mask row with no allowed column: output must be exactly zero.
    kc, vc, bt, _ = make_paged_kv([3], 1, 16, 16, torch.float32, "cpu")
    query = torch.randn(3, 2, 16)
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.uint8)
    out, expected = _run_both(query, kc, vc, bt, torch.tensor([3], dtype=torch.int32), start_loc([3]), 0.25,
                              mask=mask)
    assert torch.all(out[1] == 0)
    torch.testing.assert_close(out, expected)


def test_unselected_blocks_are_not_read():
    # NaN in every context block that was not selected: a kernel that touched them would emit NaN.
    gen = torch.Generator().manual_seed(5)
    bs, hkv, d = 32, 2, 64
    seq_lens, q_lens = [32 * 20 + 4], [4]
    kc, vc, bt, raw = make_paged_kv(seq_lens, hkv, d, bs, torch.float32, "cpu", gen)
    sel = torch.full((1, hkv, 5), -1, dtype=torch.int32)
    sel[0, 0, :3] = torch.tensor([0, 7, 19])
    sel[0, 1, :4] = torch.tensor([0, 3, 11, 19])
    nsel = torch.tensor([[3, 4]], dtype=torch.int32)
    for h in range(hkv):
        keep = set(sel[0, h, : nsel[0, h]].tolist()) | {20}  # block 20 holds the query tokens
        for b in range(21):
            if b not in keep:
                raw[int(bt[0, b]), h] = float("nan")
    query = torch.randn(4, hkv * 3, d, generator=gen)
    qsl, sl = start_loc(q_lens), torch.tensor(seq_lens, dtype=torch.int32)
    out = ops.block_sparse_tree_attention(query, kc, vc, bt, sl, qsl, 0.125, sel, nsel)
    assert torch.isfinite(out).all()
    raw.nan_to_num_(0.0)  # reference masks by -inf but still multiplies NaN*0 in einsum: compare on clean data
    expected = torch.empty_like(out)
    ref.block_sparse_tree_attention(expected, query, kc, vc, bt, sl, qsl, sel, nsel, None, 0.125)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_opcheck_fake_impl():
    kc, vc, bt, _ = make_paged_kv([40, 9], 1, 16, 16, torch.float32, "cpu")
    query = torch.randn(3, 2, 16)
    args = (torch.empty_like(query), query, kc, vc, bt, torch.tensor([40, 9], dtype=torch.int32),
            start_loc([2, 1]), None, None, None, 0.25)
    torch.library.opcheck(torch.ops.sparsever.block_sparse_tree_attention.default, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tree", [False, True])
def test_many_rows_sdpa_path(dtype, tree):
    # >= 128 rows (q_len x group) in bf16/fp16 go through SDPA on the gathered selected tokens
    # (SPARSEVER_CPU_ATTN_SDPA_MIN_ROWS); a request without context stays on the kernel.
    gen = torch.Generator().manual_seed(6)
    bs, hkv, group, d = 32, 2, 7, 64
    q_lens = [20, 3, 19]
    seq_lens = [32 * 12 + 20, 300, 19]
    kc, vc, bt, _ = make_paged_kv(seq_lens, hkv, d, bs, dtype, "cpu", gen)
    query = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype)
    sl, qsl = torch.tensor(seq_lens, dtype=torch.int32), start_loc(q_lens)
    sel = torch.full((3, hkv, 4), -1, dtype=torch.int32)
    nsel = torch.tensor([[4, 3], [2, 2], [0, 0]], dtype=torch.int32)
    sel[0, 0], sel[0, 1, :3] = torch.tensor([0, 2, 5, 11]), torch.tensor([0, 7, 11])
    sel[1, :, :2] = torch.tensor([1, 8])
    mask = _random_tree_mask(q_lens, gen) if tree else None
    with torch.profiler.profile() as prof:
        out = ops.block_sparse_tree_attention(query, kc, vc, bt, sl, qsl, 0.125, sel, nsel, mask)
    assert any("scaled_dot_product" in e.name for e in prof.events())  # the path under test ran
    expected = torch.empty_like(query)
    ref.block_sparse_tree_attention(expected, query, kc, vc, bt, sl, qsl, sel, nsel, mask, 0.125)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def test_invalid_selected_block_raises():
    kc, vc, bt, _ = make_paged_kv([100], 1, 16, 16, torch.float32, "cpu")
    query = torch.randn(2, 1, 16)
    sel = torch.tensor([[[0, 7]]], dtype=torch.int32)  # 98 context tokens = blocks 0..6
    with pytest.raises(RuntimeError, match="not a context block"):
        ops.block_sparse_tree_attention(query, kc, vc, bt, torch.tensor([100], dtype=torch.int32), start_loc([2]),
                                        0.25, sel, torch.tensor([[2]], dtype=torch.int32))


@pytest.mark.skipif(not ops.bf16_dot_available(), reason="needs a CPU with AVX512-BF16 and the AVX-512 build")
@pytest.mark.parametrize("block_size", [16, 48, 128])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_bf16_dot_path_on_plain_layout(monkeypatch, block_size, head_dim):
    # bf16 on vLLM-CPU's plain layout runs vdpbf16ps on pair-interleaved K/V. Unwritten slots hold NaN
    # (the path's masked loads and zeroed V pairs must keep them out); query tokens start mid-block, so
    # segments are unaligned; 1-16 tokens x GQA 6 cover every row-tile remainder; trees and causal.
    gen = torch.Generator().manual_seed(block_size + head_dim)
    hkv, group = 2, 6
    reqs = [(1000, 16), (37, 5), (300, 1), (block_size * 3, 3)]
    q_lens = [q for _, q in reqs]
    seq_lens = [c + q for c, q in reqs]
    kc, vc, bt, raw = make_paged_kv(seq_lens, hkv, head_dim, block_size, torch.bfloat16, "cpu", gen,
                                    spare_blocks=1)
    written = torch.zeros(raw.shape[0], block_size, dtype=torch.bool)
    for r, s in enumerate(seq_lens):
        for p in range(s):
            written[int(bt[r, p // block_size]), p % block_size] = True
    kc.masked_fill_(~written[:, None, :, None], float("nan"))
    vc.masked_fill_(~written[:, None, :, None], float("nan"))
    query = torch.randn(sum(q_lens), hkv * group, head_dim, generator=gen).to(torch.bfloat16)
    sl, qsl = torch.tensor(seq_lens, dtype=torch.int32), start_loc(q_lens)
    clean_k, clean_v = kc.nan_to_num(0.0), vc.nan_to_num(0.0)  # the reference multiplies 0 x NaN
    for mask in (None, _random_tree_mask(q_lens, gen)):
        monkeypatch.setenv("SPARSEVER_CPU_ATTN_BF16_DOT", "1")  # on by default only without AMX
        out = ops.block_sparse_tree_attention(query, kc, vc, bt, sl, qsl, 0.1, None, None, mask)
        expected = torch.empty_like(query)
        ref.block_sparse_tree_attention(expected, query, clean_k, clean_v, bt, sl, qsl, None, None, mask, 0.1)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
        monkeypatch.setenv("SPARSEVER_CPU_ATTN_BF16_DOT", "0")
        fp32_fma = ops.block_sparse_tree_attention(query, kc, vc, bt, sl, qsl, 0.1, None, None, mask)
        torch.testing.assert_close(out.float(), fp32_fma.float(), rtol=2e-2, atol=2e-2)
        # The path under test ran: it rounds P to bf16, the fp32 FMA path does not.
        assert not torch.equal(out, fp32_fma)
