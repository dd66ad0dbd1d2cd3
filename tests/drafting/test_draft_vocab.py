"""VocabTrim: token ranking from the target's generated text, and the LM head rows it reads."""

import pytest
import torch
from types import SimpleNamespace

from vllm_sparsever.drafting.draft_vocab import (
    available_draft_vocab,
    load_draft_vocab,
    rank_tokens,
    save_draft_vocab,
)


def test_rank_tokens_by_frequency_with_forced_tokens_first():
    ranked = rank_tokens([[5, 7, 7, 9], [7, 5, 2]], always=(2, 11))
    assert ranked.tolist() == [2, 11, 7, 5, 9]  # 7 x3, 5 x2, then 9 (ties by id)


def test_save_and_load(tmp_path):
    save_draft_vocab(tmp_path, rank_tokens([[4, 4, 3], [3, 4, 8]], always=(2,)))
    assert available_draft_vocab(tmp_path) == 4
    assert load_draft_vocab(tmp_path, 3).tolist() == [2, 4, 3]
    with pytest.raises(ValueError, match="4 ranked tokens, 5 asked"):
        load_draft_vocab(tmp_path, 5)
    assert available_draft_vocab(tmp_path / "nowhere") == 0


def test_lm_head_rows_single_rank(vllm_env):
    from vllm_sparsever.compat.model import lm_head_rows

    weight = torch.randn(10, 4)
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=weight))
    ids = torch.tensor([7, 2, 9])
    rows = lm_head_rows(model, ids)
    assert torch.equal(rows, weight[ids])
    # Logits over the trimmed rows equal the full logits at those ids.
    h = torch.randn(3, 4)
    assert torch.allclose(h @ rows.T, (h @ weight.T)[:, ids])


def _head(vocab=50, hidden=8, soft_cap=None, scale=1.0):
    from vllm_sparsever.compat.model import PlainLMHead

    return PlainLMHead(weight=torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)),
                       soft_cap=soft_cap, scale=scale)


