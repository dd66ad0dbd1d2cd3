"""models/quantize.py: a model's decoder linears to int8 (W8A8) or int4 (W4A16) in a compressed-tensors folder."""

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


def test_int4_groups_keep_the_clip_with_the_least_error():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 0, 64).unsqueeze(1)
    w[3, 17] = 40.0  # an outlier: its group's best range clips it
    q, scale = quantize.quantize_int4_per_group(w, group_size=128, scale_dtype=torch.float32)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (64, 2)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    back = (q.float().view(64, 2, 128) * scale.unsqueeze(2)).view(64, 256)
    # round to nearest at the full range (the first candidate) is never better, group by group
    full = w.view(64, 2, 128).abs().amax(dim=2, keepdim=True) / 7.5
    rtn = (torch.round(w.view(64, 2, 128) / full).clamp(-8, 7) * full).view(64, 256)
    err = ((back - w) ** 2).view(64, 2, 128).sum(2)
    assert (err <= ((rtn - w) ** 2).view(64, 2, 128).sum(2) + 1e-12).all()
    assert (err < ((rtn - w) ** 2).view(64, 2, 128).sum(2)).any()  # and somewhere the search found better
    assert ((back - w).norm() / w.norm()) < 0.12
    # within a group every value is within half a step of its scale's grid, but for clipped ones
    inside = w.abs() <= 7 * scale.repeat_interleave(128, dim=1)
    assert ((back - w).abs()[inside] <= scale.repeat_interleave(128, dim=1)[inside] / 2 + 1e-6).all()


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="not a multiple of the int4 group size 128"):
        quantize.quantize_int4_per_group(torch.zeros(8, 96), group_size=128)


@pytest.fixture(scope="module")
def tiny_w4a16(tmp_path_factory):
    from tiny_models import make_tiny_qwen2

    base = make_tiny_qwen2(tmp_path_factory.mktemp("base4") / "qwen2")
    out = tmp_path_factory.mktemp("w4a16")
    return base, out, quantize.build_quantized_folder(base, out, "w4a16-int4")


def test_int4_folder_packs_eight_values_per_int32(tiny_w4a16):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    base, out, facts = tiny_w4a16
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    linears = [n for n in before if quantize.LINEAR_WEIGHT.match(n)]
    assert len(linears) == 2 * 7 == facts["quantization"]["quantized_tensors"]
    for name in linears:
        prefix = name[: -len("weight")]
        assert name not in after
        packed, scale, shape = after[prefix + "weight_packed"], after[prefix + "weight_scale"], after[prefix + "weight_shape"]
        n, k = before[name].shape
        assert packed.dtype == torch.int32 and packed.shape == (n, k // 8)
        assert scale.shape == (n, k // quantize.INT4_GROUP_SIZE) and scale.dtype == before[name].dtype
        assert shape.tolist() == [n, k]
        q = unpack_from_int32(packed, 4, torch.Size([n, k]))  # compressed-tensors' own reader
        expected, _ = quantize.quantize_int4_per_group(before[name], scale_dtype=before[name].dtype)
        assert torch.equal(q, expected)
    for name, tensor in before.items():
        if name not in linears:
            assert torch.equal(after[name], tensor), name
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == quantize.int4_config() and config["format"] == "pack-quantized"
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == quantize.INT4_GROUP_SIZE
    assert facts["quantization"]["scheme"] == "w4a16-int4"
    assert 0 < facts["quantization"]["max_relative_weight_error"] < 0.15


def test_unknown_scheme_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown quantization scheme 'w2'; known: w8a8-int8, w4a16-int4"):
        quantize.build_quantized_folder(tmp_path, tmp_path / "out", "w2")


def test_folder_without_weights_or_linears_is_refused(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        quantize.build_w8a8_folder(tmp_path, tmp_path / "out")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="no decoder linear weights"):
        quantize.build_w8a8_folder(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-w8a8", "qwen2.5-coder-0.5b-w4a16"])
def test_registry_names_its_base_and_scheme(name):
    from vllm_sparsever.models import registry

    spec = registry.get_spec(name)
    assert isinstance(spec, registry.QuantizedModelSpec) and spec.scheme in quantize.SCHEMES
    assert registry.required_packages(spec.name) == registry.required_packages(spec.base)
