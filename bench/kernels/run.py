"""Kernel benchmarks: sparsever CPU kernels vs the dense PyTorch equivalent, in the same run.

    .venv/bin/python bench/kernels/run.py [--quick] [--dtype bf16|fp32] [--out bench/results]

Shapes are verification shapes (1-64 query tokens, contexts 2K-32K) of SmolLM2-135M, Qwen2.5-0.5B and
Qwen2.5-1.5B. Every kernel is compared with (a) the dense PyTorch equivalent timed in the same run and
(b) the machine's DRAM read bandwidth measured in the same run (achieved GB/s of the bytes the kernel
must read). Data is rotated over several "layers" whose total size exceeds the caches, so every call
reads cold memory as a real forward pass does. Threads: torch.set_num_threads(2).
Writes bench/results/kernels_<date>.json (command line, hardware, versions, raw times) and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import vllm_sparsever._custom_ops as ops  # noqa: E402
from vllm_sparsever.compat.linear import stock_cpu_linear  # noqa: E402

MODELS = {
    # name: hidden, intermediate, q heads, kv heads, head_dim
    "SmolLM2-135M": (576, 1536, 9, 3, 64),
    "Qwen2.5-0.5B": (896, 4864, 14, 2, 64),
    "Qwen2.5-1.5B": (1536, 8960, 12, 2, 128),
}
ROTATION_BYTES = 768 << 20  # total size of the rotated copies: well past L2/L3 per core
INPUT_KEEP = 0.7  # ffn.gate_input_keep_ratio timed for the "input_sparse" gate (its default)


# The machine is shared: other processes preempt our threads, which inflates some repetitions by whole
# scheduler quanta. Ratios therefore use the MINIMUM over repetitions (the least-disturbed run);
# medians are saved too.
STAT = "min_s"


def bench(fn, min_reps=7, min_time=0.3, warmup=2) -> dict:
    """Wall times of fn() in seconds (fn rotates its own data): min, median, reps."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": len(times)}


