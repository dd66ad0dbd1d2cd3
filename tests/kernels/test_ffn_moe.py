"""topk_swiglu_ffn, moe_route_and_prune and moe_grouped_dispatch vs the PyTorch reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from op_inputs import (SELECTION_TIE_RTOL, TOL, assert_ffn_matches_reference,
                       assert_input_sparse_gate_matches_reference, assert_topk_selection, ffn_weights,
                       gated_ffn_problem, input_sparse_gate_problem, start_loc)


@settings(max_examples=50, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    h=st.sampled_from([8, 40, 64, 100, 128]),
    inter=st.integers(1, 150),
    groups=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    keep_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_ffn_matches_reference(dtype, h, inter, groups, keep_frac, seed):
    gen = torch.Generator().manual_seed(seed)
    keep = max(1, round(keep_frac * inter))
    w_gate_up, w_down_t = ffn_weights(h, inter, dtype, gen)
    x = torch.randn(sum(groups), h, generator=gen).to(dtype)
    gsl = start_loc(groups)
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, keep)
    assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, gsl, keep, SELECTION_TIE_RTOL[dtype])


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    gate_in_fp32=st.booleans(),
    h=st.sampled_from([8, 40, 64, 128]),
    inter=st.integers(1, 150),
    groups=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    keep_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_ffn_gated_matches_reference(dtype, gate_in_fp32, h, inter, groups, keep_frac, seed):
    # The gate projection given, w_up a view of the up rows: scores, selection and output from that
    # gate, which the op must not modify.
    x, gate, w_gate_up, w_down_t, gsl, keep = gated_ffn_problem(h, inter, groups, keep_frac, dtype, gate_in_fp32,
                                                                seed)
    given = gate.clone()
    out, sel = ops.topk_swiglu_ffn_gated(x, gate, w_gate_up[inter:], w_down_t, gsl, keep)
    assert torch.equal(gate, given)
    assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, gsl, keep, SELECTION_TIE_RTOL[dtype], gate=gate)


def test_ffn_gated_with_the_exact_gate_is_the_ungated_op():
    gen = torch.Generator().manual_seed(4)
    h, inter, keep = 64, 96, 30
    w_gate_up, w_down_t = ffn_weights(h, inter, torch.float32, gen)
    x = torch.randn(7, h, generator=gen)
    gsl = start_loc([3, 4])
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, keep)
    gate = x @ w_gate_up[:inter].t()
    out_g, sel_g = ops.topk_swiglu_ffn_gated(x, gate, w_gate_up[inter:].clone(), w_down_t, gsl, keep)
    assert torch.equal(sel, sel_g)
    torch.testing.assert_close(out_g, out, rtol=1e-5, atol=1e-5)


def test_ffn_gated_rejects_a_gate_of_the_wrong_shape():
    gen = torch.Generator().manual_seed(5)
    w_gate_up, w_down_t = ffn_weights(16, 24, torch.float32, gen)
    x = torch.randn(3, 16, generator=gen)
    with pytest.raises(RuntimeError, match=r"gate must be a floating-point \[T, I\]"):
        ops.topk_swiglu_ffn_gated(x, torch.randn(3, 23), w_gate_up[24:], w_down_t, start_loc([3]), 5)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    h=st.sampled_from([8, 40, 64, 100]),
    inter=st.integers(1, 150),
    groups=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    keep_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_input_sparse_gate_matches_reference(dtype, h, inter, groups, keep_frac, seed):
    x, w_gate_t, gsl, input_keep = input_sparse_gate_problem(h, inter, groups, keep_frac, dtype, seed)
    gate, channels = ops.input_sparse_gate(x, w_gate_t, gsl, input_keep)
    assert_input_sparse_gate_matches_reference(gate, channels, x, w_gate_t, gsl, input_keep,
                                               SELECTION_TIE_RTOL[torch.float32])


@pytest.mark.parametrize("bf16_dot", ["0", "1"])
def test_input_sparse_gate_bf16_paths(bf16_dot, monkeypatch):
    """Both bf16 paths (vdpbf16ps where the CPU has it, else fp32 FMAs), at sizes with column tails,
    several token tiles and a real hidden size; all channels kept is the exact gate."""
    monkeypatch.setenv("SPARSEVER_CPU_FFN_BF16_DOT", bf16_dot)
    gen = torch.Generator().manual_seed(11)
    for h, inter, groups, input_keep in [(64, 100, [3, 6], 45), (1536, 256, [4, 7], 1075), (96, 40, [2], 96)]:
        w_gate_t = (torch.randn(h, inter, generator=gen) / h**0.5).to(torch.bfloat16)
        x = torch.randn(sum(groups), h, generator=gen).to(torch.bfloat16)
        gate, channels = ops.input_sparse_gate(x, w_gate_t, start_loc(groups), input_keep)
        assert_input_sparse_gate_matches_reference(gate, channels, x, w_gate_t, start_loc(groups), input_keep,
                                                   SELECTION_TIE_RTOL[torch.float32])
        if input_keep == h:
            exact = (x.float() @ w_gate_t.float()).to(torch.bfloat16)
            torch.testing.assert_close(gate.float(), exact.float(), rtol=2e-2, atol=2e-2)


def test_input_sparse_gate_feeds_the_gated_ffn():
    # All input channels kept: the approximate gate is the exact one, so the gated op then selects the
    # same neurons as topk_swiglu_ffn (fp32).
    gen = torch.Generator().manual_seed(12)
    h, inter, keep = 64, 96, 30
    w_gate_up, w_down_t = ffn_weights(h, inter, torch.float32, gen)
    x = torch.randn(7, h, generator=gen)
    gsl = start_loc([3, 4])
    gate, channels = ops.input_sparse_gate(x, w_gate_up[:inter].t().contiguous(), gsl, h)
    assert channels.tolist() == [list(range(h))] * 2
    out_g, sel_g = ops.topk_swiglu_ffn_gated(x, gate, w_gate_up[inter:], w_down_t, gsl, keep)
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, keep)
    assert torch.equal(sel, sel_g)
    torch.testing.assert_close(out_g, out, rtol=1e-5, atol=1e-5)


def test_input_sparse_gate_rejects_bad_arguments():
    x = torch.randn(3, 16)
    gsl = start_loc([3])
    with pytest.raises(RuntimeError, match=r"w_gate_t must be \[H, I\]"):
        ops.input_sparse_gate(x, torch.randn(24, 16), gsl, 4)
    with pytest.raises(RuntimeError, match=r"input_keep must be in \[1, H\], got 17"):
        ops.input_sparse_gate(x, torch.randn(16, 24), gsl, 17)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        ops.input_sparse_gate(x, torch.randn(16, 24).to(torch.bfloat16), gsl, 4)


def test_ffn_keep_all_is_dense_mlp():
    gen = torch.Generator().manual_seed(0)
    h, inter = 64, 96
    w_gate_up, w_down_t = ffn_weights(h, inter, torch.float32, gen)
    x = torch.randn(5, h, generator=gen)
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, start_loc([5]), inter)
    gate, up = (x @ w_gate_up.t()).chunk(2, dim=-1)
    torch.testing.assert_close(out, (F.silu(gate) * up) @ w_down_t, rtol=1e-5, atol=1e-5)
    assert sel[0].tolist() == list(range(inter))


@pytest.mark.parametrize("keep", [1, 5, 12, 23, 24])
def test_ffn_exact_ties_lower_index_wins_and_nan_scores_come_last(keep):
    # Neurons in groups of identical gate rows have bit-identical scores: a cut through a group
    # keeps its lowest indices, as the reference does. A NaN gate row (NaN score) is never taken
    # before a number (it ranks as -inf), and the selection stays k valid indices, ascending.
    gen = torch.Generator().manual_seed(2)
    h, inter = 64, 24
    w_gate_up, w_down_t = ffn_weights(h, inter, torch.float32, gen)
    w_gate_up[:inter] = w_gate_up[torch.arange(inter) // 4]  # 6 groups of 4 equal gate rows
    x = torch.randn(3, h, generator=gen)
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, start_loc([3]), keep)
    expected, expected_sel = torch.empty_like(x), torch.empty_like(sel)
    ref.topk_swiglu_ffn(expected, x, w_gate_up, w_down_t, start_loc([3]), keep, expected_sel)
    assert sel.tolist() == expected_sel.tolist()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    w_gate_up[inter - 1] = float("nan")
    _, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, start_loc([3]), keep)
    picked = sel[0].tolist()
    assert picked == sorted(set(picked)) and len(picked) == keep and all(0 <= n < inter for n in picked)
    assert (inter - 1 in picked) == (keep == inter)


def test_ffn_reads_only_selected_rows():
    gen = torch.Generator().manual_seed(1)
    h, inter, keep = 64, 128, 16
    w_gate_up, w_down_t = ffn_weights(h, inter, torch.bfloat16, gen)
    x = torch.randn(3, h, generator=gen).to(torch.bfloat16)
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, start_loc([3]), keep)
    assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, start_loc([3]), keep,
                                 SELECTION_TIE_RTOL[torch.bfloat16])
    expected = ref.swiglu_ffn_on_neurons(x, w_gate_up, w_down_t, sel[0])
    unused = sorted(set(range(inter)) - set(sel[0].tolist()))
    w_gate_up[inter + torch.tensor(unused)] = float("nan")  # up rows of unselected neurons
    w_down_t[torch.tensor(unused)] = float("nan")
    out, sel2 = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, start_loc([3]), keep)
    assert torch.equal(sel, sel2) and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)


def test_selection_check_accepts_only_near_ties():
    # The tie rule itself must be able to fail: a swap across a clear gap is rejected, one inside the
    # tolerance accepted (and reported as a differing set), a below-cut pick inside a tie rejected.
    scores = torch.tensor([5.0, 1.0, 3.0, 3.0001, 0.5])
    assert assert_topk_selection([0, 3], [0, 3], scores, 2, 1e-3)
    assert not assert_topk_selection([0, 2], [0, 3], scores, 2, 1e-3)
    with pytest.raises(AssertionError, match="without a tie"):
        assert_topk_selection([0, 2], [0, 3], scores, 2, 1e-6)
    with pytest.raises(AssertionError, match="without a tie"):
        assert_topk_selection([0, 1], [0, 2], torch.tensor([5.0, 2.0, 3.0, 0.0]), 2, 1e-3)
    with pytest.raises(AssertionError, match="picked a neuron"):
        assert_topk_selection([1, 3], [0, 2], torch.tensor([3.0, 1.0, 3.0, 3.0]), 2, 1e-3)
    with pytest.raises(AssertionError, match="ascending and distinct"):
        assert_topk_selection([3, 0], [0, 3], scores, 2, 1e-3)


@settings(max_examples=50, deadline=None)
@given(
    num_experts=st.integers(1, 20),
    top_k_frac=st.floats(0.0, 1.0),
    groups=st.lists(st.integers(0, 8), min_size=1, max_size=4),
    ratio=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    budget=st.integers(0, 6),
    use_groups=st.booleans(),
    renormalize=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_route_and_prune_matches_reference(num_experts, top_k_frac, groups, ratio, budget, use_groups,
                                           renormalize, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = max(1, round(top_k_frac * num_experts))
    logits = torch.randn(sum(groups), num_experts, generator=gen) * 2
    gsl = start_loc(groups) if use_groups else None
    w, ids = ops.moe_route_and_prune(logits, top_k, ratio, gsl, budget, renormalize)
    rw, rids = torch.empty_like(w), torch.empty_like(ids)
    ref.moe_route_and_prune(logits, top_k, ratio, gsl, budget, renormalize, rw, rids)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert (ids >= 0).any(dim=1).all()  # every token keeps an expert
    if use_groups and budget > 0:
        for g in range(len(groups)):
            block = ids[gsl[g] : gsl[g + 1]]
            assert len(set(block[block >= 0].tolist())) <= budget


def _moe_problem(num_tokens, h, inter, num_experts, top_k, dtype, gen):
    x = torch.randn(num_tokens, h, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return x, w13, w2, logits


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    num_tokens=st.integers(1, 9),
    h=st.sampled_from([8, 40, 64]),
    inter=st.integers(1, 80),
    num_experts=st.integers(1, 10),
    ratio=st.sampled_from([0.0, 0.3, 0.8]),
    ids_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_dispatch_matches_reference(dtype, num_tokens, h, inter, num_experts, ratio, ids_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(2, num_experts)
    x, w13, w2, logits = _moe_problem(num_tokens, h, inter, num_experts, top_k, dtype, gen)
    w, ids = ops.moe_route_and_prune(logits, top_k, ratio)
    ids = ids.to(ids_dtype)
    out, used = ops.moe_grouped_dispatch(x, w, ids, w13, w2)
    expected, rused = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    ref.moe_grouped_dispatch(expected, x, w, ids, w13, w2, rused)
    assert int(used) == int(rused) == len(set(ids[ids >= 0].tolist()))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def test_dispatch_reads_only_kept_experts():
    gen = torch.Generator().manual_seed(2)
    x, w13, w2, _ = _moe_problem(4, 64, 32, 8, 2, torch.float32, gen)
    ids = torch.tensor([[1, -1], [5, 1], [1, -1], [-1, 5]], dtype=torch.int32)
    w = torch.tensor([[1.0, 0.0], [0.6, 0.4], [1.0, 0.0], [0.0, 1.0]])
    expected, used = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    ref.moe_grouped_dispatch(expected, x, w, ids, w13, w2, used)
    for e in (0, 2, 3, 4, 6, 7):
        w13[e] = float("nan")
        w2[e] = float("nan")
    out, n = ops.moe_grouped_dispatch(x, w, ids, w13, w2)
    assert int(n) == 2 and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_opcheck_fake_impls():
    gen = torch.Generator().manual_seed(3)
    h, inter = 16, 24
    w_gate_up, w_down_t = ffn_weights(h, inter, torch.float32, gen)
    x = torch.randn(3, h, generator=gen)
    gsl = start_loc([2, 1])
    torch.library.opcheck(torch.ops.sparsever.topk_swiglu_ffn.default,
                          (torch.empty_like(x), x, w_gate_up, w_down_t, gsl, 5, torch.empty(2, 5, dtype=torch.int32)))
    torch.library.opcheck(torch.ops.sparsever.topk_swiglu_ffn_gated.default,
                          (torch.empty_like(x), x, torch.randn(3, inter, generator=gen), w_gate_up[inter:], w_down_t,
                           gsl, 5, torch.empty(2, 5, dtype=torch.int32)))
    torch.library.opcheck(torch.ops.sparsever.input_sparse_gate.default,
                          (torch.empty(3, inter), x, w_gate_up[:inter].t().contiguous(), gsl, 7,
                           torch.empty(2, 7, dtype=torch.int32)))
    x, w13, w2, logits = _moe_problem(3, h, inter, 4, 2, torch.float32, gen)
    tw, ti = torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparsever.moe_route_and_prune.default, (logits, 2, 0.2, gsl, 2, True, tw, ti))
    tw, ti = ops.moe_route_and_prune(logits, 2, 0.2, gsl, 2, True)  # opcheck ran on copies
    torch.library.opcheck(torch.ops.sparsever.moe_grouped_dispatch.default,
                          (torch.empty_like(x), x, tw, ti, w13, w2, torch.empty(1, dtype=torch.int32)))


@pytest.mark.parametrize("gemm_min_tokens", ["16", "1000"])
@pytest.mark.parametrize("dtype", list(TOL))
def test_many_tokens_gemm_path(dtype, gemm_min_tokens, monkeypatch):
    # Groups / experts with at least SPARSEVER_CPU_GEMM_MIN_TOKENS tokens run gathered-row GEMMs ("16":
    # the 33-token group and every expert), else the streaming kernels over many token tiles ("1000").
    monkeypatch.setenv("SPARSEVER_CPU_GEMM_MIN_TOKENS", gemm_min_tokens)
    gen = torch.Generator().manual_seed(4)
    h, inter, keep = 64, 96, 24
    w_gate_up, w_down_t = ffn_weights(h, inter, dtype, gen)
    x = torch.randn(40, h, generator=gen).to(dtype)
    gsl = start_loc([3, 33, 4])
    out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, keep)
    assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, gsl, keep, SELECTION_TIE_RTOL[dtype])
    rtol, atol = TOL[dtype]
    _, w13, w2, logits = _moe_problem(40, h, 32, 4, 2, dtype, gen)
    w, ids = ops.moe_route_and_prune(logits, 2, 0.0)
    out, used = ops.moe_grouped_dispatch(x, w, ids, w13, w2)
    expected, rused = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
    ref.moe_grouped_dispatch(expected, x, w, ids, w13, w2, rused)
    assert int(used) == int(rused)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("bf16_dot", ["0", "1"])
def test_ffn_bf16_paths_match_reference(bf16_dot, monkeypatch):
    """bf16 weights run vdpbf16ps kernels where the CPU has AVX512-BF16, else widen to fp32 FMAs;
    SPARSEVER_CPU_FFN_BF16_DOT=0 forces the widening path, so both are checked on every CPU
    (shapes with column/row tails, odd keeps, more than one token tile, a real hidden size), for
    the top-k FFN and the MoE experts' streamed projections."""
    monkeypatch.setenv("SPARSEVER_CPU_FFN_BF16_DOT", bf16_dot)
    gen = torch.Generator().manual_seed(7)
    for h, inter, groups, keep in [(64, 96, [3, 5], 40), (100, 37, [1, 9], 11), (1536, 256, [4, 7], 129)]:
        w_gate_up, w_down_t = ffn_weights(h, inter, torch.bfloat16, gen)
        x = torch.randn(sum(groups), h, generator=gen).to(torch.bfloat16)
        out, sel = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, start_loc(groups), keep)
        assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, start_loc(groups), keep,
                                     SELECTION_TIE_RTOL[torch.bfloat16])
    # MoE experts with few tokens stream through the same kernels (hidden and expert sizes with tails).
    for h, inter, num_tokens in [(64, 48, 5), (100, 37, 9), (1536, 64, 3)]:
        x, w13, w2, logits = _moe_problem(num_tokens, h, inter, 6, 2, torch.bfloat16, gen)
        w, ids = ops.moe_route_and_prune(logits, 2, 0.0)
        out, used = ops.moe_grouped_dispatch(x, w, ids, w13, w2)
        expected, rused = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
        ref.moe_grouped_dispatch(expected, x, w, ids, w13, w2, rused)
        assert int(used) == int(rused)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_ffn_bf16_dot_follows_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    expected = "avx512_bf16" in flags and torch.ops.sparsever.ext_info() == "avx512"
    assert ops.bf16_dot_available() == expected
    amx = expected and {"amx_bf16", "amx_tile"} <= set(flags)
    assert ops.amx_available() == amx
