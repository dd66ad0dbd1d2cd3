"""Lossless sparse verification on a real model: Qwen2.5-Coder-0.5B (the set-up's default model) in
fp32, long-document prompts of ~1.5K tokens, n-gram drafts; the sparse target (a few KV blocks, a
quarter of the FFN neurons) checks each round, the dense target the pending tokens. Greedy output
must equal non-speculative greedy token for token (batch 3)."""

from __future__ import annotations

import gc
import os

import pytest

from vllm_sparsever.models import build_model, registry
from vllm_sparsever.store.packages import missing_packages

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "qwen2.5-coder-0.5b"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    missing = missing_packages(registry.required_packages(MODEL))
    if missing:
        pytest.skip(f"{MODEL}: not installed: {' '.join(p.requirement for p in missing)}")
    root = os.environ.get("SPARSEVER_TEST_MODELS_ROOT") or tmp_path_factory.mktemp("models")
    return build_model(MODEL, root=root)


@pytest.fixture(scope="module")
def long_prompts(model):
    from vllm_sparsever.data.long_context import long_context_prompts

    rows = long_context_prompts(model, 1536, task="summarize", n=3)
    assert len(rows) == 3 and all(1000 < r["num_tokens"] <= 1536 for r in rows)
    return [[{"role": "user", "content": r["prompt"]}] for r in rows]


def _greedy(model, prompts, spec):
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=3,
              seed=0, speculative_config=spec)
    try:
        outs = llm.chat(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], (get_metrics(llm) if spec else None)
    finally:
        del llm
        gc.collect()


def test_real_model_sparse_hierarchy_equals_plain_greedy(model, long_prompts):
    plain, _ = _greedy(model, long_prompts, None)
    spec = {
        "method": "sparsever", "draft_source": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "num_speculative_tokens": 6,
        "attention": {"enabled": True, "top_k_blocks": 2, "min_context_len": 512},
        "ffn": {"enabled": True, "keep_ratio": 0.25, "max_verify_requests": 4},
        "early_exit": {"enabled": True, "intermediate": "sparse", "round_tokens": 3, "full_verify_every": 3},
    }
    tokens, m = _greedy(model, long_prompts, spec)
    assert tokens == plain
    s, h = m["sparsity"], m["hierarchical"]
    assert s["attn_layers_sparse"] > 0 and 0 < s["attn_kv_blocks_read"] < s["attn_kv_blocks_dense"], s
    assert s.get("attention_fallbacks", 0) == 0 and s.get("ffn_fallbacks", 0) == 0, s
    assert h["hier_intermediate_passes"] > 0 and m["num_draft_tokens"] > 0
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]
