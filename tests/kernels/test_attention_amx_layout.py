"""block_sparse_tree_attention reading vLLM-CPU's AMX KV layout in place (AMX tile products, on the
instructions and on their software model) against the PyTorch reference on the same K/V written in the
plain layout; token moves in that layout."""

import pytest
import torch

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref
from vllm_sparsever.compat.cpu_attention import write_kv_cache
from vllm_sparsever.verification.lossless.kv_layout import move_kv_tokens, paged_kv_views

# vLLM-CPU chooses the AMX layout only on CPUs with AMX; its cache write runs on AVX512-BF16 CPUs too
# (AMD Zen 4), where the kernel's AMX path runs on emulated tiles (the `amx_tiles` fixture).
pytestmark = pytest.mark.skipif(not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()),
                                reason="vLLM-CPU's AMX-layout cache write needs a CPU with AMX or AVX512-BF16")

# bf16 in, fp32 accumulation; P is rounded to bf16 before P V (as vLLM's AMX kernel does).
ATOL = RTOL = 2e-2


def _caches(seq_lens, hkv, d, bs, gen):
    """The same random K/V written by vLLM's cache op in the AMX and the vec layout; unwritten slots
    of the AMX cache hold NaN (the kernel must not read them into any output)."""
    blocks = [(s + bs - 1) // bs for s in seq_lens]
    nb = sum(blocks) + 2
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[at: at + n].to(torch.int32)
        at += n
    amx = torch.full((nb, hkv, bs, 2 * d), float("nan"), dtype=torch.bfloat16)
    vec = torch.zeros(nb, hkv, bs, 2 * d, dtype=torch.bfloat16)
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = table[r, pos // bs].long() * bs + pos % bs
        k = torch.randn(s, hkv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(s, hkv, d, generator=gen).to(torch.bfloat16)
        write_kv_cache(k, v, amx, slots, "amx")
        write_kv_cache(k, v, vec, slots, "vec")
    return amx, vec, table


def _tree_mask(q_lens, gen):
    rows = []
    for q in q_lens:
        m = torch.zeros(q, max(q_lens), dtype=torch.bool)
        for i in range(q):
            m[i, i] = True
            if i:
                m[i, :q] |= m[int(torch.randint(0, i, (1,), generator=gen)), :q]
        rows.append(m)
    return torch.cat(rows)


def _selection(seq_lens, q_lens, hkv, bs, gen):
    """Half of each request's context blocks per KV head (at least one), ascending."""
    slots = max((s + bs - 1) // bs for s in seq_lens)
    sel = torch.full((len(seq_lens), hkv, slots), -1, dtype=torch.int32)
    nsel = torch.zeros(len(seq_lens), hkv, dtype=torch.int32)
    for r, (s, q) in enumerate(zip(seq_lens, q_lens)):
        ctx_blocks = (s - q + bs - 1) // bs
        for h in range(hkv):
            keep = sorted(torch.randperm(ctx_blocks, generator=gen)[: max(1, ctx_blocks // 2)].tolist())
            sel[r, h, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
            nsel[r, h] = len(keep)
    return sel, nsel


CASES = [
    # seq_lens, q_lens, hkv, group, d, bs, tree, sparse
    ([300], [4], 2, 6, 128, 128, False, False),           # Qwen2.5-1.5B's heads, 24 rows: two row tiles
    ([300, 77, 1000], [1, 4, 8], 2, 6, 128, 128, False, False),  # decode row beside verify rows
    ([5000], [16], 2, 6, 128, 128, False, False),         # 96 rows (3 row-tile pairs); split-K chunks
    ([263, 129], [6, 3], 2, 6, 128, 128, True, False),    # tree masks; query tokens straddle blocks
    ([3000, 2100], [5, 16], 2, 6, 128, 128, True, True),  # selected blocks with tree masks
    ([100, 64], [3, 2], 4, 2, 64, 32, False, False),      # head_dim 64, block 32
    ([900], [7], 1, 8, 256, 64, False, True),             # head_dim 256
    ([40], [40], 2, 1, 64, 32, False, False),             # only query tokens in the context
]


def _case_inputs(seq_lens, q_lens, hkv, group, d, bs, tree, sparse, seed):
    """A case's caches (AMX and vec layouts), block table, seq_lens, query_start_loc, query, tree mask
    and block selection."""
    gen = torch.Generator().manual_seed(seed)
    amx, vec, table = _caches(seq_lens, hkv, d, bs, gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), hkv * group, d, generator=gen).to(torch.bfloat16)
    mask = _tree_mask(q_lens, gen) if tree else None
    sel, nsel = _selection(seq_lens, q_lens, hkv, bs, gen) if sparse else (None, None)
    return amx, vec, table, seq, qsl, query, mask, sel, nsel


@pytest.mark.parametrize("seq_lens,q_lens,hkv,group,d,bs,tree,sparse", CASES)
def test_amx_layout_matches_reference(seq_lens, q_lens, hkv, group, d, bs, tree, sparse, amx_tiles):
    amx, vec, table, seq, qsl, query, mask, sel, nsel = _case_inputs(seq_lens, q_lens, hkv, group, d, bs, tree,
                                                                     sparse, seed=sum(seq_lens) + d)
    scale = d ** -0.5

    out = ops.block_sparse_tree_attention(query, *paged_kv_views(amx, "amx"), table, seq, qsl, scale,
                                          sel, nsel, mask)
    amx_tiles()
    expected = torch.empty_like(query)
    ref.block_sparse_tree_attention(expected, query, *paged_kv_views(vec), table, seq, qsl, sel, nsel, mask, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), rtol=RTOL, atol=ATOL)
    # The reference reads the AMX views too (logical_kv) and agrees with itself on the vec layout.
    again = torch.empty_like(query)
    ref.block_sparse_tree_attention(again, query, *paged_kv_views(amx, "amx"), table, seq, qsl, sel, nsel, mask,
                                    scale)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_amx_layout_is_bf16_only():
    amx = torch.zeros(2, 1, 32, 128, dtype=torch.float32)
    key, value = paged_kv_views(amx, "amx")
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.block_sparse_tree_attention(q, key, value, torch.zeros(1, 2, dtype=torch.int32),
                                        torch.tensor([1], dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32), 0.1)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_move_kv_tokens_in_either_layout(isa):
    """Token moves (a draft tree's accepted path into place) copy exactly those tokens' K and V."""
    gen = torch.Generator().manual_seed(3)
    amx, vec, table = _caches([200], 2, 64, 32, gen)
    cache = amx if isa == "amx" else vec
    src = torch.tensor([130, 133, 140])
    dst = torch.tensor([129, 130, 131])  # 130 is read before it is overwritten
    before = [t.clone() for t in ref.logical_kv(*paged_kv_views(cache, isa))] if isa == "amx" else \
        [t.clone() for t in paged_kv_views(cache, isa)]
    sb, db = table[0, src // 32].long(), table[0, dst // 32].long()
    move_kv_tokens(cache, isa, sb, src % 32, db, dst % 32)
    after = ref.logical_kv(*paged_kv_views(cache, isa)) if isa == "amx" else paged_kv_views(cache, isa)
    for b, a in zip(before, after):
        expect = b.clone()
        expect[db, :, dst % 32] = b[sb, :, src % 32]
        torch.testing.assert_close(a, expect, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4], CASES[5]],
                         ids=["24-rows", "96-rows", "tree-sparse", "d64"])
def test_streamed_prefetch_gives_the_same_output(case, amx_tiles, monkeypatch):
    """SPARSEVER_CPU_AMX_PREFETCH=stream streams the blocks ahead in over the tile steps instead of one
    line per page: prefetches only, so the output is the default's to the bit."""
    amx, _, table, seq, qsl, query, mask, sel, nsel = _case_inputs(*case, seed=7)
    d = query.shape[-1]
    outs = {}
    for mode in ("pages", "stream"):
        monkeypatch.setenv("SPARSEVER_CPU_AMX_PREFETCH", mode)
        outs[mode] = ops.block_sparse_tree_attention(query, *paged_kv_views(amx, "amx"), table, seq, qsl,
                                                     d ** -0.5, sel, nsel, mask)
    amx_tiles()
    assert not outs["stream"].isnan().any()
    torch.testing.assert_close(outs["stream"], outs["pages"], rtol=0, atol=0)


def test_unknown_amx_prefetch_is_refused(monkeypatch):
    if not (ops.amx_available() or ops.amx_emulation_available()):
        pytest.skip("needs AMX tiles or their emulation")
    if not ops.amx_available():
        monkeypatch.setenv("SPARSEVER_CPU_AMX_EMULATE", "1")
    monkeypatch.setenv("SPARSEVER_CPU_AMX_PREFETCH", "lines")
    gen = torch.Generator().manual_seed(1)
    amx, _, table = _caches([40], 1, 64, 32, gen)
    q = torch.randn(1, 1, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="SPARSEVER_CPU_AMX_PREFETCH=lines: allowed values are 'pages'"):
        ops.block_sparse_tree_attention(q, *paged_kv_views(amx, "amx"), table, torch.tensor([40], dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("q_len", [4, 16])
def test_streamed_prefetch_fetches_what_the_tiles_read_next(q_len, monkeypatch):
    """The stream's schedule, followed on the emulated tiles: it prefetches most of the context's K/V
    lines (all but each work item's first block's K), and nearly every prefetched line is read by a
    tile load at least 16 tile loads later (the rest: V of partial segments, read through a zero-padded
    copy). Prefetching the blocks of the iteration under way instead reaches 0.86-0.90 here."""
    if not ops.amx_emulation_available():
        pytest.skip("the AMX emulation needs the AVX-512 build on a CPU with AVX512-BF16")
    monkeypatch.setenv("SPARSEVER_CPU_AMX_EMULATE", "1")
    monkeypatch.setenv("SPARSEVER_CPU_AMX_PREFETCH", "stream")
    hkv, group, d, bs, ctx = 2, 6, 128, 128, 4096
    gen = torch.Generator().manual_seed(5)
    amx, _, table = _caches([ctx + q_len], hkv, d, bs, gen)
    query = torch.randn(q_len, hkv * group, d, generator=gen).to(torch.bfloat16)
    issued0, loaded0 = ops.amx_emulated_prefetch_lines()
    ops.block_sparse_tree_attention(query, *paged_kv_views(amx, "amx"), table,
                                    torch.tensor([ctx + q_len], dtype=torch.int32),
                                    torch.tensor([0, q_len], dtype=torch.int32), d ** -0.5)
    issued, loaded = (a - b for a, b in zip(ops.amx_emulated_prefetch_lines(), (issued0, loaded0)))
    kv_lines = ctx // bs * hkv * 2 * bs * d * 2 // 64  # the context's K and V, 64-byte lines
    assert issued >= 0.75 * kv_lines, (issued, kv_lines)
    assert issued <= 1.05 * kv_lines, (issued, kv_lines)
    assert loaded >= 0.97 * issued, (loaded, issued)
