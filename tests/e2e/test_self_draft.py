"""Self-drafting (draft_source='early_exit'): the tiny target's first layer plus an exit head drafts
inside the target worker. Lossless: greedy output equals non-speculative greedy (fp32, batch 6);
sampled output follows the target's distribution (two-sample chi-square against plain sampling).

One engine per configuration, shared by the tests of this module.
"""

import gc
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import GREEDY_MAX_TOKENS as MAX_TOKENS
from conftest import GREEDY_PROMPTS as NUM_PROMPTS
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_SPEC = 3
DRAFT_LAYER = 1  # the tiny target has 2 decoder layers
SAMPLES = 800  # sampled completions per engine for the distribution test
SAMPLE_TOKENS = 4


def make_heads(model: Path, out: Path, layers: tuple[int, ...] = (DRAFT_LAYER,), *, seed: int = 0,
               adapter_scale: float = 0.3) -> Path:
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
def heads(tiny_target, tmp_path_factory):
    return make_heads(tiny_target, tmp_path_factory.mktemp("heads") / "exit_heads")


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


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts(NUM_PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [list(o.outputs[0].token_ids) for o in outs]


SAMPLE_PROMPT = prompts(1, seed=7)[0]


@pytest.fixture(scope="module")
def self_draft_run(tiny_target, heads):
    from vllm_sparsever.metrics import get_metrics

    llm = _engine(tiny_target, _spec(heads))
    try:
        greedy = _greedy(llm)
        greedy_metrics = get_metrics(llm)
        sampled = _sample(llm, SAMPLE_PROMPT)
    finally:
        del llm
        gc.collect()
    return greedy, greedy_metrics, sampled


@pytest.fixture(scope="module")
def plain_samples(tiny_target):
    llm = _engine(tiny_target, None)
    try:
        return _sample(llm, SAMPLE_PROMPT)
    finally:
        del llm
        gc.collect()


def _assert_same(baseline, tokens):
    assert len(tokens) == len(baseline)
    for i, (want, got) in enumerate(zip(baseline, tokens, strict=True)):
        assert got == want, f"prompt {i} differs"


def test_self_draft_greedy_equals_plain_greedy(plain_greedy, self_draft_run):
    greedy, _, _ = self_draft_run
    _assert_same([t for t, _ in plain_greedy], greedy)


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
    # A random adapter on layer 1 of 2: some drafts right, some wrong.
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def _chi2_two_sample_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that `a` and `b` are draws from one categorical distribution
    (categories with fewer than 10 draws in all are pooled)."""
    ca, cb = Counter(a), Counter(b)
    pooled: dict = {}
    for key in set(ca) | set(cb):
        k = key if ca[key] + cb[key] >= 10 else "rare"
        pooled.setdefault(k, [0, 0])
        pooled[k][0] += ca[key]
        pooled[k][1] += cb[key]
    table = torch.tensor(list(pooled.values()), dtype=torch.float64)
    if table.shape[0] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_self_draft_sampling_follows_the_target_distribution(self_draft_run, plain_samples):
    _, _, sampled = self_draft_run
    assert len(sampled) == len(plain_samples) == SAMPLES
    assert all(len(s) == SAMPLE_TOKENS for s in sampled)
    # Tokens 1..3 of a completion come from verified drafts or from the rejection sampler's
    # correction; a sampler that trusted the drafts would concentrate them on the head's argmax.
    for position in range(1, SAMPLE_TOKENS):
        p = _chi2_two_sample_p([s[position] for s in sampled], [s[position] for s in plain_samples])
        assert p > 1e-3, f"token {position}: self-drafted samples differ from plain sampling (p={p:.2e})"
    # The test does detect a sampler that over-trusts drafts: moving a quarter of the mass onto one
    # token (what accepting a confident draft too often does) is flagged.
    plain_1 = [s[1] for s in plain_samples]
    top = Counter(plain_1).most_common(1)[0][0]
    biased = plain_1[: SAMPLES * 3 // 4] + [top] * (SAMPLES // 4)
    assert _chi2_two_sample_p(biased, [s[1] for s in sampled]) < 1e-3


@pytest.fixture(scope="module")
def dynamic_run(tiny_target, heads, self_draft_run):
    from vllm_sparsever.metrics import get_metrics

    # A threshold at the mean head probability seen without one: some drafts stop early, some not.
    threshold = self_draft_run[1]["self_draft"]["self_draft_mean_confidence"]
    assert 0.0 < threshold < 1.0
    llm = _engine(tiny_target, _spec(heads, draft_confidence=threshold))
    try:
        return _greedy(llm), get_metrics(llm)
    finally:
        del llm
        gc.collect()


def test_dynamic_draft_length_is_lossless_and_stops_early(plain_greedy, dynamic_run):
    greedy, m = dynamic_run
    _assert_same([t for t, _ in plain_greedy], greedy)
    assert m["self_draft"]["self_draft_stopped_by_confidence"] > 0
    assert 0 < m["num_draft_tokens"] < NUM_SPEC * m["num_drafts"]


def test_tensor_parallel_self_draft_equals_plain_greedy(plain_greedy, tiny_target, heads, monkeypatch):
    # Two ranks on two cores: no core reserved for the front end, one OpenMP thread per rank.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = _engine(tiny_target, _spec(heads), tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        greedy = _greedy(llm)
        from vllm_sparsever.metrics import get_metrics

        m = get_metrics(llm)
    finally:
        del llm
        gc.collect()
    _assert_same([t for t, _ in plain_greedy], greedy)
    ranks = m["ranks"]
    assert len(ranks) == 2
    # Both ranks drafted the same tokens (all-gathered logits, same argmax, same stops).
    assert ranks[0]["self_draft"]["self_draft_tokens"] == ranks[1]["self_draft"]["self_draft_tokens"] > 0


@pytest.mark.parametrize(
    "early_exit, message",
    [
        ({"heads": "/nonexistent/exit_heads"}, "no exit heads"),
        ({"draft_layer": 5}, "draft_layer"),
        ({"draft_layer": 0}, "draft_layer"),
    ],
)
def test_bad_self_draft_config_fails_before_start(tiny_target, heads, early_exit, message):
    from vllm_sparsever.config import SparseverConfigError

    spec = _spec(heads)
    spec["early_exit"].update(early_exit)
    with pytest.raises(SparseverConfigError, match=message):
        _engine(tiny_target, spec)
