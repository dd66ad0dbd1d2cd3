"""Distinct experts per verify step on an MoE target (a metric, not a sparsity).

Verification cost on an MoE target grows with the union of experts its tokens route to (every kept
expert's weights are read once per step), so draft trees and EVICT report it. Installed when the
target has MoE blocks and draft trees or adaptive verification are on, without MoE pruning (whose
wrapper counts its own experts): each MoE runner's forward is shadowed on the target's own
instances; on full-level verify steps it takes the top-k of the router logits of every verifying
request's tokens and records, per layer and request, the distinct routed experts and the tokens
(`moe_verify_distinct_experts` / `moe_verify_request_layers` / `moe_verify_tokens` counters), then
runs the stock forward unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_sparsever.integration.compat import fused_moe as vllm_moe
from vllm_sparsever.plan import VerifyLevel, current_plan


def install_expert_counter(model: nn.Module, runtime: Any) -> int:
    runners = vllm_moe.find_moe_runners(model)
    for _, runner in runners:
        stock = vllm_moe.stock_runner_forward(runner)
        top_k, _ = vllm_moe.router_top_k(runner)
        gate = vllm_moe.runner_gate(runner)

        def forward(hidden_states, router_logits=None, *args, _stock=stock, _k=top_k, _gate=gate, **kwargs):
            plan = current_plan()
            if plan is not None and plan.is_verify_step and plan.level is VerifyLevel.FULL:
                logits = router_logits
                if logits is None and _gate is not None:
                    out = _gate(hidden_states)
                    logits = out[0] if isinstance(out, tuple) else out
                if logits is not None:
                    count_experts(plan, logits, _k, runtime)
            return _stock(hidden_states, router_logits, *args, **kwargs)

        vllm_moe.shadow_runner_forward(runner, forward)
    return len(runners)


def count_experts(plan: Any, router_logits: torch.Tensor, top_k: int, runtime: Any) -> None:
    ids = router_logits.topk(top_k, dim=-1).indices
    distinct = tokens = 0
    for req in plan.requests:
        rows = ids[req.query_start: req.query_start + req.num_query_tokens]
        distinct += int(rows.unique().numel())
        tokens += int(rows.shape[0])
    runtime.record(moe_verify_distinct_experts=distinct, moe_verify_request_layers=len(plan.requests),
                   moe_verify_tokens=tokens)
