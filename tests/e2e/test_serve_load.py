"""`vllm serve` with sparsever under load: 64 concurrent streaming completions of mixed prompt and
output lengths, a quarter of them cancelled mid-stream, once per verifier (dense draft-model
verification, EVICT-cut draft trees, the lossless sparse-target hierarchy, approximate sparse
attention + FFN).

Every request that is not cancelled completes; greedy fp32 text equals a non-speculative server's
under the same load (lossless verifiers); /metrics counters agree with what was served; afterwards
no request runs, no KV block is in use and the plugin holds no per-request state (through vLLM's
dev-mode RPC endpoint).
"""

import json

import pytest

from load_utils import ServerCounters, mixed_requests, run_load, wait_until_idle, worker_request_state
from serve_utils import running_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_REQUESTS = 64
MAX_TOKENS = 48
REQUESTS = mixed_requests(NUM_REQUESTS, seed=7, cancel_fraction=0.25, max_prompt_words=200, max_tokens=MAX_TOKENS)
SERVER_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "64", "--no-async-scheduling")
ENV = {"VLLM_SERVER_DEV_MODE": "1"}
SPARSE = {"attention": {"enabled": True, "min_context_len": 256, "top_k_blocks": 1, "anchor_layers": [0]},
          "ffn": {"enabled": True, "keep_ratio": 0.5, "max_verify_requests": 64}}


def _specs(draft: str, cost_profile: str) -> dict[str, tuple[dict, bool]]:
    """name -> (speculative config, lossless)"""
    ngram = {"method": "sparsever", "draft_source": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 6}
    return {
        "draft_model": ({"method": "sparsever", "model": draft, "num_speculative_tokens": 3}, True),
        "evict_trees": ({"method": "sparsever", "model": draft, "num_speculative_tokens": 8,
                         "tree": {"enabled": True, "branching": 2, "expand": 2, "depth": 4},
                         "adaptive": {"enabled": True, "guard": False, "cost_profile": cost_profile}}, True),
        "sparse_hierarchy": (ngram | SPARSE | {"early_exit": {"enabled": True, "intermediate": "sparse",
                                                              "round_tokens": 2, "full_verify_every": 3}}, True),
        "sparse_attention_ffn": (ngram | SPARSE, False),
    }


@pytest.fixture(scope="module")
def reference(tiny_target, tmp_path_factory):
    """A non-speculative server's greedy text for every request, under the same load (no cancels)."""
    log = tmp_path_factory.mktemp("serve_plain") / "server.log"
    with running_server(tiny_target, None, log, *SERVER_ARGS) as base:
        results = run_load(base, [r.__class__(r.index, r.prompt, r.max_tokens) for r in REQUESTS])
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return [r.text for r in results]


@pytest.fixture(scope="module")
def cost_profile(tmp_path_factory):
    from e2e.test_trees import _cost_profile

    return _cost_profile(tmp_path_factory.mktemp("cost") / "cost.json", per_token_s=1e-5)


