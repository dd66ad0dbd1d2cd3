"""update_block_key_summaries and select_kv_blocks vs the PyTorch reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from .kv_cache_utils import make_paged_kv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _slots(block_table, seq_len_ranges, block_size):
    """Physical slots of positions [lo, hi) of each request, in position order."""
    out = []
    for r, (lo, hi) in enumerate(seq_len_ranges):
        for p in range(lo, hi):
            out.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    return torch.tensor(out, dtype=torch.long)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(["cpu", "gpu"]),
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([16, 32, 48]),
    head_dim=st.sampled_from([8, 40, 64]),
    hkv=st.integers(1, 3),
    seq_lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    data=st.data(),
)
def test_summaries_match_reference(layout, dtype, block_size, head_dim, hkv, seq_lens, data):
    gen = torch.Generator().manual_seed(0)
    kc, _, bt, _ = make_paged_kv(seq_lens, hkv, head_dim, block_size, dtype, layout, gen)
    # Each request writes a suffix [lo, seq_len) (prefill: lo = 0; decode/verify: a few tokens).
    ranges = [(data.draw(st.integers(0, s - 1)), s) for s in seq_lens]
    slots = _slots(bt, ranges, block_size)
    slots = torch.cat([slots, torch.tensor([-1, -1])])  # vLLM pads with -1
    nb = kc.shape[0]
    init = torch.randn(nb, hkv, head_dim, generator=gen)
    kmin, kmax = init.clone(), init.clone() + 1
    rmin, rmax = init.clone(), init.clone() + 1
    ops.update_block_key_summaries(kc, slots.to(data.draw(st.sampled_from([torch.int32, torch.int64]))),
                                   block_size, kmin, kmax)
    ref.update_block_key_summaries(kc, slots, block_size, rmin, rmax)
    torch.testing.assert_close(kmin, rmin, rtol=0, atol=0)
    torch.testing.assert_close(kmax, rmax, rtol=0, atol=0)


def test_summaries_reset_when_block_reused():
    kc, _, bt, _ = make_paged_kv([64], 1, 16, 32, torch.float32, "cpu")
    b = int(bt[0, 0])
    kmin = torch.full((kc.shape[0], 1, 16), -100.0)
    kmax = torch.full((kc.shape[0], 1, 16), 100.0)
    kc[b, 0, 0] = 5.0
    ops.update_block_key_summaries(kc, torch.tensor([b * 32]), 32, kmin, kmax)
    assert torch.all(kmin[b] == 5.0) and torch.all(kmax[b] == 5.0)  # offset 0 only: old bound gone
    other = [i for i in range(kc.shape[0]) if i != b]
    assert torch.all(kmin[other] == -100.0)  # untouched blocks stay as they were


def _check_selection(sel, nsel, qp, kmin, kmax, bt, seq_lens, q_lens, bs, top_k, sink, local):
    """Selection is valid up to fp rounding of near-tied scores; exact match otherwise."""
    for r in range(sel.shape[0]):
        n = ref.num_context_blocks(seq_lens[r], q_lens[r], bs)
        for h in range(sel.shape[1]):
            k = int(nsel[r, h])
            got = sel[r, h, :k].tolist()
            assert all(v == -1 for v in sel[r, h, k:].tolist())
            if n <= top_k + sink + local:
                assert got == list(range(n))
                continue
            assert k == top_k + sink + local
            assert got == sorted(got)
            assert got[:sink] == list(range(sink)) and got[k - local :] == list(range(n - local, n))
            scores = ref.quest_block_scores(qp[r], kmin, kmax, bt[r, :n].long())[h]
            middle = set(got[sink : k - local])
            rest = [b for b in range(sink, n - local) if b not in middle]
            tol = 1e-4 * (1 + scores.abs().max().item())
            if rest and middle:
                assert min(scores[list(middle)]) >= max(scores[rest]) - tol


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    block_size=st.sampled_from([16, 32]),
    head_dim=st.sampled_from([8, 40, 64]),
    hkv=st.integers(1, 3),
    group=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 8)), min_size=1, max_size=3),
    top_k=st.integers(0, 6),
    sink=st.integers(0, 2),
    local=st.integers(0, 2),
)
def test_select_matches_reference(dtype, block_size, head_dim, hkv, group, reqs, top_k, sink, local):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [max(s, q) for s, q in reqs]
    q_lens = [q for _, q in reqs]
    kc, _, bt, _ = make_paged_kv(seq_lens, hkv, head_dim, block_size, dtype, "cpu", gen)
    nb = kc.shape[0]
    kmin, kmax = torch.zeros(nb, hkv, head_dim), torch.zeros(nb, hkv, head_dim)
    ref.update_block_key_summaries(kc, _slots(bt, [(0, s) for s in seq_lens], block_size), block_size, kmin, kmax)
    qp = torch.randn(len(reqs), hkv * group, head_dim, generator=gen).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    ql = torch.tensor(q_lens, dtype=torch.int32)
    sel, nsel = ops.select_kv_blocks(qp, kmin, kmax, bt, sl, ql, block_size, top_k, sink, local)
    _check_selection(sel, nsel, qp, kmin, kmax, bt, seq_lens, q_lens, block_size, top_k, sink, local)
    rsel, rnsel = torch.empty_like(sel), torch.empty_like(nsel)
    ref.select_kv_blocks(qp, kmin, kmax, bt, sl, ql, block_size, top_k, sink, local, rsel, rnsel)
    assert torch.equal(nsel, rnsel)


def test_select_ties_lower_index_wins():
    # All blocks get identical summaries, so every middle score ties: the lowest indices must win.
    nb, hkv, d, bs = 12, 2, 16, 16
    kmin, kmax = -torch.ones(nb, hkv, d), torch.ones(nb, hkv, d)
    bt = torch.arange(nb, dtype=torch.int32).flip(0).unsqueeze(0).contiguous()
    qp = torch.ones(1, 4, d)
    sl, ql = torch.tensor([12 * bs], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    sel, nsel = ops.select_kv_blocks(qp, kmin, kmax, bt, sl, ql, bs, 3, 1, 2)
    # ctx = 12*16-1 -> 12 blocks; sink {0}, local {10, 11}, top-3 of 1..9 by tie -> {1, 2, 3}.
    assert sel[0, 0].tolist() == [0, 1, 2, 3, 10, 11] and nsel.tolist() == [[6, 6]]


def test_select_edge_cases():
    nb, hkv, d, bs = 8, 1, 16, 16
    kmin, kmax = torch.randn(nb, hkv, d), torch.randn(nb, hkv, d) + 3
    bt = torch.arange(nb, dtype=torch.int32).unsqueeze(0).repeat(3, 1)
    qp = torch.randn(3, 2, d)
    # ctx 0 (only query tokens); ctx not a multiple of bs; top_k larger than blocks present.
    sl = torch.tensor([4, 16 * 3 + 5 + 2, 16 * 8], dtype=torch.int32)
    ql = torch.tensor([4, 2, 1], dtype=torch.int32)
    sel, nsel = ops.select_kv_blocks(qp, kmin, kmax, bt, sl, ql, bs, 100, 1, 1)
    assert nsel.tolist() == [[0], [4], [8]]
    assert sel[1, 0, :4].tolist() == [0, 1, 2, 3] and sel[0, 0].tolist() == [-1] * sel.shape[2]
    with pytest.raises(RuntimeError):  # too few slots for what must be kept
        ops.select_kv_blocks(qp, kmin, kmax, bt, sl, ql, bs, 100, 1, 1,
                             selected=torch.empty(3, 1, 2, dtype=torch.int32))
