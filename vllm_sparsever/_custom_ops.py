"""Thin Python wrappers over `torch.ops.sparsever.*` plus fake impls for torch.compile (vLLM style).

Ops mutate their output arguments and return nothing; the wrappers allocate outputs when not given.
Semantics of every op: vllm_sparsever/reference.py.
"""

from __future__ import annotations

import torch

from vllm_sparsever._C_loader import load_extension

load_extension()

_ops = torch.ops.sparsever

OP_NAMES = ("update_block_key_summaries", "select_kv_blocks", "block_sparse_tree_attention", "topk_swiglu_ffn",
            "topk_swiglu_ffn_gated", "input_sparse_gate", "dense_linear", "int8_linear", "int4_linear",
            "moe_route_and_prune", "moe_grouped_dispatch")


def loaded_module() -> str:
    """The extension module this process loaded (vllm_sparsever._C_avx512 or vllm_sparsever._C)."""
    return load_extension()


def registered_kernels() -> dict[str, list[str]]:
    """For every op, the devices it has a kernel for ("CPU", "CUDA"): a CUDA build that registered no
    CUDA kernels shows here (`vllm-sparsever ext-info` prints it)."""
    return {op: [key for key in ("CPU", "CUDA")
                 if torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsever::{op}", key)]
            for op in OP_NAMES}


# ---- fake impls: outputs are mutated arguments, so there is nothing to compute or allocate -----------

@torch.library.register_fake("sparsever::update_block_key_summaries")
def _update_block_key_summaries_fake(key_cache, slot_mapping, block_size, key_min, key_max) -> None:
    return None


@torch.library.register_fake("sparsever::select_kv_blocks")
def _select_kv_blocks_fake(query_pooled, key_min, key_max, block_table, seq_lens, query_lens, block_size,
                           top_k, num_sink, num_local, selected, num_selected) -> None:
    return None


@torch.library.register_fake("sparsever::block_sparse_tree_attention")
def _block_sparse_tree_attention_fake(out, query, key_cache, value_cache, block_table, seq_lens,
                                      query_start_loc, selected, num_selected, tree_mask, scale) -> None:
    return None


@torch.library.register_fake("sparsever::topk_swiglu_ffn")
def _topk_swiglu_ffn_fake(out, x, w_gate_up, w_down_t, group_start_loc, keep, selected) -> None:
    return None


@torch.library.register_fake("sparsever::topk_swiglu_ffn_gated")
def _topk_swiglu_ffn_gated_fake(out, x, gate, w_up, w_down_t, group_start_loc, keep, selected) -> None:
    return None


@torch.library.register_fake("sparsever::input_sparse_gate")
def _input_sparse_gate_fake(gate, x, w_gate_t, group_start_loc, input_keep, channels) -> None:
    return None


@torch.library.register_fake("sparsever::dense_linear")
def _dense_linear_fake(out, x, weight, bias) -> None:
    return None


@torch.library.register_fake("sparsever::int8_linear")
def _int8_linear_fake(out, x, weight, weight_scale, weight_sum, bias) -> None:
    return None


@torch.library.register_fake("sparsever::int4_linear")
def _int4_linear_fake(out, x, weight, weight_scale, bias) -> None:
    return None


@torch.library.register_fake("sparsever::moe_route_and_prune")
def _moe_route_and_prune_fake(router_logits, top_k, prune_ratio, group_start_loc, expert_budget, renormalize,
                              topk_weights, topk_ids) -> None:
    return None


@torch.library.register_fake("sparsever::moe_grouped_dispatch")
def _moe_grouped_dispatch_fake(out, x, topk_weights, topk_ids, w13, w2, num_experts_used) -> None:
    return None


# ---- wrappers ---------------------------------------------------------------------------------------

def update_block_key_summaries(key_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                               key_min: torch.Tensor, key_max: torch.Tensor) -> None:
    """Recompute key min/max of every block touched by slot_mapping (see reference)."""
    _ops.update_block_key_summaries(key_cache, slot_mapping, block_size, key_min, key_max)


def select_kv_blocks(query_pooled: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
                     block_size: int, top_k: int, num_sink: int, num_local: int,
                     selected: torch.Tensor | None = None,
                     num_selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest-style block selection; returns (selected [R, Hkv, S], num_selected [R, Hkv])."""
    num_req, hkv = block_table.shape[0], key_min.shape[1]
    if selected is None:
        max_ctx_blocks = block_table.shape[1]
        slots = max(1, min(max_ctx_blocks, top_k + num_sink + num_local))
        selected = torch.empty(num_req, hkv, slots, dtype=torch.int32, device=query_pooled.device)
    if num_selected is None:
        num_selected = torch.empty(num_req, hkv, dtype=torch.int32, device=query_pooled.device)
    _ops.select_kv_blocks(query_pooled, key_min, key_max, block_table, seq_lens, query_lens, block_size,
                          top_k, num_sink, num_local, selected, num_selected)
    return selected, num_selected


def block_sparse_tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                block_table: torch.Tensor, seq_lens: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float,
                                selected: torch.Tensor | None = None,
                                num_selected: torch.Tensor | None = None,
                                tree_mask: torch.Tensor | None = None,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over selected context blocks + the request's own (tree/causal-masked) query tokens."""
    if out is None:
        out = torch.empty_like(query)
    _ops.block_sparse_tree_attention(out, query, key_cache, value_cache, block_table, seq_lens,
                                     query_start_loc, selected, num_selected, tree_mask, scale)
    return out


def topk_swiglu_ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down_t: torch.Tensor,
                    group_start_loc: torch.Tensor, keep: int, out: torch.Tensor | None = None,
                    selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU MLP over one top-`keep` neuron set per group; returns (out [T, H], selected [G, keep])."""
    if out is None:
        out = torch.empty_like(x)
    if selected is None:
        selected = torch.empty(group_start_loc.numel() - 1, keep, dtype=torch.int32, device=x.device)
    _ops.topk_swiglu_ffn(out, x, w_gate_up, w_down_t, group_start_loc, keep, selected)
    return out, selected


def topk_swiglu_ffn_gated(x: torch.Tensor, gate: torch.Tensor, w_up: torch.Tensor, w_down_t: torch.Tensor,
                          group_start_loc: torch.Tensor, keep: int, out: torch.Tensor | None = None,
                          selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_swiglu_ffn with the gate projection given (gate [T, I] = x @ w_gate^T, e.g. from the
    target's packed dense GEMM; w_up [I, H]); returns (out [T, H], selected [G, keep])."""
    if out is None:
        out = torch.empty_like(x)
    if selected is None:
        selected = torch.empty(group_start_loc.numel() - 1, keep, dtype=torch.int32, device=x.device)
    _ops.topk_swiglu_ffn_gated(out, x, gate, w_up, w_down_t, group_start_loc, keep, selected)
    return out, selected


def input_sparse_gate(x: torch.Tensor, w_gate_t: torch.Tensor, group_start_loc: torch.Tensor, input_keep: int,
                      gate: torch.Tensor | None = None,
                      channels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An approximate gate projection from each group's top `input_keep` input channels by sum |x|
    (TEAL-style; w_gate_t [H, I] = gate_proj.weight.T); returns (gate [T, I] in x's dtype, channels
    [G, input_keep]). Feed the gate to topk_swiglu_ffn_gated."""
    if gate is None:
        gate = torch.empty(x.shape[0], w_gate_t.shape[1], dtype=x.dtype, device=x.device)
    if channels is None:
        channels = torch.empty(group_start_loc.numel() - 1, input_keep, dtype=torch.int32, device=x.device)
    _ops.input_sparse_gate(gate, x, w_gate_t, group_start_loc, input_keep, channels)
    return gate, channels


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) over plain weights (weight [N, K], or a transposed view of a
    [K, N] tensor); out [..., N] in x's dtype. On CPU: the weights streamed for few tokens, widened to
    fp32 panels for ATen's fp32 GEMM for more (faster than torch's 16-bit linear on CPUs without
    AVX-512); on CUDA: cuBLAS."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _ops.dense_linear(out, x2, weight, bias)
    return out.view(*lead, weight.shape[0])


def int8_weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """int8_linear's `weight_sum`: each int8 weight row's sum, int32 [N] (computed once, at load)."""
    return weight.sum(dim=1, dtype=torch.int32)


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A floating-point weight [N, K] as int8_linear takes it: (int8 rows [N, K], symmetric, one fp32
    scale per row [N], `int8_weight_sums`), with `weight ~= rows * scale` row by row."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    rows = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return rows, scale.contiguous(), int8_weight_sums(rows)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_sum: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A W8A8 linear: x [..., K] quantized per token to symmetric int8 at run time, times the int8
    weight [N, K] (contiguous rows) with one fp32 scale per row (+ bias); out [..., N] in x's dtype.
    weight_sum: `int8_weight_sums(weight)`. On CPU each weight row is read once per call for every
    token (VNNI dot products where the CPU has them): an int8 draft model's few-token passes."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _ops.int8_linear(out, x2, weight, weight_scale, weight_sum, bias)
    return out.view(*lead, weight.shape[0])


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """int4 weights [N, K] (integers in [-8, 7], K a multiple of 128) in int4_linear's layout: uint8
    [N, K / 2], each 128-channel block 64 bytes, byte j = (w[j] + 8) | (w[64 + j] + 8) << 4
    (reference.unpack_int4_rows inverts it)."""
    n, k = values.shape
    if k % 128:
        raise ValueError(f"pack_int4_rows: K must be a multiple of 128, got {k}")
    v = (values.to(torch.int16) + 8).reshape(n, k // 128, 2, 64)
    if bool(((v < 0) | (v > 15)).any()):
        raise ValueError("pack_int4_rows: values must be integers in [-8, 7]")
    return (v[:, :, 0] | (v[:, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2).contiguous()


def int4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A W4A8 linear: x [..., K] quantized per token to symmetric int8 at run time, times int4 weights
    (`pack_int4_rows` [N, K / 2]) with one fp32 scale per group of input channels [N, K / G] (+ bias);
    out [..., N] in x's dtype. On CPU each packed row is read once per call for every token (VNNI dot
    products where the CPU has them): an int4 draft model's few-token passes."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _ops.int4_linear(out, x2, weight, weight_scale, bias)
    return out.view(*lead, weight.shape[0])


def bf16_dot_available() -> bool:
    """Whether this build and CPU have AVX512-BF16 dot instructions (vdpbf16ps): topk_swiglu_ffn then
    streams bf16 weights with them (SPARSEVER_CPU_FFN_BF16_DOT=0 widens to fp32 instead), and
    block_sparse_tree_attention computes bf16 on vLLM's plain KV layout with them
    (SPARSEVER_CPU_ATTN_BF16_DOT=0 keeps fp32 FMAs)."""
    return bool(_ops.bf16_dot_available())


def int8_vnni_available() -> bool:
    """Whether int8_linear runs on AVX512-VNNI dot products in this build and CPU (else a portable
    loop, correct and far slower; SPARSEVER_CPU_INT8_VNNI=0 forces it, for tests)."""
    return bool(_ops.int8_vnni_available())


def amx_available() -> bool:
    """Whether this build and CPU run bf16 AMX tiles: dense_linear then runs bf16 weights at 3-16
    tokens on them (SPARSEVER_CPU_LINEAR_AMX=0 keeps vdpbf16ps rows)."""
    return bool(_ops.amx_available())


def amx_emulation_available() -> bool:
    """Whether SPARSEVER_CPU_AMX_EMULATE=1 runs the AMX paths here on a software model of the tiles (for
    tests, on CPUs without AMX): the AVX-512 build on a CPU with AVX512-BF16."""
    return bf16_dot_available()


def amx_emulated_products() -> int:
    """Tile products run on the emulated tiles in this process (tests: the AMX path ran)."""
    return int(_ops.amx_emulated_products())


def amx_emulated_prefetch_lines() -> tuple[int, int]:
    """(lines the AMX path prefetched on the emulated tiles in this process, of them those a tile load of
    the same thread read at least 16 tile loads later): tests of its prefetch schedule."""
    issued, loaded = _ops.amx_emulated_prefetch_lines()
    return int(issued), int(loaded)


def moe_route_and_prune(router_logits: torch.Tensor, top_k: int, prune_ratio: float = 0.0,
                        group_start_loc: torch.Tensor | None = None, expert_budget: int = 0,
                        renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing with ratio pruning and a per-group expert budget; (weights fp32, ids int32)."""
    num_tokens = router_logits.shape[0]
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    _ops.moe_route_and_prune(router_logits, top_k, prune_ratio, group_start_loc, expert_budget, renormalize,
                             topk_weights, topk_ids)
    return topk_weights, topk_ids


def moe_grouped_dispatch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One SwiGLU expert GEMM per kept expert; returns (out [T, H], num_experts_used [1] int32)."""
    if out is None:
        out = torch.empty_like(x)
    num_experts_used = torch.empty(1, dtype=torch.int32, device=x.device)
    _ops.moe_grouped_dispatch(out, x, topk_weights, topk_ids, w13, w2, num_experts_used)
    return out, num_experts_used
