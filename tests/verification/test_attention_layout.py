"""The KV views the sparse attention reads are the layout vLLM-CPU writes (vec ISA)."""

import pytest
import torch

from vllm_sparsever.verification.lossless.kv_layout import paged_kv_views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kv_views_match_vllm_cpu_writes(dtype):
    from vllm import _custom_ops as vllm_ops

    nb, hkv, bs, d = 4, 2, 32, 64
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=dtype)
    stock = kv_cache.view(nb, hkv, 2 * bs, d)
    key_stock, value_stock = stock.chunk(2, dim=2)
    n = 70
    key = torch.randn(n, hkv, d, dtype=dtype)
    value = torch.randn(n, hkv, d, dtype=dtype)
    slots = torch.randperm(nb * bs)[:n].to(torch.int64)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, key_stock, value_stock, slots, "vec",
                                        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    key_view, value_view = paged_kv_views(kv_cache)
    assert key_view.shape == value_view.shape == (nb, hkv, bs, d)
    blocks, offsets = slots // bs, slots % bs
    torch.testing.assert_close(key_view[blocks, :, offsets], key, rtol=0, atol=0)
    torch.testing.assert_close(value_view[blocks, :, offsets], value, rtol=0, atol=0)


# vLLM-CPU chooses the AMX layout only on CPUs with AMX; its cache write runs on AVX512-BF16 CPUs too
# (AMD Zen 4), where the kernel's AMX path is tested on emulated tiles.
@pytest.mark.skipif(not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()),
                    reason="vLLM-CPU's AMX-layout cache write needs a CPU with AMX or AVX512-BF16")
def test_amx_views_match_vllm_cpu_writes():
    """The 6-D views of the AMX layout, unpacked by `reference.logical_kv`, hold what vLLM's own
    cache op wrote (the layout contract the AMX path of the kernel reads)."""
    from vllm import _custom_ops as vllm_ops

    from vllm_sparsever.reference import logical_kv

    nb, hkv, bs, d = 4, 2, 32, 64
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=torch.bfloat16)
    key_stock, value_stock = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    n = 70
    key = torch.randn(n, hkv, d).to(torch.bfloat16)
    value = torch.randn(n, hkv, d).to(torch.bfloat16)
    slots = torch.randperm(nb * bs)[:n].to(torch.int64)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, key_stock, value_stock, slots, "amx",
                                        k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    key_view, value_view = logical_kv(*paged_kv_views(kv_cache, "amx"))
    blocks, offsets = slots // bs, slots % bs
    torch.testing.assert_close(key_view[blocks, :, offsets], key, rtol=0, atol=0)
    torch.testing.assert_close(value_view[blocks, :, offsets], value, rtol=0, atol=0)


# ---- attention.kernel = "vllm": vLLM's kernel over a compacted block table -------------------------

# KV layouts vLLM-CPU writes on this machine (AMX tiles, bf16 only, where the CPU has AMX).
_LAYOUTS = [("vec", torch.float32), ("vec", torch.bfloat16)]
if torch.cpu._is_amx_tile_supported():
    _LAYOUTS.append(("amx", torch.bfloat16))


