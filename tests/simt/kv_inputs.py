"""Random paged-KV inputs shared by the SIMT attention/selection tests (both cache layouts of PLATFORM.md)."""

from __future__ import annotations

import torch


def make_kv_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, layout, gen):
    """key_cache, value_cache as strided [nb, Hkv, bs, D] views of one storage, like vLLM's backends.

    layout "gpu": FlashAttention-style rows [nb, bs, Hkv, 2D] (head_dim contiguous, K then V per token).
    layout "cpu": vLLM-CPU [nb, Hkv, 2*bs*D]: K stored transposed [D, bs], V row-major [bs, D].
    """
    if layout == "gpu":
        raw = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, generator=gen).to(dtype)
        return raw[..., :head_dim].transpose(1, 2), raw[..., head_dim:].transpose(1, 2)
    raw = torch.randn(num_blocks, num_kv_heads, 2 * block_size * head_dim, generator=gen).to(dtype)
    k = raw[..., : block_size * head_dim].view(num_blocks, num_kv_heads, head_dim, block_size).transpose(2, 3)
    v = raw[..., block_size * head_dim :].view(num_blocks, num_kv_heads, block_size, head_dim)
    return k, v


def make_requests(seq_specs, block_size, gen, extra_blocks=3):
    """seq_specs: [(ctx_len, q_len)] -> block_table [R, max_blocks], seq_lens, query_lens, query_start_loc, nb.

    Physical blocks are a random permutation, so logical order != physical order.
    """
    blocks_per_req = [max(1, -(-(c + q) // block_size)) for c, q in seq_specs]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_specs), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = perm[used : used + n].int()
        used += n
    seq_lens = torch.tensor([c + q for c, q in seq_specs], dtype=torch.int32)
    query_lens = torch.tensor([q for _, q in seq_specs], dtype=torch.int32)
    qsl = torch.zeros(len(seq_specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    return table, seq_lens, query_lens, qsl, num_blocks


def make_tree_mask(query_lens, gen):
    """Random draft trees: token j's parent is a random earlier token; mask row = ancestors + itself."""
    total = int(query_lens.sum())
    max_q = int(query_lens.max()) if len(query_lens) else 0
    mask = torch.zeros(total, max(max_q, 1), dtype=torch.bool)
    t = 0
    for q in query_lens.tolist():
        rows = torch.zeros(q, q, dtype=torch.bool)
        for j in range(q):
            rows[j, j] = True
            if j > 0:
                parent = int(torch.randint(0, j, (1,), generator=gen))
                rows[j] |= rows[parent]
        mask[t : t + q, :q] = rows
        t += q
    return mask