def test_plain_lm_head_matches_vllms_logits_processor(vllm_env):
    """Contract: compat.model.plain_lm_head reproduces vLLM's `compute_logits` (LogitsProcessor over a
    ParallelLMHead: padding dropped, soft cap, scale) from weight rows alone."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm_sparsever.compat.model import plain_lm_head

    torch.manual_seed(0)
    lm_head = ParallelLMHead(37, 8, params_dtype=torch.float32)  # padded to 64 rows
    lm_head.weight.data.normal_()
    lm_head.quant_method.process_weights_after_loading(lm_head)  # as the model loader does
    processor = LogitsProcessor(37, scale=0.5, soft_cap=3.0)
    head = plain_lm_head(SimpleNamespace(lm_head=lm_head, logits_processor=processor))
    assert head.weight.shape[0] == 37
    hidden = torch.randn(3, 8)
    full = processor(lm_head, hidden)
    assert full.shape == (3, 37)
    ids = torch.tensor([36, 0, 5])
    assert torch.allclose(head.logits(hidden, head.weight[ids]), full[:, ids], atol=1e-5)
    with pytest.raises(ValueError, match="bias"):
        plain_lm_head(SimpleNamespace(lm_head=ParallelLMHead(37, 8, bias=True, params_dtype=torch.float32),
                                      logits_processor=processor))


def test_context_vocab_drafts_low_ids_stop_tokens_and_the_requests_tokens():
    import numpy as np

    from vllm_sparsever.drafting.draft_vocab import ContextDraftVocab

    head = _head(soft_cap=5.0, scale=2.0)
    vocab = ContextDraftVocab(head, 10, always=(45, 3, 99))  # 3 is below 10, 99 outside the vocabulary
    vocab.update(["a", "b"], [np.array([1, 30, 12, 30]), np.array([4, 5])])
    assert vocab.ids.tolist() == list(range(10)) + [12, 30, 45]
    hidden = torch.randn(4, 8)
    full = head.logits(hidden, head.weight)
    # Logits of the drafted ids equal the full head's at those ids; argmax/top map back to token ids.
    assert torch.allclose(vocab.logits(hidden), full[:, vocab.ids], atol=1e-5)
    best = full[:, vocab.ids].argmax(-1)
    assert vocab.argmax(hidden) == vocab.ids[best].tolist()
    probs, ids = vocab.top(hidden, 3)
    assert ids[:, 0].tolist() == vocab.ids[best].tolist()
    assert torch.allclose(probs.sum(-1), torch.softmax(full[:, vocab.ids], -1).topk(3, -1).values.sum(-1))
    # New tokens of a live request join; a finished request's leave; an unchanged batch reuses the rows.
    vocab.update(["a", "b"], [np.array([1, 30, 12, 30, 20]), np.array([4, 5])])
    assert vocab.ids.tolist()[10:] == [12, 20, 30, 45] and vocab.rebuilds == 2
    vocab.update(["b"], [np.array([4, 5, 6])])
    assert vocab.ids.tolist()[10:] == [45] and vocab.rebuilds == 3
    vocab.update(["b"], [np.array([4, 5, 6, 7])])
    assert vocab.rebuilds == 3
    with pytest.raises(ValueError, match="between 1 and the draft model's vocabulary"):
        ContextDraftVocab(head, 51)


def test_context_vocab_takes_the_lowest_ids_from_their_prepared_product():
    """`prepare`: the lowest ids' logits come from the product it prepares over their rows (called
    with the hidden states only), the extra rows from `linear`; the logits equal the full head's at
    the drafted ids."""
    import numpy as np

    from vllm_sparsever.drafting.draft_vocab import ContextDraftVocab

    head = _head(soft_cap=5.0, scale=2.0)
    rows = head.weight[:10].clone()
    calls = []

    def lowest(x):
        calls.append(x.shape)
        return x @ rows.t()

    prepared = []
    vocab = ContextDraftVocab(head, 10, always=(45,), prepare=lambda r: prepared.append(r.shape) or lowest)
    assert prepared == [(10, 8)]
    vocab.update(["a"], [np.array([1, 30])])
    hidden = torch.randn(2, 8)
    assert torch.allclose(vocab.logits(hidden), head.logits(hidden, head.weight)[:, vocab.ids], atol=1e-5)
    assert calls == [(2, 8)]


@pytest.mark.parametrize("kernel", ["vllm", "vllm-padded", "sparsever", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_rows_linear_follows_the_linear_kernel(kernel, dtype):
    """verification/lossless/linear_kernel.py head_rows_linear: on CPU the product with a draft's LM head rows, prepared
    as the engine's linear_kernel prepares linears (dense_linear, or vLLM-CPU's packed linear for
    16-bit rows, padded under "vllm-padded"); torch's linear (None) for fp32 rows under "vllm"."""
    from vllm_sparsever.verification.lossless.linear_kernel import head_rows_linear

    rows = (torch.randn(40, 64) * 0.1).to(dtype)
    product = head_rows_linear(rows, kernel)
    if dtype == torch.float32 and kernel == "vllm":
        assert product is None
        return
    rows_before = rows.clone()
    for tokens in (1, 3, 5):
        x = torch.randn(tokens, 64, dtype=dtype)
        torch.testing.assert_close(product(x).float(), x.float() @ rows.float().t(), rtol=2e-2, atol=2e-2)
    assert torch.equal(rows, rows_before)  # the plain rows stay (the head's own weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_head_rows_linear_is_int8_linear_over_rows_quantized_per_row(dtype):
    """verification/lossless/linear_kernel.py int8_head_rows_linear: a W8A8 draft's LM head rows quantized
    once to int8 per row (`quantize_int8_rows`, as models/quantize.py quantizes the projections), the
    product on int8_linear: equal to the PyTorch reference of int8_linear over those rows, near the
    16-bit product, its top-1 row mostly the same; the head's own rows untouched."""
    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever import reference
    from vllm_sparsever.models.quantize import quantize_int8_per_channel
    from vllm_sparsever.verification.lossless.linear_kernel import int8_head_rows_linear

    torch.manual_seed(0)
    rows = (torch.randn(300, 128) * 0.05).to(dtype)
    rows_before = rows.clone()
    q, scale, sums = ops.quantize_int8_rows(rows)
    assert q.dtype == torch.int8 and scale.shape == (300,) and torch.equal(sums, q.sum(1, dtype=torch.int32))
    assert (q.abs().amax(1) == 127).all()  # each row's largest weight takes the full range
    torch.testing.assert_close(q.float() * scale[:, None], rows.float(), atol=float(scale.max()) / 2 + 1e-6, rtol=0)
    q_build, scale_build = quantize_int8_per_channel(rows)  # a checkpoint's rows, quantized the same way
    assert torch.equal(q_build, q) and torch.equal(scale_build[:, 0], scale)
    product = int8_head_rows_linear(rows)
    x = torch.randn(5, 128, dtype=dtype)
    expected = torch.empty(5, 300, dtype=dtype)
    reference.int8_linear(expected, x, q, scale, sums, None)
    got = product(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3)
    exact = x.float() @ rows.float().t()
    assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()
    assert (got.float().argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8
    assert torch.equal(rows, rows_before)


def test_a_draft_models_price_before_its_first_pass():
    """EVICT's DraftCost of a draft model, from the configs: a pass's bytes (projections at their stored
    bits, the LM head rows it reads, with draft_vocab fewer) against the target's, and a catch-up
    token's weights against the target's; no price where a config does not describe a dense decoder."""
    from vllm_sparsever.drafting.draft_model import _relative_cost

    def model(dtype, **config):
        m = torch.nn.Linear(2, 2).to(dtype)  # its dtype is the model's
        m.config = SimpleNamespace(**config)
        return m

    target = model(torch.bfloat16, hidden_size=16, num_hidden_layers=4, intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=4, vocab_size=100)
    shape = dict(hidden_size=8, num_hidden_layers=2, intermediate_size=16, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=100)
    int4 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4}}}}
    draft = model(torch.bfloat16, **shape, quantization_config=int4)
    draft_proj, draft_head = 2 * (2 * 8 * 2 * 4 + 2 * 8 * 1 * 4 + 3 * 8 * 16), 100 * 8
    target_proj, target_head = 4 * (2 * 16 * 4 * 4 + 2 * 16 * 2 * 4 + 3 * 16 * 32), 100 * 16
    target_bytes = 2 * (target_proj + target_head)
    cost = _relative_cost(draft, target, None)
    assert cost.pass_share == pytest.approx((draft_proj / 2 + 2 * draft_head) / target_bytes)  # int4 body, bf16 head
    assert cost.prompt_share == pytest.approx((draft_proj + draft_head) / (target_proj + target_head))
    vocab = SimpleNamespace(size=25)  # a quarter of the head's rows
    assert _relative_cost(draft, target, vocab).pass_share == pytest.approx(
        (draft_proj / 2 + 2 * draft_head / 4) / target_bytes)
    # the head's rows run int8 (int8_head_rows_linear): a byte a weight
    assert _relative_cost(draft, target, vocab, head_bits=8).pass_share == pytest.approx(
        (draft_proj / 2 + draft_head / 4) / target_bytes)
    gptq8 = model(torch.bfloat16, **shape, quantization_config={"quant_method": "gptq", "bits": 8})
    assert _relative_cost(gptq8, target, None).pass_share == pytest.approx((draft_proj + 2 * draft_head) / target_bytes)
    plain = model(torch.float32, **shape)  # fp32: 4 bytes a weight
    assert _relative_cost(plain, target, None).pass_share == pytest.approx(4 * (draft_proj + draft_head) / target_bytes)
    moe = model(torch.bfloat16, **{**shape, "num_experts": 8})
    assert _relative_cost(moe, target, None) is None and _relative_cost(draft, torch.nn.Linear(2, 2), None) is None