def _paged_cache(isa, dtype, block_table, seq_lens, hkv, bs, d, seed=0):
    """A KV cache written by vLLM's own cache op in `isa`'s layout (same K/V for the same seed)."""
    from vllm import _custom_ops as vllm_ops

    g = torch.Generator().manual_seed(seed)
    nb = int(block_table.max()) + 2
    kv_cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=dtype)
    key_stock, value_stock = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = block_table[r, pos // bs].to(torch.long) * bs + pos % bs
        k = torch.randn(s, hkv, d, generator=g).to(dtype)
        v = torch.randn(s, hkv, d, generator=g).to(dtype)
        vllm_ops.cpu_attn_reshape_and_cache(k, v, key_stock, value_stock, slots, isa,
                                            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv_cache


@pytest.mark.parametrize("isa,dtype", _LAYOUTS)
def test_vllm_kernel_on_compacted_table_matches_reference(isa, dtype):
    """vLLM's own attention kernel over `compact_block_table` = the reference on the same kept
    blocks (shared by all KV heads), incl. a query that straddles two blocks and a dense row."""
    from vllm import _custom_ops as vllm_ops

    from vllm_sparsever import reference
    from vllm_sparsever.verification.sparse.attention import compact_block_table

    bs, d, hkv, group = 32, 64, 2, 2
    seq_lens, query_lens = [300, 226, 70], [4, 4, 1]  # 226 - 4 = 222: the query spans blocks 6 and 7
    g = torch.Generator().manual_seed(1)
    block_table = torch.randperm(40, generator=g)[:30].view(3, 10).to(torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    qlen_t = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.tensor([0, 4, 8, 9], dtype=torch.int32)
    query = torch.randn(9, hkv * group, d, generator=g).to(dtype)
    # Row 0 keeps sink 0, blocks 3 and 6, local 9 (of 10 context blocks); row 1 keeps 0, 2 and 6
    # (block 6 holds context and query tokens, block 7 only query); row 2 keeps all (a dense row).
    keep = [[0, 3, 6, 9], [0, 2, 6], [0, 1, 2]]
    selected = torch.full((3, 1, 10), -1, dtype=torch.int32)
    num_selected = torch.tensor([[len(k)] for k in keep], dtype=torch.int32)
    for r, ks in enumerate(keep):
        selected[r, 0, : len(ks)] = torch.tensor(ks, dtype=torch.int32)

    table, seq_c = compact_block_table(block_table, seq_t, qlen_t, selected, num_selected, bs)
    assert seq_c.tolist() == [4 * bs + 300 - 10 * bs, 3 * bs + 226 - 7 * bs, 70]
    assert table[0, :4].tolist() == block_table[0, [0, 3, 6, 9]].tolist()
    assert table[1, :4].tolist() == block_table[1, [0, 2, 6, 7]].tolist()
    assert torch.equal(table[2], block_table[2])

    kv_cache = _paged_cache(isa, dtype, block_table, seq_lens, hkv, bs, d)
    nb = kv_cache.shape[0]
    key_cache, value_cache = kv_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    sched = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=3, num_heads=hkv * group, num_kv_heads=hkv, head_dim=d, seq_lens=seq_c, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    out = torch.zeros_like(query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
        seq_lens=seq_c, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=table, softcap=0, scheduler_metadata=sched, s_aux=None)

    key_plain, value_plain = paged_kv_views(_paged_cache("vec", dtype, block_table, seq_lens, hkv, bs, d))
    expected = torch.zeros_like(query)
    reference.block_sparse_tree_attention(
        expected, query, key_plain, value_plain, block_table, seq_t, qsl,
        selected.expand(-1, hkv, -1), num_selected.expand(-1, hkv), None, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_folded_summaries_bound_the_keys_and_restart_with_a_block():
    """Folding written keys gives min <= key <= max for every key written since the block's first
    slot was (re)written; a rewrite from slot 0 drops the previous owner's keys."""
    from vllm_sparsever.verification.sparse.attention import fold_block_key_summaries

    nb, hkv, bs, d = 3, 2, 4, 8
    key_min = torch.zeros(nb, hkv, d)
    key_max = torch.zeros(nb, hkv, d)
    first = torch.randn(6, hkv, d)
    fold_block_key_summaries(first, torch.tensor([4, 5, 6, 7, 8, -1]), bs, key_min, key_max)
    torch.testing.assert_close(key_min[1], first[:4].amin(0))
    torch.testing.assert_close(key_max[1], first[:4].amax(0))
    torch.testing.assert_close(key_min[2], first[4])  # one key so far; the padded row is ignored
    more = torch.randn(2, hkv, d) * 5
    fold_block_key_summaries(more, torch.tensor([9, 10]), bs, key_min, key_max)
    torch.testing.assert_close(key_min[2], torch.stack([first[4], *more]).amin(0))
    torch.testing.assert_close(key_max[2], torch.stack([first[4], *more]).amax(0))
    # Block 1 reused by another request: starts again from its first slot.
    again = torch.randn(2, hkv, d) * 0.1
    fold_block_key_summaries(again, torch.tensor([4, 5]), bs, key_min, key_max)
    torch.testing.assert_close(key_min[1], again.amin(0))
    torch.testing.assert_close(key_max[1], again.amax(0))


def test_dense_kernel_resolves_per_layout():
    from vllm_sparsever.verification.sparse.attention import resolve_dense_kernel

    for isa in ("vec", "vec16", "amx"):
        assert resolve_dense_kernel("auto", isa) == "sparsever"
        assert resolve_dense_kernel("sparsever", isa) == "sparsever"
        assert resolve_dense_kernel("vllm", isa) == "vllm"
    assert resolve_dense_kernel("auto", "neon") == "vllm"
    with pytest.raises(RuntimeError, match="attention.dense_kernel.*'neon'"):
        resolve_dense_kernel("sparsever", "neon")


def test_decode_kernel_resolves_per_layout():
    """Decode steps: ours where it beat vLLM's vec kernel at one token; vLLM's AMX tiles (a tie) and
    layouts ours cannot read stay stock."""
    from vllm_sparsever.verification.sparse.attention import resolve_decode_kernel

    for isa in ("vec", "vec16"):
        assert resolve_decode_kernel("auto", isa) == "sparsever"
    assert resolve_decode_kernel("auto", "amx") == "vllm"
    assert resolve_decode_kernel("sparsever", "amx") == "sparsever"
    assert resolve_decode_kernel("auto", "neon") == "vllm" and resolve_decode_kernel("vllm", "vec") == "vllm"
    with pytest.raises(RuntimeError, match="attention.decode_kernel.*'neon'"):
        resolve_decode_kernel("sparsever", "neon")


def test_a_layers_kv_views_are_built_once_per_cache():
    """The attention backend keeps a layer's KV views across calls (one cache per layer), builds them
    anew for another cache or ISA, and they read the cache as it is written."""
    from vllm_sparsever.verification.sparse.attention import SparseverCPUAttentionImpl

    impl = object.__new__(SparseverCPUAttentionImpl)  # (only the views' state: no vLLM layer needed)
    impl._views_of, impl._views = None, None
    nb, hkv, bs, d = 4, 2, 32, 64
    cache = torch.zeros(nb, hkv, bs, 2 * d)
    key, value = impl._kv_views(cache)
    assert impl._kv_views(cache)[0] is key
    for got, want in zip((key, value), paged_kv_views(cache), strict=True):
        assert got.shape == want.shape and got.stride() == want.stride() and got.data_ptr() == want.data_ptr()
    cache.view(nb, hkv, 2 * bs * d)[1, 0, : bs * d] = 1.0  # block 1's keys, head 0
    assert bool((key[1, 0] == 1).all()) and not bool(key[0].any())
    other = torch.zeros_like(cache)
    assert impl._kv_views(other)[0].data_ptr() == other.data_ptr()
    assert impl._kv_views(other, "vec16")[0] is not impl._kv_views(other)[0]
