"""Every `vllm-sparsever` command that runs a model, with its defaults (plus the smallest size flags),
on every kind of model the project builds: a dense Llama, a Qwen2 whose maximum length is short (1K:
every default length is clamped to it), a Mixtral-style MoE and a shared-expert MoE (Qwen2-MoE).
Each run exits 0 with no traceback or engine warning and writes the file it promises, which loads.
Hostile arguments are in tests/test_cli_errors.py."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KINDS = ("llama", "qwen2-short", "mixtral", "qwen2-moe")
SHORT = 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_models import make_tiny_llama, make_tiny_qwen2
    from tiny_moe import make_tiny_mixtral, make_tiny_qwen2_moe

    root = tmp_path_factory.mktemp("matrix")
    return {
        "llama": make_tiny_llama(root / "llama", max_position_embeddings=4096),
        "qwen2-short": make_tiny_qwen2(root / "qwen2", max_position_embeddings=SHORT),
        "mixtral": make_tiny_mixtral(root / "mixtral", max_position_embeddings=4096),
        "qwen2-moe": make_tiny_qwen2_moe(root / "qwen2-moe", max_position_embeddings=4096),
    }


def _run(*argv: str, kind: str) -> subprocess.CompletedProcess:
    # On the first kind each command runs vLLM's default multiprocess engine, as users get it (its
    # clean exit is what the checks below are about; `generate` there is the set-up's main job on a
    # tiny model); on the others in-process, as the tests' engines.
    multiprocess = "1" if kind == KINDS[0] else os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    proc = subprocess.run([sys.executable, "-m", "vllm_sparsever.cli", *argv], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",
                                                VLLM_ENABLE_V1_MULTIPROCESSING=multiprocess))
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "exited unexpectedly" not in proc.stderr, proc.stderr[-3000:]
    assert "force killing" not in proc.stderr, proc.stderr[-3000:]  # the engine exited on its own
    return proc


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])


@pytest.mark.parametrize("kind", KINDS)
def test_generate(models, kind, tmp_path):
    out = tmp_path / "metrics.json"
    proc = _run("generate", "--model", str(models[kind]), "--max-tokens", "8", "--metrics-json", str(out), kind=kind)
    _ok(proc)
    assert "tokens/s:" in proc.stdout and json.loads(out.read_text())["num_tokens"] > 0
    if kind == "qwen2-short":  # the default --max-model-len (2048) is clamped to the model's, and said
        assert f"generate: --max-model-len {SHORT} (the model's maximum length is {SHORT})" in proc.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_calibrate(models, kind, tmp_path):
    from vllm_sparsever.verification.sparse.profile import CalibrationProfile

    out = tmp_path / "profile.json"
    proc = _run("calibrate", str(models[kind]), "--output", str(out), "--num-windows", "2", "--no-progress", kind=kind)
    _ok(proc)
    profile = CalibrationProfile.load(out)
    assert profile.num_layers == 2
    if kind == "qwen2-short":
        assert f"calibrate: --max-tokens {SHORT} (the model's maximum length is {SHORT})" in proc.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_train_exits(models, kind, tmp_path):
    from vllm_sparsever.drafting.exit_head import SUPPORTED_ARCHITECTURES, ExitHeadManifest

    architecture = json.loads((models[kind] / "config.json").read_text())["architectures"][0]
    assert architecture in SUPPORTED_ARCHITECTURES  # every kind built here (MoE blocks differ in the MLP only)
    out = tmp_path / "heads"
    _ok(_run("train-exits", str(models[kind]), "--output", str(out), "--num-prompts", "4",
             "--num-heldout-prompts", "2", "--max-new-tokens", "16", "--time-budget", "2", "--no-progress", kind=kind))
    manifest = ExitHeadManifest.load(out)
    assert manifest.num_hidden_layers == 2 and manifest.heads


@pytest.mark.parametrize("kind", KINDS)
def test_train_eagle(models, kind, tmp_path):
    out = tmp_path / "eagle3"
    proc = _run("train-eagle", str(models[kind]), "--output", str(out), "--num-prompts", "4",
                "--num-heldout-prompts", "2", "--max-new-tokens", "16", "--epochs", "1", "--draft-vocab", "64",
                "--samples-per-prompt", "2",
                "--time-budget", "2", "--no-progress", kind=kind)
    if kind in ("mixtral", "qwen2-moe"):  # vLLM's EAGLE-3 drafter reads no MoE target's layer outputs
        assert proc.returncode == 2 and "MODEL: vLLM's EAGLE-3 drafter reads" in proc.stderr, proc.stderr[-2000:]
        return
    _ok(proc)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert (out / "model.safetensors").is_file() and json.loads((out / "sparsever_eagle.json").read_text())["steps"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_profile_verify(models, kind, tmp_path):
    from vllm_sparsever.adaptive.cost import VerifyCostProfile

    out = tmp_path / "cost.json"
    proc = _run("profile-verify", str(models[kind]), "--quick", "--out", str(out), kind=kind)
    _ok(proc)
    profile = VerifyCostProfile.load(out)
    assert profile.coef and all(v == v for v in profile.fit_error.values())
    assert bool(profile.moe) == (kind in ("mixtral", "qwen2-moe"))
    if kind == "qwen2-short":  # the default --max-context (16384) is clamped to fit the model
        assert "profile-verify: --max-context" in proc.stdout and f"maximum length is {SHORT}" in proc.stdout
