"""Runs inside the worker for bench/evict_trace.py (through `sparsever_call`): wraps the runner's
EVICT (its facade, adaptive.policy.EvictPolicy) so each measured step and each depth decision is
recorded."""

from __future__ import annotations

import time
from typing import Any

TRACE: list[dict[str, Any]] = []


def install(worker: Any) -> bool:
    evict = worker.model_runner.sparsever_proposer.evict
    observe_step, plan_depth = evict.observe_step, evict.plan_depth

    def traced_observe_step(query_tokens, contexts, seconds, mask="chain", gap_s=None):
        TRACE.append({"kind": "step", "query_tokens": list(query_tokens), "contexts": list(contexts),
                      "seconds": seconds, "gap_s": gap_s, "t": time.perf_counter()})
        return observe_step(query_tokens, contexts, seconds, mask, gap_s)

    def traced_plan_depth(contexts, shape, catch_up_tokens=0, **weighed):
        depth = plan_depth(contexts, shape, catch_up_tokens, **weighed)
        TRACE.append({"kind": "plan", "depth": depth, "contexts": list(contexts), "catch_up_tokens": catch_up_tokens,
                      "clock": {k: v for k, v in evict.summary().items() if k.startswith("evict_clock_")},
                      "t": time.perf_counter()})
        return depth

    evict.observe_step, evict.plan_depth = traced_observe_step, traced_plan_depth
    return True


def fetch(worker: Any) -> list[dict[str, Any]]:
    out = list(TRACE)
    TRACE.clear()
    return out