def bench_interleaved(fns: dict, min_rounds=15, min_time=1.0, warmup=2) -> dict:
    """Wall times of each fn, called in turn round after round (baseline and candidates alike), so a
    phase of a shared machine (other tenants, memory contention) slows them all instead of whichever
    was being timed then: {name: {min_s, median_s, reps}}."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < min_time and rounds < 200):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "reps": len(t)} for name, t in times.items()}


class EnvSwitch:
    """Calls fn with environment variables set for the call only (kernels that read a switch per call)."""

    def __init__(self, fn, **env: str):
        self.fn, self.env = fn, env

    def __call__(self):
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            return self.fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v


_BASE = torch.randn(4 << 20)


def rand(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    """Random-looking data quickly: tiles of one 16 MiB random block (timings do not depend on values)."""
    out = torch.empty(*shape, dtype=dtype)
    flat = out.view(-1)
    for i in range(0, flat.numel(), _BASE.numel()):
        n = min(_BASE.numel(), flat.numel() - i)
        flat[i : i + n].copy_(_BASE[:n] * scale)
    return out


def n_copies(bytes_per_copy: int, lo: int = 2, hi: int = 64) -> int:
    return max(lo, min(hi, math.ceil(ROTATION_BYTES / max(1, bytes_per_copy))))


class Rotor:
    """Cycles through copies so consecutive calls touch different memory."""

    def __init__(self, n: int):
        self.n, self.i = n, 0

    def next(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


# ---------------------------------------------------------------------------------------------------
def measure_bandwidth() -> dict:
    x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read = bench(lambda: x.sum(), min_reps=7, min_time=1.0)
    copy = bench(lambda: y.copy_(x), min_reps=7, min_time=1.0)
    return {
        "read_GBps": nbytes / read[STAT] / 1e9,
        "copy_GBps": 2 * nbytes / copy[STAT] / 1e9,
        "read": read, "copy": copy,
        "method": "torch.sum over 1 GiB fp32 (read) and copy_ (read+write), best of reps",
    }


def measure_roof(dtype: torch.dtype, n: int = 2048) -> dict:
    """The compute roof these threads reach for `dtype` data: a large n x n x n GEMM through torch
    (oneDNN: AMX tiles on CPUs that have them, else AVX512-BF16 / AVX-512 FMAs), operands resident in
    cache-friendly tiles. For 16-bit data it also times the fp32 GEMM: a CPU without bf16/fp16 dot
    products (AVX2) multiplies such data widened to fp32, and torch's own 16-bit GEMM there is a slow
    fallback, so the roof is whichever of the two is faster ('roof_dtype' says which)."""
    def gemm(dt: torch.dtype) -> dict:
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        c = torch.empty(n, n, dtype=dt)
        if dt != torch.float32:  # a slow fallback path: time one call before committing to reps
            start = time.perf_counter()
            torch.matmul(a, b, out=c)
            if time.perf_counter() - start > 2.0:
                return {STAT: time.perf_counter() - start, "reps": 1, "note": "one call (slow path)"}
        return bench(lambda: torch.matmul(a, b, out=c), min_reps=5, min_time=1.0)

    flops = 2 * n**3
    own = gemm(dtype)
    out = {"gemm": own, "gemm_GFLOPs_own_dtype": flops / own[STAT] / 1e9, "roof_dtype": str(dtype).split(".")[-1]}
    best = out["gemm_GFLOPs_own_dtype"]
    if dtype != torch.float32:
        f32 = gemm(torch.float32)
        out["gemm_fp32"] = f32
        out["gemm_GFLOPs_fp32"] = flops / f32[STAT] / 1e9
        if out["gemm_GFLOPs_fp32"] > best:
            best, out["roof_dtype"] = out["gemm_GFLOPs_fp32"], "float32"
    return out | {"gemm_GFLOPs": best, "shape": [n, n, n], "dtype": str(dtype).split(".")[-1],
                  "amx": bool(torch.cpu._is_amx_tile_supported()),
                  "method": f"torch.matmul, best of reps, the faster of {str(dtype).split('.')[-1]} and float32 "
                            "(the attention columns' 'roof %' divide by this)"}


# Dense attention variants reported against the roof: sparsever's kernel on the vec layout and on
# vLLM's AMX layout, vLLM's kernel with the vec and AMX ISAs.
# dense_ours_bf16dot / _fp32fma: the vec layout's two bf16 paths forced (SPARSEVER_CPU_ATTN_BF16_DOT),
# on CPUs with AVX512-BF16; dense_ours is whichever the kernel picks by default.
DENSE_ATTENTION_VARIANTS = ("dense_ours", "dense_ours_bf16dot", "dense_ours_fp32fma", "dense_ours_amx", "vllm_dense",
                            "vllm_dense_amx")


def attention_flops(q_len: int, ctx: int, hq: int, d: int) -> int:
    """QK^T and PV multiply-adds (2 flops each) of one causal verify query over ctx + q_len keys."""
    keys = q_len * ctx + q_len * (q_len + 1) // 2
    return 4 * hq * d * keys


# ---------------------------------------------------------------------------------------------------
def bench_attention(model: str, ctx: int, q_len: int, dtype: torch.dtype, keep_frac: float, bw: float,
                    roof_gflops: float | None = None) -> dict:
    hidden, _, hq, hkv, d = MODELS[model]
    bs = 128  # vLLM-CPU default block size
    seq_len = ctx + q_len
    nblk = (seq_len + bs - 1) // bs
    esize = torch.finfo(dtype).bits // 8
    layer_bytes = nblk * hkv * 2 * bs * d * esize
    layers = n_copies(layer_bytes)
    # vLLM-CPU layout per layer: [nb, Hkv, 2*bs*D], K transposed [D, bs] then V [bs, D].
    raws = [rand(nblk, hkv, 2 * bs * d, dtype=dtype) for _ in range(layers)]
    kcs = [r[:, :, : bs * d].view(nblk, hkv, d, bs).transpose(2, 3) for r in raws]
    vcs = [r[:, :, bs * d :].view(nblk, hkv, bs, d) for r in raws]
    # Dense PyTorch baseline: SDPA (GQA) on the same KV already contiguous per head ([Hkv, L, D]).
    kds = [k.permute(1, 0, 2, 3).reshape(hkv, nblk * bs, d)[:, :seq_len].contiguous() for k in kcs]
    vds = [v.permute(1, 0, 2, 3).reshape(hkv, nblk * bs, d)[:, :seq_len].contiguous() for v in vcs]
    block_table = torch.randperm(nblk).to(torch.int32).unsqueeze(0)
    # block_table is a permutation, so logical positions map to the same data under both layouts only
    # if the baseline uses the permuted order; attention over a set is order-free, and the timing only
    # needs identical bytes, so the baseline reads the blocks in physical order.
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    q_lens = torch.tensor([q_len], dtype=torch.int32)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    query = torch.randn(q_len, hq, d).to(dtype)
    scale = 1 / math.sqrt(d)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(ctx)
    summaries = [(torch.empty(nblk, hkv, d), torch.empty(nblk, hkv, d)) for _ in range(layers)]
    all_slots = (block_table[0].long().repeat_interleave(bs) * bs + torch.arange(bs).repeat(nblk))[:seq_len]
    for l in range(layers):
        ops.update_block_key_summaries(kcs[l], all_slots, bs, *summaries[l])
    ctx_blocks = (ctx + bs - 1) // bs
    top_k = max(1, round(keep_frac * ctx_blocks) - 2)  # + 1 sink + 1 local = keep_frac of the blocks
    out = torch.empty_like(query)
    rot = Rotor(layers)
    qt = query.transpose(0, 1).unsqueeze(0)

    def dense_torch():
        l = rot.next()
        return F.scaled_dot_product_attention(qt, kds[l].unsqueeze(0), vds[l].unsqueeze(0),
                                              attn_mask=mask, scale=scale, enable_gqa=True)

    def dense_ours():
        l = rot.next()
        ops.block_sparse_tree_attention(query, kcs[l], vcs[l], block_table, seq_lens, qsl, scale, out=out)

    bf16_paths = dtype == torch.bfloat16 and ops.bf16_dot_available()
    dense_ours_bf16dot = EnvSwitch(dense_ours, SPARSEVER_CPU_ATTN_BF16_DOT="1")
    dense_ours_fp32fma = EnvSwitch(dense_ours, SPARSEVER_CPU_ATTN_BF16_DOT="0")

    sel_cache = {}

    def select(l):
        qp = query.float().mean(0, keepdim=True)
        sel_cache[l] = ops.select_kv_blocks(qp, *summaries[l], block_table, seq_lens, q_lens, bs, top_k, 1, 1)

    def sparse_select_and_attend():
        l = rot.next()
        select(l)
        sel, nsel = sel_cache[l]
        ops.block_sparse_tree_attention(query, kcs[l], vcs[l], block_table, seq_lens, qsl, scale, sel, nsel, out=out)

    def sparse_attend_only():
        l = rot.next()
        sel, nsel = sel_cache[l]
        ops.block_sparse_tree_attention(query, kcs[l], vcs[l], block_table, seq_lens, qsl, scale, sel, nsel, out=out)

    def summary_update():  # per step: fold the q_len new tokens in
        l = rot.next()
        ops.update_block_key_summaries(kcs[l], all_slots[-q_len:], bs, *summaries[l])

    # attention.kernel "vllm": vLLM's CPU kernel dense, and over a compacted block table (one
    # selection per request shared by the KV heads; same number of kept blocks, so same bytes).
    from vllm import _custom_ops as vllm_ops

    from vllm_sparsever.verification.lossless.kv_layout import paged_kv_views
    from vllm_sparsever.verification.sparse.attention import compact_block_table, heads_as_one

    stock_kv = [r.view(nblk, hkv, 2 * bs, d).chunk(2, dim=2) for r in raws]  # vLLM's own view, vec ISA

    def vllm_attend(l, table, lens, sched):
        vllm_ops.cpu_attention_with_kv_cache(
            query=query, key_cache=stock_kv[l][0], value_cache=stock_kv[l][1], output=out, query_start_loc=qsl,
            seq_lens=lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0, scheduler_metadata=sched, s_aux=None)

    def vllm_sched(lens, isa="vec"):
        return vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=lens, dtype=dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)

    dense_sched = vllm_sched(seq_lens)
    # What vLLM-CPU picks for bf16 where AMX exists (its own packed K/V layout; random bytes time alike).
    amx = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() and bs % 32 == 0
    amx_sched = vllm_sched(seq_lens, "amx") if amx else None
    compacted = {}

    def vllm_select(l):
        qp, kmin, kmax = heads_as_one(query.float().mean(0, keepdim=True), *summaries[l])
        sel, nsel = ops.select_kv_blocks(qp, kmin, kmax, block_table, seq_lens, q_lens, bs, top_k, 1, 1)
        compacted[l] = compact_block_table(block_table, seq_lens, q_lens, sel, nsel, bs)

    for l in range(layers):
        select(l)
        vllm_select(l)
    sparse_sched = vllm_sched(compacted[0][1])  # once per step in the engine

    def vllm_dense():
        vllm_attend(rot.next(), block_table, seq_lens, dense_sched)

    def vllm_dense_amx():
        vllm_attend(rot.next(), block_table, seq_lens, amx_sched)

    # sparsever's kernel reading vLLM's AMX layout in place (6-D views of the same bytes).
    amx_views = [paged_kv_views(r.view(nblk, hkv, bs, 2 * d), "amx") for r in raws] if amx else None

    def dense_ours_amx():
        l = rot.next()
        ops.block_sparse_tree_attention(query, *amx_views[l], block_table, seq_lens, qsl, scale, out=out)

    def vllm_sparse_select_and_attend():
        l = rot.next()
        vllm_select(l)
        vllm_attend(l, *compacted[l], sparse_sched)

    def vllm_sparse_attend_only():
        l = rot.next()
        vllm_attend(l, *compacted[l], sparse_sched)

    kept = int(sel_cache[0][1][0, 0])
    q_blocks = (seq_len - 1) // bs - ctx // bs + 1
    bytes_dense = layer_bytes
    bytes_sparse = (kept + q_blocks) * hkv * 2 * bs * d * esize
    res = {
        "model": model, "ctx": ctx, "q_len": q_len, "dtype": str(dtype).split(".")[-1], "block_size": bs,
        "kept_blocks": kept, "ctx_blocks": ctx_blocks, "layers_rotated": layers,
        "bytes_dense": bytes_dense, "bytes_sparse": bytes_sparse,
        **bench_interleaved({
            "dense_torch_sdpa": dense_torch, "dense_ours": dense_ours,
            "sparse_with_select": sparse_select_and_attend, "sparse_attend_only": sparse_attend_only,
            "summary_update": summary_update,
            "vllm_dense": vllm_dense, "vllm_sparse_with_select": vllm_sparse_select_and_attend,
            "vllm_sparse_attend_only": vllm_sparse_attend_only,
            **({"vllm_dense_amx": vllm_dense_amx, "dense_ours_amx": dense_ours_amx} if amx else {}),
            **({"dense_ours_bf16dot": dense_ours_bf16dot, "dense_ours_fp32fma": dense_ours_fp32fma}
               if bf16_paths else {}),
        }),
    }
    flops = attention_flops(q_len, ctx, hq, d)
    res["flops"] = flops
    # Roofline: what the measured compute roof and DRAM read bandwidth allow at this arithmetic
    # intensity (FLOPs per byte of K/V read once).
    res["attainable_GFLOPs"] = min(roof_gflops or float("inf"), bw * flops / bytes_dense)
    for name in DENSE_ATTENTION_VARIANTS:
        if name in res:
            res[f"GFLOPs_{name}"] = flops / res[name][STAT] / 1e9
            if roof_gflops:
                res[f"roof_fraction_{name}"] = res[f"GFLOPs_{name}"] / roof_gflops
            res[f"attainable_fraction_{name}"] = res[f"GFLOPs_{name}"] / res["attainable_GFLOPs"]
    t_dt = res["dense_torch_sdpa"][STAT]
    t_sp = res["sparse_with_select"][STAT]
    res["speedup_vllm_sparse_vs_vllm_dense"] = res["vllm_dense"][STAT] / res["vllm_sparse_with_select"][STAT]
    res["sparsever_sparse_vs_vllm_sparse"] = res["vllm_sparse_with_select"][STAT] / t_sp
    res["speedup_sparse_vs_torch_dense"] = t_dt / t_sp
    res["speedup_sparse_vs_our_dense"] = res["dense_ours"][STAT] / t_sp
    if bf16_paths:
        res["speedup_bf16dot_vs_fp32fma"] = res["dense_ours_fp32fma"][STAT] / res["dense_ours_bf16dot"][STAT]
    res["GBps_dense_ours"] = bytes_dense / res["dense_ours"][STAT] / 1e9
    res["GBps_sparse_attend"] = bytes_sparse / res["sparse_attend_only"][STAT] / 1e9
    res["GBps_dense_torch"] = bytes_dense / t_dt / 1e9
    res["frac_of_bw_dense_ours"] = res["GBps_dense_ours"] / bw
    return res


# ---------------------------------------------------------------------------------------------------
class vllm_cpu_linear:  # noqa: N801 (a callable standing for one linear layer)
    """`y = x W^T` through the dense linear vLLM-CPU sets up for `weight` at load
    (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`, weights kept)."""

    def __init__(self, weight: torch.Tensor) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        self.layer = torch.nn.Module()
        self.layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        dispatch_cpu_unquantized_gemm(self.layer, remove_weight=False)
        fn = self.layer.cpu_linear
        # Which path vLLM chose, from what its dispatch closure holds (a oneDNN handler, sgl-kernel's
        # packed weight, or nothing: torch's linear as the fallback).
        free = set(getattr(getattr(fn, "__code__", None), "co_freevars", ()))
        self.kind = "oneDNN" if "handler" in free else "sgl-kernel" if "packed_weight" in free else "torch linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.cpu_linear(x, self.layer.weight, None)


def shared_weights_mlp(w_gate_up: torch.Tensor, w_down: torch.Tensor, name: str) -> torch.nn.Module:
    """The served FFN wrapper over one MLP loaded with `ffn.weights: "shared"` (plain weights, no packed
    copy; `ffn.gate: "auto"`): its dense steps are what this times."""
    from vllm_sparsever.verification.sparse.ffn import SparseSwiGLUMLP

    class PlainMLP(torch.nn.Module):  # vLLM-CPU's MLP with "shared" weights: torch's linear on them
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(w_gate_up.shape[1], w_gate_up.shape[0], bias=False)
            self.down_proj = torch.nn.Linear(w_down.shape[1], w_down.shape[0], bias=False)
            self.gate_up_proj.weight = torch.nn.Parameter(w_gate_up, requires_grad=False)
            self.down_proj.weight = torch.nn.Parameter(w_down, requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)

    return SparseSwiGLUMLP(PlainMLP(), name, 0, gate="auto", weights="shared")


def has_widening_path(dtype: torch.dtype) -> bool:
    """True where this CPU takes the bf16 dot path, so the fp32-widening path (what CPUs without
    AVX512-BF16 run; SPARSEVER_CPU_FFN_BF16_DOT=0) is a second path to time."""
    return dtype == torch.bfloat16 and ops.bf16_dot_available()


def bench_ffn(model: str, num_tokens: int, dtype: torch.dtype, keep_fracs: list[float], bw: float) -> dict:
    hidden, inter, *_ = MODELS[model]
    esize = torch.finfo(dtype).bits // 8
    dense_bytes = 3 * inter * hidden * esize
    layers = n_copies(dense_bytes)
    w_gu = [rand(2 * inter, hidden, dtype=dtype, scale=hidden**-0.5) for _ in range(layers)]
    w_down = [rand(hidden, inter, dtype=dtype, scale=inter**-0.5) for _ in range(layers)]  # torch layout
    w_down_t = [w.t().contiguous() for w in w_down]  # made once at load
    x = torch.randn(num_tokens, hidden).to(dtype)
    gsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    out = torch.empty_like(x)
    rot = Rotor(layers)

    def dense_torch():
        l = rot.next()
        gu = F.linear(x, w_gu[l])
        g, u = gu.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w_down[l])

    # vLLM-CPU's own dense MLP path: the linear vLLM dispatches for these weights in a served model
    # (sgl-kernel with AMX, else oneDNN with weights packed at load, else torch's linear).
    v_gu = [vllm_cpu_linear(w) for w in w_gu]
    v_down = [vllm_cpu_linear(w) for w in w_down]

    def dense_vllm():
        l = rot.next()
        g, u = v_gu[l](x).chunk(2, dim=-1)
        return v_down[l](F.silu(g) * u)

    # Every variant is timed in the same rounds (bench_interleaved): baseline and candidates see the
    # same machine phases.
    # A dense step with `ffn.weights: "shared"` as served (the op at keep = I over the plain weights
    # for few tokens, else torch's linear on them).
    shared = [shared_weights_mlp(w_gu[l], w_down[l], f"bench.{model}.{num_tokens}.{l}.mlp") for l in range(layers)]

    def dense_shared():
        return shared[rot.next()]._dense(x)

    fns = {"dense_torch": dense_torch, "dense_vllm": dense_vllm, "dense_shared": dense_shared}
    # What the served FFN path runs ("copy" weights): the dense gate on vLLM's own packed linear for
    # the gate rows, then topk_swiglu_ffn_gated over the kept up/down rows; and the op that streams
    # the gate itself ("shared" weights).
    gate_linear = [stock_cpu_linear(w[:inter].clone()) for w in w_gu]
    w_up = [w[inter:] for w in w_gu]
    # ffn.gate "input_sparse": the approximate gate from the top INPUT_KEEP of hidden channels'
    # rows of a transposed gate copy, then the gated op.
    w_gate_t = [w[:inter].t().contiguous() for w in w_gu]
    input_keep = max(1, round(INPUT_KEEP * hidden))
    keeps = {r: max(1, round(r * inter)) for r in keep_fracs}
    for r, keep in keeps.items():
        sel = torch.empty(1, keep, dtype=torch.int32)

        def ours(keep=keep, sel=sel):
            l = rot.next()
            ops.topk_swiglu_ffn_gated(x, gate_linear[l](x), w_up[l], w_down_t[l], gsl, keep, out=out, selected=sel)

        def streamed_gate(keep=keep, sel=sel):
            l = rot.next()
            ops.topk_swiglu_ffn(x, w_gu[l], w_down_t[l], gsl, keep, out=out, selected=sel)

        def input_sparse(keep=keep, sel=sel):
            l = rot.next()
            gate, _ = ops.input_sparse_gate(x, w_gate_t[l], gsl, input_keep)
            ops.topk_swiglu_ffn_gated(x, gate, w_up[l], w_down_t[l], gsl, keep, out=out, selected=sel)

        fns[f"ours@{r}"] = ours
        fns[f"streamed_gate@{r}"] = streamed_gate
        fns[f"input_sparse@{r}"] = input_sparse
        if has_widening_path(dtype):
            fns[f"widening@{r}"] = EnvSwitch(ours, SPARSEVER_CPU_FFN_BF16_DOT="0")
            if num_tokens > 4:  # more than one token tile: the up kernel's prefetch as before 2026-11-26
                fns[f"first_tile_prefetch@{r}"] = EnvSwitch(ours, SPARSEVER_CPU_FFN_SPREAD_PREFETCH="0")
    times = bench_interleaved(fns)
    res = {"model": model, "q_len": num_tokens, "dtype": str(dtype).split(".")[-1], "hidden": hidden,
           "intermediate": inter, "layers_rotated": layers, "dense_bytes": dense_bytes,
           "dense_torch": times["dense_torch"], "dense_vllm": times["dense_vllm"],
           "vllm_linear_kind": v_gu[0].kind, "by_keep": [], "timing": "interleaved rounds"}
    t_torch = res["dense_torch"][STAT]
    t_vllm = res["dense_vllm"][STAT]
    res["GBps_dense_torch"] = dense_bytes / t_torch / 1e9
    res["GBps_dense_vllm"] = dense_bytes / t_vllm / 1e9
    res["dense_shared"] = times["dense_shared"]
    res["dense_shared_path"] = "op at keep = I" if shared[0].dense_uses_op(num_tokens) else "torch linear"
    res["speedup_vs_vllm_dense_shared"] = t_vllm / times["dense_shared"][STAT]
    res["speedup_vs_vllm_dense_torch"] = t_vllm / t_torch
    for r, keep in keeps.items():
        t = times[f"ours@{r}"]
        widened = times.get(f"widening@{r}")
        streamed = times[f"streamed_gate@{r}"]
        ideal_frac = 1 / 3 + 2 * (keep / inter) / 3
        ideal_s = ideal_frac * dense_bytes / (bw * 1e9)
        res["by_keep"].append({
            "keep_ratio": keep / inter, "keep": keep, "time": t, "bytes": ideal_frac * dense_bytes,
            "GBps": ideal_frac * dense_bytes / t[STAT] / 1e9,
            "ideal_s_at_measured_bw": ideal_s, "ratio_to_ideal": t[STAT] / ideal_s,
            "speedup_vs_torch_dense": t_torch / t[STAT],
            "speedup_vs_vllm_dense": t_vllm / t[STAT],
            "time_streamed_gate": streamed, "speedup_vs_vllm_dense_streamed_gate": t_vllm / streamed[STAT],
            "time_input_sparse_gate": times[f"input_sparse@{r}"], "input_keep_ratio": INPUT_KEEP,
            "speedup_vs_vllm_dense_input_sparse_gate": t_vllm / times[f"input_sparse@{r}"][STAT],
            **({"time_fp32_widening": widened, "speedup_vs_vllm_dense_fp32_widening": t_vllm / widened[STAT]}
               if widened else {}),
            **({"time_first_tile_prefetch": first, "speedup_vs_vllm_dense_first_tile_prefetch": t_vllm / first[STAT]}
               if (first := times.get(f"first_tile_prefetch@{r}")) else {}),
        })
    # Same target relative to our own dense streaming rate (keep = I): isolates the cost of selection
    # from how close the streaming loop gets to DRAM bandwidth.
    dense_ours = [k for k in res["by_keep"] if k["keep"] == inter]
    for k in res["by_keep"]:
        if dense_ours:
            ideal = (1 / 3 + 2 * k["keep_ratio"] / 3) * dense_ours[0]["time"][STAT]
            k["ratio_to_scaled_own_dense"] = k["time"][STAT] / ideal
    return res


# ---------------------------------------------------------------------------------------------------
def bench_moe(num_tokens: int, dtype: torch.dtype, budgets: list[int], bw: float, hidden=1024, inter=512,
              num_experts=64, top_k=8) -> dict:
    """Qwen3-MoE-like fine-grained experts; cost vs the number of distinct experts kept."""
    esize = torch.finfo(dtype).bits // 8
    expert_bytes = 3 * hidden * inter * esize
    layers = n_copies(expert_bytes * num_experts, hi=8)
    w13 = [rand(num_experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5) for _ in range(layers)]
    w2 = [rand(num_experts, hidden, inter, dtype=dtype, scale=inter**-0.5) for _ in range(layers)]
    x = torch.randn(num_tokens, hidden).to(dtype)
    logits = torch.randn(num_tokens, num_experts) * 2
    gsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    out = torch.empty_like(x)
    rot = Rotor(layers)

    def torch_grouped(weights, ids):
        """Dense PyTorch equivalent: loop over experts with tokens, index_select + linear + index_add."""
        l = rot.next()
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = F.linear(x[tok], w13[l][e])
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            y = F.linear(h, w2[l][e]).float()
            acc.index_add_(0, tok, y * weights[tok, slot].unsqueeze(1))
        return acc.to(dtype)

    rows = []
    for budget in budgets:
        weights, ids = ops.moe_route_and_prune(logits, top_k, 0.0, gsl, budget, True)
        distinct = len(set(ids[ids >= 0].tolist()))

        def ours():
            l = rot.next()
            ops.moe_grouped_dispatch(x, weights, ids, w13[l], w2[l], out=out)

        fns = {"ours": ours, "torch": lambda: torch_grouped(weights, ids)}
        if has_widening_path(dtype):
            fns["widening"] = EnvSwitch(ours, SPARSEVER_CPU_FFN_BF16_DOT="0")
        times = bench_interleaved(fns)
        t, tt, widened = times["ours"], times["torch"], times.get("widening")
        route = bench(lambda: ops.moe_route_and_prune(logits, top_k, 0.0, gsl, budget, True))
        rows.append({"budget": budget, "distinct_experts": distinct, "time": t, "torch_time": tt,
                     "route_time": route, "bytes": distinct * expert_bytes,
                     "GBps": distinct * expert_bytes / t[STAT] / 1e9,
                     "speedup_vs_torch": tt[STAT] / t[STAT],
                     **({"time_fp32_widening": widened} if widened else {})})
    # Least-squares fit time = a + b * distinct: proportional cost means a small intercept.
    xs = [r["distinct_experts"] for r in rows]
    ys = [r["time"][STAT] for r in rows]
    fit = None
    if len(set(xs)) >= 2:
        mx, my = statistics.mean(xs), statistics.mean(ys)
        b = sum((a - mx) * (c - my) for a, c in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
        a = my - b * mx
        ss_res = sum((c - (a + b * x_)) ** 2 for x_, c in zip(xs, ys))
        ss_tot = sum((c - my) ** 2 for c in ys)
        fit = {"intercept_s": a, "per_expert_s": b, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
               "per_expert_ideal_s": expert_bytes / (bw * 1e9)}
    return {"q_len": num_tokens, "dtype": str(dtype).split(".")[-1], "hidden": hidden, "intermediate": inter,
            "num_experts": num_experts, "top_k": top_k, "expert_bytes": expert_bytes, "layers_rotated": layers,
            "rows": rows, "fit": fit}


# ---------------------------------------------------------------------------------------------------
def hardware() -> dict:
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        lscpu = subprocess.check_output(["lscpu"], text=True)
        for line in lscpu.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "L1d cache", "L2 cache", "L3 cache"):
                info[key.strip()] = val.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    info["isa_build"] = torch.ops.sparsever.ext_info()
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def markdown(results: dict) -> str:
    bw = results["bandwidth"]["read_GBps"]
    lines = [f"# Kernel benchmarks ({results['date']})", "",
             f"Machine: {results['hardware'].get('Model name', '?')}, {results['hardware'].get('CPU(s)', '?')} CPUs; "
             f"threads: {results['threads']}; load average at start/end {results['loadavg_start'][0]:.1f}/{results['loadavg_end'][0]:.1f} "
             f"(shared machine); DRAM read {bw:.1f} GB/s, copy {results['bandwidth']['copy_GBps']:.1f} GB/s "
             f"(measured in this run). Times: best of rounds in which the baseline and every candidate of a row run in turn (shared machine; medians in the JSON).", "",
             "## Block-sparse attention (keep 1/8 of context blocks incl. 1 sink + 1 local, block 128, vLLM-CPU layout)", "",
             "'vllm' = vLLM's own CPU attention kernel (vec ISA): dense, and sparse over a compacted block "
             "table (attention.kernel 'vllm'; selection + compaction included).", "",
             "| model | dtype | ctx | q | torch SDPA dense ms | ours dense ms (GB/s) | ours sparse+select ms | speedup vs torch dense | vs ours dense | vllm dense ms | vllm sparse+select ms | vllm sparse vs vllm dense | vllm sparse / ours sparse |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["attention"]:
        vllm_cols = ("| - | - | - | - |" if "vllm_dense" not in r else
                     f"| {r['vllm_dense'][STAT]*1e3:.3f} | {r['vllm_sparse_with_select'][STAT]*1e3:.3f} | "
                     f"{r['speedup_vllm_sparse_vs_vllm_dense']:.2f}x | {r['sparsever_sparse_vs_vllm_sparse']:.2f} |")
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['ctx']} | {r['q_len']} | {r['dense_torch_sdpa'][STAT]*1e3:.3f} | "
            f"{r['dense_ours'][STAT]*1e3:.3f} ({r['GBps_dense_ours']:.1f}) | {r['sparse_with_select'][STAT]*1e3:.3f} | "
            f"{r['speedup_sparse_vs_torch_dense']:.2f}x | {r['speedup_sparse_vs_our_dense']:.2f}x " + vllm_cols)
    if results.get("roof") and results["attention"]:
        roof = results["roof"]
        lines += ["", f"## Dense verify attention against the compute roof ({roof['gemm_GFLOPs']:.0f} GFLOP/s: a "
                  f"{roof['shape'][0]}^3 {roof.get('roof_dtype', roof['dtype'])} GEMM through torch{', AMX' if roof['amx'] else ''}, this run"
                  + (f"; the {roof['dtype']} GEMM reached {roof['gemm_GFLOPs_own_dtype']:.1f}" if roof.get('roof_dtype', roof['dtype']) != roof['dtype'] else "") + ")", "",
                  "FLOPs: QK^T and PV of every query row over its causal keys. 'vllm amx' = vLLM's kernel with the ISA "
                  "it picks for bf16 on CPUs with AMX (its own K/V layout).", "",
                  "'ours amx' = sparsever's kernel reading that AMX layout in place (AMX tile products). "
                  "'attainable' = min(roof, DRAM read bandwidth x FLOPs per K/V byte): below it, a kernel "
                  "is bound by memory, not compute; each cell's second % is of it.", "",
                  "'ours vec bf16 dot' / 'ours vec fp32 FMA': the vec layout's two bf16 paths forced "
                  "(SPARSEVER_CPU_ATTN_BF16_DOT=1 / 0; 'ours vec' is the default: the dot path only on CPUs "
                  "without AMX).", "",
                  "| model | ctx | q | attainable GFLOP/s | ours vec: ms, GFLOP/s, roof %, attainable % | "
                  "ours vec bf16 dot | ours vec fp32 FMA | ours amx | vllm vec | vllm amx |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["attention"]:
            cells = []
            for name in DENSE_ATTENTION_VARIANTS:
                cells.append(f"{r[name][STAT]*1e3:.3f}, {r[f'GFLOPs_{name}']:.0f}, {100*r[f'roof_fraction_{name}']:.0f}%, "
                             f"{100*r[f'attainable_fraction_{name}']:.0f}%"
                             if name in r and f"roof_fraction_{name}" in r else "-")
            lines.append(f"| {r['model']} | {r['ctx']} | {r['q_len']} | {r.get('attainable_GFLOPs', float('nan')):.0f} | "
                         + " | ".join(cells) + " |")
    lines += ["", "## Top-k SwiGLU FFN (one neuron set for all q tokens)", "",
              "'ours' = what the served path runs with `ffn.weights: copy`: the dense gate on vLLM's own packed "
              "linear for the gate rows, then topk_swiglu_ffn_gated over the kept up/down rows. 'gate streamed' = "
              "topk_swiglu_ffn computing the gate itself (`weights: shared`). 'input-sparse gate' = `ffn.gate: "
              f"input_sparse` (approximate): input_sparse_gate over the top {INPUT_KEEP} of hidden channels, then "
              "topk_swiglu_ffn_gated. bf16 on a CPU with AVX512-BF16: the "
              "kernels use vdpbf16ps; the last column is 'ours' on the fp32-widening path "
              "(SPARSEVER_CPU_FFN_BF16_DOT=0), as CPUs without it run; 'first-tile prefetch' = 'ours' with the up "
              "kernel prefetching the next rows in the first 4-token tile only, as before 2026-11-26 "
              "(SPARSEVER_CPU_FFN_SPREAD_PREFETCH=0; more than 4 tokens).", "",
              "| model | dtype | q | torch dense ms (GB/s) | vLLM dense ms (GB/s) [path] | keep r | ours ms (GB/s) | time / ideal at DRAM BW | time / ideal at own dense rate | speedup vs torch dense | speedup vs vLLM dense | gate streamed: ms, vs vLLM dense | input-sparse gate: ms, vs vLLM dense | widening path: ms, vs vLLM dense | first-tile prefetch: ms, vs vLLM dense |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["ffn"]:
        vllm_dense = (f"{r['dense_vllm'][STAT]*1e3:.3f} ({r['GBps_dense_vllm']:.1f}) [{r['vllm_linear_kind']}]"
                      if "dense_vllm" in r else "-")
        for k in r["by_keep"]:
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['q_len']} | {r['dense_torch'][STAT]*1e3:.3f} ({r['GBps_dense_torch']:.1f}) | "
                f"{vllm_dense} | {k['keep_ratio']:.3f} | {k['time'][STAT]*1e3:.3f} ({k['GBps']:.1f}) | {k['ratio_to_ideal']:.2f} | "
                + (f"{k['ratio_to_scaled_own_dense']:.2f} | " if "ratio_to_scaled_own_dense" in k else "- | ")
                + f"{k['speedup_vs_torch_dense']:.2f}x | {k.get('speedup_vs_vllm_dense', float('nan')):.2f}x | "
                + (f"{k['time_streamed_gate'][STAT]*1e3:.3f}, {k['speedup_vs_vllm_dense_streamed_gate']:.2f}x | "
                   if "time_streamed_gate" in k else "- | ")
                + (f"{k['time_input_sparse_gate'][STAT]*1e3:.3f}, {k['speedup_vs_vllm_dense_input_sparse_gate']:.2f}x | "
                   if "time_input_sparse_gate" in k else "- | ")
                + (f"{k['time_fp32_widening'][STAT]*1e3:.3f}, {k['speedup_vs_vllm_dense_fp32_widening']:.2f}x | "
                   if "time_fp32_widening" in k else "- | ")
                + (f"{k['time_first_tile_prefetch'][STAT]*1e3:.3f}, {k['speedup_vs_vllm_dense_first_tile_prefetch']:.2f}x |"
                   if "time_first_tile_prefetch" in k else "- |"))
    lines += ["", "## Dense steps with `ffn.weights: shared` (no packed copy)", "",
              "What a dense step (every neuron) runs when the MLP weights are kept once, plain: the FFN wrapper's "
              "dense path (sparsever's op at keep = I for few tokens, else torch's linear), against vLLM's "
              "packed dense MLP (what `copy` keeps, at +1x MLP memory); torch's linear on the plain weights for "
              "reference.", "",
              "| model | dtype | q | vLLM dense ms | torch linear (plain): ms, vs vLLM | shared-weights dense step: ms, vs vLLM [path] |",
              "|---|---|---|---|---|---|"]
    for r in results["ffn"]:
        if "dense_shared" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | {r['q_len']} | {r['dense_vllm'][STAT]*1e3:.3f} | "
                         f"{r['dense_torch'][STAT]*1e3:.3f}, {r['speedup_vs_vllm_dense_torch']:.2f}x | "
                         f"{r['dense_shared'][STAT]*1e3:.3f}, {r['speedup_vs_vllm_dense_shared']:.2f}x "
                         f"[{r['dense_shared_path']}] |")
    lines += ["", "## MoE grouped dispatch (E=64, top-8, H=1024, I=512 per expert)", "",
              "| dtype | q | budget | distinct experts | ours ms (GB/s) | torch loop ms | speedup | widening path ms |",
              "|---|---|---|---|---|---|---|---|"]
    for m in results["moe"]:
        for r in m["rows"]:
            lines.append(f"| {m['dtype']} | {m['q_len']} | {r['budget'] or 'none'} | {r['distinct_experts']} | "
                         f"{r['time'][STAT]*1e3:.3f} ({r['GBps']:.1f}) | {r['torch_time'][STAT]*1e3:.3f} | "
                         f"{r['speedup_vs_torch']:.2f}x | "
                         + (f"{r['time_fp32_widening'][STAT]*1e3:.3f} |" if "time_fp32_widening" in r else "- |"))
        if m["fit"]:
            f = m["fit"]
            lines.append(f"| fit q={m['q_len']} | | | time = {f['intercept_s']*1e3:.3f} ms + {f['per_expert_s']*1e3:.3f} ms x experts "
                         f"(R^2 {f['r2']:.3f}; ideal per expert {f['per_expert_ideal_s']*1e3:.3f} ms) | | | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes (CI smoke run)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2,
                    help="torch/OpenMP threads (2 = the machine; 1 = a per-core view immune to worker wake-up "
                         "stalls when other processes share the cores)")
    ap.add_argument("--parts", nargs="+", choices=["attention", "ffn", "moe"], default=["attention", "ffn", "moe"])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help="default: all (quick: Qwen2.5-0.5B)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="attention contexts (default 2K-32K)")
    ap.add_argument("--q-lens", type=int, nargs="+", default=None, help="query tokens per request (default 1-64)")
    ap.add_argument("--keeps", type=float, nargs="+", default=None,
                    help="FFN keep ratios (default 1/8, 1/4, 1/2, 1; issue 14's aims: 0.3 0.5 0.7 1)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. the machine), so runs on one day do not overwrite each other")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]

    if args.quick:
        models, contexts, q_lens = ["Qwen2.5-0.5B"], [2048, 16384], [1, 8]
        moe_tokens, keep_fracs, budgets = [8], [0.125, 0.5, 1.0], [0, 8, 16]
    else:
        models, contexts, q_lens = list(MODELS), [2048, 8192, 16384, 32768], [1, 4, 16, 64]
        moe_tokens, keep_fracs, budgets = [1, 8, 64], [0.125, 0.25, 0.5, 1.0], [0, 4, 8, 16, 32]
    models, contexts, q_lens = args.models or models, args.contexts or contexts, args.q_lens or q_lens
    keep_fracs = args.keeps or keep_fracs
    attn_shapes = [(m, c, q) for m in models for c in contexts for q in q_lens] if "attention" in args.parts else []
    ffn_shapes = [(m, q) for m in models for q in q_lens] if "ffn" in args.parts else []
    moe_tokens = moe_tokens if "moe" in args.parts else []

    results = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
               "hardware": hardware(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "thread_note": "torch.set_num_threads(%d); at::parallel_for uses the same OpenMP pool" % args.threads,
               "env": {k: v for k, v in os.environ.items() if k in ("LD_PRELOAD", "OMP_NUM_THREADS", "KMP_AFFINITY")}}
    results["loadavg_start"] = os.getloadavg()
    print("measuring memory bandwidth ...", flush=True)
    results["bandwidth"] = measure_bandwidth()
    bw = results["bandwidth"]["read_GBps"]
    print(f"read {bw:.1f} GB/s", flush=True)
    if attn_shapes:
        results["roof"] = measure_roof(dtype)
        print(f"roof: {results['roof']['gemm_GFLOPs']:.0f} GFLOP/s ({results['roof']['roof_dtype']} GEMM)", flush=True)
    roof = results.get("roof", {}).get("gemm_GFLOPs")
    results["attention"] = [bench_attention(m, c, q, dtype, 1 / 8, bw, roof)
                            for m, c, q in tqdm(attn_shapes, desc="attention")]
    results["ffn"] = [bench_ffn(m, q, dtype, keep_fracs, bw) for m, q in tqdm(ffn_shapes, desc="ffn")]
    results["moe"] = [bench_moe(q, dtype, budgets, bw) for q in tqdm(moe_tokens, desc="moe")]
    results["loadavg_end"] = os.getloadavg()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = "" if len(args.parts) == 3 else "_" + "-".join(args.parts)
    stem = f"kernels_{dt.date.today().isoformat()}{'_quick' if args.quick else ''}{parts}_{args.dtype}_t{args.threads}{'_' + args.tag if args.tag else ''}"
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / stem}.json and .md")


if __name__ == "__main__":
    main()
