"""The int8 (W8A8) linear's CUDA kernel bodies (per-token quantization, dp4a rows), run by the SIMT
executor and compared with vllm_sparsever.reference: both the 4-byte (dp4a) and the byte path, token
counts past one pass over a row, rows past one CTA."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simt_build import kernel_ops

from op_inputs import TOL

from vllm_sparsever import reference

SETTINGS = dict(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def _check(ops, x, w, scale, bias):
    w_sum = w.sum(dim=1, dtype=torch.int32)
    out = torch.full((x.shape[0], w.shape[0]), 7.0, dtype=x.dtype)
    ops.int8_linear(out, x, w, scale, w_sum, bias)
    expected = torch.empty_like(out)
    reference.int8_linear(expected, x, w, scale, w_sum, bias)
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(list(TOL)),
    t=st.integers(1, 11),
    k=st.sampled_from([1, 6, 8, 64, 130]),
    n=st.integers(1, 10),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_linear_matches_reference(ops, dtype, t, k, n, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=gen) * 2).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.05 + 1e-3
    _check(ops, x, w, scale, torch.randn(n, generator=gen).to(dtype) if bias else None)


def test_int8_linear_zero_token_and_strided_rows(ops):
    """A token of zeros gives the bias; a weight that is a row slice of a wider tensor (strided rows)."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randint(-127, 128, (9, 72), generator=gen, dtype=torch.int8)
    x = torch.randn(3, 64, generator=gen)
    x[0] = 0
    _check(ops, x, wide[:, :64], torch.rand(9, generator=gen), torch.randn(9, generator=gen))
