"""Block-sparse attention on verify steps: vLLM's CPU attention backend with Quest-style KV selection.

Registered over `CPU_ATTN` (vLLM picks it for every attention layer of the worker) only when
attention sparsity is enabled at start. What it changes:
- after every KV write of a target layer, the per-block key min/max of the touched blocks are
  recomputed (`update_block_key_summaries`), so selection never reads the blocks it skips;
- on verify steps, per request and KV head, an *anchor* layer scores context blocks against the
  mean of the request's query tokens (one selection shared by all its draft tokens) and keeps the
  top-k plus the sink and local blocks; the layers after it reuse that selection (logical block
  ids, valid for every layer of the KV cache group); `block_sparse_tree_attention` then reads only
  the kept blocks;
- requests below `min_context_len` and plain decode rows of the same step stay dense (all their
  blocks selected); a step with a prefill chunk, and anything unexpected, runs the stock kernel.

Two kernels attend over the kept blocks (`attention.kernel`, fixed at start):
- "sparsever": `block_sparse_tree_attention`, a selection per request and KV head. It reads the `vec`
  ISA's layout (K transposed per block, V row-major), so the builder keeps every layer on that ISA
  rather than AMX's packed tiles; summaries are recomputed from the cache after each write (exact).
- "vllm": vLLM's own `cpu_attention_with_kv_cache` over a *compacted* block table (kept blocks, in
  order, then the query's own blocks) with shortened sequence lengths: exact attention over the kept
  blocks in whatever layout vLLM chose (AMX included), so dense steps keep the stock ISA. One
  selection per request, shared by its KV heads (the block table has no head axis); summaries are
  folded from the keys being written (layout-free; a conservative bound that may include keys of
  rejected drafts until the block is rewritten from its first slot).
"""

from __future__ import annotations

import torch

# Used by SparseverCPUAttentionImpl below; its rewrite switches them to the compat wrappers
# (`vllm_attn.attention_over_block_table`, `scheduler_metadata`, `impl_supports_sparse`).
from vllm import _custom_ops as vllm_ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.integration.compat import cpu_attention as vllm_attn
from vllm_sparsever.integration.compat.cpu_attention import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm_sparsever.plan import current_plan
from vllm_sparsever.verification.runtime import get_runtime, layer_index_of

# ISAs whose KV cache layout is K [D, block_size] + V [block_size, D] per block and head.
_PLAIN_LAYOUT_ISAS = vllm_attn.PLAIN_LAYOUT_ISAS


def paged_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical [num_blocks, num_kv_heads, block_size, head_dim] views of a CPU_ATTN KV tensor.

    vLLM-CPU allocates `[nb, Hkv, bs, 2*D]` and stores, per block and head, K transposed
    (`[D, bs]`) followed by V row-major (`[bs, D]`). The ops take strides, so no copy is made.
    """
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.view(nb, hkv, 2 * bs * d)
    key = flat[:, :, : bs * d].unflatten(-1, (d, bs)).transpose(2, 3)
    value = flat[:, :, bs * d :].unflatten(-1, (bs, d))
    return key, value


def resolve_attention_kernel(choice: str, stock_isa: str) -> str:
    """`attention.kernel` in force for layers whose stock ISA is `stock_isa`."""
    if choice == "auto":
        return "sparsever" if stock_isa in _PLAIN_LAYOUT_ISAS else "vllm"
    return choice


def fold_block_key_summaries(
    key: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, key_min: torch.Tensor, key_max: torch.Tensor
) -> None:
    """Fold the keys being written ([T, Hkv, D], slots [T]) into per-block min/max ([nb, Hkv, D]).

    A write to a block's first slot starts the block afresh (a new fill: tokens are written in
    position order), so summaries of reused blocks never carry an earlier owner's keys. Keys of
    rejected drafts stay in the bound until then: it is a superset bound, still a valid Quest bound.
    """
    slots = slot_mapping[: key.shape[0]].to(torch.long)
    valid = slots >= 0  # padded rows carry slot -1
    if not bool(valid.all()):
        key, slots = key[valid], slots[valid]
    blocks = slots.div(block_size, rounding_mode="floor")
    fresh = blocks[slots.remainder(block_size) == 0]
    key_min[fresh] = float("inf")
    key_max[fresh] = float("-inf")
    keys = key.float().flatten(1)
    index = blocks.view(-1, 1).expand_as(keys)
    key_min.view(key_min.shape[0], -1).scatter_reduce_(0, index, keys, "amin", include_self=True)
    key_max.view(key_max.shape[0], -1).scatter_reduce_(0, index, keys, "amax", include_self=True)


def heads_as_one(
    query_pooled: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`select_kv_blocks` inputs for one selection shared by all KV heads: a single "head" whose
    channels are every KV head's, so its Quest bound is the sum over all query heads, each against
    its own KV head's summaries. [R, Hq, D], [nb, Hkv, D] -> [R, G, Hkv*D], [nb, 1, Hkv*D]."""
    num_reqs, hq, d = query_pooled.shape
    nb, hkv = key_min.shape[:2]
    group = hq // hkv
    pooled = query_pooled.view(num_reqs, hkv, group, d).transpose(1, 2).reshape(num_reqs, group, hkv * d)
    return pooled, key_min.view(nb, 1, hkv * d), key_max.view(nb, 1, hkv * d)


