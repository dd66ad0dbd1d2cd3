"""dense_linear (the dense linear over plain weights) vs the PyTorch reference: both weight layouts,
both CPU paths (streamed weights for few tokens, fp32 panels for more), with and without bias."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from op_inputs import TOL, kernel_env

STREAM_MAX = "SPARSEVER_CPU_LINEAR_STREAM_MAX"


def _path(path: str):
    """Force one CPU path (the kernel reads the variable per call); "default": the built-in threshold."""
    return kernel_env(STREAM_MAX, {"stream": "1000", "gemm": "0"}.get(path))


def _problem(dtype, t, k, n, layout, bias, gen):
    x = torch.randn(t, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen) if layout == "rows" else torch.randn(k, n, generator=gen).t()
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w.to(dtype), b


def _check(x, w, b, out):
    expected = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    ref.dense_linear(expected, x, w, b)
    rtol, atol = TOL[x.dtype]
    # fp32 accumulation over K terms of unit scale: the tolerance grows like sqrt(K).
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol * max(1.0, x.shape[1] ** 0.5))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    t=st.integers(1, 40),
    k=st.sampled_from([1, 7, 64, 203, 256]),
    n=st.integers(1, 70),
    layout=st.sampled_from(["rows", "cols"]),
    bias=st.booleans(),
    path=st.sampled_from(["stream", "gemm", "default"]),
    seed=st.integers(0, 2**16),
)
def test_dense_linear_matches_reference(dtype, t, k, n, layout, bias, path, seed):
    x, w, b = _problem(dtype, t, k, n, layout, bias, torch.Generator().manual_seed(seed))
    with _path(path):
        out = ops.dense_linear(x, w, b)
    _check(x, w, b, out)


@pytest.mark.parametrize("path", ["stream", "gemm"])
@pytest.mark.parametrize("shape", [(1536, 2048, "rows", True), (8960, 1536, "cols", False)])
def test_dense_linear_real_shapes_and_leading_dims(path, shape):
    """Qwen2.5-1.5B's QKV projection (row-major, bias) and its down projection as the FFN's shared
    weights keep it (a transposed view) in bf16, from a 3-D input; the widened path splits them into
    several panels (of N, of K)."""
    k, n, layout, bias = shape
    x, w, b = _problem(torch.bfloat16, 6, k, n, layout, bias, torch.Generator().manual_seed(1))
    with _path(path):
        out = ops.dense_linear(x.view(2, 3, k), w, b)
    assert out.shape == (2, 3, n) and out.dtype == torch.bfloat16
    _check(x, w, b, out.view(6, n))


def test_dense_linear_refuses_a_weight_without_contiguous_rows():
    x = torch.randn(2, 8)
    w = torch.randn(16, 16)[::2, ::2]  # strided both ways
    with pytest.raises(RuntimeError, match="weight must be \\[N, K\\] with contiguous rows"):
        ops.dense_linear(x, w)
    with pytest.raises(RuntimeError, match="x must be \\[T, K\\] and weight \\[N, K\\]"):
        ops.dense_linear(torch.randn(2, 9), torch.randn(4, 8))


FEW_TOKENS = pytest.mark.parametrize("t", [1, 3, 4, 5, 8, 13, 16])
# K a multiple of 32 (the tiles' depth) or not; N past a multiple of 16 rows (the rest on vdpbf16ps); a
# weight whose rows lie further apart than K (a slice of a wider tensor).
FEW_TOKEN_SHAPES = pytest.mark.parametrize(("k", "n", "row_stride"),
                                           [(64, 16, 64), (896, 50, 896), (256, 96, 320), (200, 40, 200)])


def _few_token_problem(t, k, n, row_stride):
    gen = torch.Generator().manual_seed(t * 1000 + k + n)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, row_stride, generator=gen).to(torch.bfloat16)[:, :k]
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


@FEW_TOKENS
@FEW_TOKEN_SHAPES
def test_dense_linear_bf16_few_tokens_on_amx_tiles(t, k, n, row_stride, amx_tiles, monkeypatch):
    """bf16 row-major weights at up to 16 tokens with the AMX path on: tiles at 3-16 tokens where K is a
    multiple of 32, vdpbf16ps rows otherwise."""
    x, w, b = _few_token_problem(t, k, n, row_stride)
    monkeypatch.setenv("SPARSEVER_CPU_LINEAR_AMX", "1")
    _check(x, w, b, ops.dense_linear(x, w, b))
    amx_tiles(expected=3 <= t <= 16 and k % 32 == 0)


@FEW_TOKENS
@FEW_TOKEN_SHAPES
def test_dense_linear_bf16_few_tokens_without_amx(t, k, n, row_stride, monkeypatch):
    """The same without tiles (SPARSEVER_CPU_LINEAR_AMX=0): vdpbf16ps rows, or fp32 rows on CPUs without
    AVX512-BF16."""
    x, w, b = _few_token_problem(t, k, n, row_stride)
    monkeypatch.setenv("SPARSEVER_CPU_LINEAR_AMX", "0")
    _check(x, w, b, ops.dense_linear(x, w, b))
