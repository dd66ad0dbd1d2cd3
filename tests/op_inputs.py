"""Inputs and tolerances shared by the CPU-kernel tests (tests/kernels) and the SIMT tests (tests/simt)."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch

# (rtol, atol) of a kernel output against the fp32 PyTorch reference, per dtype.
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@contextlib.contextmanager
def kernel_env(name: str, value: str | None):
    """The environment variable `name` set to `value` (None: unset) while the context is active, as it
    was after: the switches the CPU kernels read per call, to force one of their paths."""
    with mock.patch.dict(os.environ):
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
        yield


def start_loc(lengths: list[int]) -> torch.Tensor:
    """Offsets [0, l0, l0+l1, ...] as int32."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32) if lengths else out[1:]
    return out


def ffn_weights(h: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    """Random SwiGLU weights: merged gate/up [2I, H] and the transposed down projection [I, H]."""
    w_gate_up = (torch.randn(2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w_down_t = (torch.randn(inter, h, generator=gen) / inter**0.5).to(dtype)
    return w_gate_up, w_down_t


# Relative tolerance under which two neuron scores count as tied, per dtype of x and the weights.
# Kernels may round the gate projection to that dtype (the CPU kernels' GEMM path for many tokens,
# like torch's own bf16 MLP) and sum in another order than the fp32 reference; unit roundoff is 2^-9
# for bf16 and 2^-12 for fp16, so these leave a few-fold margin. fp32: summation order only.
SELECTION_TIE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def ffn_neuron_scores(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """|silu(gate)| per token and neuron in fp32, [T, I]: a group's scores are its rows summed (the
    definition in vllm_sparsever.reference.topk_swiglu_ffn)."""
    inter = w_gate_up.shape[0] // 2
    return torch.nn.functional.silu(x.float() @ w_gate_up[:inter].float().t()).abs()


def assert_topk_selection(got, expected, scores: torch.Tensor, keep: int, tie_rtol: float) -> bool:
    """Check a kernel's top-`keep` index set against the reference's; True iff the two sets are equal.

    got, expected: the kernel's / reference's selected indices (ascending, as the ops store them).
    scores: [n] fp32 scores the reference ranked. When the reference's keep-th and (keep+1)-th scores
    are within `tie_rtol * (1 + keep-th)`, the cut falls in a near-tie that rounding may flip, so any
    set of `keep` distinct indices whose scores are all >= keep-th minus that tolerance is accepted;
    otherwise the sets must be equal.
    """
    got = [int(i) for i in got]
    expected = [int(i) for i in expected]
    n = scores.numel()
    assert len(got) == keep, f"kernel selected {len(got)} indices, expected {keep}"
    assert got == sorted(set(got)), f"kernel selection not ascending and distinct: {got}"
    assert 0 <= got[0] and got[-1] < n, f"kernel selection out of range [0, {n}): {got}"
    assert len(expected) == keep and expected == sorted(set(expected)), f"bad reference selection {expected}"
    if got == expected:
        return True
    scores = scores.float()
    kth = float(scores[expected].min())
    rest = sorted(set(range(n)) - set(expected))
    next_best = float(scores[rest].max()) if rest else float("-inf")
    tol = tie_rtol * (1.0 + abs(kth))
    assert kth - next_best <= tol, (
        f"selection differs without a tie: kernel {got}, reference {expected}; "
        f"{keep}-th score {kth:.6g}, next {next_best:.6g}, tie tolerance {tol:.3g}")
    low = float(scores[got].min())
    assert low >= kth - tol, (
        f"kernel picked a neuron scoring {low:.6g} < {keep}-th score {kth:.6g} - {tol:.3g}: "
        f"kernel {got}, reference {expected}")
    return False


def assert_ffn_matches_reference(out, sel, x, w_gate_up, w_down_t, group_start_loc, keep: int,
                                 tie_rtol: float, gate: torch.Tensor | None = None) -> int:
    """Check a top-k SwiGLU FFN kernel's (out, selected) against vllm_sparsever.reference.topk_swiglu_ffn
    (or, with `gate` given, reference.topk_swiglu_ffn_gated on the up rows of w_gate_up).

    Per group: the selection against the reference selection (assert_topk_selection), then the output
    against the reference output. Returns how many non-empty groups selected exactly the reference set.
    """
    from vllm_sparsever import reference

    rsel = torch.full_like(sel, 77)
    expected = torch.zeros_like(x)
    inter = w_down_t.shape[0]
    if gate is None:
        reference.topk_swiglu_ffn(expected, x, w_gate_up, w_down_t, group_start_loc, keep, rsel)
        scores = ffn_neuron_scores(x, w_gate_up)
    else:
        reference.topk_swiglu_ffn_gated(expected, x, gate, w_gate_up[inter:], w_down_t, group_start_loc, keep, rsel)
        scores = torch.nn.functional.silu(gate.float()).abs()
    rtol, atol = TOL[x.dtype]
    starts = group_start_loc.tolist()
    num_equal = 0
    for g in range(len(starts) - 1):
        t0, t1 = starts[g], starts[g + 1]
        if t0 == t1:
            assert sel[g].tolist() == rsel[g].tolist() == [-1] * keep, f"empty group {g}: {sel[g].tolist()}"
            continue
        if assert_topk_selection(sel[g], rsel[g], scores[t0:t1].sum(0), keep, tie_rtol):
            num_equal += 1
            want = expected[t0:t1]
        else:
            # A near-tie at the cut flipped the selection (accepted above): the reference output is for
            # another neuron set, so compare with the reference recomputed on the kernel's set.
            if gate is None:
                want = reference.swiglu_ffn_on_neurons(x[t0:t1], w_gate_up, w_down_t, sel[g]).to(x.dtype)
            else:
                idx = sel[g].long()
                act = torch.nn.functional.silu(gate[t0:t1, idx].float())
                up = x[t0:t1].float() @ w_gate_up[inter + idx].float().t()
                want = ((act * up) @ w_down_t[idx].float()).to(x.dtype)
        torch.testing.assert_close(out[t0:t1].float(), want.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, g=g: f"group {g}: {m}")
    return num_equal


def gated_ffn_problem(h: int, inter: int, groups: list[int], keep_frac: float, dtype: torch.dtype,
                      gate_in_fp32: bool, seed: int):
    """Inputs of topk_swiglu_ffn_gated: (x, gate, w_gate_up, w_down_t, group_start_loc, keep). The
    gate as a dense GEMM returns it (x's dtype, or fp32); the op's w_up is w_gate_up[inter:]."""
    gen = torch.Generator().manual_seed(seed)
    keep = max(1, round(keep_frac * inter))
    w_gate_up, w_down_t = ffn_weights(h, inter, dtype, gen)
    x = torch.randn(sum(groups), h, generator=gen).to(dtype)
    gate = x.float() @ w_gate_up[:inter].float().t()
    return x, gate if gate_in_fp32 else gate.to(dtype), w_gate_up, w_down_t, start_loc(groups), keep


def input_sparse_gate_problem(h: int, inter: int, groups: list[int], keep_frac: float, dtype: torch.dtype,
                              seed: int, row_pad: int = 0):
    """Inputs of input_sparse_gate: (x, w_gate_t, group_start_loc, input_keep); x is a view with row
    stride h + row_pad (row_pad > 0: rows not contiguous with each other)."""
    gen = torch.Generator().manual_seed(seed)
    input_keep = max(1, round(keep_frac * h))
    w_gate_t = (torch.randn(h, inter, generator=gen) / h**0.5).to(dtype)
    x = torch.randn(sum(groups), h + row_pad, generator=gen).to(dtype)[:, :h]
    return x, w_gate_t, start_loc(groups), input_keep


def assert_input_sparse_gate_matches_reference(gate, channels, x, w_gate_t, group_start_loc, input_keep: int,
                                               tie_rtol: float) -> None:
    """Check input_sparse_gate's (gate, channels) against vllm_sparsever.reference.input_sparse_gate:
    per group the channel set (assert_topk_selection on sum |x|), then the gate rows against the
    reference's gate on the kernel's channel set (the same set unless a near-tie flipped the cut)."""
    from vllm_sparsever import reference

    rgate = torch.zeros_like(gate)
    rch = torch.full_like(channels, 77)
    reference.input_sparse_gate(rgate, x, w_gate_t, group_start_loc, input_keep, rch)
    rtol, atol = TOL[x.dtype]
    starts = group_start_loc.tolist()
    for g in range(len(starts) - 1):
        t0, t1 = starts[g], starts[g + 1]
        if t0 == t1:
            assert channels[g].tolist() == [-1] * input_keep, f"empty group {g}: {channels[g].tolist()}"
            continue
        if assert_topk_selection(channels[g], rch[g], x[t0:t1].float().abs().sum(0), input_keep, tie_rtol):
            want = rgate[t0:t1]
        else:
            idx = channels[g].long()
            want = (x[t0:t1].float()[:, idx] @ w_gate_t[idx].float()).to(gate.dtype)
        torch.testing.assert_close(gate[t0:t1].float(), want.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, g=g: f"group {g}: {m}")
