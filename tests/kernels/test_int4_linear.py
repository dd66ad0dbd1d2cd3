"""int4_linear (an int4 draft model's W4A8 linear) vs the PyTorch reference: each group's integer
products are exact in both, the groups summed in fp32 in another order; groups of one and of several
128-channel blocks, row counts of every parallel task's split, token tiles of 1-4, bias dtypes, the
packing's round trip, and the portable path where the CPU lacks VNNI."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from op_inputs import TOL, kernel_env

VNNI = "SPARSEVER_CPU_INT8_VNNI"


def _problem(dtype, t, k, n, group, bias, gen):
    x = (torch.randn(t, k, generator=gen) * 3).to(dtype)
    values = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, ops.pack_int4_rows(values), scale, b


def _expected(x, packed, scale, b):
    out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    ref.int4_linear(out, x, packed, scale, b)
    return out


def _path(path: str):
    return kernel_env(VNNI, "0" if path == "portable" else None)


def test_packing_round_trips_and_refuses_out_of_range_values():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(-8, 8, (5, 384), generator=gen, dtype=torch.int8)
    packed = ops.pack_int4_rows(values)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 192)
    assert torch.equal(ref.unpack_int4_rows(packed), values)
    # byte j of a block: channel j low, channel 64 + j high, each + 8
    assert int(packed[0, 0]) == (int(values[0, 0]) + 8) | (int(values[0, 64]) + 8) << 4
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.pack_int4_rows(values[:, :100])
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        ops.pack_int4_rows(values.clamp(-8, 7) * 2)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(list(TOL)),
    t=st.integers(1, 19),
    blocks=st.integers(1, 8),
    blocks_per_group=st.sampled_from([1, 2, 3]),
    n=st.integers(1, 41),
    bias=st.booleans(),
    path=st.sampled_from(["default", "portable"]),
    seed=st.integers(0, 2**16),
)
def test_int4_linear_matches_reference(dtype, t, blocks, blocks_per_group, n, bias, path, seed):
    if blocks % blocks_per_group:
        blocks_per_group = 1
    k = 128 * blocks
    x, packed, scale, b = _problem(dtype, t, k, n, 128 * blocks_per_group, bias, torch.Generator().manual_seed(seed))
    with _path(path):
        out = ops.int4_linear(x, packed, scale, b)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.float(), _expected(x, packed, scale, b).float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("t", [1, 4, 8, 33])
def test_int4_linear_real_shapes_and_strided_rows(t):
    """Qwen2.5-0.5B's projections (K 896 / 4864, groups of 128), bf16 tokens, a weight that is a row
    slice of a wider tensor (rows strided), leading dims kept."""
    gen = torch.Generator().manual_seed(t)
    for n, k in ((1152, 896), (9728, 896), (896, 4864)):
        x, packed, scale, b = _problem(torch.bfloat16, t, k, n, 128, True, gen)
        wide = torch.zeros(n, k // 2 + 64, dtype=torch.uint8)
        wide[:, : k // 2] = packed
        out = ops.int4_linear(x.view(1, t, k), wide[:, : k // 2], scale, b)
        assert out.shape == (1, t, n)
        torch.testing.assert_close(out[0].float(), _expected(x, packed, scale, b).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", ["default", "portable"])
def test_int4_linear_zero_tokens_and_exact_products(path):
    """A token of zeros gives the bias; a token whose only entry is its largest maps to 127 there, so
    each output is -127 * w * (amax / 127) * scale exactly; no tokens, no output."""
    k, n = 256, 9
    values = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed, scale = ops.pack_int4_rows(values), torch.full((n, 2), 0.5)
    x = torch.zeros(2, k)
    x[1, 200] = -2.0  # amax 2: q = -127 there, 0 elsewhere (channel 200: block 1, high nibble)
    b = torch.arange(n, dtype=torch.float32)
    with _path(path):
        out = ops.int4_linear(x, packed, scale, b)
    assert torch.equal(out[0], b)
    expected = -127 * values[:, 200].float() * (2.0 / 127 * 0.5) + b
    torch.testing.assert_close(out[1], expected, rtol=1e-6, atol=1e-5)
    assert ops.int4_linear(torch.zeros(0, k), packed, scale).shape == (0, n)


def test_int4_linear_refuses_bad_inputs_by_name():
    packed = torch.zeros(4, 64, dtype=torch.uint8)
    x = torch.zeros(2, 128)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        ops.int4_linear(torch.zeros(2, 96), torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1))
    with pytest.raises(RuntimeError, match="weight must be uint8"):
        ops.int4_linear(x, packed.to(torch.int8), torch.ones(4, 1))
    with pytest.raises(RuntimeError, match="weight_scale"):
        ops.int4_linear(x, packed, torch.ones(4, 1, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="weight_scale"):
        ops.int4_linear(torch.zeros(2, 256), torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 4))  # groups of 64
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.int4_linear(torch.empty(2, 4), torch.zeros(2, 96), torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1),
                        None)
