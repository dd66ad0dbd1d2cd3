"""OpenAI features of `vllm serve` that stock vLLM offers with speculative decoding, with sparsever:
each request gets the same answer from a non-speculative server and from sparsever servers
(dense draft-model verification; EVICT-cut draft trees, where sparsever owns verification).
Greedy fp32, tiny models; JSON-schema structured output on Qwen2.5-Coder-0.5B (the tiny models'
word-level vocabulary has no JSON characters).
"""

import json

import pytest
import requests

from serve_utils import running_server, running_servers
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MAX_MODEL_LEN = 512
ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--no-async-scheduling", "--max-logprobs", "5")
PROMPTS = prompts(4, length=16, seed=11)


@pytest.fixture(scope="module")
def servers(tiny_target, tiny_draft, tmp_path_factory):
    """{"plain": url, "draft_model": url, "evict_trees": url}"""
    from e2e.test_trees import _cost_profile

    logs = tmp_path_factory.mktemp("serve_features")
    profile = _cost_profile(logs / "cost.json", per_token_s=1e-5)
    specs = {
        "plain": None,
        "draft_model": {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 3},
        "evict_trees": {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 8,
                        "tree": {"enabled": True, "branching": 2, "expand": 2, "depth": 4},
                        "adaptive": {"enabled": True, "guard": False, "cost_profile": profile}},
    }
    with running_servers(tiny_target, specs, logs, *ARGS) as bases:
        yield bases


def _complete(base: str, **body) -> requests.Response:
    return requests.post(f"{base}/v1/completions", json={"model": "tiny", "temperature": 0.0, **body}, timeout=300)


def _same_everywhere(servers, **body) -> list[dict]:
    """The request's JSON answer from each server; asserts every sparsever answer equals plain's."""
    answers = {}
    for name, base in servers.items():
        r = _complete(base, **body)
        assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:500]}"
        answers[name] = r.json()
    want = [(c["text"], c["finish_reason"]) for c in answers["plain"]["choices"]]
    for name, answer in answers.items():
        got = [(c["text"], c["finish_reason"]) for c in answer["choices"]]
        assert got == want, f"{name} differs from the plain server for {body}"
    return list(answers.values())


def test_stop_strings(servers):
    for prompt in PROMPTS:
        text = _complete(servers["plain"], prompt=prompt, max_tokens=24).json()["choices"][0]["text"]
        stop = text.split()[len(text.split()) // 2]  # a word the answer reaches halfway
        (plain, *_) = _same_everywhere(servers, prompt=prompt, max_tokens=24, stop=[stop, "zz top"])
        assert plain["choices"][0]["finish_reason"] == "stop"
        assert stop not in plain["choices"][0]["text"]


def test_many_stop_strings(servers):
    # vLLM's completions API takes at most 4 stop strings: the same clear 400 from every server.
    for name, base in servers.items():
        r = _complete(base, prompt=PROMPTS[0], max_tokens=16, stop=[f"never{i}" for i in range(1000)])
        assert r.status_code == 400 and "stop" in r.text, f"{name}: {r.status_code} {r.text[:300]}"
    _same_everywhere(servers, prompt=PROMPTS[0], max_tokens=16, stop=[f"never{i}" for i in range(4)])


def test_n_with_seed_is_reproducible(servers):
    """Also on EVICT, whose measurements change between the two requests (its draft shapes for a
    seeded request must not: they set how many random draws each step makes)."""
    for name, base in servers.items():
        body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 1234}
        first = _complete(base, **body).json()
        for prompt in PROMPTS[2:]:
            _complete(base, prompt=prompt, max_tokens=24, temperature=1.0)
        second = _complete(base, **body).json()
        texts = [c["text"] for c in first["choices"]]
        assert len(texts) == 3 and all(texts), name
        assert texts == [c["text"] for c in second["choices"]], f"{name}: same seed, other text"


def test_logprobs(servers):
    answers = _same_everywhere(servers, prompt=PROMPTS[2], max_tokens=12, logprobs=3, echo=False)
    plain = answers[0]["choices"][0]["logprobs"]
    for answer in answers[1:]:
        got = answer["choices"][0]["logprobs"]
        assert got["tokens"] == plain["tokens"]
        assert all(len(top) == 3 for top in got["top_logprobs"])
        assert got["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-3)


def test_structured_outputs_choice_and_regex(servers):
    (plain, *_) = _same_everywhere(servers, prompt=PROMPTS[3], max_tokens=8,
                                   structured_outputs={"choice": ["w5", "w77", "w401"]})
    assert plain["choices"][0]["text"].strip() in ("w5", "w77", "w401")
    _same_everywhere(servers, prompt=PROMPTS[3], max_tokens=6, structured_outputs={"regex": "(w1|w2|w3)+"})


def test_chat_template(servers):
    answers = {}
    for name, base in servers.items():
        r = requests.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": "tiny", "temperature": 0.0, "max_tokens": 16,
            "messages": [{"role": "system", "content": PROMPTS[0]}, {"role": "user", "content": PROMPTS[1]}]})
        assert r.status_code == 200, f"{name}: {r.text[:300]}"
        answers[name] = r.json()["choices"][0]["message"]["content"]
    assert len(set(answers.values())) == 1, answers


