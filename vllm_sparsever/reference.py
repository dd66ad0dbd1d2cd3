"""PyTorch references of every `sparsever` op: the definition of each op's semantics.

The CPU kernels (csrc/cpu) and CUDA kernels (csrc/kernels) must match these functions; tests compare
them on random shapes. The references favour clarity over speed (Python loops over requests/groups).

Conventions shared by all ops
-----------------------------
* All arithmetic is done in fp32; only the final outputs are rounded to the output dtype. Intermediate
  values (attention probabilities, SwiGLU activations, expert outputs) are NOT rounded to bf16/fp16.
  (Kernels may round bf16/fp16 intermediates where they hand compute-bound shapes to matrix engines,
  e.g. the CPU kernels' GEMM/SDPA paths for many tokens; tests compare with dtype tolerances.)
* Top-k tie-breaking: larger score first; among equal scores the LOWER index wins. Selected index sets
  are returned sorted ascending. Unused slots of fixed-size index outputs are -1.
* Paged KV cache: `key_cache` / `value_cache` are strided views with logical shape
  `[num_blocks, num_kv_heads, block_size, head_dim]` (any strides: vLLM-CPU stores K transposed, i.e.
  the view has stride 1 on the block_size axis; GPU layouts have stride 1 on head_dim).
  `block_table[r, b]` is the physical block holding the request's positions `[b*bs, (b+1)*bs)`.
* A request r has `seq_len = seq_lens[r]` positions in the cache, the last `q_len` of which are its
  query tokens (the last accepted token + its draft tokens; vLLM writes their KV before attention runs).
  Its context is positions `< ctx_len = seq_len - q_len`; context blocks are the logical blocks
  `0 .. ceil(ctx_len / bs) - 1` (the last one may be partial and may also hold query tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "update_block_key_summaries",
    "pool_queries",
    "quest_block_scores",
    "select_kv_blocks",
    "block_sparse_tree_attention",
    "logical_kv",
    "topk_swiglu_ffn",
    "topk_swiglu_ffn_gated",
    "input_sparse_gate",
    "dense_linear",
    "int8_linear",
    "int4_linear",
    "unpack_int4_rows",
    "moe_route_and_prune",
    "moe_grouped_dispatch",
    "topk_lower_index_wins",
    "num_context_blocks",
    "swiglu_ffn_on_neurons",
]


def topk_lower_index_wins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a 1-D tensor, ties broken by lower index, sorted ascending."""
    n = scores.numel()
    k = min(k, n)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    # Stable descending sort keeps equal scores in index order, so lower index wins.
    order = torch.sort(scores.float(), descending=True, stable=True).indices
    return torch.sort(order[:k]).values


# ---------------------------------------------------------------------------------------------------
# 1. KV block key summaries, selection and block-sparse tree attention
# ---------------------------------------------------------------------------------------------------


def update_block_key_summaries(
    key_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
) -> None:
    """Recompute the per-channel key min/max of every block touched by `slot_mapping` (in place).

    key_cache: [num_blocks, num_kv_heads, block_size, head_dim] strided view, fp32/bf16/fp16.
    slot_mapping: [N] int32/int64 physical slots just written (slot = block * block_size + offset);
        negative slots (vLLM's padding) are ignored.
    key_min, key_max: [num_blocks, num_kv_heads, head_dim] fp32.

    Choice (exact recompute, not a running fold): for each touched block b, with `last` the largest
    offset of b in slot_mapping, key_min[b] / key_max[b] become the min / max over offsets `0..last` of
    key_cache[b]. Tokens are written in position order, so `last` is the block's fill level; stale
    entries from rejected drafts beyond it are excluded, and a reused block is reset automatically.
    """
    slots = slot_mapping.to(torch.long)
    slots = slots[slots >= 0]
    if slots.numel() == 0:
        return
    blocks = slots // block_size
    offsets = slots % block_size
    for b in torch.unique(blocks).tolist():
        last = int(offsets[blocks == b].max())
        keys = key_cache[b, :, : last + 1, :].float()  # [Hkv, last+1, D]
        key_min[b] = keys.amin(dim=1)
        key_max[b] = keys.amax(dim=1)