def compact_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor,
    selected: torch.Tensor, num_selected: torch.Tensor, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table and sequence lengths that make a dense kernel attend over the kept blocks only.

    Row r lists its selected context blocks (`selected[r, 0]`, logical ids, ascending, the last
    context block among them) followed by the blocks that hold only query tokens; every kept block
    but the last is full, so positions shift uniformly and the causal mask of the query tokens is
    unchanged. Rows that kept every context block come out as they were.
    """
    table = block_table.clone()
    seq_c = seq_lens.clone()
    for r, (seq_len, q_len, ns) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), num_selected[:, 0].tolist())):
        n_ctx = (max(seq_len - q_len, 0) + block_size - 1) // block_size
        n_all = (seq_len + block_size - 1) // block_size
        if ns == n_ctx:
            continue
        logical = torch.cat([selected[r, 0, :ns].to(torch.long), torch.arange(n_ctx, n_all)])
        table[r, : logical.numel()] = block_table[r, logical]
        seq_c[r] = seq_len - (n_ctx - ns) * block_size
    return table, seq_c


class SparseverCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        rt = get_runtime()
        isa = vllm_attn.builder_isa(self)
        self.sparse_kernel = resolve_attention_kernel(rt.attention.kernel if rt else "vllm", isa)
        if self.sparse_kernel == "sparsever" and isa not in _PLAIN_LAYOUT_ISAS:
            # AMX packs K/V into tiles sparsever's kernels cannot read; the vec kernels handle
            # the same shapes (verification at small batch is memory-bound either way).
            vllm_attn.set_builder_isa(self, "vec" if self.block_size % 32 == 0 else "vec16")
        self._set_isa_to_layers(layer_names)

    def _set_isa_to_layers(self, layer_names: list[str]) -> None:
        super()._set_isa_to_layers(layer_names)
        for layer in vllm_attn.attention_layers(self.vllm_config, layer_names).values():
            layer.sparsever_attention_kernel = getattr(self, "sparse_kernel", None)


class SparseverCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU attention that keeps key summaries and attends sparsely on verify steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._key_min: torch.Tensor | None = None
        self._key_max: torch.Tensor | None = None
        self._supported = (
            self.attn_type == AttentionType.DECODER
            and self.sliding_window == -1
            and self.alibi_slopes is None
            and not self.logits_soft_cap
            and self.sinks is None
            and not self.is_fp8_kv_cache
        )

    # ---- summaries ----------------------------------------------------------------------

    def _summaries(self, nb: int, hkv: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key_min is None or self._key_min.shape != (nb, hkv, d):
            self._key_min = torch.zeros(nb, hkv, d, dtype=torch.float32, device=device)
            self._key_max = torch.zeros_like(self._key_min)
        return self._key_min, self._key_max

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # Only the target's forward runs under a plan (not the draft model, not warm-up).
        if not self._supported or current_plan() is None or get_runtime() is None:
            return
        kernel = _layer_kernel(layer)
        if kernel == "vllm":
            nb, hkv, bs, two_d = kv_cache.shape
            key_min, key_max = self._summaries(nb, hkv, two_d // 2, kv_cache.device)
            fold_block_key_summaries(key, slot_mapping, bs, key_min, key_max)
        elif kernel == "sparsever":
            key_cache, _ = paged_kv_views(kv_cache)
            nb, hkv, bs, d = key_cache.shape
            key_min, key_max = self._summaries(nb, hkv, d, key_cache.device)
            ops.update_block_key_summaries(key_cache, slot_mapping, bs, key_min, key_max)

    # ---- attention ----------------------------------------------------------------------

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan, rt = current_plan(), get_runtime()
        if (
            attn_metadata is not None
            and plan is not None
            and rt is not None
            and rt.attention.enabled
            and plan.is_verify_step
            and output_scale is None
            and output_block_scale is None
        ):
            if not self._supported:
                rt.fallback("attention", "layer uses sliding window/ALiBi/softcap/sinks/fp8 KV")
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
            try:
                if self._sparse_forward(layer, query, kv_cache, attn_metadata, output, plan, rt):
                    return output
            except Exception as exc:  # never emit a token from a half-done sparse pass
                rt.fallback("attention", f"{type(exc).__name__}: {exc}")
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _sparse_forward(self, layer, query, kv_cache, md, output, plan, rt) -> bool:
        kernel = _layer_kernel(layer)
        if kernel is None or self._key_min is None:
            return False
        cfg = rt.attention
        num_tokens = md.num_actual_tokens
        num_reqs = md.seq_lens.shape[0]
        if num_reqs != plan.num_reqs or num_tokens != plan.num_tokens:
            rt.fallback("attention", "attention metadata does not match the step's plan")
            return False
        state = plan.extras.setdefault("attention", {})
        if "sparse_rows" not in state:  # once per step: the same for every layer
            state["query_lens"], state["sparse_rows"], state["run_sparse"] = self._step_rows(
                md, plan, cfg, num_reqs
            )
        if not state["run_sparse"]:
            return False
        query_lens, sparse_rows = state["query_lens"], state["sparse_rows"]
        nb, hkv, bs, _ = kv_cache.shape
        shared = kernel == "vllm"  # one selection per request for all KV heads

        layer_idx = layer_index_of(layer.layer_name)
        if layer_idx is None or rt.is_anchor(layer_idx) or "selected" not in state:
            state["selected"], state["num_selected"], state["dense_blocks"] = self._select(
                query[:num_tokens], hkv, bs, md, query_lens, sparse_rows, cfg, shared
            )
            if shared:
                state["block_table"], seq_lens = compact_block_table(
                    md.block_table, md.seq_lens, query_lens, state["selected"], state["num_selected"], bs
                )
                if "seq_lens" not in state:  # kept counts, hence lengths, are the same at every anchor
                    state["seq_lens"] = seq_lens
                    state["scheduler_metadata"] = self._scheduler_metadata(layer, query, md, seq_lens)
            state["anchor"] = layer_idx
            rt.record(attn_selections=1)
        selected, num_selected = state["selected"], state["num_selected"]

        if shared:
            key_cache, value_cache = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
            vllm_ops.cpu_attention_with_kv_cache(
                query=query[:num_tokens], key_cache=key_cache, value_cache=value_cache,
                output=output[:num_tokens], query_start_loc=md.query_start_loc,
                seq_lens=state["seq_lens"], scale=self.scale, causal=True, alibi_slopes=None,
                sliding_window=self.sliding_window, block_table=state["block_table"],
                softcap=self.logits_soft_cap, scheduler_metadata=state["scheduler_metadata"], s_aux=None,
                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype,
            )
            selected, num_selected = selected.expand(-1, hkv, -1), num_selected.expand(-1, hkv)
        else:
            key_cache, value_cache = paged_kv_views(kv_cache)
            ops.block_sparse_tree_attention(
                query[:num_tokens], key_cache, value_cache, md.block_table, md.seq_lens,
                md.query_start_loc, self.scale, selected=selected, num_selected=num_selected,
                out=output[:num_tokens],
            )
        if rt.check_reference and layer.isa in _PLAIN_LAYOUT_ISAS:
            self._check_reference(query[:num_tokens], *paged_kv_views(kv_cache), md, selected,
                                  num_selected, output[:num_tokens], rt, exact_summaries=not shared)
        rt.record(
            attn_layers_sparse=1,
            attn_kv_blocks_read=int(num_selected.sum()),
            attn_kv_blocks_dense=state["dense_blocks"],
        )
        return True

    def _scheduler_metadata(self, layer, query, md, seq_lens):
        """vLLM's work split for the compacted lengths (once per step; every layer reuses it)."""
        return vllm_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=seq_lens, dtype=query.dtype,
            query_start_loc=md.query_start_loc, causal=True, sliding_window_size=self.sliding_window,
            isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype,
        )

    @staticmethod
    def _step_rows(md, plan, cfg, num_reqs):
        """Query lengths, the rows that attend sparsely, and whether the step runs sparse at all."""
        query_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
        verify_rows = torch.zeros(num_reqs, dtype=torch.bool)
        sparse_rows = torch.zeros(num_reqs, dtype=torch.bool)
        for req in plan.requests:
            verify_rows[req.batch_index] = True
            sparse_rows[req.batch_index] = req.context_len >= cfg.min_context_len
        # Dense when every verify request is short (nothing to save) or a prefill chunk shares the
        # step (the stock kernel runs it all).
        run_sparse = bool(sparse_rows.any()) and not bool(((query_lens.cpu() > 1) & ~verify_rows).any())
        return query_lens, sparse_rows, run_sparse

    def _select(self, query, hkv, bs, md, query_lens, sparse_rows, cfg, shared_heads):
        """One anchor layer's selection: [R, Hkv, S] logical block ids, [R, Hkv] counts ([R, 1, S],
        [R, 1] with `shared_heads`), and the number of (request, head, block) reads dense attention
        would make."""
        num_reqs = md.seq_lens.shape[0]
        # One pooled query per request: all its draft tokens share the blocks they read.
        row_of_token = torch.repeat_interleave(
            torch.arange(num_reqs, device=query.device), query_lens.to(torch.long)
        )
        pooled = torch.zeros(num_reqs, query.shape[1], query.shape[2], dtype=torch.float32,
                             device=query.device)
        pooled.index_add_(0, row_of_token, query.float())
        pooled /= query_lens.clamp(min=1).to(torch.float32).view(-1, 1, 1)

        key_min, key_max = self._key_min, self._key_max
        if shared_heads:
            pooled, key_min, key_max = heads_as_one(pooled, key_min, key_max)
        slots = md.block_table.shape[1]
        heads = key_min.shape[1]
        selected = torch.empty(num_reqs, heads, slots, dtype=torch.int32, device=query.device)
        num_selected = torch.empty(num_reqs, heads, dtype=torch.int32, device=query.device)
        ops.select_kv_blocks(
            pooled, key_min, key_max, md.block_table, md.seq_lens,
            query_lens.to(torch.int32), bs, cfg.top_k_blocks, cfg.num_sink_blocks,
            cfg.num_local_blocks, selected, num_selected,
        )
        ctx_blocks = (md.seq_lens - query_lens + bs - 1).div(bs, rounding_mode="floor").clamp(min=0)
        # Rows that stay dense (short context, plain decode rows) read all their context blocks.
        for r in (~sparse_rows).nonzero().flatten().tolist():
            n = int(ctx_blocks[r])
            selected[r].fill_(-1)
            selected[r, :, :n] = torch.arange(n, dtype=torch.int32)
            num_selected[r] = n
        return selected, num_selected, int(ctx_blocks.sum()) * hkv


    def _check_reference(self, query, key_cache, value_cache, md, selected, num_selected, out, rt,
                         exact_summaries=True):
        """Test hook: summaries equal a recompute (or, folded, bound it: min <= keys <= max);
        output equals the reference on the selection."""
        from vllm_sparsever import reference

        bs = key_cache.shape[2]
        summary_err = 0.0
        for r, seq_len in enumerate(md.seq_lens.tolist()):
            for b in range((seq_len + bs - 1) // bs):
                phys = int(md.block_table[r, b])
                keys = key_cache[phys, :, : min(bs, seq_len - b * bs)].float()
                low, high = self._key_min[phys] - keys.amin(1), keys.amax(1) - self._key_max[phys]
                if not exact_summaries:  # a folded bound may be wider, never narrower
                    low, high = low.clamp(min=0), high.clamp(min=0)
                summary_err = max(summary_err, float(low.abs().max()), float(high.abs().max()))
        rt.record_reference_error("attn_summaries", summary_err)
        expected = torch.empty_like(out)
        reference.block_sparse_tree_attention(
            expected, query, key_cache, value_cache, md.block_table, md.seq_lens,
            md.query_start_loc, selected, num_selected, None, self.scale,
        )
        rt.record_reference_error("attn", float((out.float() - expected.float()).abs().max()))


def _layer_kernel(layer) -> str | None:
    """The sparse kernel a layer can run: None when its KV layout does not allow one."""
    kernel = getattr(layer, "sparsever_attention_kernel", None)
    if kernel == "sparsever" and vllm_attn.layer_isa(layer) not in _PLAIN_LAYOUT_ISAS:
        return None
    return kernel


class SparseverCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[SparseverCPUAttentionImpl]:
        return SparseverCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparseverCPUAttentionMetadataBuilder]:
        return SparseverCPUAttentionMetadataBuilder


def register_sparse_attention_backend() -> None:
    """Make vLLM pick the sparsever CPU backend for CPU_ATTN in this process."""
    vllm_attn.register_cpu_attention_backend(SparseverCPUAttentionBackend)
