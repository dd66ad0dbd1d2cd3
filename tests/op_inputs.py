"""Inputs and tolerances shared by the CPU-kernel tests (tests/kernels) and the SIMT tests (tests/simt)."""

from __future__ import annotations

import torch

# (rtol, atol) of a kernel output against the fp32 PyTorch reference, per dtype.
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


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