def pool_queries(query: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Mean of each request's query tokens: [T, Hq, D] -> [R, Hq, D] fp32 (the selection's query)."""
    starts = query_start_loc.tolist()
    out = torch.zeros(len(starts) - 1, query.shape[1], query.shape[2], dtype=torch.float32)
    for r in range(len(starts) - 1):
        if starts[r + 1] > starts[r]:
            out[r] = query[starts[r] : starts[r + 1]].float().mean(dim=0)
    return out


def quest_block_scores(
    query_pooled: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, phys_blocks: torch.Tensor
) -> torch.Tensor:
    """Quest upper bound per KV head and block: [Hkv, nblk].

    score[h, b] = sum over the GQA group's query heads g of sum_d max(q[g,d]*min[b,h,d], q[g,d]*max[b,h,d]).
    query_pooled: [Hq, D]; query head g belongs to KV head g // (Hq // Hkv).
    """
    hq, d = query_pooled.shape
    hkv = key_min.shape[1]
    q = query_pooled.float().reshape(hkv, hq // hkv, 1, d)  # [Hkv, G, 1, D]
    kmin = key_min[phys_blocks].float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, nblk, D]
    kmax = key_max[phys_blocks].float().permute(1, 0, 2).unsqueeze(1)
    return torch.maximum(q * kmin, q * kmax).sum(dim=-1).sum(dim=1)  # [Hkv, nblk]


def num_context_blocks(seq_len: int, q_len: int, block_size: int) -> int:
    """Blocks holding context positions `< seq_len - q_len`."""
    ctx = max(seq_len - q_len, 0)
    return (ctx + block_size - 1) // block_size


def select_kv_blocks(
    query_pooled: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_size: int,
    top_k: int,
    num_sink: int,
    num_local: int,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
) -> None:
    """Choose, per request and KV head, the context blocks that attention reads (in place).

    query_pooled: [R, Hq, D] (any float dtype; e.g. pool_queries()). key_min/key_max: [nb, Hkv, D] fp32.
    block_table: [R, max_blocks] int32. seq_lens, query_lens: [R] int32.
    selected: [R, Hkv, S] int32 out: LOGICAL block indices (positions in the request's block table),
        ascending, -1 past num_selected. S must be >= every request's kept count, i.e.
        S >= min(max context blocks, top_k + num_sink + num_local) (ValueError otherwise).
    num_selected: [R, Hkv] int32 out.

    With n = num_context_blocks(seq_len, q_len, block_size):
      * n <= top_k + num_sink + num_local: keep all n blocks (below this context length, dense);
      * else keep blocks [0, num_sink) (attention sinks), [n - num_local, n) (local window, incl. the
        partial last context block), and the top_k blocks of [num_sink, n - num_local) by
        quest_block_scores of this request's pooled query (larger first, lower index wins ties).
    ctx_len == 0 gives num_selected = 0. top_k larger than the middle blocks present is the first case.
    """
    num_req, hkv, slots = selected.shape
    selected.fill_(-1)
    num_selected.zero_()
    budget = top_k + num_sink + num_local
    for r in range(num_req):
        n = num_context_blocks(int(seq_lens[r]), int(query_lens[r]), block_size)
        if n <= budget:
            keep = [torch.arange(n)] * hkv
        else:
            phys = block_table[r, :n].to(torch.long)
            scores = quest_block_scores(query_pooled[r], key_min, key_max, phys)  # [Hkv, n]
            keep = []
            for h in range(hkv):
                middle = topk_lower_index_wins(scores[h, num_sink : n - num_local], top_k) + num_sink
                keep.append(torch.cat([torch.arange(num_sink), middle, torch.arange(n - num_local, n)]))
        for h in range(hkv):
            if keep[h].numel() > slots:
                raise ValueError(f"selected has {slots} slots per head, request {r} needs {keep[h].numel()}")
            selected[r, h, : keep[h].numel()] = keep[h].to(selected.dtype)
            num_selected[r, h] = keep[h].numel()


def logical_kv(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, Hkv, bs, D] copies of caches in vLLM-CPU's AMX layout, given as the 6-D views that name it:
    K [nb, Hkv, bs/16, D/2, 16, 2] (element [g, j, t, e] = K[16g + t, 2j + e]) and
    V [nb, Hkv, D/16, bs/2, 16, 2] (element [i, s, c, o] = V[2s + o, 16i + c])."""
    nb, hkv, groups, pairs = key_cache.shape[:4]
    bs, d = groups * 16, pairs * 2
    key = key_cache.permute(0, 1, 2, 4, 3, 5).reshape(nb, hkv, bs, d)
    value = value_cache.permute(0, 1, 3, 5, 2, 4).reshape(nb, hkv, bs, d)
    return key, value


def block_sparse_tree_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    selected: torch.Tensor | None,
    num_selected: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    scale: float,
) -> None:
    """Attention of each request's query tokens over selected context blocks plus its own query tokens.

    out, query: [T, Hq, D] (fp32/bf16/fp16, same dtype as the caches). key_cache/value_cache: strided
    [nb, Hkv, bs, D], or vLLM-CPU's AMX layout as 6-D views (`logical_kv`). block_table [R, max_blocks] int32; seq_lens [R] int32; query_start_loc [R+1] int32.
    selected/num_selected: from select_kv_blocks ([R, Hkv, S] logical block ids, [R, Hkv]); None = all
        context blocks (dense). Only the first num_selected[r, h] entries are read.
    tree_mask: [T, max_q_len] bool/uint8 or None. Row t (global token index) of request r: column j
        (j < q_len_r) says whether token t may attend to r's j-th query token (position ctx_len + j).
        Columns >= q_len_r are ignored. None = causal chain (token i attends to query tokens j <= i).
        A tree mask should include the diagonal (a token attends to itself); nothing enforces it.

    Token i of request r (local index i) with query head g attends to KV head g // (Hq // Hkv) at:
      * context positions p < ctx_len inside the selected logical blocks, and
      * query positions ctx_len + j allowed by the mask row.
    softmax(scale * q.k) over those keys, times v. A row with no allowed key gets zeros.
    """
    num_tokens, hq, d = query.shape
    if key_cache.dim() == 6:
        key_cache, value_cache = logical_kv(key_cache, value_cache)
    hkv = key_cache.shape[1]
    bs = key_cache.shape[2]
    group = hq // hkv
    starts = query_start_loc.tolist()
    for r in range(len(starts) - 1):
        t0, t1 = starts[r], starts[r + 1]
        q_len = t1 - t0
        if q_len == 0:
            continue
        seq_len = int(seq_lens[r])
        ctx_len = seq_len - q_len
        n_blocks = (seq_len + bs - 1) // bs
        phys = block_table[r, :n_blocks].to(torch.long)
        # Logical positions 0..seq_len-1 of this request, gathered as [Hkv, seq_len, D].
        keys = key_cache[phys].permute(1, 0, 2, 3).reshape(hkv, n_blocks * bs, d)[:, :seq_len].float()
        vals = value_cache[phys].permute(1, 0, 2, 3).reshape(hkv, n_blocks * bs, d)[:, :seq_len].float()
        if tree_mask is not None:
            qmask = tree_mask[t0:t1, :q_len].bool()
        else:
            qmask = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        for h in range(hkv):
            ctx_mask = torch.zeros(ctx_len, dtype=torch.bool)
            if selected is None:
                ctx_mask[:] = True
            else:
                for b in selected[r, h, : int(num_selected[r, h])].tolist():
                    ctx_mask[b * bs : (b + 1) * bs] = True
            allowed = torch.cat([ctx_mask.expand(q_len, ctx_len), qmask], dim=1)  # [q_len, seq_len]
            q = query[t0:t1, h * group : (h + 1) * group].float()  # [q_len, G, D]
            logits = torch.einsum("igd,pd->gip", q, keys[h]) * scale  # [G, q_len, seq_len]
            logits = logits.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
            o = torch.einsum("gip,pd->igd", probs, vals[h])
            out[t0:t1, h * group : (h + 1) * group] = o.to(out.dtype)


