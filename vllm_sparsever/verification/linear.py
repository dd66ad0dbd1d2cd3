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

`linear_kernel: "hybrid"`, for CPUs where vLLM-CPU's packed GEMM (oneDNN with AMX / AVX-512) wins
prefill but reads its weights more slowly than the op streams them at a few tokens: each layer keeps
both, the plain weight and vLLM-CPU's packed one, and a call of up to `hybrid_max_tokens` tokens runs
the op, a longer one vLLM-CPU's linear. Each weight is held twice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.compat.linear import cpu_gemm_dispatch_override, use_plain_cpu_linear
from vllm_sparsever.compat.worker import is_cpu_platform
from vllm_sparsever.verification.runtime import get_runtime

logger = logging.getLogger("vllm_sparsever")

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)

# linear_kernel "hybrid": calls of up to this many tokens run dense_linear, longer ones vLLM-CPU's
# packed GEMM: 8 where dense_linear runs bf16 on AMX tiles (per projection flat up to 16 tokens, but
# whole 16-token verify steps measured slower than on vLLM's linears), else 4 (the vdpbf16ps rows
# re-read the weight past 4 tokens). Measured: bench/results, linear_ab_xeon-*, verify_step_xeon-linear-*.
HYBRID_MAX_TOKENS = {"amx": 8, "vec": 4}


def hybrid_max_tokens(dtype: torch.dtype) -> int:
    return HYBRID_MAX_TOKENS["amx" if dtype == torch.bfloat16 and ops.amx_available() else "vec"]


def slow_16bit_cpu_linear(dtype: torch.dtype) -> bool:
    """Whether vLLM-CPU's own linear for `dtype` is torch's slow 16-bit one here (no AVX-512)."""
    return (is_cpu_platform() and dtype in _SIXTEEN_BIT
            and torch.backends.cpu.get_cpu_capability() != "AVX512")


def resolve_linear_kernel(choice: str, dtype: torch.dtype) -> str:
    """`linear_kernel` in force for a target of `dtype` (config.py has the rule)."""
    if choice in ("sparsever", "hybrid") and not is_cpu_platform():
        raise RuntimeError(f"linear_kernel: {choice!r} runs on CPU only (allowed here: 'auto', 'vllm')")
    if choice != "auto":
        return choice
    return "sparsever" if slow_16bit_cpu_linear(dtype) else "vllm"


def sparsever_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer's CPU forward (vLLM's `cpu_linear(x, weight, bias)` contract) on `dense_linear`."""
    return ops.dense_linear(x, weight, bias)


def hybrid_cpu_linear(packed: Callable[..., torch.Tensor], max_tokens: int) -> Callable[..., torch.Tensor]:
    """A layer's CPU forward under linear_kernel "hybrid": `dense_linear` over the plain weight for up
    to `max_tokens` tokens, else `packed` (the forward vLLM-CPU prepared, its own weight copy)."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() <= max_tokens * x.shape[-1]:
            return ops.dense_linear(x, weight, bias)
        return packed(x, weight, bias)

    return linear


@contextlib.contextmanager
def plain_linears(what: str = "target", hybrid: bool = False) -> Iterator[None]:
    """While a model loads: its 2-D linear weights stay plain and run `dense_linear` (`hybrid`: for
    few tokens; vLLM-CPU prepares its packed weight too, for more)."""
    count = 0

    def dispatch(layer, remove_weight, stock) -> None:
        nonlocal count
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            stock(layer, remove_weight)
            return
        if hybrid:
            stock(layer, False)  # its packed copy; the plain weight stays on the layer
            if layer.weight is not weight:
                raise RuntimeError(f"linear_kernel 'hybrid': vLLM-CPU replaced the weight of {type(layer).__name__} "
                                   f"while keeping it (remove_weight=False)")
            use_plain_cpu_linear(layer, hybrid_cpu_linear(layer.cpu_linear, hybrid_max_tokens(weight.dtype)))
        else:
            use_plain_cpu_linear(layer, sparsever_cpu_linear)
        count += 1

    with cpu_gemm_dispatch_override(dispatch):
        yield
    runtime = get_runtime()
    if runtime is not None and count:  # (an n-gram "drafter" loads no model)
        runtime.linear_layers[what] = count
    logger.info("sparsever: %d dense linear layers of the %s on sparsever's dense_linear (linear_kernel%s)", count,
                what, " 'hybrid': for few tokens" if hybrid else "")
