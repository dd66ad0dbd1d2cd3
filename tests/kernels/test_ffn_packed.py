"""topk_block_swiglu_ffn (packed bf16 neuron blocks) vs the PyTorch reference, and the packed layout."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_sparsever._custom_ops as ops
import vllm_sparsever.reference as ref

from op_inputs import SELECTION_TIE_RTOL, assert_topk_selection, ffn_neuron_scores, ffn_weights, start_loc

BLOCK = ref.FFN_NEURON_BLOCK
BF16 = torch.bfloat16
# The kernel rounds x . w to fp32 sums of bf16 products and the SwiGLU product to bf16 (as a bf16 MLP
# does); the reference keeps fp32 throughout.
RTOL, ATOL = 2e-2, 2e-2


def _packed_problem(h, num_blocks, num_tokens, gen):
    w_gate_up, w_down_t = ffn_weights(h, num_blocks * BLOCK, BF16, gen)
    x = torch.randn(num_tokens, h, generator=gen).to(BF16)
    return x, w_gate_up, w_down_t, ref.pack_swiglu_ffn_blocks(w_gate_up, w_down_t)


def _block_scores(x, w_gate_up):
    scores = ffn_neuron_scores(x, w_gate_up)
    return scores.view(x.shape[0], scores.shape[1] // BLOCK, BLOCK).sum(-1)  # [T, nb]


def _check(out, sel, x, w_gate_up, w_down_t, packed, gsl, keep_blocks):
    rsel = torch.full_like(sel, 77)
    expected = torch.zeros_like(x)
    ref.topk_block_swiglu_ffn(expected, x, *packed, gsl, keep_blocks, rsel)
    scores = _block_scores(x, w_gate_up)
    starts = gsl.tolist()
    for g in range(len(starts) - 1):
        t0, t1 = starts[g], starts[g + 1]
        if t0 == t1:
            assert sel[g].tolist() == rsel[g].tolist() == [-1] * keep_blocks
            continue
        if assert_topk_selection(sel[g], rsel[g], scores[t0:t1].sum(0), keep_blocks, SELECTION_TIE_RTOL[BF16]):
            want = expected[t0:t1]
        else:  # near-tie at the cut: compare with the reference on the kernel's blocks
            idx = (sel[g].long()[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
            want = ref.swiglu_ffn_on_neurons(x[t0:t1], w_gate_up, w_down_t, idx).to(BF16)
        torch.testing.assert_close(out[t0:t1].float(), want.float(), rtol=RTOL, atol=ATOL)


def test_pack_layout_and_roundtrip():
    gen = torch.Generator().manual_seed(0)
    h, inter = 48, 64
    w_gate_up, w_down_t = ffn_weights(h, inter, BF16, gen)
    wg, wu, wd = ref.pack_swiglu_ffn_blocks(w_gate_up, w_down_t)
    assert wg.shape == wu.shape == (inter // BLOCK, h // 2, BLOCK, 2)
    assert wd.shape == (inter // BLOCK, h // BLOCK, BLOCK // 2, BLOCK, 2)
    b, p, i, r = 2, 5, 7, 1
    assert wg[b, p, i, r] == w_gate_up[BLOCK * b + i, 2 * p + r]
    assert wu[b, p, i, r] == w_gate_up[inter + BLOCK * b + i, 2 * p + r]
    c, l = 1, 9
    assert wd[b, c, 3, l, r] == w_down_t[BLOCK * b + 2 * 3 + r, BLOCK * c + l]
    gu, dt = ref.unpack_swiglu_ffn_blocks(wg, wu, wd)
    assert torch.equal(gu, w_gate_up) and torch.equal(dt, w_down_t)
    with pytest.raises(ValueError, match="multiples of 16"):
        ref.pack_swiglu_ffn_blocks(w_gate_up[:, :40], w_down_t[:, :40])


@settings(max_examples=40, deadline=None)
@given(
    h=st.sampled_from([16, 32, 48, 64, 128, 144]),
    num_blocks=st.integers(1, 12),
    groups=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    keep_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_block_ffn_matches_reference(h, num_blocks, groups, keep_frac, seed):
    gen = torch.Generator().manual_seed(seed)
    keep_blocks = max(1, round(keep_frac * num_blocks))
    x, w_gate_up, w_down_t, packed = _packed_problem(h, num_blocks, sum(groups), gen)
    gsl = start_loc(groups)
    out, sel = ops.topk_block_swiglu_ffn(x, *packed, gsl, keep_blocks)
    _check(out, sel, x, w_gate_up, w_down_t, packed, gsl, keep_blocks)


def test_keep_all_blocks_is_the_dense_mlp():
    gen = torch.Generator().manual_seed(1)
    x, w_gate_up, w_down_t, packed = _packed_problem(1536, 24, 6, gen)  # Qwen-1.5B hidden size
    out, sel = ops.topk_block_swiglu_ffn(x, *packed, start_loc([6]), 24)
    gate, up = (x.float() @ w_gate_up.float().t()).chunk(2, dim=-1)
    dense = (F.silu(gate) * up) @ w_down_t.float()
    torch.testing.assert_close(out.float(), dense, rtol=RTOL, atol=ATOL)
    assert sel[0].tolist() == list(range(24))


def test_reads_only_the_kept_blocks():
    gen = torch.Generator().manual_seed(2)
    x, w_gate_up, w_down_t, packed = _packed_problem(64, 8, 3, gen)
    out, sel = ops.topk_block_swiglu_ffn(x, *packed, start_loc([3]), 3)
    unused = sorted(set(range(8)) - set(sel[0].tolist()))
    wg, wu, wd = (w.clone() for w in packed)
    wu[unused] = float("nan")
    wd[unused] = float("nan")
    out2, sel2 = ops.topk_block_swiglu_ffn(x, wg, wu, wd, start_loc([3]), 3)
    assert torch.equal(sel, sel2) and torch.equal(out, out2)


def test_groups_select_independently():
    gen = torch.Generator().manual_seed(3)
    x, w_gate_up, w_down_t, packed = _packed_problem(32, 10, 7, gen)
    x[4:] *= -3  # the second group's scores differ
    gsl = start_loc([4, 3])
    out, sel = ops.topk_block_swiglu_ffn(x, *packed, gsl, 4)
    alone, sel_alone = ops.topk_block_swiglu_ffn(x[4:].contiguous(), *packed, start_loc([3]), 4)
    assert torch.equal(sel[1], sel_alone[0]) and torch.equal(out[4:], alone)
    _check(out, sel, x, w_gate_up, w_down_t, packed, gsl, 4)


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(4)
    x, _, _, packed = _packed_problem(32, 4, 2, gen)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.topk_block_swiglu_ffn(x.float(), *packed, start_loc([2]), 2)
    with pytest.raises(RuntimeError, match="keep_blocks"):
        ops.topk_block_swiglu_ffn(x, *packed, start_loc([2]), 5)
    with pytest.raises(RuntimeError, match="w_down_p"):
        ops.topk_block_swiglu_ffn(x, packed[0], packed[1], packed[2][:, :1], start_loc([2]), 2)


def test_isa_names_the_kernel():
    assert ops.ffn_packed_isa() in ("avx512_bf16", "portable")


def test_opcheck_fake_impl():
    gen = torch.Generator().manual_seed(5)
    x, _, _, packed = _packed_problem(32, 4, 3, gen)
    out = torch.empty_like(x)
    sel = torch.empty(1, 2, dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparsever.topk_block_swiglu_ffn.default,
                          (out, x, *packed, start_loc([3]), 2, sel))
