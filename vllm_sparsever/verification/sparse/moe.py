"""MoE expert pruning on verify steps: one expert budget per request, dispatch over the kept experts.

vLLM 0.32 runs an MoE block (Mixtral's `MixtralMoE`, and every model built on `FusedMoEFactory`) as
`gate` (router logits) -> `MoERunner.forward(hidden, logits)` -> `router.select_experts` (CPU:
`CPURouter`, softmax top-k, optional renormalize) -> `RoutedExperts.forward_modular` ->
`CPUUnquantizedExperts.apply` -> `torch.ops._C.cpu_fused_moe`, then the runner all-reduces the
partial sums under TP (`_maybe_reduce_final_output`). Experts hold `w13_weight` [E, 2I, H] (rows
0..I-1 gate, I..2I-1 up) and `w2_weight` [E, H, I], I sharded under TP.

Weights: after loading, vLLM-CPU pads I to the kernel alignment and *replaces* both parameters by a
prepacked copy (`cpu_prepack_moe_weight`, 16-row blocks stored transposed for fp32, VNNI pairs for
bf16); the [E, 2I, H] originals are freed. `preserve_expert_weights()` (active while the target
loads) therefore changes that step for the target's layers:
- mode "shared" (memory-neutral): no padding, no prepack; the parameters stay [E, 2I, H] /
  [E, H, I] and the experts' `apply` runs `moe_grouped_dispatch` with the stock routing on them, so
  dense steps (prefill, decode, moe off at run time) use the same router and reduction as stock
  with our expert kernel (equal up to fp32 summation order, not bit-identical to cpu_fused_moe);
- mode "copy" (default; config `moe.weights`): stock prepack kept (dense steps are exactly stock) and
  a plain copy kept for the sparse path: +1x the expert weights in memory.

`install_moe` wraps the forward of every `MoERunner` of the target with one opaque custom op
(`sparsever_moe::runner_forward`), so a torch.compile graph reads each step's plan. On a verify
step with `moe.enabled`, the verify tokens are routed by `moe_route_and_prune` (ratio pruning and
the per-request expert budget) and run by `moe_grouped_dispatch` over the union of kept experts;
other tokens of a mixed step, and every other step, take the stock forward.

Shared experts (Qwen2-MoE's `shared_expert` + sigmoid `shared_expert_gate`, run by vLLM's
`SharedExperts` inside the runner): never pruned. On the sparse path the block runs the model's
shared-expert module densely on the verify tokens and adds it to the pruned routed output before
the TP reduction, as the stock runner does; the stock forward (dense steps, other tokens of a mixed
step, the dense fallback) runs them itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vllm_sparsever import _custom_ops as ops
from vllm_sparsever.compat import fused_moe as vllm_moe
from vllm_sparsever.compat.forward_context import skip_moe_layer_slot
from vllm_sparsever.compat.worker import is_cpu_platform
from vllm_sparsever.verification.sparse.op_modules import OpModuleRegistry
from vllm_sparsever.forward_scope import current_plan
from vllm_sparsever.plan import VerificationPlan
from vllm_sparsever.verification.sparse.runtime import (
    SparsePathUnavailable,
    SparseVerificationRuntime,
    get_runtime,
    layer_index_of,
)

SUPPORTED = (
    "MixtralForCausalLM and other FusedMoE blocks with softmax top-k routing, SiLU-gated "
    "unquantized experts without bias, optional shared experts run densely (a module with its own "
    "gate, e.g. Qwen2MoeForCausalLM) and no expert/data parallelism "
    "(e.g. Qwen3MoeForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM)"
)
WEIGHT_MODES = ("shared", "copy")

# the custom op finds its block here (ops cannot take modules)
BLOCKS: OpModuleRegistry["SparseMoEBlock"] = OpModuleRegistry()


# ---- load-time: keep the expert weights the sparse path reads ---------------------------------------

def _raw_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
               global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
               expert_tokens_meta, apply_router_weight_on_input):
    """`CPUUnquantizedExperts.apply` (same parameters, `vllm_moe.EXPERTS_APPLY_PARAMS`) for experts
    whose weights stayed [E, 2I, H] / [E, H, I]; bound on those experts objects only."""
    if apply_router_weight_on_input:  # weights already applied to the input by prepare()
        topk_weights = torch.ones_like(topk_weights)
    if expert_map is not None:
        topk_ids = expert_map[topk_ids.long()]  # global -> local ids, -1 = not on this rank
    result, _ = ops.moe_grouped_dispatch(
        hidden_states, topk_weights.float(), topk_ids, w1, w2,
        out=output if output.is_contiguous() else None,
    )
    if result is not output:
        output.copy_(result)


def _preservable(layer: nn.Module) -> bool:
    moe_config = getattr(layer, "moe_config", None)
    w13, w2 = vllm_moe.expert_weights(layer)
    return (
        moe_config is not None
        and vllm_moe.is_silu_without_bias(moe_config)
        and isinstance(w13, torch.Tensor) and w13.ndim == 3 and w13.is_floating_point()
        and isinstance(w2, torch.Tensor) and w2.ndim == 3 and w2.is_floating_point()
    )


@contextlib.contextmanager
def preserve_expert_weights(mode: str = "copy") -> Iterator[None]:
    """While the target loads on CPU: keep its experts' [E, 2I, H] / [E, H, I] weights.

    mode "shared": no prepack, dense steps run our kernel on the same tensors (no extra
    memory). mode "copy": stock prepack plus a plain copy (+1x expert weights). The config's
    `moe.weights` chooses. No-op off CPU (Triton keeps the plain layout).
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"moe.weights: {mode!r} (allowed: {', '.join(WEIGHT_MODES)})")
    if not is_cpu_platform():
        yield
        return

    def process_weights(experts, layer: nn.Module, stock) -> None:
        if not _preservable(layer):
            return stock(layer)  # install_moe reports these layers
        if mode == "copy":
            w13, w2 = vllm_moe.expert_weights(layer)
            experts._sparsever_weights = (w13.detach().clone(), w2.detach().clone())
            return stock(layer)
        # Shared: the loaded parameters are what the stock path (via `apply`) and ours read; only
        # these experts objects run our kernel, the class (other engines, the draft) stays stock.
        vllm_moe.disable_zentorch(experts)
        vllm_moe.bind_experts_apply(experts, _raw_apply)
        experts._sparsever_raw = True

    with vllm_moe.experts_weight_processing(process_weights):
        yield