# ---------------------------------------------------------------------------------------------------
# 2. Top-k SwiGLU FFN neuron gating
# ---------------------------------------------------------------------------------------------------


def topk_swiglu_ffn(
    out: torch.Tensor,
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down_t: torch.Tensor,
    group_start_loc: torch.Tensor,
    keep: int,
    selected: torch.Tensor,
) -> None:
    """SwiGLU MLP computed only for one top-`keep` neuron set per token group (CATS-style), in place.

    out, x: [T, H]. w_gate_up: [2I, H] (rows 0..I-1 gate_proj, I..2I-1 up_proj: vLLM's merged
    gate_up_proj layout). w_down_t: [I, H] = down_proj.weight.T made contiguous (row n = neuron n's
    output weights). group_start_loc: [G+1] int32 token offsets (e.g. query_start_loc: one group per
    request, or [0, T] for the whole step). 1 <= keep <= I. selected: [G, keep] int32 out.

    gate = x @ w_gate.T for all tokens; score[n] = sum over the group's tokens of |silu(gate[t, n])|;
    the group's neuron set = top-`keep` scores (lower index wins ties), stored ascending in selected[g];
    for its tokens out[t] = sum_{n in set} silu(gate[t, n]) * (x[t] . w_up[n]) * w_down_t[n].
    An empty group writes -1 to its selected row and no output. keep == I is the dense MLP.
    """
    inter = w_gate_up.shape[0] // 2
    gate = x.float() @ w_gate_up[:inter].float().t()  # [T, I]
    topk_swiglu_ffn_gated(out, x, gate, w_gate_up[inter:], w_down_t, group_start_loc, keep, selected)


