"""Draft trees (tree.enabled) on the tiny target with a noisy draft model: dynamic trees drafted
with tree attention in the draft model, verified in one target pass under the ancestor mask, the
accepted path's K/V compacted. Lossless: greedy output equals non-speculative greedy (fp32, batch 6,
TP=1 and TP=2); sampled output follows the target's distribution (two-sample chi-square).

One engine per configuration, shared by the tests of this module.
"""

import gc
from pathlib import Path

import pytest

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS
from e2e.test_self_draft import SAMPLE_PROMPT, SAMPLES, _assert_follows_plain_sampling, _sample
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


@pytest.fixture(scope="module")
def tree_run(tiny_target, tiny_draft):
    """Greedy outputs, metrics, then sampled completions of one tree engine."""
    from vllm_sparsever.metrics import get_metrics

    llm = _engine(tiny_target, _tree_spec(tiny_draft))
    try:
        greedy = _greedy(llm)
        metrics = get_metrics(llm)
        sampled = _sample(llm, SAMPLE_PROMPT)
    finally:
        del llm
        gc.collect()
    return greedy, metrics, sampled


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
    d, t = m["draft_model"], m["tree"]
    # Real trees were drafted (more nodes grown than kept, several levels) and verified ...
    assert d["draft_model_trees"] > 0 and d["draft_model_tree_nodes_grown"] > d["draft_model_tree_nodes"]
    assert t["tree_verify_trees"] > 0 and t["tree_nodes_verified"] > 0
    # ... with some nodes accepted, some off the first branch (their K/V moved into place).
    assert 0 < t["tree_accepted_tokens"] < t["tree_nodes_verified"]
    assert t["tree_kv_moved_tokens"] > 0
    assert m["num_accepted_tokens"] >= t["tree_accepted_tokens"]


def test_tree_sampling_follows_the_target_distribution(tree_run, plain_samples):
    _assert_follows_plain_sampling(tree_run[2], plain_samples, "draft tree")
