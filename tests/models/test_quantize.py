"""models/quantize.py: a model's decoder linears to int8 (W8A8) in a compressed-tensors folder."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_sparsever.models import quantize


def test_per_channel_int8_rounds_to_nearest_within_half_a_step():
    w = torch.randn(48, 80) * torch.logspace(-3, 0, 48).unsqueeze(1)  # rows of very different scales
    q, scale = quantize.quantize_int8_per_channel(w.to(torch.bfloat16))
    assert q.dtype == torch.int8 and scale.shape == (48, 1) and scale.dtype == torch.float32
    assert q.abs().max() == 127 and int(q.min()) >= -127
    back = q.float() * scale
    w32 = w.to(torch.bfloat16).float()
    assert ((back - w32).abs() <= scale / 2 + 1e-7).all()
    assert (q.abs().amax(dim=1) == 127).all()  # each row uses its whole range


def test_zero_rows_stay_zero():
    q, scale = quantize.quantize_int8_per_channel(torch.zeros(4, 32))
    assert (q == 0).all() and torch.isfinite(scale).all()


@pytest.fixture(scope="module")
def tiny_w8a8(tmp_path_factory):
    from tiny_models import make_tiny_qwen2

    base = make_tiny_qwen2(tmp_path_factory.mktemp("base") / "qwen2")
    out = tmp_path_factory.mktemp("w8a8")
    return base, out, quantize.build_w8a8_folder(base, out)


def test_folder_holds_int8_linears_and_everything_else_as_it_was(tiny_w8a8):
    from safetensors.torch import load_file

    base, out, facts = tiny_w8a8
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    linears = [n for n in before if quantize.LINEAR_WEIGHT.match(n)]
    assert len(linears) == 2 * 7 == facts["quantization"]["quantized_tensors"]  # 2 layers x q k v o gate up down
    for name in linears:
        q, scale = after[name], after[name[: -len("weight")] + "weight_scale"]
        assert q.dtype == torch.int8 and q.shape == before[name].shape and scale.shape == (q.shape[0], 1)
        err = (q.float() * scale - before[name].float()).norm() / before[name].float().norm()
        assert err < 0.02
    for name, tensor in before.items():  # embeddings, norms, biases, the LM head
        if name not in linears:
            assert torch.equal(after[name], tensor), name
    assert "lm_head.weight" in after and after["lm_head.weight"].dtype == before["lm_head.weight"].dtype
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == quantize.COMPRESSED_TENSORS_CONFIG
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    assert (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()
    assert 0 < facts["quantization"]["max_relative_weight_error"] < 0.02


def test_folder_without_weights_or_linears_is_refused(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        quantize.build_w8a8_folder(tmp_path, tmp_path / "out")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="no decoder linear weights"):
        quantize.build_w8a8_folder(tmp_path, tmp_path / "out")


def test_registry_names_its_base_and_scheme():
    from vllm_sparsever.models import registry

    spec = registry.get_spec("qwen2.5-coder-0.5b-w8a8")
    assert isinstance(spec, registry.QuantizedModelSpec) and spec.scheme in quantize.SCHEMES
    assert registry.required_packages(spec.name) == registry.required_packages(spec.base)
