"""Self-drafting (draft_source='early_exit') and hierarchical verification on a tiny 4-layer target:
its first layer plus an exit head drafts inside the target worker; with early_exit.enabled, its
first 3 layers plus a head verify each round first. Lossless: greedy output equals
non-speculative greedy (fp32, batch 6, TP=1 and TP=2); sampled output follows the target's
distribution (two-sample chi-square against plain sampling).

One engine per configuration, shared by the tests of this module.
"""

import gc
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS
from sampling_stats import assert_follows_plain_sampling, chi2_two_sample_p
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_SPEC = 3
DRAFT_LAYER = 1
VERIFY_LAYER = 3  # of 4 decoder layers
SAMPLES = 800  # sampled completions per engine for the distribution test
SAMPLE_TOKENS = 4


def make_heads(model: Path, out: Path, layers: tuple[int, ...] = (DRAFT_LAYER, VERIFY_LAYER), *, seed: int = 0,
               adapter_scale: float = 0.05) -> Path:
    """Exit heads for `model` with a random (untrained) adapter: drafts that are often but not
    always the target's tokens, so both acceptance and rejection are exercised."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from vllm_sparsever.drafting.exit_head import ExitHead, ExitHeadEntry, ExitHeadManifest

    config = AutoConfig.from_pretrained(model)
    weights = load_file(str(model / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    manifest = ExitHeadManifest(
        model_architecture="LlamaForCausalLM", num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size, vocab_size=config.vocab_size,
    )
    torch.manual_seed(seed)
    for layer in layers:
        head = ExitHead.untrained(weights["model.norm.weight"], adapter_size=32, eps=config.rms_norm_eps)
        with torch.no_grad():
            head.up.weight.normal_(0.0, adapter_scale)
        head.save(out / f"exit_{layer}.safetensors")
        manifest.heads.append(ExitHeadEntry(exit_layer=layer, file=f"exit_{layer}.safetensors", adapter_size=32))
    manifest.save(out)
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 4-layer Llama whose layers 1..3 write half-scale outputs into the residual stream,
    so early exits agree with the last layer often but not always (untrained exit at layer 1: about
    60% top-1 agreement, layer 3: about 80%), like a trained model's."""
    from transformers import LlamaForCausalLM

    from tiny_models import make_tiny_llama, save_model

    base = make_tiny_llama(tmp_path_factory.mktemp("target4") / "base", seed=3, num_layers=4)
    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.5)
            layer.mlp.down_proj.weight.mul_(0.5)
    return save_model(model, tmp_path_factory.mktemp("target4") / "model", random_init=False)


DRAFT_VOCAB = 48


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory, plain_greedy4):
    """Exit heads at layers 1 and 3, and a draft vocabulary (VocabTrim) ranked from the plain
    greedy outputs (a test stand-in for the target's generated text)."""
    from vllm_sparsever.drafting.draft_vocab import rank_tokens, save_draft_vocab

    out = make_heads(target, tmp_path_factory.mktemp("heads") / "exit_heads")
    ranked = rank_tokens(plain_greedy4, always=(2,))
    assert ranked.numel() > DRAFT_VOCAB
    save_draft_vocab(out, ranked)
    return out


def _spec(heads: Path, **early_exit) -> dict:
    return {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": NUM_SPEC,
            "early_exit": {"heads": str(heads)} | early_exit}


def _engine(model: Path, spec: dict | None, **kwargs):
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
               max_num_seqs=8, seed=0, speculative_config=spec, **kwargs)


