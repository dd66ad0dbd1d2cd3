"""Bad input to the server and the offline API: hostile speculative configs fail before start with
the field named; malformed, oversized or hostile requests get a 4xx (never a 5xx, never a hang)
and the server keeps serving the same greedy text afterwards."""

import json
import subprocess
import sys
import time

import pytest
import requests

from conftest import GREEDY_MAX_TOKENS
from serve_utils import running_server
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft, tmp_path_factory):
    spec = {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 3}
    log = tmp_path_factory.mktemp("serve_fuzz") / "server.log"
    with running_server(tiny_target, spec, log, "--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


GOOD = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0.0}

# (request body changes, a word the error must contain; None: any 4xx)
BAD_REQUESTS = [
    ({"prompt": "w1 " * (MAX_MODEL_LEN + 10)}, "context length"),
    ({"prompt": "w1", "max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"prompt": {"nested": ["junk", {"deeper": [1, 2]}]}}, "prompt"),
    ({"prompt": []}, None),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"seed": "abc"}, "seed"),
    ({"logprobs": 10**6}, "logprobs"),
    ({"stop": {"not": "a list"}}, "stop"),
    ({"model": "no-such-model"}, "model"),
    ({"min_p": 1.5, "temperature": 0.8}, "min_p"),  # (valid min_p and logit_bias are honoured)
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"not-a-token": 1.0}}, "logit_bias"),
]


@pytest.mark.parametrize(("change", "word"), BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_request_gets_a_clear_4xx(server, change, word):
    r = requests.post(f"{server}/v1/completions", json={**GOOD, **change}, timeout=60)
    assert 400 <= r.status_code < 500, (change, r.status_code, r.text[:300])
    if word is not None:
        assert word in r.text, (change, r.text[:500])


def test_raw_garbage_bodies_get_a_4xx(server):
    for body in (b"{not json", b'{"prompt": "\xff\xfe\xfa", "model": "tiny"}', b"\x00" * 1000, b"[]", b"null"):
        r = requests.post(f"{server}/v1/completions", data=body, timeout=60,
                          headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (body[:20], r.status_code, r.text[:300])


def test_empty_prompt_and_edge_requests_do_not_break_the_server(server):
    # An empty prompt: vLLM may refuse it (4xx) or answer from BOS; never a server error.
    r = requests.post(f"{server}/v1/completions", json={**GOOD, "prompt": ""}, timeout=60)
    assert r.status_code < 500, r.text[:300]
    # Thousands of stop strings that never match: the plain answer.
    r = requests.post(f"{server}/v1/completions", timeout=120,
                      json={**GOOD, "max_tokens": 8, "stop": [f"nomatch{i}" for i in range(5000)]})
    assert r.status_code < 500, r.text[:300]


def test_server_still_serves_plain_greedy_after_the_bad_input(server, plain_greedy):
    for i in range(2):
        r = requests.post(f"{server}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompts(6)[i], "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0.0})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["text"] == plain_greedy[i][1]
    assert requests.get(f"{server}/health", timeout=10).status_code == 200


HOSTILE_CONFIGS = [
    ({"num_speculative_tokens": 10**18}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 3, "attention": {"enabled": "yes"}}, "attention.enabled"),
    ({"num_speculative_tokens": 3, "attention": {"top_k_blocks": [[[]]], "enabled": True}}, "attention.top_k_blocks"),
    ({"num_speculative_tokens": 3, "ffn": {"enabled": True, "keep_ratio": float("nan")}}, "ffn.keep_ratio"),
    ({"num_speculative_tokens": 3, "unknown_section": {"a": {"b": [1]}}}, "unknown field 'unknown_section'"),
    ({"num_speculative_tokens": 3, "tree": "deep"}, "tree"),
]


@pytest.mark.parametrize(("config", "word"), HOSTILE_CONFIGS, ids=[w for _, w in HOSTILE_CONFIGS])
def test_offline_hostile_config_fails_before_start_naming_the_field(tiny_target, config, word):
    from vllm import LLM

    from vllm_sparsever.config import SparseverConfigError

    start = time.monotonic()
    with pytest.raises(SparseverConfigError) as err:
        LLM(model=str(tiny_target), enforce_eager=True, max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "sparsever", "prompt_lookup_max": 3, **config})
    assert word in str(err.value)
    assert time.monotonic() - start < 30  # refused while parsing, no engine was started


@pytest.mark.parametrize("index", [0, 3, 4])
def test_vllm_serve_hostile_config_exits_naming_the_field(tiny_target, index, tmp_path):
    config, word = HOSTILE_CONFIGS[index]
    vllm_bin = str(__import__("pathlib").Path(sys.executable).with_name("vllm"))
    spec = json.dumps({"method": "sparsever", "prompt_lookup_max": 3, **config})
    start = time.monotonic()
    done = subprocess.run([vllm_bin, "serve", str(tiny_target), "--max-model-len", str(MAX_MODEL_LEN),
                           "--port", "0", "--speculative-config", spec],
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-2000:]
    assert word in output, output[-3000:]
    assert "EngineCore" not in output or "Waiting for init message" not in output
    assert time.monotonic() - start < 180
