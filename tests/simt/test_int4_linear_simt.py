"""The int4 (W4A8) linear's CUDA kernel body (per-token quantization, nibbles unpacked to signed bytes,
dp4a per group), run by the SIMT executor and compared with vllm_sparsever.reference: groups of one and
of several 128-channel blocks, token counts past one pass over a row, rows past one CTA."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simt_build import kernel_ops

from op_inputs import TOL

from vllm_sparsever import _custom_ops, reference

SETTINGS = dict(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(list(TOL)),
    t=st.integers(1, 11),
    blocks=st.integers(1, 3),
    blocks_per_group=st.sampled_from([1, 3]),
    n=st.integers(1, 10),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int4_linear_matches_reference(ops, dtype, t, blocks, blocks_per_group, n, bias, seed):
    blocks_per_group = blocks if blocks_per_group > blocks or blocks % blocks_per_group else blocks_per_group
    k = 128 * blocks
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=gen) * 2).to(dtype)
    packed = _custom_ops.pack_int4_rows(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8))
    scale = torch.rand(n, blocks // blocks_per_group, generator=gen) * 0.05 + 1e-3
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = torch.full((t, n), 7.0, dtype=dtype)
    ops.int4_linear(out, x, packed, scale, b)
    expected = torch.empty_like(out)
    reference.int4_linear(expected, x, packed, scale, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)
