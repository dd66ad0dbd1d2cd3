"""vLLM's CPU attention backend (`CPU_ATTN`): what the sparse attention backend extends and calls.

Imported only where sparse attention runs (a worker with attention sparsity), like the backend.
Private symbols touched:
- bases `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend`, `CPUAttentionBackendImpl`,
  `CPUAttentionMetadataBuilder`; the builder's `__init__(kv_cache_spec, layer_names, vllm_config,
  device)`, its `isa` / `block_size` / `vllm_config` attributes and its `_set_isa_to_layers(layer_names)`
  (overridden); the impl's `do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)` and
  `forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
  output_block_scale)` (overridden); `get_impl_cls` / `get_builder_cls`;
- attention layers' `isa`, `layer_name`, `_k_scale_float`, `_v_scale_float` attributes;
- impl attributes `IMPL_ATTRIBUTES`; `CPUAttentionMetadata` fields `METADATA_FIELDS`;
- ops `vllm._custom_ops.cpu_attention_with_kv_cache`, `cpu_attn_get_scheduler_metadata`,
  `cpu_attn_reshape_and_cache` (tests) and `vllm.envs.VLLM_CPU_ATTN_SPLIT_KV`;
- the KV cache layout: per layer `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, viewed by
  vLLM as `[nb, Hkv, 2 * bs, D]` K half then V half; with the `vec`/`vec16` ISAs K is stored
  transposed (`[D, bs]` per block and head), V row-major (`[bs, D]`); other ISAs (AMX) pack tiles;
- `vllm.config.get_layers_from_vllm_config`, `vllm.model_executor.layers.attention.Attention`,
  `vllm.v1.attention.backend.AttentionType`;
- `vllm.v1.attention.backends.registry.register_backend(AttentionBackendEnum.CPU_ATTN, path)`, and
  the selector's memo of chosen classes `vllm.v1.attention.selector._cached_get_attn_backend`
  (`functools.cache`), cleared on registration: an engine started earlier in the same process
  (vLLM's in-process engine) would otherwise hand the next one its stock class.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as _vllm_ops
from vllm import envs as _vllm_envs
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

__all__ = [
    "AttentionType", "CPUAttentionBackend", "CPUAttentionBackendImpl", "CPUAttentionMetadataBuilder",
    "attention_layers", "attention_impls", "attention_over_block_table", "builder_isa", "impl_supports_sparse",
    "layer_isa", "layer_kv_scales", "register_cpu_attention_backend", "scheduler_metadata",
    "set_builder_isa", "split_kv_enabled", "stock_kv_halves", "write_kv_cache",
]

# ISAs whose KV layout is K [D, block_size] + V [block_size, D] per block and head.
PLAIN_LAYOUT_ISAS = ("vec", "vec16")

# Impl attributes read by the sparse backend (set by CPUAttentionBackendImpl.__init__).
IMPL_ATTRIBUTES = (
    "attn_type", "sliding_window", "alibi_slopes", "logits_soft_cap", "sinks", "is_fp8_kv_cache",
    "scale", "num_heads", "num_kv_heads", "head_size", "kv_cache_dtype",
)
# CPUAttentionMetadata fields read on verify steps.
METADATA_FIELDS = ("num_actual_tokens", "seq_lens", "query_start_loc", "block_table")
# Methods the sparse backend overrides -> parameters (after self) it relies on.
BUILDER_HOOKS: dict[str, tuple[str, ...]] = {
    "__init__": ("kv_cache_spec", "layer_names", "vllm_config", "device"),
    "_set_isa_to_layers": ("layer_names",),
}
IMPL_HOOKS: dict[str, tuple[str, ...]] = {
    "do_kv_cache_update": ("layer", "key", "value", "kv_cache", "slot_mapping"),
    "forward": ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                "output_scale", "output_block_scale"),
}
BACKEND_HOOKS: dict[str, tuple[str, ...]] = {"get_impl_cls": (), "get_builder_cls": ()}


# ---- builder / layers ----------------------------------------------------------------------------

def builder_isa(builder: CPUAttentionMetadataBuilder) -> str:
    """The KV ISA vLLM chose for the builder's layers ("vec", "vec16", "amx", ...)."""
    return builder.isa


# What the builder knows about its layers' attention (set in its __init__), as the plugin reads it.
BUILDER_GEOMETRY = ("isa", "block_size", "num_heads", "num_kv_heads", "head_dim", "dtype", "kv_cache_dtype")


def builder_geometry(builder: CPUAttentionMetadataBuilder) -> dict[str, Any]:
    """The builder's ISA, block size, head counts, head size, model dtype and KV cache dtype: what
    vLLM's scheduler-metadata op takes besides the lengths."""
    return {name: getattr(builder, name) for name in BUILDER_GEOMETRY}


