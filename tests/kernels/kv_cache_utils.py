"""Paged KV caches in the two layouts the kernels must take by strides (vLLM-CPU and GPU FlashAttention)."""

from __future__ import annotations

import torch


def make_paged_kv(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, layout: str, generator: torch.Generator | None = None,
                  spare_blocks: int = 2):
    """Random K/V caches as strided [nb, Hkv, bs, D] views plus a shuffled int32 block table.

    layout "cpu": vLLM-CPU per-layer tensor [nb, Hkv, 2*bs*D]: K transposed [D, bs], then V [bs, D].
    layout "gpu": FlashAttention-style [nb, bs, Hkv, 2*D]: each token row holds K then V.
    """
    blocks_per_req = [max(1, (s + block_size - 1) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    g = generator
    if layout == "cpu":
        raw = torch.randn(num_blocks, num_kv_heads, 2 * block_size * head_dim, generator=g).to(dtype)
        key_cache = raw[:, :, : block_size * head_dim].view(num_blocks, num_kv_heads, head_dim, block_size)
        key_cache = key_cache.transpose(2, 3)
        value_cache = raw[:, :, block_size * head_dim :].view(num_blocks, num_kv_heads, block_size, head_dim)
    elif layout == "gpu":
        raw = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, generator=g).to(dtype)
        key_cache = raw[..., :head_dim].transpose(1, 2)
        value_cache = raw[..., head_dim:].transpose(1, 2)
    else:
        raise ValueError(layout)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return key_cache, value_cache, block_table, raw