def test_max_tokens_at_the_model_limit(servers):
    prompt = PROMPTS[0] * 20
    n_prompt = _complete(servers["plain"], prompt=prompt, max_tokens=1).json()["usage"]["prompt_tokens"]
    limit = MAX_MODEL_LEN - n_prompt
    (plain, *_) = _same_everywhere(servers, prompt=prompt, max_tokens=limit)
    assert plain["usage"]["completion_tokens"] == limit or plain["choices"][0]["finish_reason"] == "stop"
    # Past the limit vLLM stops at max_model_len ("length"); sparsever the same, never past it.
    (plain, *_) = _same_everywhere(servers, prompt=prompt, max_tokens=limit + 50)
    assert plain["usage"]["prompt_tokens"] + plain["usage"]["completion_tokens"] <= MAX_MODEL_LEN


LOGIT_BIAS = {"7": 3.0, "11": 3.0, "13": 3.0, "5": -3.0}


def test_logit_bias_is_honoured(servers):
    """vLLM refuses logit_bias under speculative decoding; sparsever applies it to the
    verification logits: every answer equals the non-speculative server's biased one."""
    changed = 0
    for prompt in PROMPTS:
        unbiased = _complete(servers["plain"], prompt=prompt, max_tokens=16).json()["choices"][0]["text"]
        (plain, *_) = _same_everywhere(servers, prompt=prompt, max_tokens=16, logit_bias=LOGIT_BIAS)
        changed += plain["choices"][0]["text"] != unbiased
    assert changed, "the bias changes no answer: the test would not notice it being ignored"


def test_min_p_is_honoured(servers):
    """min_p = 1 keeps only the most likely token: sampled answers equal the greedy ones on every
    server, though the same sampling without min_p does not (so draft positions are masked too)."""
    differs = 0
    for i, prompt in enumerate(PROMPTS):
        greedy = _complete(servers["plain"], prompt=prompt, max_tokens=16).json()["choices"][0]["text"]
        for name, base in servers.items():
            r = _complete(base, prompt=prompt, max_tokens=16, temperature=1.0, seed=i, min_p=1.0)
            assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:300]}"
            assert r.json()["choices"][0]["text"] == greedy, f"{name}: min_p=1 is not greedy"
        sampled = _complete(servers["draft_model"], prompt=prompt, max_tokens=16, temperature=1.0, seed=i)
        differs += sampled.json()["choices"][0]["text"] != greedy
    assert differs, "sampling equals greedy without min_p: the test would not notice min_p being ignored"


def _qwen_model(tmp_path_factory):
    import os

    from vllm_sparsever.models import build_model, registry
    from vllm_sparsever.store.packages import missing_packages

    name = "qwen2.5-coder-0.5b"  # the set-up's default model
    missing = missing_packages(registry.required_packages(name))
    assert not missing, f"{name}: not installed ({' '.join(p.requirement for p in missing)}); run scripts/setup.sh"
    root = os.environ.get("SPARSEVER_TEST_MODELS_ROOT") or tmp_path_factory.mktemp("models")
    return build_model(name, root=root)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
          "required": ["name", "year"], "additionalProperties": False}


def test_json_schema_structured_output_on_a_real_model(tmp_path_factory):
    import jsonschema

    model = _qwen_model(tmp_path_factory)
    spec = {"method": "sparsever", "draft_source": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 4}
    body = {"model": "tiny", "temperature": 0.0, "max_tokens": 64, "messages": [
        {"role": "user", "content": "Give the name and release year of a programming language as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA}}}
    texts = {}
    logs = tmp_path_factory.mktemp("serve_json")
    for name, s in (("plain", None), ("sparsever", spec)):
        # One at a time: two fp32 Qwen servers next to the module's tiny ones would not fit in memory.
        with running_server(model, s, logs / f"{name}.log", "--max-model-len", "1024") as base:
            r = requests.post(f"{base}/v1/chat/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text[:500]
            texts[name] = r.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(texts["sparsever"]), SCHEMA)
    assert texts["sparsever"] == texts["plain"]