def topk_swiglu_ffn_gated(
    out: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down_t: torch.Tensor,
    group_start_loc: torch.Tensor,
    keep: int,
    selected: torch.Tensor,
) -> None:
    """topk_swiglu_ffn with the gate projection given: gate [T, I] = x @ w_gate.T in any float dtype
    (e.g. the target's own dense GEMM, rounded to its dtype); w_up [I, H]. Scores and the SwiGLU
    product use silu(gate) as given."""
    act = F.silu(gate.float())  # [T, I]
    starts = group_start_loc.tolist()
    for g in range(len(starts) - 1):
        t0, t1 = starts[g], starts[g + 1]
        if t1 == t0:
            selected[g] = -1
            continue
        idx = topk_lower_index_wins(act[t0:t1].abs().sum(dim=0), keep).to(torch.long)
        selected[g] = idx.to(selected.dtype)
        up = x[t0:t1].float() @ w_up[idx].float().t()
        out[t0:t1] = ((act[t0:t1, idx] * up) @ w_down_t[idx].float()).to(out.dtype)


def dense_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A plain dense linear, in place: out [T, N] = x [T, K] @ weight^T + bias, in fp32, rounded to
    out's dtype. weight: [N, K] (row-major, or a transposed view of a [K, N] tensor); bias: [N] or None.
    (The CPU kernel streams the weights for few tokens and widens them to fp32 panels for an fp32 GEMM
    for more; there is no sparsity in it: it serves dense steps over plain weights.)"""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    out.copy_(y.to(out.dtype))


def _tokens_to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] quantized per token, symmetric: (q [T, K] fp32 integers in [-127, 127], scale [T] fp32),
    q = round_half_even(x * (127 / amax_t)) (0 where amax_t = 0), scale = amax_t / 127."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # fp32 quotients correctly rounded (via fp64), as a kernel's one fp32 division gives them (torch's
    # `127.0 / t` is a reciprocal and a product: two roundings)
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    scale = (amax.double() / 127.0).float()
    return torch.round(xf * inv[:, None]).clamp(-127, 127), scale


def int8_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                weight_sum: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A W8A8 linear (vLLM's int8 scheme with dynamic per-token symmetric activations), in place.

    x: [T, K] float. weight: [N, K] int8. weight_scale: [N] fp32, one per row. weight_sum: [N] int32,
    weight.sum(1) (kernels need it to take back the offset of unsigned activations; it must be exact).
    bias: [N] or None. Each token t is quantized as q = round_half_even(x * (127 / amax_t)) (0 where
    amax_t = 0) with scale amax_t / 127; out[t, n] = (q_t . w_n, exact in integers) * (scale_t *
    weight_scale[n]) + bias[n], in fp32, rounded to out's dtype."""
    if not torch.equal(weight_sum.to(torch.int64), weight.to(torch.int64).sum(dim=1)):
        raise ValueError("int8_linear: weight_sum must be weight.sum(1)")
    q, scale = _tokens_to_int8(x)
    acc = (q.double() @ weight.double().t()).float()  # exact integers, rounded to fp32 as int32 sums are
    y = acc * (scale[:, None] * weight_scale.float()[None, :])
    if bias is not None:
        y = y + bias.float()
    out.copy_(y.to(out.dtype))


