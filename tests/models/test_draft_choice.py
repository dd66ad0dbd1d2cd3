"""The draft a target gets per CPU class (models/registry.py DRAFTS): measured, named, buildable, valid."""

import argparse
import json
from pathlib import Path

import pytest

from vllm_sparsever.models import registry

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_cpu_class_from_the_flags():
    assert registry.cpu_isa({"amx_tile", "avx512_bf16", "avx512f"}) == "AMX"
    assert registry.cpu_isa({"avx512_bf16", "avx512f"}) == "AVX512-BF16"
    assert registry.cpu_isa({"avx2"}) == registry.cpu_isa({"avx512f", "avx2"}) == "AVX2"


def test_each_target_has_one_measured_draft_per_class_and_each_is_valid():
    from vllm_sparsever.config import SparseverConfig

    assert registry.draft_for("qwen2.5-coder-1.5b", "AMX").draft == "qwen2.5-coder-0.5b-w4a16"
    assert registry.draft_for("qwen2.5-coder-1.5b", "AVX512-BF16").draft == "qwen2.5-coder-0.5b-w8a8"
    assert registry.draft_for("smollm2-135m", "AVX2") is None
    for target, choices in registry.DRAFTS.items():
        assert target in registry.MODELS
        assert len({c.isa for c in choices}) == len(choices)
        for c in choices:
            assert c.draft in registry.MODELS
            run = c.measured.split()[0]  # the run that chose it is in the repository
            assert (RESULTS / f"{run}.md").exists() or (RESULTS / f"{run}.json").exists(), run
            spec = registry.speculative_config(c, "/drafts/x")
            assert spec["model"] == "/drafts/x" and c.config.get("model") is None
            SparseverConfig.from_dict(spec)  # the config a user is told to pass is one sparsever accepts


def test_building_a_target_offers_its_draft_and_builds_it_on_request(monkeypatch, capsys, tmp_path):
    from vllm_sparsever.models import builder, cli

    built = []
    monkeypatch.setattr(builder, "build_model", lambda name, root=None, **kw: built.append(name) or tmp_path / name)
    monkeypatch.setattr(registry, "cpu_isa", lambda flags=None: "AVX512-BF16")
    args = argparse.Namespace(name="qwen2.5-coder-1.5b", root=None, dtype="bfloat16", install=False, force=False,
                              keep_gguf=False, num_experts=None, top_k=None, shared_neurons=None, seed=0,
                              check=False, with_draft=False)
    assert cli._cmd_build(args) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(tmp_path / "qwen2.5-coder-1.5b")  # stdout: the folder only
    assert "qwen2.5-coder-0.5b-w8a8" in out.err and "models build qwen2.5-coder-0.5b-w8a8" in out.err
    assert built == ["qwen2.5-coder-1.5b"]
    args.with_draft = True
    cli._cmd_build(args)
    err = capsys.readouterr().err
    assert built[-1] == "qwen2.5-coder-0.5b-w8a8"
    config = json.loads(err.split("--speculative-config '", 1)[1].split("'", 1)[0])
    assert config["model"] == str(tmp_path / "qwen2.5-coder-0.5b-w8a8") and config["draft_vocab"] == 32768


@pytest.mark.parametrize("name", ["smollm2-135m"])
def test_a_model_without_a_measured_draft_prints_nothing_more(monkeypatch, capsys, tmp_path, name):
    from vllm_sparsever.models import builder, cli

    monkeypatch.setattr(builder, "build_model", lambda n, root=None, **kw: tmp_path / n)
    args = argparse.Namespace(name=name, root=None, dtype="bfloat16", install=False, force=False, keep_gguf=False,
                              num_experts=None, top_k=None, shared_neurons=None, seed=0, check=False, with_draft=True)
    assert cli._cmd_build(args) == 0
    assert capsys.readouterr().err == ""
