"""Sparse verification under torch.compile (vLLM's default; `vllm serve` without --enforce-eager).

Per-step behaviour lives in opaque custom ops (attention inside vLLM's attention op, the FFN
wrapper's op), so a graph traced once must still switch between dense and sparse paths per step.
One engine start (~1-2 min with compilation) on a tiny fp32 Llama with n-gram drafts.
"""

import gc
import os

import pytest

from tiny_models import make_tiny_llama, prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_LAYERS = 4
LONG_PROMPTS = [p * 55 for p in prompts(3, length=12, seed=3)]  # 5-6 KV blocks of 128
ATTENTION = {"enabled": True, "min_context_len": 256, "top_k_blocks": 1, "anchor_layers": [0, 2]}
FFN = {"enabled": True, "keep_ratio": 0.25, "max_verify_requests": 4}


@pytest.fixture(scope="module")
def compiled_llm(tiny_dir):
    from vllm import LLM

    target = make_tiny_llama(tiny_dir / "target4c", seed=0, num_layers=NUM_LAYERS)
    old = os.environ.get("VLLM_SPARSEVER_CHECK_REFERENCE")
    os.environ["VLLM_SPARSEVER_CHECK_REFERENCE"] = "1"
    try:
        llm = LLM(model=str(target), dtype="float32", max_model_len=2048, max_num_seqs=4, seed=0,
                  speculative_config={"method": "sparsever", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 3, "attention": ATTENTION, "ffn": FFN})
    finally:
        if old is None:
            os.environ.pop("VLLM_SPARSEVER_CHECK_REFERENCE")
        else:
            os.environ["VLLM_SPARSEVER_CHECK_REFERENCE"] = old
    yield llm
    del llm
    gc.collect()


def test_engine_is_compiled(compiled_llm):
    from vllm.config import CompilationMode

    cfg = compiled_llm.llm_engine.vllm_config
    assert not cfg.model_config.enforce_eager
    assert cfg.compilation_config.mode != CompilationMode.NONE


def test_sparse_layers_run_per_step_inside_the_compiled_graph(compiled_llm):
    from vllm import SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics, set_sparsity

    params = SamplingParams(temperature=0.0, max_tokens=24)
    # Sparse: every verify step, every layer, both sparsities, equal to the reference.
    set_sparsity(compiled_llm, attention=ATTENTION, ffn=FFN)
    reset_metrics(compiled_llm)
    sparse = [list(o.outputs[0].token_ids) for o in compiled_llm.generate(LONG_PROMPTS, params)]
    m = get_metrics(compiled_llm)
    s = m["sparsity"]
    steps = m["num_verify_steps"]
    assert steps > 0
    assert s.get("attention_fallbacks", 0) == 0 and s.get("ffn_fallbacks", 0) == 0, s
    assert s["attn_layers_sparse"] == NUM_LAYERS * steps, (s, m)
    assert s["ffn_layers_sparse"] == NUM_LAYERS * steps, (s, m)
    assert 0 < s["attn_kv_blocks_read"] < s["attn_kv_blocks_dense"]
    assert 0 < s["ffn_neurons_read"] < s["ffn_neurons_dense"]
    assert s["attn_reference_max_abs_err"] < 1e-4 and s["ffn_reference_max_abs_err"] < 1e-4, s

    # Switched off in the same compiled engine: no sparse layer runs, so the graph is not frozen
    # on the sparse branch.
    set_sparsity(compiled_llm, attention={"enabled": False}, ffn={"enabled": False})
    reset_metrics(compiled_llm)
    dense = [list(o.outputs[0].token_ids) for o in compiled_llm.generate(LONG_PROMPTS, params)]
    m = get_metrics(compiled_llm)
    assert m["num_verify_steps"] > 0
    assert not any(k.endswith("_sparse") for k in m["sparsity"]), m["sparsity"]
    assert len(dense) == len(sparse) == len(LONG_PROMPTS)
