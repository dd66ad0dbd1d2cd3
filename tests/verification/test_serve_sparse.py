"""Sparse verification inside `vllm serve`: attention + FFN on a dense model, attention + MoE on an
MoE model, seen on /metrics."""


import pytest

from serve_utils import running_server, settled_sparsever_metrics
from tiny_models import make_tiny_llama, prompts
from tiny_moe import make_tiny_mixtral

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def sparse_server(tiny_dir, tmp_path_factory):
    target = make_tiny_llama(tiny_dir / "target4", seed=0, num_layers=4)
    spec = {"method": "sparsever", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "attention": {"enabled": True, "min_context_len": 256, "top_k_blocks": 1},
            "ffn": {"enabled": True, "keep_ratio": 0.25, "weights": "shared"}}  # offline tests: "copy"
    log = tmp_path_factory.mktemp("serve_sparse") / "server.log"
    with running_server(target, spec, log, "--max-model-len", "2048") as base:
        yield base


def _long_completion(base: str) -> tuple[str, dict[str, float]]:
    """One ~700-token prompt (5+ KV blocks of 128); returns the greedy text and the server's sparsever
    metrics after it."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    long_prompt = prompts(1, length=12, seed=5)[0] * 55
    resp = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=32, temperature=0.0)
    assert resp.usage.completion_tokens == 32
    values = settled_sparsever_metrics(base, lambda v: v.get("sparsever:num_verify_steps_total", 0) > 0)
    assert values.get("sparsever:num_verify_steps_total", 0) > 0, values
    assert values.get("sparsever:num_dense_fallbacks_total", 0) == 0
    return resp.choices[0].text, values


def _counter(values: dict[str, float], name: str) -> float:
    return values.get(f'sparsever:sparsity_total{{counter="{name}"}}', 0.0)


def _assert_repeat_is_identical_and_sparse(base: str, first_text: str, first: dict[str, float],
                                           counters: tuple[str, ...]) -> None:
    """Sparse verification may change the text, so plain greedy is no reference here. What must hold:
    the same greedy request (fp32) gives the same text again, and it was verified sparsely again."""
    second_text, second = _long_completion(base)
    assert second_text == first_text, "two identical greedy requests gave different text"
    for name in counters:
        assert _counter(second, name) > _counter(first, name), (name, first, second)


def test_serve_runs_sparse_attention_and_ffn(sparse_server):
    text, values = _long_completion(sparse_server)

    def counter(name):
        return _counter(values, name)

    assert counter("attn_layers_sparse") > 0, values
    assert 0 < counter("attn_kv_blocks_read") < counter("attn_kv_blocks_dense")
    assert counter("ffn_layers_sparse") > 0
    assert 0 < counter("ffn_neurons_read") < counter("ffn_neurons_dense")
    _assert_repeat_is_identical_and_sparse(sparse_server, text, values, ("attn_layers_sparse", "ffn_layers_sparse"))


@pytest.fixture(scope="module")
def moe_server(tiny_dir, tmp_path_factory):
    target = make_tiny_mixtral(tiny_dir / "mixtral_serve", seed=0, num_layers=2, top_k=3)
    spec = {"method": "sparsever", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,  # the random Mixtral repeats the prompt less than the Llama
            "attention": {"enabled": True, "min_context_len": 256, "top_k_blocks": 1},
            "moe": {"enabled": True, "ratio_threshold": 0.9, "expert_budget": 2, "weights": "shared"}}
    log = tmp_path_factory.mktemp("serve_moe") / "server.log"
    # Count the dense-expert reference (a second routing, normally sampled) on every verify step.
    with running_server(target, spec, log, "--max-model-len", "2048",
                        env={"VLLM_SPARSEVER_STATS_SAMPLE_EVERY": "1"}) as base:
        yield base


def test_serve_runs_sparse_attention_and_moe(moe_server):
    text, values = _long_completion(moe_server)
    assert _counter(values, "attn_layers_sparse") > 0, values
    assert _counter(values, "moe_experts_read") == _counter(values, "moe_experts_read_sampled") > 0, values
    assert _counter(values, "moe_experts_read_sampled") < _counter(values, "moe_experts_dense_sampled"), values
    _assert_repeat_is_identical_and_sparse(moe_server, text, values, ("attn_layers_sparse", "moe_experts_read"))
