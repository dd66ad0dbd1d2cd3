"""bench/draft_agreement.py's fake quantization: which projections each variant keeps in int8, the bytes
it counts, the weights as `models build` quantizes them, and the inputs quantized per token to int8."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import draft_agreement  # noqa: E402


def _model(**config):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, **config)
    return Qwen2ForCausalLM(config).to(torch.bfloat16)


def test_variants_pick_their_int8_projections():
    pick = draft_agreement.int8_projection
    assert pick("w8a8", "model.layers.3.mlp.up_proj", 24)
    assert not pick("w4a8", "model.layers.3.self_attn.q_proj", 24)
    assert pick("w4-mlp", "model.layers.3.self_attn.o_proj", 24) and not pick("w4-mlp", "model.layers.3.mlp.down_proj", 24)
    assert pick("w4-no-down", "model.layers.3.mlp.down_proj", 24) and not pick("w4-no-down", "model.layers.3.mlp.up_proj", 24)
    assert pick("w4-ends", "model.layers.23.mlp.up_proj", 24) and pick("w4-ends", "model.layers.1.mlp.up_proj", 24)
    assert not pick("w4-ends", "model.layers.11.mlp.up_proj", 24)


@pytest.mark.parametrize("variant, bytes_per_weight", [("bf16", 2.0), ("w8a8", 1.0), ("w4a8", 0.5)])
def test_fake_quantize_counts_bytes_and_quantizes_weights_and_inputs(variant, bytes_per_weight):
    from vllm_sparsever.models.quantize import quantize_int4_per_group, quantize_int8_per_channel

    model = _model()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    before = {n: m.weight.data.clone() for n, m in linears.items()}
    stored = draft_agreement.fake_quantize(model, variant)
    assert stored == bytes_per_weight * sum(w.numel() for w in before.values())
    w = before["model.layers.0.mlp.down_proj"]
    after = linears["model.layers.0.mlp.down_proj"].weight.data
    if variant == "bf16":
        assert torch.equal(after, w) and not linears["model.layers.0.mlp.down_proj"]._forward_pre_hooks
        return
    if variant == "w8a8":
        q, s = quantize_int8_per_channel(w)
        expected = (q.float() * s.float()).to(w.dtype)
    else:
        q, s = quantize_int4_per_group(w, 128, torch.bfloat16)
        expected = (q.float().view(w.shape[0], -1, 128) * s.float().unsqueeze(2)).view_as(w).to(w.dtype)
    assert torch.equal(after, expected)
    # the input reaches the product quantized per token: 127 levels of its largest magnitude (to bf16's
    # rounding of each level, 2^-9 relative)
    seen = []
    linear = linears["model.layers.0.mlp.down_proj"]
    handle = linear.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(3, 256).to(torch.bfloat16)
    linear(x)
    handle.remove()
    levels = seen[0].float() / (x.float().abs().amax(-1, keepdim=True) / 127)
    assert ((levels - levels.round()).abs() <= 0.004 * levels.abs() + 1e-3).all()
    assert not ((x.float() / (x.float().abs().amax(-1, keepdim=True) / 127)).frac().abs() < 0.004).all()


def test_head8_quantizes_a_copy_of_a_tied_lm_head():
    """w8a8-head8: the projections as w8a8, and the LM head int8 per row with its input int8 per token,
    in a weight of its own: the input embedding tied to it keeps its bf16 rows."""
    from vllm_sparsever.models.quantize import quantize_int8_per_channel

    model = _model(tie_word_embeddings=True)
    embedding = model.get_input_embeddings().weight
    assert model.lm_head.weight is embedding
    before = embedding.data.clone()
    stored = draft_agreement.fake_quantize(model, "w8a8-head8")
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    assert stored == sum(m.weight.numel() for m in linears)  # the head is not counted among the linears
    q, s = quantize_int8_per_channel(before)
    assert torch.equal(model.lm_head.weight, (q.float() * s.float()).to(before.dtype))
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert model.lm_head._forward_pre_hooks
