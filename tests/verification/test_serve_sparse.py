"""Sparse verification inside `vllm serve`: attention + FFN on a dense model, seen on /metrics."""

import time

import pytest

from serve_utils import running_server, sparsever_metrics
from tiny_models import make_tiny_llama, prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def sparse_server(tiny_dir, tmp_path_factory):
    target = make_tiny_llama(tiny_dir / "target4", seed=0, num_layers=4)
    spec = {"method": "sparsever", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "attention": {"enabled": True, "min_context_len": 256, "top_k_blocks": 1},
            "ffn": {"enabled": True, "keep_ratio": 0.25}}
    log = tmp_path_factory.mktemp("serve_sparse") / "server.log"
    with running_server(target, spec, log, "--max-model-len", "2048") as base:
        yield base


def test_serve_runs_sparse_attention_and_ffn(sparse_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{sparse_server}/v1", api_key="unused", timeout=120)
    long_prompt = prompts(1, length=12, seed=5)[0] * 55  # ~700 tokens: 5+ KV blocks
    resp = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=32, temperature=0.0)
    assert resp.usage.completion_tokens == 32
    time.sleep(0.6)  # worker snapshots are written at most every 0.25 s
    values = sparsever_metrics(sparse_server)

    def counter(name):
        return values.get(f'sparsever:sparsity_total{{counter="{name}"}}', 0.0)

    assert values.get("sparsever:num_verify_steps_total", 0) > 0, values
    assert counter("attn_layers_sparse") > 0, values
    assert 0 < counter("attn_kv_blocks_read") < counter("attn_kv_blocks_dense")
    assert counter("ffn_layers_sparse") > 0
    assert 0 < counter("ffn_neurons_read") < counter("ffn_neurons_dense")
    assert values.get("sparsever:num_dense_fallbacks_total", 0) == 0
