"""One HF-transformers forward pass over the calibration text, reduced to per-layer statistics.

Nothing is kept at full size across layers: each layer's hook turns its activations into the few
numbers calibration needs while the forward pass runs, then drops them:

* attention (a custom attention function registered with transformers' `AttentionInterface`, which
  records the post-RoPE queries/keys and then delegates to sdpa): the KV blocks the runtime would
  select on each verify window (`select_window_blocks`, `reference.select_kv_blocks` semantics);
* dense SwiGLU MLP (forward hook on `mlp.gate_proj`): per token group, the share of neurons that
  covers `ffn_mass` of the group's summed |silu(gate)| (`ffn_group_keep_shares`);
* MoE (forward hook on the router, Mixtral's `mlp.gate` / `block_sparse_moe.gate`): per token, the
  ratios p_j / p_top1 of its top-k softmax probabilities, j >= 1 (`moe_slot_ratios`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vllm_sparsever import reference
from vllm_sparsever.offline.calibration.options import CalibrationError

ATTN_IMPLEMENTATION = "sparsever_calibrate"


# ---------------------------------------------------------------------------------------------
# Verify windows
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowPlan:
    """Where the simulated verify steps sit in the text and the selection knobs in force."""

    ctx_lens: tuple[int, ...]  # context length of each window; its query tokens follow it
    window: int  # query tokens per verify step: last accepted token + k draft tokens
    block_size: int
    top_k: int  # top-k blocks actually used (may be scaled down from the requested one)
    top_k_requested: int
    num_sink: int
    num_local: int
    min_context_len_applied: bool  # False when the text is too short to honour it

    @property
    def top_k_scaled(self) -> bool:
        return self.top_k != self.top_k_requested

    @property
    def num_slots(self) -> int:
        return self.top_k + self.num_sink + self.num_local


def plan_windows(
    num_tokens: int,
    *,
    num_draft_tokens: int,
    block_size: int,
    top_k: int,
    num_sink: int,
    num_local: int,
    num_windows: int,
    min_context_len: int,
) -> WindowPlan:
    """Verify windows spread evenly over the contexts where the selection has a choice to make.

    A window of context length c has n = ceil(c / block_size) context blocks; the runtime chooses
    only when n > top_k + sink + local. If even the longest context the text allows has too few
    middle blocks (n - sink - local <= top_k), top_k is scaled down to half of them, so that the
    selection still chooses something (recorded in the profile's details).
    """
    window = num_draft_tokens + 1
    ctx_hi = num_tokens - window
    middle_hi = math.ceil(max(ctx_hi, 0) / block_size) - num_sink - num_local
    if middle_hi < 2:
        need = (num_sink + num_local + 1) * block_size + 1 + window
        raise CalibrationError(
            f"calibration text has {num_tokens} tokens; attention calibration with block size "
            f"{block_size}, {num_sink} sink and {num_local} local block(s) needs at least {need} "
            f"(use longer text, a larger --max-tokens or a smaller --block-size)"
        )
    top_k_used = top_k if top_k < middle_hi else max(1, middle_hi // 2)
    # Smallest context with a choice: n >= top_k + sink + local + 1 blocks.
    choice_lo = (top_k_used + num_sink + num_local) * block_size + 1
    lo = max(choice_lo, min_context_len)
    min_ctx_applied = lo <= ctx_hi
    if not min_ctx_applied:
        lo = choice_lo
    count = max(1, min(num_windows, ctx_hi - lo + 1))
    if count == 1:
        ctx_lens = (ctx_hi,)
    else:
        ctx_lens = tuple(sorted({round(lo + i * (ctx_hi - lo) / (count - 1)) for i in range(count)}))
    return WindowPlan(
        ctx_lens=ctx_lens,
        window=window,
        block_size=block_size,
        top_k=top_k_used,
        top_k_requested=top_k,
        num_sink=num_sink,
        num_local=num_local,
        min_context_len_applied=min_ctx_applied,
    )


# ---------------------------------------------------------------------------------------------
# Per-layer reductions (pure functions; the tests check them against independent computations)
# ---------------------------------------------------------------------------------------------


def select_window_blocks(
    query: torch.Tensor, key: torch.Tensor, plan: WindowPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's selection on every verify window of one layer.

    query: [Hq, T, D] post-RoPE queries; key: [Hkv, T, D] post-RoPE keys (one sequence).
    Returns (selected [W, Hkv, S] int32 logical block ids, -1 padded; num_selected [W, Hkv] int32)
    exactly as `reference.select_kv_blocks` makes them for a request whose cache holds positions
    < ctx + window (the window's query tokens are written before attention, as in vLLM): block key
    summaries are min/max over each block's written positions, the query is the mean of the window's.
    """
    hkv, num_tokens, d = key.shape
    bs = plan.block_size
    key = key.float()
    nb_full = num_tokens // bs
    full = key[:, : nb_full * bs].reshape(hkv, nb_full, bs, d)
    key_min = [full.amin(dim=2).permute(1, 0, 2)]  # [nb_full, Hkv, D]
    key_max = [full.amax(dim=2).permute(1, 0, 2)]
    num_w = len(plan.ctx_lens)
    max_blocks = math.ceil((max(plan.ctx_lens) + plan.window) / bs)
    block_table = torch.zeros(num_w, max_blocks, dtype=torch.int32)
    seq_lens = torch.zeros(num_w, dtype=torch.int32)
    pooled = torch.zeros(num_w, query.shape[0], d, dtype=torch.float32)
    extra = nb_full
    for r, ctx in enumerate(plan.ctx_lens):
        seq_len = ctx + plan.window
        seq_lens[r] = seq_len
        pooled[r] = query[:, ctx:seq_len].float().mean(dim=1)
        n_seq_blocks = math.ceil(seq_len / bs)
        block_table[r, :n_seq_blocks] = torch.arange(n_seq_blocks, dtype=torch.int32)
        if seq_len % bs:  # last block partly written: its own summary (a physical block per window)
            last = n_seq_blocks - 1
            part = key[:, last * bs : seq_len]  # [Hkv, fill, D]
            key_min.append(part.amin(dim=1).unsqueeze(0))
            key_max.append(part.amax(dim=1).unsqueeze(0))
            block_table[r, last] = extra
            extra += 1
    key_min_t = torch.cat(key_min)
    key_max_t = torch.cat(key_max)
    selected = torch.empty(num_w, hkv, plan.num_slots, dtype=torch.int32)
    num_selected = torch.empty(num_w, hkv, dtype=torch.int32)
    reference.select_kv_blocks(
        pooled, key_min_t, key_max_t, block_table, seq_lens,
        torch.full((num_w,), plan.window, dtype=torch.int32), bs, plan.top_k, plan.num_sink,
        plan.num_local, selected, num_selected,
    )  # fmt: skip
    return selected, num_selected


def chosen_block_masks(selected: torch.Tensor, num_selected: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """[W, Hkv, max_blocks] bool: the blocks picked by score, i.e. the selection minus the sink and
    local blocks every layer keeps anyway (they would only inflate the similarity between layers)."""
    num_w, hkv, _ = selected.shape
    max_blocks = math.ceil(max(plan.ctx_lens) / plan.block_size)
    mask = torch.zeros(num_w, hkv, max_blocks, dtype=torch.bool)
    for r, ctx in enumerate(plan.ctx_lens):
        n = math.ceil(ctx / plan.block_size)
        for h in range(hkv):
            ids = selected[r, h, : int(num_selected[r, h])].to(torch.long)
            mask[r, h, ids] = True
        mask[r, :, : plan.num_sink] = False
        mask[r, :, max(n - plan.num_local, 0) : n] = False
    return mask


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over windows and heads of |A & B| / |A | B| for [W, Hkv, nblk] bool masks (empty: 1)."""
    inter = (a & b).sum(dim=-1).float()
    union = (a | b).sum(dim=-1).float()
    score = torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))
    return float(score.mean())


def chance_jaccard(plan: WindowPlan) -> float:
    """Expected Jaccard of two independent uniformly random top-k choices, mean over the windows:
    the similarity two unrelated layers would show (a floor to read min_jaccard against)."""
    values = []
    for ctx in plan.ctx_lens:
        m = math.ceil(ctx / plan.block_size) - plan.num_sink - plan.num_local
        k = min(plan.top_k, m)
        if k <= 0:
            values.append(1.0)
            continue
        total = math.comb(m, k)
        values.append(sum(math.comb(k, i) * math.comb(m - k, k - i) / total * i / (2 * k - i)
                          for i in range(max(0, 2 * k - m), k + 1)))
    return sum(values) / len(values)


def greedy_anchors(jaccard_matrix: list[list[float]], min_jaccard: float) -> tuple[list[int], list[float | None]]:
    """Layer 0 anchors; layer l reuses the current anchor a while J[a][l] >= min_jaccard, else it
    becomes the anchor. Returns the anchors and, per layer, the J[a][l] that decided (None at 0)."""
    num_layers = len(jaccard_matrix)
    anchors = [0]
    decided: list[float | None] = [None]
    for layer in range(1, num_layers):
        sim = jaccard_matrix[anchors[-1]][layer]
        decided.append(sim)
        if sim < min_jaccard:
            anchors.append(layer)
    return anchors, decided


def ffn_group_keep_shares(gate: torch.Tensor, group_size: int, mass: float) -> torch.Tensor:
    """Per group of `group_size` consecutive tokens: the smallest share of neurons whose summed
    score covers `mass` of the group's total, with score[n] = sum over the group's tokens of
    |silu(gate[t, n])| (the `topk_swiglu_ffn` score). gate: [T, I] pre-activation. Returns [G]."""
    inter = gate.shape[-1]
    num_groups = gate.shape[0] // group_size
    if num_groups == 0:
        return torch.empty(0)
    act = F.silu(gate[: num_groups * group_size].float()).abs()
    scores = act.reshape(num_groups, group_size, inter).sum(dim=1)  # [G, I]
    ordered = torch.sort(scores, dim=-1, descending=True).values.double()
    cum = ordered.cumsum(dim=-1)
    target = mass * cum[:, -1:]
    # Neurons needed = 1 + number of prefixes still short of the target (at least 1, at most I).
    needed = ((cum < target).sum(dim=-1) + 1).clamp(max=inter)
    return needed.float() / inter


def moe_slot_ratios(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """p_j / p_top1 for slots j = 1..top_k-1 of every token's top-k softmax probabilities (flat)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top = torch.topk(probs, top_k, dim=-1).values  # descending
    if top_k < 2:
        return torch.empty(0)
    return (top[:, 1:] / top[:, :1]).flatten()


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerStats:
    """What one decoder layer leaves behind after the forward pass."""

    chosen: torch.Tensor | None = None  # [W, Hkv, nblk] bool, blocks picked by score
    selected: torch.Tensor | None = None  # [W, Hkv, S] int32 (the full runtime selection)
    num_selected: torch.Tensor | None = None
    ffn_shares: torch.Tensor | None = None  # [G] per token group, None = no dense SwiGLU MLP
    moe_ratios: torch.Tensor | None = None  # [T * (top_k - 1)], None = no MoE block
    qk: tuple[torch.Tensor, torch.Tensor] | None = None  # kept only for layers asked for (tests)


@dataclass
class CaptureResult:
    num_tokens: int
    plan: WindowPlan
    layers: list[LayerStats]
    moe_top_k: int | None = None
    num_experts: int | None = None
    mlp_kinds: list[str] = field(default_factory=list)  # "swiglu" / "moe" / "other" per layer


_active: _Capture | None = None


class _Capture:
    def __init__(self, plan: WindowPlan, num_layers: int, ffn_mass: float, keep_qk_layers, progress):
        self.plan = plan
        self.layers = [LayerStats() for _ in range(num_layers)]
        self.ffn_mass = ffn_mass
        self.keep_qk_layers = set(keep_qk_layers)
        self.progress = progress

    def on_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        # query [B=1, Hq, T, D], key [B=1, Hkv, T, D], both post-RoPE (before GQA repeat).
        q, k = query[0].detach(), key[0].detach()
        selected, num_selected = select_window_blocks(q, k, self.plan)
        stats = self.layers[layer]
        stats.selected, stats.num_selected = selected, num_selected
        stats.chosen = chosen_block_masks(selected, num_selected, self.plan)
        if layer in self.keep_qk_layers:
            stats.qk = (q.float().clone(), k.float().clone())
        if self.progress is not None:
            self.progress.update(1)


def _calibration_attention(module, query, key, value, attention_mask, **kwargs):
    """Registered as AttentionInterface 'sparsever_calibrate': record, then run sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _active is not None:
        _active.on_attention(module.layer_idx, query, key)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> str:
    """Register the recording attention function (and sdpa's mask for it) with transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _calibration_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    except ImportError:  # older transformers: the model falls back to its own causal mask
        pass
    return ATTN_IMPLEMENTATION


def decoder_layers(model) -> Any:
    base = getattr(model, "model", None)
    if base is None:
        base = model.base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise CalibrationError(f"{type(model).__name__}: no decoder layers at model.model.layers")
    return base, layers


def _moe_router(layer) -> tuple[Any, Any] | None:
    """(moe block, router module) of a Mixtral-style layer, None for other layers."""
    for name in ("block_sparse_moe", "mlp"):
        block = getattr(layer, name, None)
        if block is not None and hasattr(block, "experts") and hasattr(block, "gate"):
            return block, block.gate
    return None


def _dense_swiglu(layer, config) -> Any | None:
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return None  # the op's score is |silu(gate)|; another activation would need its own op
    return mlp


@torch.no_grad()
def capture(
    model,
    input_ids: torch.Tensor,
    plan: WindowPlan,
    *,
    ffn_mass: float,
    keep_qk_layers=(),
    show_progress: bool = True,
) -> CaptureResult:
    """Run `model` (loaded with attn_implementation=ATTN_IMPLEMENTATION) once over input_ids [1, T]."""
    global _active
    from tqdm.auto import tqdm

    config = model.config
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        raise CalibrationError(
            f"model attention is {config._attn_implementation!r}; load it with "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} (see calibrate.load_model)"
        )
    base, layers = decoder_layers(model)
    num_layers = len(layers)
    group = plan.window
    kinds: list[str] = []
    moe_top_k = num_experts = None
    progress = tqdm(total=num_layers, desc="calibrate: layers", unit="layer", disable=not show_progress)
    cap = _Capture(plan, num_layers, ffn_mass, keep_qk_layers, progress)
    handles = []

    def ffn_hook(layer_idx):
        def hook(_module, _inputs, output):
            gate = output.reshape(-1, output.shape[-1])
            cap.layers[layer_idx].ffn_shares = ffn_group_keep_shares(gate, group, ffn_mass)

        return hook

    def moe_hook(layer_idx, top_k):
        def hook(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            logits = logits.reshape(-1, logits.shape[-1])
            cap.layers[layer_idx].moe_ratios = moe_slot_ratios(logits, top_k)

        return hook

    for i, layer in enumerate(layers):
        moe = _moe_router(layer)
        mlp = _dense_swiglu(layer, config)
        if moe is not None:
            block, router = moe
            top_k = int(getattr(config, "num_experts_per_tok", None) or block.top_k)
            moe_top_k = top_k
            num_experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)) or None
            handles.append(router.register_forward_hook(moe_hook(i, top_k)))
            kinds.append("moe")
        elif mlp is not None:
            handles.append(mlp.gate_proj.register_forward_hook(ffn_hook(i)))
            kinds.append("swiglu")
        else:
            kinds.append("other")
    _active = cap
    try:
        base(input_ids=input_ids, use_cache=False)  # no LM head: [T, vocab] logits are not needed
    finally:
        _active = None
        for h in handles:
            h.remove()
        progress.close()
    missing = [i for i, s in enumerate(cap.layers) if s.chosen is None]
    if missing:
        raise CalibrationError(f"attention of layers {missing} was not captured")
    return CaptureResult(
        num_tokens=int(input_ids.shape[1]),
        plan=plan,
        layers=cap.layers,
        moe_top_k=moe_top_k,
        num_experts=num_experts,
        mlp_kinds=kinds,
    )
