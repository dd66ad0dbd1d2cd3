"""Distinct experts per verify step on an MoE target (a metric, and EVICT's cost input).

Verification cost on an MoE target grows with the union of experts its tokens route to (every
routed expert's weights are read once per step), so draft trees and EVICT report and use it.
Installed on MoE targets without MoE pruning (whose wrapper counts its own experts): each MoE
runner's forward is shadowed on the target's own instances; on sampled full-level verify steps
(`runtime.should_sample`, one in STATS_SAMPLE_EVERY) it takes
the top-k of the router logits of the verifying requests' tokens and records
- per layer and request: the distinct routed experts and the tokens (`moe_verify_distinct_experts`
  / `moe_verify_request_layers` / `moe_verify_tokens` counters),
- per layer and step: the distinct routed experts over all of the step's verifying tokens, which
  is what the step reads (`moe_verify_step_distinct_experts` / `moe_verify_step_layers` /
  `moe_verify_step_tokens`);
and hands each request's (tokens, distinct experts) per layer to `runtime.experts_observer` when one
is set (EVICT's expert-union model, adaptive/experts.py),
then runs the stock forward unchanged. `probe_step_experts()` collects the per-layer step unions of
every forward, plan or not (profile-verify, offline/profile_verify.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from vllm_sparsever.compat import fused_moe as vllm_moe
from vllm_sparsever.forward_scope import current_plan
from vllm_sparsever.plan import VerifyLevel

_probe: list[tuple[int, int, int]] | None = None  # (tokens, distinct experts, experts) per MoE layer run


def moe_routing(model: nn.Module) -> tuple[int, int] | None:
    """(routed experts per layer, top-k) of an MoE target, None for a dense one."""
    runners = vllm_moe.find_moe_runners(model)
    if not runners:
        return None
    runner = runners[0][1]
    w13, _ = vllm_moe.expert_weights(vllm_moe.routed_experts(runner))
    return int(w13.shape[0]), vllm_moe.router_top_k(runner)[0]


def install_expert_counter(model: nn.Module, runtime: Any) -> int:
    runners = vllm_moe.find_moe_runners(model)
    for _, runner in runners:
        stock = vllm_moe.stock_runner_forward(runner)
        top_k, _ = vllm_moe.router_top_k(runner)
        gate = vllm_moe.runner_gate(runner)

        def forward(hidden_states, router_logits=None, *args, _stock=stock, _k=top_k, _gate=gate, **kwargs):
            plan = current_plan()
            # A second routing per layer is a few percent of a small MoE's step: sampled steps only.
            counting = (plan is not None and plan.is_verify_step and plan.level is VerifyLevel.FULL
                        and runtime.should_sample(plan.step))
            if counting or _probe is not None:
                logits = router_logits
                if logits is None and _gate is not None:
                    out = _gate(hidden_states)
                    logits = out[0] if isinstance(out, tuple) else out
                if logits is not None:
                    if _probe is not None:  # a measurement (profile-verify): not a served step
                        ids = logits.topk(_k, dim=-1).indices
                        _probe.append((int(ids.shape[0]), int(ids.unique().numel()), int(logits.shape[-1])))
                    else:
                        count_experts(plan, logits, _k, runtime)
            return _stock(hidden_states, router_logits, *args, **kwargs)

        vllm_moe.shadow_runner_forward(runner, forward)
    return len(runners)


def count_experts(plan: Any, router_logits: torch.Tensor, top_k: int, runtime: Any) -> None:
    ids = router_logits.topk(top_k, dim=-1).indices
    observer = runtime.experts_observer
    distinct = tokens = 0
    verifying = []
    for req in plan.requests:
        rows = ids[req.query_start: req.query_start + req.num_query_tokens]
        request_distinct = int(rows.unique().numel())
        distinct += request_distinct
        tokens += int(rows.shape[0])
        verifying.append(rows)
        if observer is not None:
            observer(int(rows.shape[0]), request_distinct)
    step_distinct = int(torch.cat(verifying).unique().numel()) if verifying else 0
    runtime.record(moe_verify_distinct_experts=distinct, moe_verify_request_layers=len(plan.requests),
                   moe_verify_tokens=tokens, moe_verify_step_distinct_experts=step_distinct,
                   moe_verify_step_layers=1, moe_verify_step_tokens=tokens)


@contextmanager
def probe_step_experts() -> Iterator[list[tuple[int, int, int]]]:
    """Collect (tokens, distinct routed experts, experts) of every MoE layer run inside, on targets
    with the counter installed."""
    global _probe
    _probe, outer = [], _probe
    try:
        yield _probe
    finally:
        _probe = outer