# ---- the wrapped block -------------------------------------------------------------------------------

@torch.library.custom_op("sparsever_moe::runner_forward", mutates_args=())
def _runner_forward_op(hidden_states: torch.Tensor, router_logits: torch.Tensor, block_key: str) -> torch.Tensor:
    out = BLOCKS[block_key].forward_impl(hidden_states, router_logits)
    # A custom op's output may not alias its inputs.
    return out.clone() if out.data_ptr() in (hidden_states.data_ptr(), router_logits.data_ptr()) else out


@_runner_forward_op.register_fake
def _(hidden_states: torch.Tensor, router_logits: torch.Tensor, block_key: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


class SparseMoEBlock:
    """Verify-step forward of one `MoERunner` (a plain object: the runner stays in the model, where
    vLLM's forward context finds it by name)."""

    def __init__(self, runner: nn.Module, name: str, layer_idx: int, w13: torch.Tensor | None,
                 w2: torch.Tensor | None) -> None:
        self.runner = runner
        self.name = name
        self.layer_idx = layer_idx
        # The class's forward (not `runner.forward`, which we shadow on the instance).
        self.stock_forward = vllm_moe.stock_runner_forward(runner)
        self._w13, self._w2 = w13, w2  # None = the runner's own (unpacked) parameters
        self.top_k, self.renormalize = vllm_moe.router_top_k(runner)
        self.shared_experts = vllm_moe.shared_experts_module(runner)  # None: no shared experts
        self.key = BLOCKS.add(name, self)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._w13 is not None:
            return self._w13, self._w2
        return vllm_moe.expert_weights(vllm_moe.routed_experts(self.runner))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                input_ids: torch.Tensor | None = None,
                shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids is not None or shared_experts_input is not None:
            return self.stock_forward(hidden_states, router_logits, input_ids, shared_experts_input)
        return torch.ops.sparsever_moe.runner_forward(hidden_states, router_logits, self.key)

    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        plan, rt = current_plan(), get_runtime()
        if (plan is None or rt is None or not rt.moe.enabled or plan.groups is None
                or len(plan.requests) > rt.moe.max_verify_requests):
            return self.stock_forward(hidden_states, router_logits)
        out = rt.run_sparse("moe", lambda: self._sparse(hidden_states, router_logits, plan, rt))
        return self.stock_forward(hidden_states, router_logits) if out is None else out

    def _sparse(self, x: torch.Tensor, logits: torch.Tensor, plan: VerificationPlan,
                rt: SparseVerificationRuntime) -> torch.Tensor:
        groups = plan.groups
        num_tokens = x.shape[0]
        if x.ndim != 2 or num_tokens < groups.num_tokens:
            raise SparsePathUnavailable(
                "shape_mismatch", f"hidden states {tuple(x.shape)} vs the plan's {groups.num_tokens} tokens")
        gate = vllm_moe.runner_gate(self.runner)
        if gate is not None:  # the runner holds the gate: logits are computed inside
            logits, _ = gate(x)
        all_verify = groups.all_tokens_verify and num_tokens == groups.num_tokens
        xv = (x if all_verify else x[groups.token_index]).contiguous()
        lv = (logits if all_verify else logits[groups.token_index]).contiguous()

        budget = rt.moe.expert_budget or 0
        budget_groups = groups.group_start_loc
        if rt.moe.budget_scope == "step":  # one group: the budget caps the union over requests
            budget_groups = budget_groups[[0, -1]]
        threshold = rt.moe_ratio_threshold(self.layer_idx)
        weights, ids = ops.moe_route_and_prune(lv, self.top_k, threshold, budget_groups, budget, self.renormalize)
        w13, w2 = self.weights()
        out_v, used = ops.moe_grouped_dispatch(xv, weights, ids, w13, w2)
        if rt.check_reference:
            self._check_reference(xv, lv, threshold, budget_groups, budget, out_v, rt)
        if self.shared_experts is not None:  # always dense; added before the reduction, as stock
            out_v = out_v + vllm_moe.run_shared_experts(self.shared_experts, xv)
        # The stock block's TP reduction (same condition, same collective).
        out_v = vllm_moe.reduce_final_output(self.runner, out_v)

        if all_verify:
            out = out_v
            skip_moe_layer_slot()  # the stock forward (which counts MoE layers) did not run
        else:  # mixed step: verify tokens sparse, the rest (and any padding) stock
            other = groups.dense_index(num_tokens)
            out = torch.empty_like(x)
            out[groups.token_index] = out_v
            if other.numel():
                out[other] = self.stock_forward(x[other], logits[other])
            else:
                skip_moe_layer_slot()  # the stock forward (which counts MoE layers) did not run
        # Expert counts stay on the device (no host sync per MoE layer); read when metrics are scraped.
        rt.record(moe_layers=1)
        rt.record_device(moe_experts_read=used)  # the dispatch's own count of the experts it read
        if rt.should_sample(plan.step):
            # Dense reference on sampled steps only (a second routing): distinct experts of the
            # unpruned top-k routing of the same tokens, by the same op so ties break the same way.
            _, dense_ids = ops.moe_route_and_prune(lv, self.top_k, 0.0, None, 0, self.renormalize)
            rt.record(moe_layers_sampled=1)
            rt.record_device(moe_experts_read_sampled=used,
                             moe_experts_dense_sampled=distinct_experts(dense_ids, w13.shape[0]))
        return out

    def _check_reference(self, xv, lv, threshold, budget_groups, budget, out_v, rt) -> None:
        """Test hook: this rank's output for the verify tokens (before the TP all-reduce) equals
        the reference routing + dispatch on the same inputs and weights."""
        from vllm_sparsever import reference

        tw = torch.empty(lv.shape[0], self.top_k, dtype=torch.float32)
        ti = torch.empty(lv.shape[0], self.top_k, dtype=torch.int32)
        reference.moe_route_and_prune(lv, self.top_k, threshold, budget_groups, budget, self.renormalize, tw, ti)
        w13, w2 = self.weights()
        expected = torch.empty_like(xv)
        reference.moe_grouped_dispatch(expected, xv, tw, ti, w13, w2, torch.empty(1, dtype=torch.int32))
        rt.record_reference_error("moe", float((out_v.float() - expected.float()).abs().max()))


def distinct_experts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many distinct experts `ids` names (-1 = none), as a one-element tensor on ids' device: a
    scatter, not `unique()`, which would wait for the device."""
    hit = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    hit.index_fill_(0, ids.reshape(-1).long() + 1, 1)
    return hit[1:].sum()


# ---- install -------------------------------------------------------------------------------------------

def _unsupported_reason(runner: nn.Module) -> str | None:
    """Why this MoE runner cannot take the sparse path (None if it can)."""
    failed = vllm_moe.unsupported_features(runner)
    return ", ".join(failed) if failed else None


def _sparse_weights(runner: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The [E, 2I, H] / [E, H, I] tensors the sparse path reads (None, None = the runner's params)."""
    if is_cpu_platform():
        fused = vllm_moe.fused_experts_of(runner)
        if getattr(fused, "_sparsever_raw", False):
            return None, None
        kept = getattr(fused, "_sparsever_weights", None)
        if kept is not None:
            return kept
        raise RuntimeError(
            f"moe.enabled: the experts of {vllm_moe.runner_layer_name(runner)} were prepacked for "
            f"cpu_fused_moe and their plain weights freed; "
            f"vllm_sparsever.verification.sparse.moe.preserve_expert_weights() must be active while the target loads"
        )
    is_triton, backend = vllm_moe.triton_expert_backend(runner)
    if not is_triton:
        raise RuntimeError(
            f"moe.enabled: expert backend {backend} of {vllm_moe.runner_layer_name(runner)} "
            f"stores weights in its own layout; supported: CPU (with preserve_expert_weights), TRITON"
        )
    return None, None


def _find_runners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return vllm_moe.find_moe_runners(model)


def install_moe(model: nn.Module, runtime: SparseVerificationRuntime | None = None) -> int:
    """Wrap the forward of every MoE block of the target; returns how many were wrapped."""
    arch = type(model).__name__
    runners = _find_runners(model)
    if not runners:
        raise RuntimeError(f"moe.enabled: no MoE block found in {arch}; supported: {SUPPORTED}")
    problems = []
    for name, runner in runners:
        reason = _unsupported_reason(runner)
        if reason is not None:
            problems.append(f"{name}: {reason}")
    if problems:
        raise RuntimeError(
            f"moe.enabled: {arch} has MoE blocks the sparse path does not support "
            f"({'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}); supported: {SUPPORTED}"
        )
    count = 0
    for name, runner in runners:
        layer_name = vllm_moe.runner_layer_name(runner)
        layer_idx = layer_index_of(layer_name) if layer_name else None
        if layer_idx is None:
            layer_idx = layer_index_of(name)
        if layer_idx is None:
            raise RuntimeError(f"moe.enabled: cannot tell the decoder layer of MoE block {name}")
        w13, w2 = _sparse_weights(runner)
        block = SparseMoEBlock(runner, layer_name or name, layer_idx, w13, w2)
        vllm_moe.shadow_runner_forward(runner, block.forward)  # this instance only
        count += 1
    return count


def describe_weights(model: nn.Module) -> dict[str, Any]:
    """How the target's expert weights are held (for logs and tests)."""
    modes = []
    for _, runner in _find_runners(model):
        fused = vllm_moe.fused_experts_of(runner)
        if getattr(fused, "_sparsever_raw", False):
            modes.append("shared")
        elif getattr(fused, "_sparsever_weights", None) is not None:
            modes.append("copy")
        else:
            modes.append("stock")
    return {"blocks": len(modes), "modes": sorted(set(modes))}