def _sample(llm, prompt: str) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=SAMPLE_TOKENS, seed=1000 + i, ignore_eos=True) for i in range(SAMPLES)]
    outs = llm.generate([prompt] * SAMPLES, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy(llm, with_text: bool = False):
    from vllm import SamplingParams

    outs = llm.generate(prompts(NUM_PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return (tokens, [o.outputs[0].text for o in outs]) if with_text else tokens


SAMPLE_PROMPT = prompts(1, seed=7)[0]


@pytest.fixture(scope="module")
def self_draft_run(target, heads):
    return _greedy_metrics_samples(target, _spec(heads, draft_layer=DRAFT_LAYER))


def _greedy_metrics_samples(target: Path, spec: dict, **engine_kwargs):
    """One engine: greedy outputs, the sparsever metrics after them, then sampled completions."""
    from vllm_sparsever.metrics import get_metrics

    llm = _engine(target, spec, **engine_kwargs)
    try:
        greedy = _greedy(llm)
        metrics = get_metrics(llm)
        sampled = _sample(llm, SAMPLE_PROMPT)
    finally:
        del llm
        gc.collect()
    return greedy, metrics, sampled


@pytest.fixture(scope="module")
def plain_run(target):
    """Non-speculative reference: greedy outputs and samples."""
    llm = _engine(target, None)
    try:
        tokens, texts = _greedy(llm, with_text=True)
        return tokens, _sample(llm, SAMPLE_PROMPT), texts
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def plain_greedy4(plain_run):
    greedy = plain_run[0]
    assert len({tuple(t) for t in greedy}) > 1  # not degenerate
    return greedy


@pytest.fixture(scope="module")
def plain_samples(plain_run):
    return plain_run[1]


def _assert_same(baseline, tokens):
    assert len(tokens) == len(baseline)
    for i, (want, got) in enumerate(zip(baseline, tokens, strict=True)):
        assert got == want, f"prompt {i} differs"


def test_self_draft_greedy_equals_plain_greedy(plain_greedy4, self_draft_run):
    greedy, _, _ = self_draft_run
    _assert_same(plain_greedy4, greedy)


def test_self_draft_drafts_full_length_and_some_are_accepted(self_draft_run):
    _, m, _ = self_draft_run
    sd = m["self_draft"]
    assert m["num_drafts"] > 0
    # draft_confidence 0: every draft is num_speculative_tokens long (the scheduler reserved the
    # KV slots the drafter writes; otherwise drafts are cut short and counted in slot_limited).
    assert m["num_draft_tokens"] == NUM_SPEC * m["num_drafts"]
    assert sd["self_draft_slot_limited"] == 0
    assert sd["self_draft_stopped_by_confidence"] == 0
    assert sd["self_draft_tokens"] >= m["num_draft_tokens"]
    assert sd["self_draft_forward_passes"] >= NUM_SPEC * sd["self_draft_rounds"] > 0
    # A random adapter on layer 1 of 4: some drafts right, some wrong.
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def _assert_follows_plain_sampling(sampled: list[list[int]], plain_samples: list[list[int]], label: str) -> None:
    assert_follows_plain_sampling(sampled, plain_samples, label, SAMPLES, SAMPLE_TOKENS)


def test_self_draft_sampling_follows_the_target_distribution(self_draft_run, plain_samples):
    _, _, sampled = self_draft_run
    # Tokens 1..3 of a completion come from verified drafts or from the rejection sampler's
    # correction; a sampler that trusted the drafts would concentrate them on the head's argmax.
    _assert_follows_plain_sampling(sampled, plain_samples, "self-drafted")
    # The test does detect a sampler that over-trusts drafts: moving a quarter of the mass onto one
    # token (what accepting a confident draft too often does) is flagged.
    plain_1 = [s[1] for s in plain_samples]
    top = Counter(plain_1).most_common(1)[0][0]
    biased = plain_1[: SAMPLES * 3 // 4] + [top] * (SAMPLES // 4)
    assert chi2_two_sample_p(biased, [s[1] for s in sampled]) < 1e-3


@pytest.fixture(scope="module")
def dynamic_run(target, heads, self_draft_run):
    from vllm_sparsever.metrics import get_metrics

    # A threshold at the mean head probability seen without one: some drafts stop early, some not.
    threshold = self_draft_run[1]["self_draft"]["self_draft_mean_confidence"]
    assert 0.0 < threshold < 1.0
    llm = _engine(target, _spec(heads, draft_layer=DRAFT_LAYER, draft_confidence=threshold))
    try:
        return _greedy(llm), get_metrics(llm)
    finally:
        del llm
        gc.collect()


def test_dynamic_draft_length_is_lossless_and_stops_early(plain_greedy4, dynamic_run):
    greedy, m = dynamic_run
    _assert_same(plain_greedy4, greedy)
    assert m["self_draft"]["self_draft_stopped_by_confidence"] > 0
    assert 0 < m["num_draft_tokens"] < NUM_SPEC * m["num_drafts"]


def test_tensor_parallel_hierarchical_equals_plain_greedy(plain_greedy4, target, heads, monkeypatch):
    # Two ranks on two cores: no core reserved for the front end, one OpenMP thread per rank.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = _engine(target, _spec(heads, enabled=True, draft_layer=DRAFT_LAYER, reuse_hidden_states=True),
                  tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        greedy = _greedy(llm)
        from vllm_sparsever.metrics import get_metrics

        m = get_metrics(llm)
    finally:
        del llm
        gc.collect()
    _assert_same(plain_greedy4, greedy)
    ranks = m["ranks"]
    assert len(ranks) == 2
    # Both ranks drafted and kept the same tokens at every level (all-gathered logits, same argmax).
    assert ranks[0]["self_draft"]["self_draft_tokens"] == ranks[1]["self_draft"]["self_draft_tokens"] > 0
    for key in ("hier_intermediate_accepted", "hier_pending_tokens", "hier_reuse_steps"):
        assert ranks[0]["hierarchical"][key] == ranks[1]["hierarchical"][key]
    assert ranks[0]["hierarchical"]["hier_pending_tokens"] > 0
    assert ranks[0]["hierarchical"]["hier_reuse_steps"] > 0  # each rank started its full passes at layer 3


@pytest.mark.parametrize(
    "early_exit, message",
    [
        ({"heads": "/nonexistent/exit_heads"}, "no exit heads"),
        ({"draft_layer": 5}, "draft_layer"),
        ({"draft_layer": 0}, "draft_layer"),
        ({"draft_layer": 2}, "no trained head for layer 2"),
        ({"draft_vocab": 100000}, "draft_vocab"),
        ({"enabled": True, "draft_layer": 3, "verify_layer": 3}, "verify_layer"),
    ],
)
def test_bad_self_draft_config_fails_before_start(target, heads, early_exit, message):
    from vllm_sparsever.config import SparseverConfigError

    spec = _spec(heads)
    spec["early_exit"].update(early_exit)
    with pytest.raises(SparseverConfigError, match=message):
        _engine(target, spec)


HIER_CAP = 6


def _hierarchy_spec(heads: Path, **early_exit) -> dict:
    """Self-drafting at layer 1 under the layer-3 verifier, 2 drafts per round, 3 rounds, cap 6."""
    spec = _spec(heads, enabled=True, draft_layer=DRAFT_LAYER, verify_layer=VERIFY_LAYER, round_tokens=2,
                 full_verify_every=3, **early_exit)
    spec["num_speculative_tokens"] = HIER_CAP
    return spec


@pytest.fixture(scope="module")
def hierarchical_run(target, heads):
    # The drafter drafts over a trimmed vocabulary (VocabTrim); the intermediate verifier's is full.
    return _greedy_metrics_samples(target, _hierarchy_spec(heads, draft_vocab=DRAFT_VOCAB))


def test_hierarchical_greedy_equals_plain_greedy(plain_greedy4, hierarchical_run):
    greedy, m, _ = hierarchical_run
    _assert_same(plain_greedy4, greedy)
    h = m["hierarchical"]
    # The intermediate verifier accepted some drafts and rejected others ...
    assert 0 < h["hier_intermediate_accepted"] < h["hier_intermediate_drafts"]
    # ... and the pending tokens it passed on are what the full target verified.
    assert h["hier_pending_tokens"] >= m["num_draft_tokens"] > 0
    assert m["num_draft_tokens"] <= HIER_CAP * m["num_drafts"]
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert m["self_draft"]["self_draft_slot_limited"] == 0


def test_hierarchical_sampling_follows_the_target_distribution(hierarchical_run, plain_samples):
    _assert_follows_plain_sampling(hierarchical_run[2], plain_samples, "hierarchical")


@pytest.fixture(scope="module")
def reuse_run(target, heads):
    """Hierarchical verification whose full pass starts at the verify layer from the intermediate
    passes' residual streams (reuse across levels)."""
    return _greedy_metrics_samples(target, _hierarchy_spec(heads, reuse_hidden_states=True))


def test_reuse_across_levels_greedy_equals_plain_greedy(plain_greedy4, reuse_run):
    greedy, m, _ = reuse_run
    _assert_same(plain_greedy4, greedy)
    h = m["hierarchical"]
    # Most full passes started at layer 3 (a step with a prefill, or a request that drafted nothing,
    # runs the whole model) ...
    assert h["hier_reuse_steps"] > m["num_verify_steps"] / 2, h
    assert h["hier_reuse_layers_skipped"] == VERIFY_LAYER * h["hier_reuse_steps"]
    assert h["hier_reuse_tokens"] >= h["hier_reuse_steps"]
    # ... after dropping the verifier's last correction, which no pass had run.
    assert h["hier_reuse_dropped_corrections"] > 0
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]


def test_reuse_across_levels_sampling_follows_the_target_distribution(reuse_run, plain_samples):
    _assert_follows_plain_sampling(reuse_run[2], plain_samples, "reuse")


@pytest.fixture(scope="module")
def draft_model_hierarchy_run(target, heads, tmp_path_factory):
    """A separate draft model (the target plus noise) drafting in rounds under the layer-3 verifier."""
    from tiny_models import make_tiny_llama

    draft = make_tiny_llama(tmp_path_factory.mktemp("draft4") / "model", seed=5, num_layers=4,
                            perturb_from=target, perturb_scale=0.03)
    spec = {"method": "sparsever", "model": str(draft), "num_speculative_tokens": HIER_CAP,
            "early_exit": {"heads": str(heads), "enabled": True, "verify_layer": VERIFY_LAYER, "round_tokens": 2,
                           "full_verify_every": 3}}
    return _greedy_metrics_samples(target, spec)


def test_draft_model_hierarchy_greedy_equals_plain_greedy(plain_greedy4, draft_model_hierarchy_run):
    greedy, m, _ = draft_model_hierarchy_run
    _assert_same(plain_greedy4, greedy)
    d, h = m["draft_model"], m["hierarchical"]
    # The drafter brought its KV up to date itself (prompts, then tokens the levels changed) ...
    assert d["draft_model_catch_up_tokens"] > 0 and d["draft_model_tokens"] > 0
    assert d["draft_model_slot_limited"] == 0
    # ... its drafts were checked by the intermediate verifier, and the pending ones by the target.
    assert 0 < h["hier_intermediate_accepted"] < h["hier_intermediate_drafts"]
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"] <= HIER_CAP * m["num_drafts"]
    # More than one round per full verification: rounds were actually stacked.
    assert h["hier_rounds"] > m["num_drafts"]


def test_draft_model_hierarchy_sampling_follows_the_target_distribution(draft_model_hierarchy_run, plain_samples):
    _assert_follows_plain_sampling(draft_model_hierarchy_run[2], plain_samples, "draft-model hierarchy")


@pytest.fixture(scope="module")
def hierarchical_server(target, heads, tmp_path_factory):
    """`vllm serve` with hierarchical verification on two tensor-parallel ranks."""
    from serve_utils import running_server

    spec = _spec(heads, enabled=True, draft_layer=DRAFT_LAYER, verify_layer=VERIFY_LAYER, round_tokens=2)
    spec["num_speculative_tokens"] = HIER_CAP
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with running_server(target, spec, log, "--max-model-len", "512", "--tensor-parallel-size", "2",
                        "--distributed-executor-backend", "mp", env=env) as base:
        yield base


def test_serve_hierarchical_tp2_streams_plain_greedy_text(hierarchical_server, plain_run):
    from openai import OpenAI

    from serve_utils import settled_sparsever_metrics

    texts = plain_run[2]
    client = OpenAI(base_url=f"{hierarchical_server}/v1", api_key="unused", timeout=120)
    for i, (prompt, want) in enumerate(zip(prompts(NUM_PROMPTS), texts, strict=True)):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        assert resp.choices[0].text == want, f"prompt {i}"
    # Streaming shows only fully verified tokens: the chunks add up to the plain text, never more.
    stream = client.completions.create(model="tiny", prompt=prompts(1)[0], max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert len(chunks) > 1 and "".join(chunks) == texts[0]
    values = settled_sparsever_metrics(
        hierarchical_server, lambda v: v.get('sparsever:drafting_total{counter="hier_pending_tokens"}', 0) > 0)
    assert values['sparsever:drafting_total{counter="hier_pending_tokens"}'] > 0, values
    assert 0 < values['sparsever:level_acceptance_rate{level="intermediate"}'] < 1
    assert 0 < values['sparsever:level_acceptance_rate{level="full"}'] <= 1
    assert values["sparsever:pending_rolled_back_total"] == (
        values["sparsever:num_draft_tokens_total"] - values["sparsever:num_accepted_tokens_total"])
    for level in ("draft", "intermediate", "full"):
        assert values[f'sparsever:level_time_seconds_total{{level="{level}"}}'] > 0


@pytest.fixture(scope="module")
def self_draft_tree_run(target, heads, tmp_path_factory):
    """Draft trees from the layer-1 exit (layers 0..0 under the tree mask), cut by EVICT."""
    from e2e.test_trees import _cost_profile

    profile = _cost_profile(tmp_path_factory.mktemp("cost") / "cost.json", per_token_s=1e-3)  # a token: 5% of a step
    spec = _spec(heads, draft_layer=DRAFT_LAYER)
    spec |= {"num_speculative_tokens": 8, "tree": {"enabled": True, "branching": 2, "expand": 2, "depth": 4},
             "adaptive": {"enabled": True, "cost_profile": profile, "guard": False}}  # the guard would skip: random head
    return _greedy_metrics_samples(target, spec)


def test_self_draft_trees_greedy_equals_plain_greedy(plain_greedy4, self_draft_tree_run):
    greedy, m, _ = self_draft_tree_run
    _assert_same(plain_greedy4, greedy)
    d, t, e = m["tree_drafting"], m["tree_verify"], m["evict"]
    assert d["tree_drafted"] > 0 and d["tree_draft_levels"] > 0
    assert t["tree_verify_trees"] > 0 and 0 < t["tree_accepted_tokens"] <= t["tree_nodes_verified"]
    assert e["evict_nodes_kept"] < e["evict_nodes_drafted"]
    assert m["self_draft"]["self_draft_slot_limited"] == 0


def test_self_draft_trees_sampling_follows_the_target_distribution(self_draft_tree_run, plain_samples):
    _assert_follows_plain_sampling(self_draft_tree_run[2], plain_samples, "self-drafted trees")
