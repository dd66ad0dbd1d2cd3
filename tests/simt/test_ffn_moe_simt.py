"""CUDA kernel bodies of top-k FFN gating and MoE routing/dispatch, run by the SIMT executor and compared
with vllm_sparsever.reference (hypothesis on small random shapes, plus edge cases)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simt_build import kernel_ops

from op_inputs import (SELECTION_TIE_RTOL, TOL, assert_ffn_matches_reference,
                       assert_input_sparse_gate_matches_reference, ffn_weights, gated_ffn_problem,
                       input_sparse_gate_problem, start_loc)

from vllm_sparsever import reference

SETTINGS = dict(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def check_ffn(ops, x, w_gate_up, w_down_t, groups, keep, forced_splits=0):
    gsl = start_loc(groups)
    out = torch.full_like(x, 5.0)
    sel = torch.full((len(groups), keep), 123, dtype=torch.int32)
    ops.topk_swiglu_ffn(out, x, w_gate_up, w_down_t, gsl, keep, sel, 4, forced_splits)
    # The CUDA kernel keeps the gate in fp32 for every dtype (no matrix-engine rounding), so only fp32
    # summation order separates its scores from the reference's: the fp32 tie tolerance applies.
    assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, gsl, keep, SELECTION_TIE_RTOL[torch.float32])
    return out, sel


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(list(TOL)),
    h=st.sampled_from([8, 40, 64, 100]),
    inter=st.integers(1, 120),
    groups=st.lists(st.integers(0, 10), min_size=1, max_size=3),
    keep_frac=st.floats(0.0, 1.0),
    forced_splits=st.sampled_from([0, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_ffn_matches_reference(ops, dtype, h, inter, groups, keep_frac, forced_splits, seed):
    gen = torch.Generator().manual_seed(seed)
    keep = max(1, round(keep_frac * inter))
    w_gate_up, w_down_t = ffn_weights(h, inter, dtype, gen)
    x = torch.randn(sum(groups), h, generator=gen).to(dtype)
    check_ffn(ops, x, w_gate_up, w_down_t, groups, keep, forced_splits)


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(list(TOL)),
    gate_in_fp32=st.booleans(),
    h=st.sampled_from([8, 40, 64]),
    inter=st.integers(1, 120),
    groups=st.lists(st.integers(0, 10), min_size=1, max_size=3),
    keep_frac=st.floats(0.0, 1.0),
    forced_splits=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_ffn_gated_matches_reference(ops, dtype, gate_in_fp32, h, inter, groups, keep_frac, forced_splits, seed):
    # topk_swiglu_ffn_gated: the gate given (x's dtype or fp32), w_up a view of the up rows.
    x, gate, w_gate_up, w_down_t, gsl, keep = gated_ffn_problem(h, inter, groups, keep_frac, dtype, gate_in_fp32,
                                                                seed)
    out = torch.full_like(x, 5.0)
    sel = torch.full((len(groups), keep), 123, dtype=torch.int32)
    ops.topk_swiglu_ffn_gated(out, x, gate, w_gate_up[inter:], w_down_t, gsl, keep, sel, 4, forced_splits)
    assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, gsl, keep, SELECTION_TIE_RTOL[torch.float32],
                                 gate=gate)


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(list(TOL)),
    h=st.sampled_from([8, 40, 64]),
    inter=st.integers(1, 120),
    groups=st.lists(st.integers(0, 10), min_size=1, max_size=3),
    keep_frac=st.floats(0.0, 1.0),
    forced_splits=st.sampled_from([0, 1, 3]),
    strided_x=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_input_sparse_gate_matches_reference(ops, dtype, h, inter, groups, keep_frac, forced_splits, strided_x,
                                             seed):
    # strided_x: a view with row stride > H (the kernel copies it for the scores)
    x, w_gate_t, gsl, input_keep = input_sparse_gate_problem(h, inter, groups, keep_frac, dtype, seed,
                                                             row_pad=8 if strided_x else 0)
    gate = torch.full((x.shape[0], inter), 5.0, dtype=dtype)
    channels = torch.full((len(groups), input_keep), 123, dtype=torch.int32)
    ops.input_sparse_gate(gate, x, w_gate_t, gsl, input_keep, channels, 4, forced_splits)
    assert_input_sparse_gate_matches_reference(gate, channels, x, w_gate_t, gsl, input_keep,
                                               SELECTION_TIE_RTOL[torch.float32])


def test_input_sparse_gate_reads_only_kept_channels(ops):
    gen = torch.Generator().manual_seed(6)
    h, inter, input_keep = 64, 48, 16
    w_gate_t = (torch.randn(h, inter, generator=gen) / 8).to(torch.bfloat16)
    x = torch.randn(5, h, generator=gen).to(torch.bfloat16)
    gsl = start_loc([5])
    gate, channels = torch.empty(5, inter, dtype=torch.bfloat16), torch.empty(1, input_keep, dtype=torch.int32)
    ops.input_sparse_gate(gate, x, w_gate_t, gsl, input_keep, channels, 4, 2)
    unused = sorted(set(range(h)) - set(channels[0].tolist()))
    w_gate_t[torch.tensor(unused)] = float("nan")  # gate rows of the dropped channels
    gate2, channels2 = torch.empty_like(gate), torch.empty_like(channels)
    ops.input_sparse_gate(gate2, x, w_gate_t, gsl, input_keep, channels2, 4, 2)
    assert torch.equal(channels, channels2) and torch.equal(gate, gate2)


def test_ffn_keep_all_is_dense_mlp_and_ties_prefer_lower_index(ops):
    gen = torch.Generator().manual_seed(1)
    w_gate_up, w_down_t = ffn_weights(64, 48, torch.float32, gen)
    x = torch.randn(3, 64, generator=gen)
    out, sel = check_ffn(ops, x, w_gate_up, w_down_t, [3], 48)
    assert sel[0].tolist() == list(range(48))
    dense = (F.silu(x @ w_gate_up[:48].t()) * (x @ w_gate_up[48:].t())) @ w_down_t
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)
    # Copies of the best gate row give exactly tied top scores: the lowest of their indices must win.
    scores = F.silu(x @ w_gate_up[:48].t()).abs().sum(0)
    best = int(scores.argmax())
    for n in (3, 10, 20):
        w_gate_up[n] = w_gate_up[best]
    _, sel = check_ffn(ops, x, w_gate_up, w_down_t, [3], 1)
    assert sel[0].tolist() == [min(best, 3)]
    _, sel = check_ffn(ops, x, w_gate_up, w_down_t, [3], 3)
    assert sel[0].tolist() == sorted({best, 3, 10, 20})[:3]


def test_ffn_reads_only_selected_rows(ops):
    gen = torch.Generator().manual_seed(4)
    inter, keep = 64, 8
    w_gate_up, w_down_t = ffn_weights(64, inter, torch.bfloat16, gen)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    _, sel = check_ffn(ops, x, w_gate_up, w_down_t, [5], keep)
    unused = sorted(set(range(inter)) - set(sel[0].tolist()))
    w_gate_up[inter + torch.tensor(unused)] = float("nan")  # up rows of unselected neurons
    w_down_t[torch.tensor(unused)] = float("nan")
    out = torch.empty_like(x)
    sel2 = torch.empty_like(sel)
    ops.topk_swiglu_ffn(out, x, w_gate_up, w_down_t, start_loc([5]), keep, sel2, 4, 2)
    assert torch.equal(sel, sel2) and torch.isfinite(out).all()


@settings(**SETTINGS)
@given(
    num_experts=st.integers(1, 70),
    top_k_frac=st.floats(0.0, 1.0),
    groups=st.lists(st.integers(0, 8), min_size=1, max_size=3),
    ratio=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    budget=st.integers(0, 6),
    use_groups=st.booleans(),
    renormalize=st.booleans(),
    logit_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_route_and_prune_matches_reference(ops, num_experts, top_k_frac, groups, ratio, budget, use_groups,
                                           renormalize, logit_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = max(1, min(32, round(top_k_frac * num_experts)))
    logits = (torch.randn(sum(groups), num_experts, generator=gen) * 2).to(logit_dtype)
    gsl = start_loc(groups) if use_groups else None
    w = torch.full((sum(groups), top_k), 9.0)
    ids = torch.full((sum(groups), top_k), 99, dtype=torch.int32)
    ops.moe_route_and_prune(logits, top_k, ratio, gsl, budget, renormalize, w, ids)
    rw, rids = torch.empty_like(w), torch.empty_like(ids)
    reference.moe_route_and_prune(logits, top_k, ratio, gsl, budget, renormalize, rw, rids)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    if use_groups and budget > 0:
        for g in range(len(groups)):
            block = ids[gsl[g] : gsl[g + 1]]
            assert len(set(block[block >= 0].tolist())) <= budget


def moe_problem(num_tokens, h, inter, num_experts, dtype, gen):
    x = torch.randn(num_tokens, h, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return x, w13, w2, logits


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(list(TOL)),
    num_tokens=st.integers(1, 10),
    h=st.sampled_from([8, 40, 64]),
    inter=st.sampled_from([1, 16, 24, 40]),
    num_experts=st.integers(1, 10),
    ratio=st.sampled_from([0.0, 0.3, 0.8]),
    ids_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_dispatch_matches_reference(ops, dtype, num_tokens, h, inter, num_experts, ratio, ids_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(2, num_experts)
    x, w13, w2, logits = moe_problem(num_tokens, h, inter, num_experts, dtype, gen)
    w = torch.empty(num_tokens, top_k)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32)
    reference.moe_route_and_prune(logits, top_k, ratio, None, 0, True, w, ids)
    ids = ids.to(ids_dtype)
    out, used = torch.full_like(x, 3.0), torch.zeros(1, dtype=torch.int32)
    ops.moe_grouped_dispatch(out, x, w, ids, w13, w2, used)
    expected, rused = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    reference.moe_grouped_dispatch(expected, x, w, ids, w13, w2, rused)
    assert int(used) == int(rused) == len(set(ids[ids >= 0].tolist()))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def test_dispatch_reads_only_kept_experts_and_empty_tokens(ops):
    gen = torch.Generator().manual_seed(2)
    x, w13, w2, _ = moe_problem(5, 64, 32, 8, torch.float32, gen)
    ids = torch.tensor([[1, -1], [5, 1], [1, -1], [-1, 5], [-1, -1]], dtype=torch.int32)
    w = torch.tensor([[1.0, 0.0], [0.6, 0.4], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    expected, used = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    reference.moe_grouped_dispatch(expected, x, w, ids, w13, w2, used)
    for e in (0, 2, 3, 4, 6, 7):
        w13[e] = float("nan")
        w2[e] = float("nan")
    out, n = torch.empty_like(x), torch.zeros(1, dtype=torch.int32)
    ops.moe_grouped_dispatch(out, x, w, ids, w13, w2, n)
    assert int(n) == 2 and torch.isfinite(out).all()
    assert torch.equal(out[4], torch.zeros(64))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_loads_in_flight_and_their_tail(ops, dtype):
    # A hidden size of 1344: with 16-byte loads, whole groups of kGemvLoadsInFlight steps per lane, then a
    # tail of single steps that some lanes of the warp take and others do not (FFN gate/up, MoE gate/up).
    gen = torch.Generator().manual_seed(11)
    h, inter = 1344, 40
    w_gate_up, w_down_t = ffn_weights(h, inter, dtype, gen)
    x = torch.randn(9, h, generator=gen).to(dtype)
    check_ffn(ops, x, w_gate_up, w_down_t, [4, 5], 12, forced_splits=2)
    x, w13, w2, logits = moe_problem(9, h, 24, 6, dtype, gen)
    w, ids = torch.empty(9, 2), torch.empty(9, 2, dtype=torch.int32)
    reference.moe_route_and_prune(logits, 2, 0.0, None, 0, True, w, ids)
    out, used = torch.empty_like(x), torch.zeros(1, dtype=torch.int32)
    ops.moe_grouped_dispatch(out, x, w, ids, w13, w2, used)
    expected, rused = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    reference.moe_grouped_dispatch(expected, x, w, ids, w13, w2, rused)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)
