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
  blocks selected); a step with a prefill chunk runs the stock kernel, and so does a layer that hits
  a run-time problem (the runtime's fallback policy: counted per reason).

What depends only on the batch (rows, kept blocks per row, compacted lengths, vLLM's work split for
them, blocks read) is computed once per step by `AttentionPlanner` into the plan's
`AttentionStepPlan`; layers only select (at anchors, into the plan's `AnchorSelections`) and attend.

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

import numpy as np
import torch

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.compat import cpu_attention as vllm_attn
from vllm_sparsever.compat.cpu_attention import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm_sparsever.forward_scope import current_plan, current_tree_mask
from vllm_sparsever.plan import (
    AnchorSelection,
    AnchorSelectionUnavailable,
    AttentionStepPlan,
    RequestVerification,
    StepBatch,
    VerificationPlan,
)
from vllm_sparsever.verification.lossless.kv_layout import (
    KERNEL_LAYOUT_ISAS,
    PLAIN_LAYOUT_ISAS,
    paged_kv_views,
)
from vllm_sparsever.verification.sparse.runtime import SparsePathUnavailable, get_runtime, layer_index_of

def resolve_attention_kernel(choice: str, stock_isa: str) -> str:
    """`attention.kernel` in force for layers whose stock ISA is `stock_isa`."""
    if choice == "auto":
        return "sparsever" if stock_isa in PLAIN_LAYOUT_ISAS else "vllm"
    return choice


def resolve_dense_kernel(choice: str, isa: str) -> str:
    """`attention.dense_kernel` in force for layers of KV layout `isa` (after the builder's choice).

    "auto" takes sparsever's kernel wherever it reads the layout: it beat vLLM's at 1-16 query
    tokens on vec and AMX layouts (bench/results/kernels_*_attention_*roof*)."""
    readable = isa in KERNEL_LAYOUT_ISAS
    if choice == "sparsever" and not readable:
        raise RuntimeError(
            f"attention.dense_kernel: 'sparsever' cannot read vLLM's {isa!r} KV layout (it reads "
            f"{', '.join(KERNEL_LAYOUT_ISAS)}); use 'auto' or 'vllm'")
    if choice == "auto":
        return "sparsever" if readable else "vllm"
    return choice


def resolve_decode_kernel(choice: str, isa: str) -> str:
    """`attention.decode_kernel` in force for layers of KV layout `isa` (after the builder's choice).

    "auto" takes sparsever's kernel on the plain layouts, where it beat vLLM's vec kernel at one
    query token on every CPU measured; on AMX tiles the two tie, so decode steps stay stock there
    (bench/results/kernels_*_attention_*: the `q = 1` rows)."""
    if choice == "sparsever" and isa not in KERNEL_LAYOUT_ISAS:
        raise RuntimeError(
            f"attention.decode_kernel: 'sparsever' cannot read vLLM's {isa!r} KV layout (it reads "
            f"{', '.join(KERNEL_LAYOUT_ISAS)}); use 'auto' or 'vllm'")
    if choice == "auto":
        return "sparsever" if isa in PLAIN_LAYOUT_ISAS else "vllm"
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


class AttentionPlanner:
    """Builds a verify step's `AttentionStepPlan` once per step (FlashInfer's plan()): which rows attend
    sparsely, how many blocks each keeps, the compacted lengths and vLLM's kernel work split for
    them. Everything here depends on the batch and the knobs only; the layers then only run.

    Made by the metadata builder (one per KV cache group), which knows the layout, ISA and kernel.
    """

    def __init__(self, builder: "SparseverCPUAttentionMetadataBuilder") -> None:
        self.kernel = builder.sparse_kernel
        geometry = vllm_attn.builder_geometry(builder)
        self.isa = geometry["isa"]
        self.block_size = geometry["block_size"]
        self.num_heads = geometry["num_heads"]
        self.num_kv_heads = geometry["num_kv_heads"]
        self.head_dim = geometry["head_dim"]
        self.dtype = geometry["dtype"]
        self.kv_cache_dtype = geometry["kv_cache_dtype"]

    def __call__(self, batch: StepBatch, requests: list[RequestVerification],
                 query_start_loc: np.ndarray) -> AttentionStepPlan | None:
        cfg = get_runtime().attention
        num_reqs, bs = batch.num_reqs, self.block_size
        query_lens = np.diff(query_start_loc)
        seq_lens = np.asarray(batch.num_computed_tokens[:num_reqs], dtype=np.int64) + query_lens
        sparse_rows = np.zeros(num_reqs, dtype=np.bool_)
        for req in requests:
            sparse_rows[req.batch_index] = req.context_len >= cfg.min_context_len
        # Dense when every verify request is short: nothing to save. (Steps holding a prefill chunk
        # never get here: build_verification_plan plans none for them.)
        if not sparse_rows.any():
            return None
        ctx_blocks = np.maximum(seq_lens - query_lens + bs - 1, 0) // bs
        budget = cfg.top_k_blocks + cfg.num_sink_blocks + cfg.num_local_blocks
        kept = np.where(sparse_rows, np.minimum(ctx_blocks, budget), ctx_blocks)
        compacted = seq_lens - (ctx_blocks - kept) * bs
        as_i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        compacted_t = as_i32(compacted)
        metadata = None
        if self.kernel == "vllm":
            metadata = vllm_attn.scheduler_metadata(
                num_reqs=num_reqs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, seq_lens=compacted_t, dtype=self.dtype,
                query_start_loc=as_i32(query_start_loc), causal=True, sliding_window_size=-1,
                isa=self.isa, kv_cache_dtype=self.kv_cache_dtype,
            )
        return AttentionStepPlan(
            run_sparse=True,
            query_lens=as_i32(query_lens),
            sparse_rows=torch.from_numpy(sparse_rows),
            kept_blocks=as_i32(kept),
            compacted_seq_lens=compacted_t,
            kv_blocks_read=int(kept.sum()) * self.num_kv_heads,
            kv_blocks_dense=int(ctx_blocks.sum()) * self.num_kv_heads,
            kernel_metadata=metadata,
            geometry=(bs, self.num_heads, self.num_kv_heads, self.head_dim),
        )


class SparseverCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        rt = get_runtime()
        isa = vllm_attn.builder_isa(self)
        choice = rt.attention.kernel if rt else "vllm"
        if rt is not None and rt.config.tree.enabled and choice == "auto":
            choice = "sparsever"  # the only kernel with a tree mask
        self.sparse_kernel = resolve_attention_kernel(choice, isa)
        summaries = rt is not None and rt.started_with["attention"]
        if self.sparse_kernel == "sparsever" and (
                isa not in KERNEL_LAYOUT_ISAS or (summaries and isa not in PLAIN_LAYOUT_ISAS)):
            # The attention kernel reads AMX's packed tiles, but the key summaries of sparse
            # attention read the plain layout: there (and on layouts neither reads) the worker
            # runs vLLM's vec ISA.
            vllm_attn.set_builder_isa(self, "vec" if self.block_size % 32 == 0 else "vec16")
        self.dense_kernel = resolve_dense_kernel(rt.attention.dense_kernel if rt else "vllm",
                                                 vllm_attn.builder_isa(self))
        self.decode_kernel = resolve_decode_kernel(rt.attention.decode_kernel if rt else "vllm",
                                                   vllm_attn.builder_isa(self))
        self._set_isa_to_layers(layer_names)
        if rt is not None and rt.target_attention_layers.intersection(vllm_attn.builder_layer_names(self)):
            rt.attention_planner = AttentionPlanner(self)

    def _set_isa_to_layers(self, layer_names: list[str]) -> None:
        super()._set_isa_to_layers(layer_names)
        for layer in vllm_attn.attention_layers(self.vllm_config, layer_names).values():
            layer.sparsever_attention_kernel = getattr(self, "sparse_kernel", None)
            layer.sparsever_dense_kernel = getattr(self, "dense_kernel", None)
            layer.sparsever_decode_kernel = getattr(self, "decode_kernel", None)


def _is_target_decode_step(plan: VerificationPlan, md, layer, rt) -> bool:
    """A plain decode step of the target: one token per row, nothing verified (a draft model's
    passes run outside the target's plan, but may share its attention backend)."""
    return (not plan.is_verify_step and plan.num_tokens == plan.num_reqs == md.num_actual_tokens
            and layer.layer_name in rt.target_attention_layers)


class SparseverCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU attention that keeps key summaries and attends sparsely on verify steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._key_min: torch.Tensor | None = None
        self._key_max: torch.Tensor | None = None
        self._supported = vllm_attn.impl_supports_sparse(self)
        self._views_of: tuple | None = None  # (cache address, shape, ISA) that `_views` were built for
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None

    def _kv_views(self, kv_cache: torch.Tensor, isa: str = "vec") -> tuple[torch.Tensor, torch.Tensor]:
        """`paged_kv_views` of this layer's KV cache, built once: vLLM allocates a layer's cache once,
        and rebuilding the strided views cost every layer call microseconds of Python. (A view keeps
        its cache alive, so a new cache never shares the old address.)"""
        key = (kv_cache.data_ptr(), kv_cache.shape, isa)
        if self._views_of != key:
            self._views, self._views_of = paged_kv_views(kv_cache, isa), key
        return self._views

    # ---- summaries ----------------------------------------------------------------------

    def _summaries(self, nb: int, hkv: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key_min is None or self._key_min.shape != (nb, hkv, d):
            self._key_min = torch.zeros(nb, hkv, d, dtype=torch.float32, device=device)
            self._key_max = torch.zeros_like(self._key_min)
        return self._key_min, self._key_max

    def refresh_summaries(self, layer, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Recompute the key summaries of the blocks holding `slot_mapping` (after sparsever moved
        K/V there: the accepted path of a draft tree compacted into place)."""
        if self._key_min is None or _layer_kernel(layer) != "sparsever":
            return
        key_cache, _ = self._kv_views(kv_cache)
        ops.update_block_key_summaries(key_cache, slot_mapping, key_cache.shape[2], self._key_min, self._key_max)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # Only the target's forward runs under a plan (not the draft model, not warm-up), and only
        # attention sparsity reads the summaries (it cannot be switched on at run time if off at start).
        rt = get_runtime()
        if not self._supported or current_plan() is None or rt is None or not rt.started_with["attention"]:
            return
        kernel = _layer_kernel(layer)
        if kernel == "vllm":
            nb, hkv, bs, two_d = kv_cache.shape
            key_min, key_max = self._summaries(nb, hkv, two_d // 2, kv_cache.device)
            fold_block_key_summaries(key, slot_mapping, bs, key_min, key_max)
        elif kernel == "sparsever":
            key_cache, _ = self._kv_views(kv_cache)
            nb, hkv, bs, d = key_cache.shape
            key_min, key_max = self._summaries(nb, hkv, d, key_cache.device)
            ops.update_block_key_summaries(key_cache, slot_mapping, bs, key_min, key_max)

    # ---- attention ----------------------------------------------------------------------

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan, rt = current_plan(), get_runtime()
        step = plan.attention if plan is not None else None
        tree_mask = current_tree_mask() if attn_metadata is not None else None
        if (
            attn_metadata is not None
            and step is not None
            and step.run_sparse
            and rt is not None
            and output_scale is None
            and output_block_scale is None
        ):
            if not self._supported:
                rt.fallback("attention", "unsupported_layer", "sliding window/ALiBi/softcap/sinks/fp8 KV")
            elif rt.run_sparse("attention", lambda: self._sparse_forward(
                    layer, query, kv_cache, attn_metadata, output, plan, rt, tree_mask)):
                return output
        if tree_mask is not None:
            return self._tree_forward(layer, query, kv_cache, attn_metadata, output, tree_mask)
        if (
            attn_metadata is not None
            and plan is not None
            and not plan.has_prefill_rows
            and output_scale is None
            and output_block_scale is None
            and self._supported
            and rt is not None
        ):
            if (plan.is_verify_step and rt.attention.dense_kernel != "vllm"
                    and getattr(layer, "sparsever_dense_kernel", None) == "sparsever"):
                rt.record(attn_layers_dense_kernel=1)
                return self._dense_forward(layer, query, kv_cache, attn_metadata, output)
            if (_is_target_decode_step(plan, attn_metadata, layer, rt) and rt.attention.decode_kernel != "vllm"
                    and getattr(layer, "sparsever_decode_kernel", None) == "sparsever"):
                rt.record(attn_layers_decode_kernel=1)
                return self._dense_forward(layer, query, kv_cache, attn_metadata, output)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _dense_forward(self, layer, query, kv_cache, md, output, tree_mask: torch.Tensor | None = None):
        """Exact attention of a verify step over every context block with sparsever's kernel, in the
        layer's KV layout (tree-masked for draft trees, else causal)."""
        num_tokens = md.num_actual_tokens
        key_cache, value_cache = self._kv_views(kv_cache, vllm_attn.layer_isa(layer))
        ops.block_sparse_tree_attention(
            query[:num_tokens], key_cache, value_cache, md.block_table, md.seq_lens,
            md.query_start_loc, self.scale, tree_mask=None if tree_mask is None else tree_mask[:num_tokens],
            out=output[:num_tokens],
        )
        return output

    def _tree_forward(self, layer, query, kv_cache, md, output, tree_mask: torch.Tensor):
        """Dense attention under a draft tree's ancestor mask: vLLM's kernel only masks causally,
        so every layer of a tree forward runs sparsever's kernel over all context blocks. Not a
        fallback case: a causal kernel here would verify the wrong tokens."""
        isa = vllm_attn.layer_isa(layer)
        if not self._supported or isa not in KERNEL_LAYOUT_ISAS:
            raise RuntimeError(
                f"draft trees: layer {layer.layer_name} cannot attend with a tree mask (ISA {isa!r}, "
                f"plain causal decoder attention: {self._supported}); tree verification needs "
                f"sparsever's attention kernel on a KV layout it reads ({', '.join(KERNEL_LAYOUT_ISAS)})")
        return self._dense_forward(layer, query, kv_cache, md, output, tree_mask)

    def _sparse_forward(self, layer, query, kv_cache, md, output, plan: VerificationPlan, rt,
                        tree_mask: torch.Tensor | None = None) -> bool:
        kernel = _layer_kernel(layer)
        if kernel is None:
            raise SparsePathUnavailable("kv_layout", f"layer ISA {getattr(layer, 'isa', None)!r}")
        if self._key_min is None:
            raise SparsePathUnavailable("no_key_summaries")
        num_tokens = md.num_actual_tokens
        if md.seq_lens.shape[0] != plan.num_reqs or num_tokens != plan.num_tokens:
            raise SparsePathUnavailable(
                "metadata_mismatch", f"{md.seq_lens.shape[0]} rows / {num_tokens} tokens vs the plan's "
                f"{plan.num_reqs} / {plan.num_tokens}")
        layer_idx = layer_index_of(layer.layer_name)
        if layer_idx is None:
            raise SparsePathUnavailable("unknown_layer", layer.layer_name)
        step = plan.attention
        nb, hkv, bs, _ = kv_cache.shape
        if step.geometry != (bs, self.num_heads, self.num_kv_heads, self.head_size):
            # The step was planned for another attention group's shapes (lengths, work split).
            raise SparsePathUnavailable(
                "geometry_mismatch", f"layer {(bs, self.num_heads, self.num_kv_heads, self.head_size)} "
                f"vs plan {step.geometry} (block size, heads, KV heads, head size)")
        shared = kernel == "vllm"  # one selection per request for all KV heads
        if shared and tree_mask is not None:
            raise RuntimeError("draft trees need attention.kernel 'sparsever' (vLLM's kernel has no tree mask)")
        if plan.selections.is_anchor(layer_idx):
            selection = self._select(layer_idx, query[:num_tokens], md, step, rt.attention, shared, bs)
            plan.selections.publish(selection)
            rt.record(attn_selections=1)
        else:
            try:
                selection = plan.selections.for_layer(layer_idx)
            except AnchorSelectionUnavailable as exc:
                raise SparsePathUnavailable("no_anchor_selection", str(exc)) from exc
        selected, num_selected = selection.selected, selection.num_selected

        if shared:
            key_cache, value_cache = vllm_attn.stock_kv_halves(kv_cache)
            k_scale, v_scale = vllm_attn.layer_kv_scales(layer)
            vllm_attn.attention_over_block_table(
                query=query[:num_tokens], key_cache=key_cache, value_cache=value_cache,
                output=output[:num_tokens], query_start_loc=md.query_start_loc,
                seq_lens=step.compacted_seq_lens, scale=self.scale, causal=True, alibi_slopes=None,
                sliding_window=self.sliding_window, block_table=selection.block_table,
                softcap=self.logits_soft_cap, scheduler_metadata=step.kernel_metadata, s_aux=None,
                k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=self.kv_cache_dtype,
            )
            selected, num_selected = selected.expand(-1, hkv, -1), num_selected.expand(-1, hkv)
        else:
            key_cache, value_cache = self._kv_views(kv_cache)
            ops.block_sparse_tree_attention(
                query[:num_tokens], key_cache, value_cache, md.block_table, md.seq_lens,
                md.query_start_loc, self.scale, selected=selected, num_selected=num_selected,
                tree_mask=None if tree_mask is None else tree_mask[:num_tokens], out=output[:num_tokens],
            )
        if rt.check_reference and vllm_attn.layer_isa(layer) in PLAIN_LAYOUT_ISAS:
            self._check_reference(query[:num_tokens], *self._kv_views(kv_cache), md, selected,
                                  num_selected, output[:num_tokens], rt, exact_summaries=not shared,
                                  tree_mask=None if tree_mask is None else tree_mask[:num_tokens])
        # Blocks read come from the plan's kept counts (the selection kernel keeps exactly those).
        rt.record(attn_layers_sparse=1, attn_kv_blocks_read=step.kv_blocks_read,
                  attn_kv_blocks_dense=step.kv_blocks_dense)
        return True

    def _select(self, layer_idx: int, query, md, step: AttentionStepPlan, cfg, shared_heads: bool,
                bs: int) -> AnchorSelection:
        """One anchor layer's selection: [R, Hkv, S] logical block ids and [R, Hkv] counts ([R, 1, S],
        [R, 1] with `shared_heads`, plus the compacted block table vLLM's kernel reads)."""
        num_reqs = md.seq_lens.shape[0]
        query_lens = step.query_lens
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
            pooled, key_min, key_max, md.block_table, md.seq_lens, query_lens, bs,
            cfg.top_k_blocks, cfg.num_sink_blocks, cfg.num_local_blocks, selected, num_selected,
        )
        # Rows that stay dense (short context, plain decode rows) read all their context blocks.
        for r in (~step.sparse_rows).nonzero().flatten().tolist():
            n = int(step.kept_blocks[r])
            selected[r].fill_(-1)
            selected[r, :, :n] = torch.arange(n, dtype=torch.int32)
            num_selected[r] = n
        if not torch.equal(num_selected, step.kept_blocks.view(-1, 1).expand_as(num_selected)):
            # The plan's compacted lengths and byte counts assume these counts.
            raise ValueError(f"select_kv_blocks kept {num_selected.tolist()} blocks, the plan expected "
                             f"{step.kept_blocks.tolist()}")
        table = None
        if shared_heads:
            table, _ = compact_block_table(md.block_table, md.seq_lens, query_lens, selected, num_selected, bs)
        return AnchorSelection(layer=layer_idx, selected=selected, num_selected=num_selected, block_table=table)

    def _check_reference(self, query, key_cache, value_cache, md, selected, num_selected, out, rt,
                         exact_summaries=True, tree_mask=None):
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
            md.query_start_loc, selected, num_selected, tree_mask, self.scale,
        )
        rt.record_reference_error("attn", float((out.float() - expected.float()).abs().max()))


def _layer_kernel(layer) -> str | None:
    """The sparse kernel a layer can run: None when its KV layout does not allow one."""
    kernel = getattr(layer, "sparsever_attention_kernel", None)
    if kernel == "sparsever" and vllm_attn.layer_isa(layer) not in PLAIN_LAYOUT_ISAS:
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