@pytest.mark.parametrize("name", ["draft_model", "evict_trees", "sparse_hierarchy", "sparse_attention_ffn"])
def test_load_with_cancellations(name, tiny_target, tiny_draft, cost_profile, reference, tmp_path):
    spec, lossless = _specs(str(tiny_draft), cost_profile)[name]
    with running_server(tiny_target, spec, tmp_path / "server.log", *SERVER_ARGS, env=ENV) as base:
        before = ServerCounters.read(base)
        state_before = worker_request_state(base)
        results = run_load(base, REQUESTS, concurrency=NUM_REQUESTS)
        after = wait_until_idle(base)
        state_after = worker_request_state(base)

    errors = [(r.index, r.error) for r in results if r.error]
    assert not errors, errors[:5]
    cancelled = [r for r in results if r.cancelled]
    completed = [r for r in results if not r.cancelled]
    designated = {r.index for r in REQUESTS if r.cancel_after_chunks is not None}
    # A designated request that ends (EOS) before its cancel point simply completes.
    assert {r.index for r in cancelled} <= designated and len(cancelled) >= 0.75 * len(designated)
    assert all(r.finish_reason in ("length", "stop") for r in completed)
    if lossless:
        differ = [r.index for r in completed if r.text != reference[r.index]]
        assert not differ, f"{name}: {len(differ)} completions differ from the plain server's: {differ[:8]}"
    else:  # approximate: still a full answer of the requested length
        assert all(r.completion_tokens == REQUESTS[r.index].max_tokens or r.finish_reason == "stop"
                   for r in completed)

    def delta(metric: str, label: str = "") -> float:
        return after.total(metric, label) - before.total(metric, label)

    served = sum(r.completion_tokens for r in completed)
    assert all(r.completion_tokens is not None for r in completed)
    generated = delta("vllm:generation_tokens_total")
    # Cancelled requests generated something, at most their max_tokens each.
    assert served < generated <= served + sum(REQUESTS[r.index].max_tokens for r in cancelled)
    # vLLM counts requests that finished in the engine (aborted ones appear in no counter). A
    # cancelled stream whose request had already finished server-side (its last chunks still in
    # flight when the client closed) counts as a success: a race the client cannot see.
    assert len(completed) <= delta("vllm:request_success_total") <= len(completed) + len(cancelled)
    assert delta("vllm:prompt_tokens_total") > 0
    # sparsever's counters: drafts were verified, never more accepted than drafted or generated.
    drafts, accepted = delta("sparsever:num_drafts_total"), delta("sparsever:num_accepted_tokens_total")
    assert drafts > 0 and 0 <= accepted <= delta("sparsever:num_draft_tokens_total")
    assert accepted < generated
    # The verifier under test ran (not only vLLM's drafting): its own counters moved.
    ran = {
        "draft_model": drafts,
        "evict_trees": min(delta("sparsever:tree_nodes_total", 'stage="verified"'),
                           delta("sparsever:evict_steps_total", 'decision="seen"')),
        "sparse_hierarchy": min(delta("sparsever:drafting_total", 'counter="hier_pending_tokens"'),
                                delta("sparsever:sparsity_total", 'counter="ffn_layers_sparse"')),
        "sparse_attention_ffn": delta("sparsever:sparsity_total", 'counter="ffn_layers_sparse"'),
    }[name]
    assert ran > 0, f"{name}: its verifier's counters did not move"
    # Nothing left behind: no request, no KV block in use, no per-request plugin state.
    assert after.total("vllm:num_requests_running") == 0 and after.total("vllm:num_requests_waiting") == 0
    assert after.total("vllm:kv_cache_usage_perc") == 0
    per_request = {k for k in state_after[0] if k not in ("ffn_layers", "moe_blocks")}
    for rank_state in state_after:
        assert all(rank_state[k] == 0 for k in per_request), rank_state
    # The sparse layers registered for the ops are the model's own, not one per request or step.
    assert [s["ffn_layers"] for s in state_after] == [s["ffn_layers"] for s in state_before]
    (tmp_path / "summary.json").write_text(json.dumps({"state": state_after, "generated": generated}))


def test_short_soak_serves_everything_with_flat_memory(tmp_path):
    """bench/serve_soak.py for one minute (the committed run is 20 minutes): no failed request, every
    batch served, resident memory of the server's processes without a trend."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from serve_soak import soak, tiny_server_args

    from serve_utils import running_vllm_serve

    _, args, env = tiny_server_args(tmp_path)
    with running_vllm_serve(args, tmp_path / "server.log", env={**ENV, **env}) as (base, proc):
        result = soak(base, proc.pid, minutes=1.0, sample_s=2.0)
        state = worker_request_state(base)
    s = result["summary"]
    assert s["requests_failed"] == 0 and s["requests_served"] >= 48, s
    assert s["requests_cancelled"] > 0
    assert abs(s["rss_growth_mb"]) < 64, s
    assert all(v == 0 for k, v in state[0].items() if k not in ("ffn_layers", "moe_blocks")), state
