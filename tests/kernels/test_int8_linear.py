"""int8_linear (an int8 draft model's W8A8 linear) vs the PyTorch reference: the integer products are
exact in both, so fp32 outputs agree to the epilogue's rounding; tails of K past 64 bytes, row counts
of every parallel task's split, token tiles of 1-4, bias dtypes, and the portable path where the CPU lacks VNNI."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from op_inputs import TOL, kernel_env

VNNI = "SPARSEVER_CPU_INT8_VNNI"


def _problem(dtype, t, k, n, bias, gen):
    x = (torch.randn(t, k, generator=gen) * 3).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, scale, ops.int8_weight_sums(w), b


def _expected(x, w, scale, w_sum, b):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    ref.int8_linear(out, x, w, scale, w_sum, b)
    return out


def _path(path: str):
    """The VNNI path where the CPU has it ("default"), or the portable loop (what the AVX2 build runs);
    the kernel reads the variable per call."""
    return kernel_env(VNNI, "0" if path == "portable" else None)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    t=st.integers(1, 19),
    k=st.sampled_from([1, 63, 64, 65, 200, 896]),
    n=st.integers(1, 41),
    bias=st.booleans(),
    path=st.sampled_from(["default", "portable"]),
    seed=st.integers(0, 2**16),
)
def test_int8_linear_matches_reference(dtype, t, k, n, bias, path, seed):
    x, w, scale, w_sum, b = _problem(dtype, t, k, n, bias, torch.Generator().manual_seed(seed))
    with _path(path):
        out = ops.int8_linear(x, w, scale, w_sum, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), _expected(x, w, scale, w_sum, b).float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("t", [1, 4, 8])
def test_int8_linear_real_shapes_and_strided_rows(t):
    """Qwen2.5-0.5B's projections (K 896 / 4864), bf16 tokens, a weight that is a row slice of a wider
    tensor (rows strided), leading dims kept."""
    gen = torch.Generator().manual_seed(t)
    for n, k in ((1152, 896), (9728, 896), (896, 4864)):
        x, w, scale, w_sum, b = _problem(torch.bfloat16, t, k, n, True, gen)
        wide = torch.zeros(n, k + 128, dtype=torch.int8)
        wide[:, :k] = w
        out = ops.int8_linear(x.view(1, t, k), wide[:, :k], scale, w_sum, b)
        assert out.shape == (1, t, n)
        torch.testing.assert_close(out[0].float(), _expected(x, w, scale, w_sum, b).float(), rtol=2e-2, atol=2e-2)


def test_int8_linear_zero_tokens_rows_and_quantization_edges():
    """A token of zeros gives the bias; a token's largest entry maps to 127 exactly; the integer
    products are exact (an fp32 output equals the reference's bit for bit up to the epilogue's one
    rounding)."""
    k, n = 130, 9
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scale = torch.full((n,), 0.5)
    x = torch.zeros(2, k)
    x[1, 3] = -2.0  # amax 2: q = -127 there, 0 elsewhere
    b = torch.arange(n, dtype=torch.float32)
    out = ops.int8_linear(x, w, scale, ops.int8_weight_sums(w), b)
    assert torch.equal(out[0], b)
    expected = -127 * w[:, 3].float() * (2.0 / 127 * 0.5) + b
    torch.testing.assert_close(out[1], expected, rtol=1e-6, atol=1e-5)
    assert ops.int8_linear(torch.zeros(0, k), w, scale, ops.int8_weight_sums(w)).shape == (0, n)



@pytest.mark.parametrize("path", ["default", "portable"])
def test_int8_linear_quantizes_ties_to_even_on_every_lane(path):
    """Halfway values round to even and clamp at +-127 in the vector lanes and the scalar tail alike:
    with an identity weight and unit scales the output is the quantized token itself."""
    k = 53  # three 16-wide steps and a tail of 5
    halves = torch.arange(k - 1, dtype=torch.float32) - 25.5  # -25.5 .. 25.5: every one a tie
    x = torch.cat([torch.tensor([127.0]), halves]).view(1, k)
    w = torch.eye(k, dtype=torch.int8)
    with _path(path):
        out = ops.int8_linear(x, w, torch.ones(k), ops.int8_weight_sums(w))
    expected = torch.cat([torch.tensor([127.0]), torch.round(halves)])  # torch.round: half to even
    assert torch.equal(out[0], expected), (out[0] - expected).nonzero()
    x[0, 7] = float("nan")  # NaN clamps to -127 on both paths (amax ignores it)
    with _path(path):
        out = ops.int8_linear(x, w, torch.ones(k), ops.int8_weight_sums(w))
    assert out[0, 7] == -127 and torch.equal(out[0, 8:], expected[8:])

def test_int8_linear_refuses_bad_inputs_by_name():
    w = torch.zeros(4, 8, dtype=torch.int8)
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="weight_sum"):
        ops.int8_linear(x, w, torch.ones(4), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="weight must be int8"):
        ops.int8_linear(x, w.float(), torch.ones(4), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="weight_scale"):
        ops.int8_linear(x, w, torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight_sum"):
        ref.int8_linear(torch.empty(2, 4), x, w, torch.ones(4), torch.ones(4, dtype=torch.int32), None)
