"""CUDA kernel bodies of KV block key summaries and Quest block selection, run by the SIMT executor and
compared with vllm_sparsever.reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_inputs import make_kv_cache, make_requests
from simt_build import kernel_ops

from vllm_sparsever import reference

SETTINGS = dict(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


@settings(**SETTINGS)
@given(
    num_blocks=st.integers(1, 6),
    hkv=st.integers(1, 3),
    block_size=st.sampled_from([16, 32]),
    head_dim=st.sampled_from([32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    layout=st.sampled_from(["gpu", "cpu"]),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    num_slots=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_key_summaries_match_reference(ops, num_blocks, hkv, block_size, head_dim, dtype, layout, slot_dtype,
                                       num_slots, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, _ = make_kv_cache(num_blocks, hkv, block_size, head_dim, dtype, layout, gen)
    slots = torch.randint(-1, num_blocks * block_size, (num_slots,), generator=gen).to(slot_dtype)
    init_min = torch.randn(num_blocks, hkv, head_dim, generator=gen)
    init_max = torch.randn(num_blocks, hkv, head_dim, generator=gen)
    kmin, kmax = init_min.clone(), init_max.clone()
    ops.update_block_key_summaries(k_cache, slots, block_size, kmin, kmax)
    rmin, rmax = init_min.clone(), init_max.clone()
    reference.update_block_key_summaries(k_cache, slots, block_size, rmin, rmax)
    assert torch.equal(kmin, rmin) and torch.equal(kmax, rmax)  # min/max are exact


def pooled_and_summaries(k_cache, nb, bs, total_tokens, hq, d, gen):
    kmin = torch.zeros(nb, k_cache.shape[1], d)
    kmax = torch.zeros(nb, k_cache.shape[1], d)
    reference.update_block_key_summaries(k_cache, torch.arange(nb * bs), bs, kmin, kmax)
    return torch.randn(total_tokens, hq, d, generator=gen), kmin, kmax


@settings(**SETTINGS)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 5)), min_size=1, max_size=3),
    block_size=st.sampled_from([16, 32]),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    top_k=st.integers(0, 6),
    num_sink=st.integers(0, 2),
    num_local=st.integers(0, 2),
    extra_slots=st.integers(0, 3),
    pooled_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_select_matches_reference(ops, seqs, block_size, hkv, group, top_k, num_sink, num_local, extra_slots,
                                  pooled_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    d = 32
    table, seq_lens, query_lens, qsl, nb = make_requests(seqs, block_size, gen)
    k_cache, _ = make_kv_cache(nb, hkv, block_size, d, torch.float32, "gpu", gen)
    query, kmin, kmax = pooled_and_summaries(k_cache, nb, block_size, int(qsl[-1]), hkv * group, d, gen)
    pooled = reference.pool_queries(query, qsl).to(pooled_dtype)
    slots = max(1, top_k + num_sink + num_local + extra_slots)
    sel = torch.full((len(seqs), hkv, slots), 77, dtype=torch.int32)
    nsel = torch.full((len(seqs), hkv), 77, dtype=torch.int32)
    ops.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, block_size, top_k, num_sink, num_local,
                         sel, nsel)
    rsel, rnsel = torch.empty_like(sel), torch.empty_like(nsel)
    reference.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, block_size, top_k, num_sink,
                               num_local, rsel, rnsel)
    assert torch.equal(nsel, rnsel)
    if not torch.equal(sel, rsel):  # only near-tied Quest scores may flip (fp summation order)
        for r, (ctx, q) in enumerate(seqs):
            n = reference.num_context_blocks(ctx + q, q, block_size)
            phys = table[r, :n].long()
            scores = reference.quest_block_scores(pooled[r], kmin, kmax, phys)
            for h in range(hkv):
                got = set(sel[r, h, : nsel[r, h]].tolist())
                want = set(rsel[r, h, : rnsel[r, h]].tolist())
                # Equal counts (asserted above), so every block the kernel swapped in replaces one.
                for a, b in zip(sorted(got - want), sorted(want - got), strict=True):
                    assert abs(float(scores[h, a]) - float(scores[h, b])) <= 1e-4 * (1 + scores[h].abs().max())
        assert torch.equal(sel[sel < 0], rsel[rsel < 0])


def test_select_edge_cases(ops):
    # No context, context shorter than the budget (dense), top_k larger than the middle blocks, exact ties.
    gen = torch.Generator().manual_seed(0)
    bs, d, hkv = 16, 32, 2
    seqs = [(0, 3), (40, 1), (16 * 9, 2), (16 * 12 + 5, 4)]
    table, seq_lens, query_lens, qsl, nb = make_requests(seqs, bs, gen)
    k_cache = torch.ones(nb, hkv, bs, d)  # every block has identical summaries: all Quest scores tie
    kmin = torch.ones(nb, hkv, d)
    kmax = torch.ones(nb, hkv, d)
    pooled = torch.randn(len(seqs), hkv * 2, d, generator=gen)
    for top_k in (2, 20):
        sel = torch.empty(len(seqs), hkv, top_k + 2, dtype=torch.int32)
        nsel = torch.empty(len(seqs), hkv, dtype=torch.int32)
        ops.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, top_k, 1, 1, sel, nsel)
        rsel, rnsel = torch.empty_like(sel), torch.empty_like(nsel)
        reference.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, top_k, 1, 1, rsel, rnsel)
        assert torch.equal(sel, rsel) and torch.equal(nsel, rnsel)
    assert k_cache.shape[0] == nb


def test_select_long_context_scores_in_many_ctas(ops):
    # 16 * 300 + 7 context tokens = 301 blocks: the scores come from 5 CTAs of 64 blocks each (one short),
    # beside a request short enough to keep every block.
    gen = torch.Generator().manual_seed(12)
    bs, d, hkv = 16, 32, 2
    seqs = [(16 * 300 + 7, 3), (50, 2)]
    table, seq_lens, query_lens, qsl, nb = make_requests(seqs, bs, gen)
    k_cache, _ = make_kv_cache(nb, hkv, bs, d, torch.float32, "gpu", gen)
    query, kmin, kmax = pooled_and_summaries(k_cache, nb, bs, int(qsl[-1]), hkv * 3, d, gen)
    pooled = reference.pool_queries(query, qsl)
    sel = torch.full((2, hkv, 40), 77, dtype=torch.int32)
    nsel = torch.full((2, hkv), 77, dtype=torch.int32)
    ops.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, 37, 1, 2, sel, nsel)
    rsel, rnsel = torch.empty_like(sel), torch.empty_like(nsel)
    reference.select_kv_blocks(pooled, kmin, kmax, table, seq_lens, query_lens, bs, 37, 1, 2, rsel, rnsel)
    assert torch.equal(nsel, rnsel) and nsel[0].tolist() == [40, 40]
    assert torch.equal(sel, rsel)
