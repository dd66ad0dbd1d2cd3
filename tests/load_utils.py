"""Load on a running `vllm serve`: many concurrent streaming completions of mixed prompt and
output lengths, some cancelled mid-stream, and the server's counters around them.

Used by tests/e2e/test_serve_load.py and bench/serve_soak.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import requests

from tiny_models import prompts


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: str
    max_tokens: int
    cancel_after_chunks: int | None = None  # close the stream after this many chunks


@dataclass
class LoadResult:
    index: int
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the final usage chunk (not for cancelled ones)
    cancelled: bool = False
    error: str | None = None
    seconds: float = 0.0


def mixed_requests(n: int, *, seed: int = 0, cancel_fraction: float = 0.25, max_prompt_words: int = 200,
                   max_tokens: int = 48) -> list[LoadRequest]:
    """`n` requests: prompt lengths 2..max_prompt_words words, 1..max_tokens output tokens; every
    1/cancel_fraction-th one (at random) is cancelled after 1-4 chunks."""
    rng = random.Random(seed)
    out = []
    cancel = set(rng.sample(range(n), round(n * cancel_fraction)))
    for i in range(n):
        length = rng.randint(2, max_prompt_words)
        prompt = prompts(1, length=length, seed=seed * 100_003 + i)[0]
        out.append(LoadRequest(i, prompt, rng.randint(1, max_tokens) if i not in cancel else max_tokens,
                               rng.randint(1, 4) if i in cancel else None))
    return out


async def _stream_one(client, base: str, model: str, req: LoadRequest, extra: dict) -> LoadResult:
    result = LoadResult(req.index)
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    start = time.monotonic()
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    result.chunks += 1
                if (req.cancel_after_chunks is not None and result.chunks >= req.cancel_after_chunks
                        and result.finish_reason is None):  # (a request that already ended is not cancelled)
                    result.cancelled = True
                    break  # leaving the block closes the connection: the server aborts the request
    except Exception as e:  # noqa: BLE001 - reported per request, the caller asserts on it
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.seconds = time.monotonic() - start
    return result


async def _run_load(base: str, reqs: list[LoadRequest], model: str, concurrency: int, extra: dict,
                    timeout_s: float) -> list[LoadResult]:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(timeout_s, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def bounded(req: LoadRequest) -> LoadResult:
            async with limit:
                return await _stream_one(client, base, model, req, extra)

        return list(await asyncio.gather(*(bounded(r) for r in reqs)))


def run_load(base: str, reqs: list[LoadRequest], *, model: str = "tiny", concurrency: int = 64,
             extra: dict | None = None, timeout_s: float = 600) -> list[LoadResult]:
    """Send `reqs` with at most `concurrency` in flight; results in request order."""
    return asyncio.run(_run_load(base, reqs, model, concurrency, extra or {}, timeout_s))


@dataclass
class ServerCounters:
    """Prometheus samples of /metrics that load tests compare before and after."""

    values: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, base: str) -> ServerCounters:
        values = {}
        for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            try:
                values[name] = float(value)
            except ValueError:
                continue
        return cls(values)

    def total(self, metric: str, label: str = "") -> float:
        """Sum of a metric over its label sets (those containing `label`, e.g. 'reason="abort"')."""
        return sum(v for k, v in self.values.items()
                   if (k == metric or k.startswith(metric + "{")) and label in k)


def wait_until_idle(base: str, timeout_s: float = 60) -> ServerCounters:
    """Counters once no request is running or waiting (aborts reach the engine asynchronously)."""
    deadline = time.time() + timeout_s
    while True:
        counters = ServerCounters.read(base)
        if counters.total("vllm:num_requests_running") == 0 and counters.total("vllm:num_requests_waiting") == 0:
            return counters
        if time.time() > deadline:
            return counters
        time.sleep(0.5)


def worker_request_state(base: str) -> list[dict]:
    """Per-rank plugin state (`sparsever_request_state`), through vLLM's dev-mode RPC endpoint
    (the server must run with VLLM_SERVER_DEV_MODE=1)."""
    r = requests.post(f"{base}/collective_rpc", json={"method": "sparsever_request_state"}, timeout=60)
    r.raise_for_status()
    return r.json()["results"]
