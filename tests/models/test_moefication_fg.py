"""Fine-grained MoEfication (Qwen2-MoE with a shared expert and dense layers) on a tiny random Llama."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from vllm_sparsever.models import moefication as moe
from vllm_sparsever.models import moefication_fg as fg

N_LAYERS, INTER = 3, 128


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=INTER, num_hidden_layers=N_LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


SMALL = dict(calib_seq_len=32, calib_sequences=16, cluster_tokens=256, kmeans_iters=10, router_steps=60,
             router_tokens=384, router_holdout=128)  # fmt: skip


@pytest.fixture(scope="module")
def calib(tiny_llama):
    ids = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(1))
    return ids, moe.capture_ffn_inputs(tiny_llama, ids)


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(96)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t2")


def _write(tiny_llama, calib, cfg, path):
    _, inputs = calib
    layers = fg.moefy_layers(tiny_llama, list(inputs), cfg)
    fg.write_qwen2_moe_folder(tiny_llama, _tokenizer(), layers, cfg, path, "float32", path)
    return layers


def test_config_sizes_and_layers(tiny_llama, calib, tmp_path):
    cfg = fg.FineGrainedConfig(num_experts=8, top_k=2, shared_neurons=32, dense_layers=(0,), **SMALL)
    layers = _write(tiny_llama, calib, cfg, tmp_path)
    assert sorted(layers) == [1, 2]  # layer 0 stays dense
    for layer in layers.values():  # shared + routed experts partition the neurons
        assert sorted(torch.cat([layer.shared, *layer.experts]).tolist()) == list(range(INTER))
        assert layer.shared.numel() == 32 and all(e.numel() == 12 for e in layer.experts)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["shared_expert_intermediate_size"], config["intermediate_size"], config["mlp_only_layers"],
            config["norm_topk_prob"]) == (8, 2, 12, 32, INTER, [0], True)  # fmt: skip
    experts = json.loads((tmp_path / "moefication_experts.json").read_text())
    assert experts["dense_layers"] == [0] and sorted(k for k in experts if k != "dense_layers") == ["1", "2"]
    with pytest.raises(ValueError, match="equal experts"):
        fg.FineGrainedConfig(num_experts=7, shared_neurons=32).moe_intermediate_size(INTER)


def test_top_all_experts_folder_equals_dense(tiny_llama, calib, tmp_path):
    """Top-E-of-E through HF's Qwen2-MoE (softmax, renormalised top-k, sigmoid(0) shared gate)
    reproduces the dense Llama: the router scale and the x k / x 2 down-projection factors cancel."""
    from transformers import AutoModelForCausalLM

    cfg = fg.FineGrainedConfig(num_experts=8, top_k=8, shared_neurons=32, dense_layers=(0,), **SMALL)
    _write(tiny_llama, calib, cfg, tmp_path)
    qwen = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(qwen).__name__ == "Qwen2MoeForCausalLM"
    ids, _ = calib
    with torch.no_grad():
        got = qwen(input_ids=ids[:4]).logits
        dense = tiny_llama(input_ids=ids[:4]).logits
    # Renormalised weights are 1/k up to the tiny router scale: relative error ~1e-4.
    assert ((got - dense).norm() / dense.norm()).item() < 1e-3
    assert torch.equal(got.argmax(-1), dense.argmax(-1))


def test_top_k_folder_matches_reference_and_drops_experts(tiny_llama, calib, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = fg.FineGrainedConfig(num_experts=8, top_k=2, shared_neurons=32, dense_layers=(0,), **SMALL)
    layers = _write(tiny_llama, calib, cfg, tmp_path)
    qwen = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference = copy.deepcopy(tiny_llama)
    blocks = fg.patch_model(reference, layers, cfg.top_k)
    assert len(blocks) == 2
    ids, _ = calib
    with torch.no_grad():
        got = qwen(input_ids=ids[:2]).logits
        want = reference(input_ids=ids[:2]).logits
        dense = tiny_llama(input_ids=ids[:2]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, dense, atol=1e-3)  # top-2 of 8 really drops experts


def test_reference_block_equals_per_expert_sum(tiny_llama, calib):
    """The masked dense computation of the reference block = the sum over selected experts + shared."""
    _, inputs = calib
    cfg = fg.FineGrainedConfig(num_experts=8, top_k=3, shared_neurons=32, **SMALL)
    mlp = tiny_llama.model.layers[1].mlp
    layer = moe.moefy_layer(mlp, inputs[1], cfg.layer_config(), 1)
    block = fg.FineGrainedMoEFFN(mlp, layer, cfg.top_k)
    x = inputs[1][:50]
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    with torch.no_grad():
        probs = torch.softmax(x @ block.router.T, dim=1)
        w, ids = probs.topk(cfg.top_k, dim=1)
        w = w / w.sum(1, keepdim=True)
        want = moe.swiglu_act(x, wg[layer.shared], wu[layer.shared]) @ wd[:, layer.shared].T
        for t in range(x.shape[0]):
            for j in range(cfg.top_k):
                idx = layer.experts[int(ids[t, j])]
                want[t] += cfg.top_k * w[t, j] * (moe.swiglu_act(x[t : t + 1], wg[idx], wu[idx]) @ wd[:, idx].T)[0]
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_distinct_experts_curve():
    # one sequence, k=1 of E=4: experts 0,0,1,2 -> N=1: 1; N=2: windows {0},{0,1},{1,2} -> 5/3; N=4: 3
    ids = torch.tensor([[[0], [0], [1], [2]]])
    curve = fg.distinct_experts_curve(ids, 4, 4)
    assert curve[0] == 1 and abs(curve[1] - 5 / 3) < 1e-6 and curve[3] == 3
    indep = fg.independent_curve(4, 1, 4)
    assert indep[0] == 1 and abs(indep[1] - 4 * (1 - 0.75**2)) < 1e-9


def test_registry_and_folder_names():
    from vllm_sparsever.models.builder import _folder_name
    from vllm_sparsever.models.registry import get_spec

    spec = get_spec("smollm2-135m-moe-fg")
    assert spec.architecture == "qwen2_moe" and spec.base == "smollm2-135m"
    fg.FineGrainedConfig(num_experts=spec.num_experts, shared_neurons=spec.shared_neurons).moe_intermediate_size(1536)
    assert _folder_name("smollm2-135m-moe-fg", None, None) == "smollm2-135m-moe-fg"
    assert _folder_name("smollm2-135m-moe-fg", 16, 4, 512) == "smollm2-135m-moe-fg-e16k4s512"
    old = get_spec("smollm2-135m-moe")  # unchanged
    assert (old.architecture, old.num_experts, old.top_k, old.shared_neurons) == ("mixtral", 8, 6, 256)


def test_router_smoothing(tiny_llama, calib):
    """Neighbour-smoothed router targets: shares mixed within a sequence only; the layer is still a
    partition of the neurons and the router beats chance on each token's own top-k."""
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [3.0, 1.0]])  # 2 sequences of 2 tokens
    torch.testing.assert_close(fg.smooth_scores(scores, 2, 1, 0.0), torch.tensor([[1.0, 0], [0, 1], [1, 0], [0.75, 0.25]]))
    torch.testing.assert_close(fg.smooth_scores(scores, 2, 1, 1.0), torch.tensor([[0.5, 0.5]] * 2 + [[0.875, 0.125]] * 2))
    _, inputs = calib
    cfg = fg.FineGrainedConfig(num_experts=8, top_k=2, shared_neurons=32, router_smoothing=0.8, router_window=2,
                               **{**SMALL, "calib_seq_len": 32})  # fmt: skip
    layer = fg.moefy_layer(tiny_llama.model.layers[1].mlp, inputs[1], cfg, 1)
    assert sorted(torch.cat([layer.shared, *layer.experts]).tolist()) == list(range(INTER))
    assert layer.router_recall > 2 / 8
