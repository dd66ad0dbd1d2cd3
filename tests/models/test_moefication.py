"""MoEfication on a tiny random Llama: exact at top-E-of-E, approximate at top-k, Mixtral folder loads."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_sparsever.models import moefication as moe


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


CFG = dict(calib_seq_len=32, calib_sequences=16, cluster_tokens=256, kmeans_iters=10, router_steps=60,
           router_tokens=384, router_holdout=128)  # fmt: skip


@pytest.fixture(scope="module")
def calib_inputs(tiny_llama):
    ids = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(1))
    return ids, moe.capture_ffn_inputs(tiny_llama, ids)


def test_balanced_kmeans_is_balanced_and_finds_planted_clusters():
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=gen) * 5
    truth = torch.arange(64) % 4
    feats = centers[truth] + 0.1 * torch.randn(64, 16, generator=gen)
    labels = moe.balanced_kmeans(feats, 4, iters=10, seed=0)
    assert torch.bincount(labels, minlength=4).tolist() == [16, 16, 16, 16]
    # every planted cluster maps onto exactly one found cluster
    for c in range(4):
        assert labels[truth == c].unique().numel() == 1
    with pytest.raises(ValueError):
        moe.balanced_kmeans(feats[:63], 4, iters=2, seed=0)


@pytest.mark.parametrize("shared", [0, 16])
def test_top_all_experts_reproduces_dense_ffn(tiny_llama, calib_inputs, shared):
    _, inputs = calib_inputs
    cfg = moe.MoEficationConfig(num_experts=4, top_k=4, shared_neurons=shared, **CFG)
    mlp = tiny_llama.model.layers[0].mlp
    layer = moe.moefy_layer(mlp, inputs[0], cfg, layer_seed=0)
    # shared + routed experts are a partition of the neurons
    assert sorted(torch.cat([layer.shared, *layer.experts]).tolist()) == list(range(128))
    assert layer.shared.numel() == shared and all(e.numel() == (128 - shared) // 4 for e in layer.experts)
    ffn = moe.MoEFFN(
        mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, layer.experts, layer.router, 4, layer.shared
    )
    x = inputs[0][:200]
    with torch.no_grad():
        dense, routed = mlp(x), ffn(x)
    # Renormalised weights are 1/k up to the tiny router scale: relative error ~1e-4.
    assert (routed - dense).norm() / dense.norm() < 1e-3


def test_top_k_approximates_and_router_beats_chance(tiny_llama, calib_inputs):
    _, inputs = calib_inputs
    mlp = tiny_llama.model.layers[1].mlp
    x = inputs[1]
    with torch.no_grad():
        dense = mlp(x)
    errors = {}
    for k in (1, 2, 3):
        cfg = moe.MoEficationConfig(num_experts=4, top_k=k, **CFG)
        layer = moe.moefy_layer(mlp, x, cfg, layer_seed=1)
        with torch.no_grad():
            routed = moe.MoEFFN(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, layer.experts, layer.router, k)(x)
            random_router = torch.randn_like(layer.router)
            chance = moe.MoEFFN(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, layer.experts, random_router, k)(x)
        errors[k] = ((routed - dense).norm() / dense.norm()).item()
        chance_error = ((chance - dense).norm() / dense.norm()).item()
        assert errors[k] < chance_error, (k, errors[k], chance_error)
        assert layer.router_recall > k / 4  # better than picking k of 4 at random
    assert errors[1] > errors[2] > errors[3] > 0


def test_shared_neurons_reduce_the_error(tiny_llama, calib_inputs):
    """The most contributing neurons, kept in every expert, make top-1 much closer to dense."""
    _, inputs = calib_inputs
    mlp = tiny_llama.model.layers[1].mlp
    x = inputs[1]
    with torch.no_grad():
        dense = mlp(x)
    errors = []
    for shared in (0, 32):
        cfg = moe.MoEficationConfig(num_experts=4, top_k=1, shared_neurons=shared, **CFG)
        layer = moe.moefy_layer(mlp, x, cfg, layer_seed=1)
        with torch.no_grad():
            out = moe.MoEFFN(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, layer.experts,
                             layer.router, 1, layer.shared)(x)  # fmt: skip
        errors.append(((out - dense).norm() / dense.norm()).item())
    assert errors[1] < errors[0]


def test_mixtral_folder_matches_reference_moe(tiny_llama, calib_inputs, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    ids, _ = calib_inputs
    cfg = moe.MoEficationConfig(num_experts=4, top_k=2, shared_neurons=16, **CFG)
    layers = moe.moefy_model(tiny_llama, ids, cfg)
    vocab = {f"t{i}": i for i in range(96)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t2")
    moe.write_mixtral_folder(tiny_llama, tokenizer, layers, cfg, tmp_path, "float32", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 28 + 16)

    mixtral = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference = __import__("copy").deepcopy(tiny_llama)
    moe.patch_model_with_moe(reference, layers, cfg.top_k)
    with torch.no_grad():
        got = mixtral(input_ids=ids[:2]).logits
        want = reference(input_ids=ids[:2]).logits
        dense = tiny_llama(input_ids=ids[:2]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, dense, atol=1e-3)  # top-2 of 4 really drops experts