def set_builder_isa(builder: CPUAttentionMetadataBuilder, isa: str) -> None:
    """Change the ISA (and so the KV layout) of the builder's layers; call before
    `_set_isa_to_layers` hands it to the layers."""
    builder.isa = isa


def attention_layers(vllm_config: Any, layer_names: list[str]) -> dict[str, Attention]:
    return get_layers_from_vllm_config(vllm_config, Attention, layer_names)


def attention_layer_names(model: torch.nn.Module) -> list[str]:
    """The names vLLM's forward context knows a model's attention layers by (`Attention.layer_name`)."""
    return [m.layer_name for m in model.modules() if isinstance(m, Attention)]


def builder_layer_names(builder: CPUAttentionMetadataBuilder) -> list[str]:
    """The attention layers a metadata builder serves (one builder per attention group: layers of
    the same backend and KV spec; a draft model with another head size gets its own)."""
    return list(builder.layer_names)


def layer_isa(layer: Any) -> str | None:
    return getattr(layer, "isa", None)


def layer_kv_scales(layer: Any) -> tuple[float, float]:
    """(k_scale, v_scale) as floats, as vLLM passes them to its CPU ops."""
    return layer._k_scale_float, layer._v_scale_float


def impl_supports_sparse(impl: CPUAttentionBackendImpl) -> bool:
    """Whether a layer's attention is plain causal decoder attention (what the sparse path computes):
    no sliding window, ALiBi, soft-cap, sinks or fp8 KV cache."""
    return (
        impl.attn_type == AttentionType.DECODER
        and impl.sliding_window == -1
        and impl.alibi_slopes is None
        and not impl.logits_soft_cap
        and impl.sinks is None
        and not impl.is_fp8_kv_cache
    )


# ---- KV cache -----------------------------------------------------------------------------------

def stock_kv_halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own (key_cache, value_cache) views of a `[nb, Hkv, bs, 2*D]` KV tensor, in the form its
    CPU ops take: `[nb, Hkv, bs, D]` each, the K and V halves of every block and head."""
    nb, hkv, bs, _ = kv_cache.shape
    return kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, isa: str, *, k_scale: float = 1.0, v_scale: float = 1.0,
                   kv_cache_dtype: str = "auto") -> None:
    """Write K/V ([T, Hkv, D]) into slots as vLLM's CPU backend does (its layout for `isa`)."""
    key_cache, value_cache = stock_kv_halves(kv_cache)
    _vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa,
                                         k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)


# ---- vLLM's CPU attention ops ------------------------------------------------------------------

def split_kv_enabled() -> bool:
    return bool(_vllm_envs.VLLM_CPU_ATTN_SPLIT_KV)


def scheduler_metadata(*, num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       seq_lens: torch.Tensor, dtype: torch.dtype, query_start_loc: torch.Tensor,
                       causal: bool, sliding_window_size: int, isa: str,
                       enable_kv_split: bool | None = None, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """vLLM's CPU attention work split for these lengths (`cpu_attn_get_scheduler_metadata`);
    `enable_kv_split` defaults to vLLM's `VLLM_CPU_ATTN_SPLIT_KV`."""
    return _vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=causal,
        sliding_window_size=sliding_window_size, isa=isa,
        enable_kv_split=split_kv_enabled() if enable_kv_split is None else enable_kv_split,
        kv_cache_dtype=kv_cache_dtype,
    )


def attention_over_block_table(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               output: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, causal: bool, alibi_slopes: torch.Tensor | None,
                               sliding_window: int, block_table: torch.Tensor, softcap: float,
                               scheduler_metadata: torch.Tensor, s_aux: torch.Tensor | None,
                               k_scale: float = 1.0, v_scale: float = 1.0,
                               kv_cache_dtype: str = "auto") -> None:
    """vLLM's CPU paged attention (`cpu_attention_with_kv_cache`) into `output`; key/value caches
    as from `stock_kv_halves`."""
    _vllm_ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=causal,
        alibi_slopes=alibi_slopes, sliding_window=sliding_window, block_table=block_table,
        softcap=softcap, scheduler_metadata=scheduler_metadata, s_aux=s_aux,
        k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )


# ---- registry ----------------------------------------------------------------------------------

def register_cpu_attention_backend(backend_cls: type) -> None:
    """Make vLLM pick `backend_cls` for CPU_ATTN in this process (every worker registers it)."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{backend_cls.__module__}.{backend_cls.__qualname__}")
    selector._cached_get_attn_backend.cache_clear()


def attention_impls(model: torch.nn.Module) -> list[Any]:
    """The backend implementation (`Attention.impl`) each of a model's attention layers runs."""
    return [m.impl for m in model.modules() if isinstance(m, Attention)]