INT4_BLOCK = 128  # input channels per 64 packed bytes


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int4_linear's weight layout back to values: packed uint8 [N, K / 2] -> int8 [N, K] in [-8, 7].
    Each row's block of 128 input channels is 64 bytes; byte j holds channel j in its low nibble and
    channel 64 + j in its high one, each stored as w + 8."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // (INT4_BLOCK // 2), INT4_BLOCK // 2).to(torch.int16)
    values = torch.cat([blocks & 0x0F, blocks >> 4], dim=2) - 8  # [N, blocks, 128]
    return values.reshape(n, half * 2).to(torch.int8)


def int4_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> None:
    """A W4A8 linear (an int4 draft's linear: symmetric int4 weights with one scale per group of input
    channels, activations quantized per token to int8 at run time), in place.

    x: [T, K] float, K a multiple of 128. weight: uint8 [N, K / 2] (`unpack_int4_rows`'s layout; packed
    by `_custom_ops.pack_int4_rows`). weight_scale: fp32 [N, K / G], G a multiple of 128. bias: [N] or
    None. Each token is quantized as in `int8_linear` (q, scale_t); out[t, n] = scale_t * sum over
    groups g of weight_scale[n, g] * (q_t . w_n over g, exact in integers) + bias[n], in fp32 (kernels
    sum the groups in another order: equal to fp32 rounding), rounded to out's dtype."""
    k = x.shape[1]
    if k % INT4_BLOCK or weight.shape[1] * 2 != k or weight.dtype != torch.uint8:
        raise ValueError("int4_linear: x [T, K] with K a multiple of 128 and weight uint8 [N, K / 2]")
    groups = weight_scale.shape[1]
    if k % groups or (k // groups) % INT4_BLOCK:
        raise ValueError("int4_linear: weight_scale [N, K / G] with G a multiple of 128")
    w = unpack_int4_rows(weight).double()  # [N, K]
    q, scale = _tokens_to_int8(x)
    q = q.double()
    g = k // groups
    per_group = torch.einsum("tgc,ngc->tng", q.view(-1, groups, g), w.view(-1, groups, g))  # exact integers
    y = (per_group * weight_scale.double()[None]).sum(dim=2) * scale.double()[:, None]
    if bias is not None:
        y = y + bias.double()
    out.copy_(y.float().to(out.dtype))


def input_sparse_gate(
    gate: torch.Tensor,
    x: torch.Tensor,
    w_gate_t: torch.Tensor,
    group_start_loc: torch.Tensor,
    input_keep: int,
    channels: torch.Tensor,
) -> None:
    """An approximate gate projection from the largest input channels only (TEAL-style), in place.

    x: [T, H]. w_gate_t: [H, I] = gate_proj.weight.T made contiguous (row c = channel c's gate weights).
    group_start_loc: [G+1] int32 token offsets. 1 <= input_keep <= H. gate: [T, I] out (x's dtype).
    channels: [G, input_keep] int32 out.

    score[c] = sum over the group's tokens of |x[t, c]|; the group's channel set = top-`input_keep`
    scores (lower index wins ties), stored ascending in channels[g]; for its tokens
    gate[t] = sum_{c in set} x[t, c] * w_gate_t[c]. An empty group writes -1 to its channels row and
    no gate rows. input_keep == H is the exact gate x @ w_gate.T. Reads input_keep / H of the gate's
    bytes; feed the result to topk_swiglu_ffn_gated.
    """
    starts = group_start_loc.tolist()
    for g in range(len(starts) - 1):
        t0, t1 = starts[g], starts[g + 1]
        if t1 == t0:
            channels[g] = -1
            continue
        xs = x[t0:t1].float()
        idx = topk_lower_index_wins(xs.abs().sum(dim=0), input_keep).to(torch.long)
        channels[g] = idx.to(channels.dtype)
        gate[t0:t1] = (xs[:, idx] @ w_gate_t[idx].float()).to(gate.dtype)


def swiglu_ffn_on_neurons(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down_t: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """fp32 SwiGLU MLP restricted to neurons `idx`: sum_n silu(x.w_gate[n]) * (x.w_up[n]) * w_down_t[n]."""
    inter = w_gate_up.shape[0] // 2
    idx = idx.to(torch.long)
    xf = x.float()
    h = F.silu(xf @ w_gate_up[idx].float().t()) * (xf @ w_gate_up[inter + idx].float().t())
    return h @ w_down_t[idx].float()


# ---------------------------------------------------------------------------------------------------
# 3. MoE routing with pruning and grouped dispatch over the union of kept experts
# ---------------------------------------------------------------------------------------------------


def moe_route_and_prune(
    router_logits: torch.Tensor,
    top_k: int,
    prune_ratio: float,
    group_start_loc: torch.Tensor | None,
    expert_budget: int,
    renormalize: bool,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Top-k softmax routing, then pruning of low-weight experts and an optional per-group budget (in place).

    router_logits: [T, E] (any float dtype). topk_weights: [T, top_k] fp32 out. topk_ids: [T, top_k]
    int32 out; pruned slots have id -1 and weight 0. Slot order: descending routing weight
    (lower expert id wins ties), pruned slots keep their position.

    1. p = softmax(logits) in fp32; the token's top_k experts (larger p first, lower id wins ties).
    2. Ratio pruning: drop slot j if p_j < prune_ratio * p_top1 (slot 0 is always kept; 0 disables).
    3. Budget (expert_budget > 0 and group_start_loc [G+1] given): per group, if more than
       expert_budget distinct experts are kept, keep the expert_budget experts with the largest sum over
       the group's tokens of p (full softmax probability; lower id wins ties) and drop slots routed to
       other experts. A token left with no slot is routed (slot 0) to the budgeted expert it gives the
       highest p (lower id wins ties), so every token keeps at least one expert.
    4. renormalize: kept weights are divided by their sum; otherwise kept weights stay p.
    """
    num_tokens, num_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float32)
    ids = torch.full((num_tokens, top_k), -1, dtype=torch.long)
    for t in range(num_tokens):
        order = torch.sort(probs[t], descending=True, stable=True).indices[:top_k]
        weights[t] = probs[t, order]
        ids[t] = order
        drop = weights[t] < prune_ratio * weights[t, 0]
        drop[0] = False
        ids[t, drop] = -1
        weights[t, drop] = 0.0
    if expert_budget > 0 and group_start_loc is not None:
        starts = group_start_loc.tolist()
        for g in range(len(starts) - 1):
            t0, t1 = starts[g], starts[g + 1]
            kept = sorted(set(ids[t0:t1][ids[t0:t1] >= 0].tolist()))
            if len(kept) <= expert_budget:
                continue
            mass = probs[t0:t1].sum(dim=0)
            kept_t = torch.tensor(kept)
            budget_ids = set(kept_t[topk_lower_index_wins(mass[kept_t], expert_budget)].tolist())
            for t in range(t0, t1):
                for j in range(top_k):
                    if int(ids[t, j]) >= 0 and int(ids[t, j]) not in budget_ids:
                        ids[t, j] = -1
                        weights[t, j] = 0.0
                if bool((ids[t] < 0).all()):
                    allowed = torch.tensor(sorted(budget_ids))
                    best = int(allowed[topk_lower_index_wins(probs[t, allowed], 1)[0]])
                    ids[t, 0] = best
                    weights[t, 0] = probs[t, best]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids.to(topk_ids.dtype))


def moe_grouped_dispatch(
    out: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_experts_used: torch.Tensor,
) -> None:
    """SwiGLU experts run once per kept expert over the tokens routed to it, combined by weight (in place).

    out, x: [T, H]. topk_weights: [T, K] fp32; topk_ids: [T, K] int32/int64, -1 = pruned slot.
    w13: [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up: vLLM's w13 layout); w2: [E, H, I].
    num_experts_used: [1] int32 out = number of distinct experts with at least one routed token
    (a tensor, not a returned int, so the op stays capturable by torch.compile).

    out[t] = sum over slots s with id e >= 0 of topk_weights[t, s] * w2[e] @ (silu(g) * u),
    g = w13[e, :I] @ x[t], u = w13[e, I:] @ x[t]. Tokens with no kept slot get zeros.
    """
    inter = w13.shape[1] // 2
    xf = x.float()
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    experts = sorted(set(topk_ids[topk_ids >= 0].tolist()))
    for e in experts:
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gu = xf[tok] @ w13[e].float().t()
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ w2[e].float().t()
        acc.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    out.copy_(acc.to(out.dtype))
    num_experts_used.fill_(len(experts))
