"""Lossless sparse verification: hierarchical verification whose intermediate level is the sparse
target (`early_exit.intermediate = "sparse"`) and whose full level is dense.

Tiny 4-layer fp32 Llama, ~700-token prompts (5-6 KV blocks of 128), n-gram drafts. The sparse level
keeps one top block (+ sink + local) and a quarter of the FFN neurons, so on its own it changes the
text (checked: the same sections at the full level give other tokens). As the intermediate level
its mistakes are pending tokens the dense level rejects, so the output equals non-speculative
greedy token for token, on one rank and on two tensor-parallel ranks.
"""

import gc

import pytest

from tiny_models import make_tiny_llama, prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_LAYERS = 4
LONG_PROMPTS = [p * 55 for p in prompts(3, length=12, seed=3)]
MAX_TOKENS = 24
CAP = 6
ATTENTION = {"enabled": True, "min_context_len": 256, "top_k_blocks": 1, "anchor_layers": [0, 2],
             "kernel": "sparsever"}
FFN = {"enabled": True, "keep_ratio": 0.25, "max_verify_requests": 4}
HIERARCHY = {"enabled": True, "intermediate": "sparse", "round_tokens": 2, "full_verify_every": 3}


def _spec(**overrides) -> dict:
    return {"method": "sparsever", "draft_source": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": CAP,
            "attention": ATTENTION, "ffn": FFN, "early_exit": HIERARCHY} | overrides


def _engine(target, spec, **engine_args):
    from vllm import LLM

    return LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4,
               seed=0, speculative_config=spec, **engine_args)


def _run(llm):
    from vllm import SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics

    if llm.llm_engine.vllm_config.speculative_config is not None:
        reset_metrics(llm)
    outs = llm.generate(LONG_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, (get_metrics(llm) if llm.llm_engine.vllm_config.speculative_config is not None else None)


def _generate(target, spec, **engine_args):
    llm = _engine(target, spec, **engine_args)
    try:
        return _run(llm)
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def target4(tiny_dir):
    return make_tiny_llama(tiny_dir / "target4_hier", seed=0, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def plain_greedy_long(target4):
    tokens, _ = _generate(target4, None)
    return tokens


@pytest.fixture(scope="module")
def sparse_hierarchy_runs(target4):
    """One engine: the hierarchy; then switched off (the same sections verify at the full level:
    approximate sparse verification); then on again."""
    from vllm_sparsever.metrics import set_hierarchy

    llm = _engine(target4, _spec())
    try:
        runs = {"hierarchy": _run(llm)}
        set_hierarchy(llm, False)
        runs["sparse_full_level"] = _run(llm)
        set_hierarchy(llm, True)
        runs["hierarchy_again"] = _run(llm)
        return runs
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def sparse_hierarchy_run(sparse_hierarchy_runs):
    return sparse_hierarchy_runs["hierarchy"]


def test_sparse_hierarchy_greedy_equals_plain_greedy(plain_greedy_long, sparse_hierarchy_run):
    tokens, m = sparse_hierarchy_run
    assert tokens == plain_greedy_long
    h, s = m["hierarchical"], m["sparsity"]
    # The intermediate level ran sparse in every layer, without falling back ...
    assert h["hier_intermediate_passes"] > 0
    assert s.get("attention_fallbacks", 0) == 0 and s.get("ffn_fallbacks", 0) == 0, s
    assert s["attn_layers_sparse"] == s["ffn_layers_sparse"] > 0, s
    assert s["attn_layers_sparse"] % NUM_LAYERS == 0
    assert 0 < s["attn_kv_blocks_read"] < s["attn_kv_blocks_dense"]
    # ... and was wrong sometimes: the dense level rejected some of the tokens it kept (so the
    # equality above is the dense level's doing, not a sparse level that happened to be exact).
    assert h["hier_pending_tokens"] >= m["num_draft_tokens"] > 0
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert m["num_draft_tokens"] <= CAP * m["num_drafts"]
    assert m["prompt_lookup"]["prompt_lookup_slot_limited"] == 0


def test_sparse_full_level_changes_the_text(sparse_hierarchy_runs, plain_greedy_long):
    """The same sections verifying at the full level (the hierarchy switched off at run time:
    approximate sparse verification) do change the output: what the hierarchy keeps lossless is not
    lossless on its own. Switched back on, the output is the plain greedy one again."""
    tokens, m = sparse_hierarchy_runs["sparse_full_level"]
    assert m["sparsity"]["attn_layers_sparse"] > 0
    assert "hierarchical" not in m and m["num_draft_tokens"] > 0
    assert tokens != plain_greedy_long
    tokens, m = sparse_hierarchy_runs["hierarchy_again"]
    assert tokens == plain_greedy_long
    assert m["hierarchical"]["hier_pending_tokens"] > 0


def test_draft_model_sparse_hierarchy_equals_plain_greedy(target4, plain_greedy_long, tiny_dir):
    """A separate draft model drafting in rounds, the sparse target checking each round."""
    draft = make_tiny_llama(tiny_dir / "draft4_hier", seed=1, num_layers=NUM_LAYERS, perturb_from=target4,
                            perturb_scale=0.005)
    spec = _spec(draft_source="draft_model", model=str(draft))
    del spec["prompt_lookup_max"]
    tokens, m = _generate(target4, spec)
    assert tokens == plain_greedy_long
    d, h = m["draft_model"], m["hierarchical"]
    # The drafter caught up on the ~700-token prompts itself, and drafted in rounds.
    assert d["draft_model_catch_up_tokens"] >= sum(len(p.split()) for p in LONG_PROMPTS)
    assert h["hier_rounds"] > m["num_drafts"] > 0
    assert 0 < h["hier_intermediate_accepted"] <= h["hier_intermediate_drafts"]
    assert m["sparsity"]["attn_layers_sparse"] > 0
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]


def test_tensor_parallel_sparse_hierarchy_equals_plain_greedy(target4, plain_greedy_long, monkeypatch):
    # Two ranks on two cores: no core reserved for the front end, one OpenMP thread per rank.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tokens, m = _generate(target4, _spec(), tensor_parallel_size=2, distributed_executor_backend="mp")
    assert tokens == plain_greedy_long
    ranks = m["ranks"]
    assert len(ranks) == 2
    # Each rank selected over its own KV heads and neurons, yet both kept the same tokens at every
    # level (all-gathered logits, same argmax).
    for key in ("hier_intermediate_passes", "hier_intermediate_accepted", "hier_pending_tokens"):
        assert ranks[0]["hierarchical"][key] == ranks[1]["hierarchical"][key]
    assert ranks[0]["hierarchical"]["hier_pending_tokens"] > 0
    assert all(r["sparsity"]["attn_layers_sparse"] > 0 for r in ranks)
