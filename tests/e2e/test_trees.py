"""Draft trees (tree.enabled) on the tiny target with a noisy draft model: dynamic trees drafted
with tree attention in the draft model, verified in one target pass under the ancestor mask, the
accepted path's K/V compacted. Lossless: greedy output equals non-speculative greedy (fp32, batch 6,
TP=1 and TP=2); sampled output follows the target's distribution (two-sample chi-square).

One engine per configuration, shared by the tests of this module.
"""

import gc
import json
from pathlib import Path

import pytest

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS
from e2e.test_self_draft import SAMPLE_PROMPT, _assert_follows_plain_sampling, _greedy_metrics_samples, _sample
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NODES = 8  # node budget (num_speculative_tokens)
TREE = {"enabled": True, "branching": 2, "expand": 2, "depth": 4}


def _tree_spec(draft: Path, **tree) -> dict:
    return {"method": "sparsever", "model": str(draft), "num_speculative_tokens": NODES, "tree": TREE | tree}


def _engine(model: Path, spec: dict | None, **kwargs):
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
               seed=0, speculative_config=spec, async_scheduling=False, **kwargs)


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts(NUM_PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy_and_metrics(model: Path, spec: dict) -> tuple[list[list[int]], dict]:
    """Greedy outputs and sparsever's metrics of one engine."""
    from vllm_sparsever.metrics import get_metrics

    llm = _engine(model, spec)
    try:
        return _greedy(llm), get_metrics(llm)
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def tree_run(tiny_target, tiny_draft):
    """Greedy outputs, metrics, then sampled completions of one tree engine."""
    return _greedy_metrics_samples(tiny_target, _tree_spec(tiny_draft), async_scheduling=False)


@pytest.fixture(scope="module")
def plain_samples(tiny_target):
    llm = _engine(tiny_target, None)
    try:
        return _sample(llm, SAMPLE_PROMPT)
    finally:
        del llm
        gc.collect()


def test_tree_greedy_equals_plain_greedy(plain_greedy, tree_run):
    greedy, m, _ = tree_run
    assert greedy == [tokens for tokens, _ in plain_greedy]
    d, t = m["tree_drafting"], m["tree_verify"]
    # Real trees were drafted (more nodes grown than kept, several levels) and verified ...
    assert d["tree_drafted"] > 0 and d["tree_draft_nodes_grown"] > d["tree_draft_nodes"] > 0
    assert d["tree_draft_levels"] > 0 and d["tree_draft_chains_for_sampler"] == 0
    assert t["tree_verify_trees"] > 0 and t["tree_nodes_verified"] > 0
    # ... with some nodes accepted, some off the first branch (their K/V moved into place).
    assert 0 < t["tree_accepted_tokens"] < t["tree_nodes_verified"]
    assert t["tree_kv_moved_tokens"] > 0
    assert m["num_accepted_tokens"] >= t["tree_accepted_tokens"]


def test_tree_sampling_follows_the_target_distribution(tree_run, plain_samples):
    _assert_follows_plain_sampling(tree_run[2], plain_samples, "draft tree")


def _cost_profile(path: Path, per_token_s: float, step_s: float = 0.02) -> str:
    """A synthetic verify-cost profile: a `step_s` step plus `per_token_s` per token."""
    from vllm_sparsever.adaptive.cost import Measurement, VerifyCostProfile

    ms = [Measurement(mask, r, q, c, step_s + per_token_s * r * q)
          for mask in ("tree", "chain") for r in (1, 4, 8) for q in (1, 2, 4, 8, 16) for c in (64, 512)]
    return str(VerifyCostProfile(model="tiny", hardware="synthetic", dtype="float32", measurements=ms).fit().save(path))


@pytest.fixture(scope="module")
def evict_run(tiny_target, tiny_draft, tmp_path_factory):
    """Trees whose depth EVICT chooses and which it truncates. The tiny draft's path probabilities
    say little (nearly uniform: ~1e-2 at depth 1, ~1e-4 deeper) while it agrees with the target
    more often than that; EVICT's calibration learns how often, and with a token at 5% of a step
    the nodes it finds unlikely get cut, not all. The guard is off: with this draft no drafting step
    pays, so it would skip nearly all of them."""
    profile = _cost_profile(tmp_path_factory.mktemp("cost") / "cost.json", per_token_s=1e-3)
    spec = _tree_spec(tiny_draft) | {"adaptive": {"enabled": True, "cost_profile": profile, "guard": False}}
    return _greedy_metrics_samples(tiny_target, spec, async_scheduling=False)


def test_evict_trees_greedy_equals_plain_greedy(plain_greedy, evict_run):
    greedy, m, _ = evict_run
    assert greedy == [tokens for tokens, _ in plain_greedy]
    e = m["evict"]
    # EVICT cut the trees (the noisy draft's deep nodes rarely pay) but kept some drafts.
    assert e["evict_steps"] > 0 and 0 < e["evict_nodes_kept"] < e["evict_nodes_drafted"]
    assert e["evict_truncated_steps"] > 0
    assert 0 < m["num_draft_tokens"] <= e["evict_nodes_kept"]


def test_evict_trees_sampling_follows_the_target_distribution(evict_run, plain_samples):
    _assert_follows_plain_sampling(evict_run[2], plain_samples, "EVICT tree")


def test_adaptive_chain_greedy_equals_plain_greedy(plain_greedy, tiny_target, tiny_draft, tmp_path):
    """adaptive without tree: chains of adaptive length; expensive tokens -> the guard skips drafting.

    The guard compares with the measured drafting time D (a few ms per step here, more on a loaded
    machine), so the profile must hold for any D in a wide range: a draft token (1 ms) must not pay
    for a node the noisy draft gives ~1e-2 (needs 6 rows x 1 ms > 0.05 (1 ms + D): D < 110 ms), and
    a plain step (1 ms + 6 x 1 ms) must be cheap enough next to D that the guard does not probe on
    its first skip (probes cost at most 5% of the skipped time: 0.05 x 7 ms < D: D > 0.35 ms). A
    20 ms step with 50 ms tokens made the guard probe at every step where D < 16 ms."""
    profile = _cost_profile(tmp_path / "cost.json", per_token_s=1e-3, step_s=1e-3)
    spec = {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 4,
            "adaptive": {"enabled": True, "cost_profile": profile}}
    greedy, m = _greedy_and_metrics(tiny_target, spec)
    assert greedy == [tokens for tokens, _ in plain_greedy]
    e = m["evict"]
    # Depth 0 wins once the draft pass and the steps are measured: the guard skips drafting (the
    # first steps draft blind, to the cap).
    assert e["evict_skipped_drafting_steps"] > 0, json.dumps(e)
    assert (e["evict_planned_depth_0"] == e["evict_skipped_drafting_steps"] + e["evict_plain_check_steps"]
            + e["evict_catch_up_deferred_steps"] > e.get("evict_planned_depth_4", 0))
    assert m["tree_drafting"]["tree_draft_nodes_grown"] <= 4 * m["tree_drafting"]["tree_drafted"]  # chains


def test_ngram_evict_chains_greedy_equal_plain_greedy(plain_greedy, tiny_target, tmp_path):
    """EVICT on n-gram drafts (chains scored per depth, calibrated online): lossless, and it cuts
    chains whose verification costs more than its calibrated acceptance gains (depth "cap": the
    lookups go to the cap and truncation decides; the depth decision is tested in
    test_evict_depth.py and tests/adaptive/test_evict.py)."""
    spec = {"method": "sparsever", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "adaptive": {"enabled": True, "guard": False, "depth": "cap",
                         "cost_profile": _cost_profile(tmp_path / "cost.json", per_token_s=0.001)}}
    greedy, m = _greedy_and_metrics(tiny_target, spec)
    assert greedy == [tokens for tokens, _ in plain_greedy]
    e = m["evict"]
    assert m["prompt_lookup"]["prompt_lookup_tokens"] >= e["evict_nodes_drafted"] > 0, json.dumps(m, default=str)
    assert 0 < m["num_draft_tokens"] <= e["evict_nodes_kept"] < e["evict_nodes_drafted"], json.dumps(m, default=str)
    # Whether any kept n-gram token is accepted depends on the measured step times (they price the
    # cut), so acceptance is not asserted here; losslessness is.


def test_serve_tp2_evict_trees_give_plain_greedy_text(plain_greedy, tiny_target, tiny_draft, tmp_path):
    """`vllm serve` on two tensor-parallel ranks, trees + EVICT: the plain greedy text of TP=1, and
    the tree/EVICT counters on /metrics. Each rank moves its K/V shard along the same paths."""
    from openai import OpenAI

    from serve_utils import running_server, settled_sparsever_metrics

    # guard off: drafting with the random draft never pays, so the guard would rightly skip nearly
    # every step (it is tested in test_adaptive_chain_greedy_equals_plain_greedy); here the trees
    # must be verified.
    spec = _tree_spec(tiny_draft) | {"adaptive": {"enabled": True, "guard": False,
                                                  "cost_profile": _cost_profile(tmp_path / "c.json", 1e-3)}}
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with running_server(tiny_target, spec, tmp_path / "server.log", "--max-model-len", "512",
                        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                        "--no-async-scheduling", env=env) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
        for i, (prompt, (_, want)) in enumerate(zip(prompts(NUM_PROMPTS), plain_greedy, strict=True)):
            resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            assert resp.choices[0].text == want, f"prompt {i}"
        # Sampled requests work too (the ranks agree on the sampled paths).
        resp = client.completions.create(model="tiny", prompt=prompts(1)[0], max_tokens=MAX_TOKENS,
                                         temperature=1.0, seed=5, n=2)
        assert all(len(c.text) > 0 for c in resp.choices)
        values = settled_sparsever_metrics(base,
                                           lambda v: v.get('sparsever:tree_nodes_total{stage="verified"}', 0) > 0)
    assert values['sparsever:tree_nodes_total{stage="verified"}'] > 0, values
    assert 0 < values['sparsever:tree_nodes_total{stage="accepted"}'] <= values['sparsever:tree_nodes_total{stage="verified"}']
    assert values['sparsever:tree_nodes_total{stage="proposed"}'] < values['sparsever:tree_nodes_total{stage="grown"}']
    assert values['sparsever:evict_steps_total{decision="seen"}'] > 0


def test_moe_target_evict_trees_price_and_count_distinct_experts(tiny_draft, tmp_path):
    """EVICT trees on a tiny Mixtral (8 experts, top-3): profile-verify measures the experts term
    (random and repeated tokens), EVICT runs with the expert-union model fed by the target's
    verify steps, lossless; the distinct routed experts per verifying request and layer are
    counted (at most min(E, k * tokens) each, at least k), and per step (their union)."""
    from tiny_moe import make_tiny_mixtral
    from vllm_sparsever.adaptive.cost import VerifyCostProfile, default_cost_profile_path
    from vllm_sparsever.cli import main
    from vllm_sparsever.metrics import get_metrics

    moe = make_tiny_mixtral(tmp_path / "mixtral", seed=0)
    llm = _engine(moe, None)
    try:
        plain = _greedy(llm)
    finally:
        del llm
        gc.collect()
    assert main(["profile-verify", str(moe), "--rows", "1,2", "--tokens", "1,8", "--contexts", "64",
                 "--max-context", "64", "--repeats", "1"]) == 0
    profile = VerifyCostProfile.load(default_cost_profile_path(moe))
    assert profile.moe == [8, 3]
    by_point = {(m.mask, m.rows, m.query_tokens, m.tokens): m.experts for m in profile.measurements}
    assert by_point[("tree", 1, 1, "random")] == pytest.approx(3 / 8)  # one token: its top-3
    assert ("tree", 1, 1, "repeated") not in by_point
    for rows, q in ((1, 8), (2, 8)):
        # One token repeated: layer 0 routes every copy alike (3 of 8), layer 1 nearly so (the
        # copies differ by position and by the K/V rows they attend to); 8-16 random tokens
        # reach nearly all 8 experts in both layers.
        assert 3 / 8 <= by_point[("tree", rows, q, "repeated")] < by_point[("tree", rows, q, "random")] <= 1
    spec = _tree_spec(tiny_draft) | {"adaptive": {"enabled": True, "guard": False, "min_draft_tokens": 2}}
    llm = _engine(moe, spec)
    try:
        greedy = _greedy(llm)
        m = get_metrics(llm)
    finally:
        del llm
        gc.collect()
    assert greedy == plain
    assert m["evict"]["evict_steps"] > 0 and 0 <= m["evict"]["evict_moe_expert_sharing"] <= 1
    s = m["sparsity"]
    pairs, distinct, tokens = s["moe_verify_request_layers"], s["moe_verify_distinct_experts"], s["moe_verify_tokens"]
    assert pairs > 0 and tokens >= pairs * 2  # trees: several tokens per request
    assert 3 * pairs <= distinct <= min(8 * pairs, 3 * tokens)
    # Per step and layer: the union over the step's verifying requests, what the step reads.
    layers, union = s["moe_verify_step_layers"], s["moe_verify_step_distinct_experts"]
    assert s["moe_verify_step_tokens"] == tokens and 0 < layers <= pairs
    assert 3 * layers <= union <= min(8 * layers, distinct)


def test_trees_with_sparse_attention_match_the_reference(tiny_target, tiny_draft, monkeypatch):
    """Trees under block-sparse attention (~700-token prompts): the sparse kernel with the tree mask
    equals the PyTorch reference on every layer's real inputs, and with every block kept the output
    is plain greedy's."""
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics

    monkeypatch.setenv("VLLM_SPARSEVER_CHECK_REFERENCE", "1")
    long_prompts = [p * 55 for p in prompts(2, length=12, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outputs = []
    for spec in (None, _tree_spec(tiny_draft) | {"attention": {"enabled": True, "min_context_len": 256,
                                                               "top_k_blocks": 64, "kernel": "sparsever"}}):
        llm = LLM(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4,
                  seed=0, speculative_config=spec, async_scheduling=False)
        try:
            outputs.append([list(o.outputs[0].token_ids) for o in llm.generate(long_prompts, params, use_tqdm=False)])
            metrics = get_metrics(llm) if spec else None
        finally:
            del llm
            gc.collect()
    assert outputs[1] == outputs[0]
    s, t = metrics["sparsity"], metrics["tree_verify"]
    assert t["tree_verify_trees"] > 0 and s["attn_layers_sparse"] > 0
    assert s["attn_reference_checks"] > 0 and s["attn_reference_max_abs_err"] < 1e-4
