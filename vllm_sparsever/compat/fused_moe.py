"""vLLM's fused MoE layer: the CPU experts, the MoE runner and its router, as the MoE path uses them.

Private symbols touched:
- `vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts`:
  `process_weights_after_loading(self, layer)` (replaced class-wide only while the target loads),
  `apply(self, <EXPERTS_APPLY_PARAMS>)` (replaced on preserved *instances* only), `_use_zentorch`;
- `quant_method.moe_kernel.fused_experts` (the experts object of a layer),
  `UnquantizedFusedMoEMethod`, `quant_method.unquantized_backend` / `UnquantizedMoeBackend`;
- `vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner`: `forward(hidden_states,
  router_logits, input_ids, shared_experts_input)` (shadowed per instance),
  `_maybe_reduce_final_output(states, trunc_size, output_is_reduced)`, attributes `router`,
  `routed_experts`, `gate`, `shared_experts`, `moe_config`, `layer_name`, `routed_input_transform`,
  `routed_output_transform`, `routed_scaling_factor`, `shared_expert_gate`;
- `runner.shared_experts` (`vllm.model_executor.layers.fused_moe.runner.shared_experts.SharedExperts`):
  its `_layer` (the model's shared-expert module, e.g. `Qwen2MoeMLP` with its sigmoid `expert_gate`,
  built with `reduce_results=False`; the runner adds its output to the routed output before the TP
  reduction);
- router attributes `top_k`, `renormalize`, `use_grouped_topk`, `scoring_func`,
  `custom_routing_function`, `e_score_correction_bias`, `routed_scaling_factor`, `eplb_state`;
- `FusedMoEConfig` fields `activation`, `has_bias`, `moe_parallel_config.use_ep`, `dp_size`,
  `pcp_size`, `is_sequence_parallel`, `hidden_dim`; `MoEActivation.SILU`; experts' `w13_weight`,
  `w2_weight`, `quant_method`, `apply_router_weight_on_input`, `expert_map`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_sparsever.compat import replaced

# CPUUnquantizedExperts.apply(self, <these>), in this order (vLLM passes them by keyword).
EXPERTS_APPLY_PARAMS = (
    "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
    "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
    "expert_tokens_meta", "apply_router_weight_on_input",
)
RUNNER_FORWARD_PARAMS = ("hidden_states", "router_logits", "input_ids", "shared_experts_input")
REDUCE_FINAL_OUTPUT_PARAMS = ("states", "trunc_size", "output_is_reduced")
# Routers whose softmax top-k (+ optional renormalize) the sparse routing reproduces.
PLAIN_TOPK_ROUTERS = ("CPURouter", "FusedTopKRouter")


def experts_cls() -> type:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return CPUUnquantizedExperts


def moe_runner_cls() -> type:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return MoERunner


# ---- load time: the CPU experts' weight preparation -------------------------------------------------

# hook(experts, layer, stock): runs instead of `experts.process_weights_after_loading(layer)`;
# `stock(layer)` is vLLM's own.
WeightProcessingHook = Callable[[Any, nn.Module, Callable[[nn.Module], None]], None]


@contextlib.contextmanager
def experts_weight_processing(hook: WeightProcessingHook) -> Iterator[None]:
    """While active, CPU experts prepare their weights through `hook` (class-wide: vLLM calls it on
    experts objects created inside the loader, which we cannot reach before)."""
    cls = experts_cls()
    original = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        hook(self, layer, lambda layer_: original(self, layer_))

    with replaced(cls, "process_weights_after_loading", process_weights_after_loading):
        yield


def bind_experts_apply(experts: Any, apply: Callable[..., None]) -> None:
    """Run `apply(experts, <EXPERTS_APPLY_PARAMS>)` instead of the class's `apply` for this experts
    object only (an instance attribute shadows the class's method; the class stays stock)."""
    experts.apply = types.MethodType(apply, experts)


def disable_zentorch(experts: Any) -> None:
    """Keep vLLM's zentorch MoE kernel off for these experts (it reads its own weight layout)."""
    experts._use_zentorch = False


def routed_experts(runner: nn.Module) -> nn.Module:
    """The experts layer a MoE runner dispatches to (holds `w13_weight` / `w2_weight`)."""
    return runner.routed_experts


def expert_weights(layer: nn.Module) -> tuple[Any, Any]:
    """(w13_weight [E, 2I, H], w2_weight [E, H, I]) of an experts layer (None if absent)."""
    return getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)


def is_silu_without_bias(moe_config: Any) -> bool:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return moe_config.activation == MoEActivation.SILU and not moe_config.has_bias


def fused_experts_of(runner: nn.Module) -> Any:
    """The experts object that runs a runner's experts (`quant_method.moe_kernel.fused_experts`)."""
    kernel = getattr(runner.routed_experts.quant_method, "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def triton_expert_backend(runner: nn.Module) -> tuple[bool, str]:
    """(whether the unquantized expert backend is Triton, its name) on GPU."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    backend = runner.routed_experts.quant_method.unquantized_backend
    return backend == UnquantizedMoeBackend.TRITON, backend.value


# ---- the runner ------------------------------------------------------------------------------------

def find_moe_runners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    cls = moe_runner_cls()
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def runner_layer_name(runner: nn.Module) -> str | None:
    """The name vLLM's forward context knows the layer by."""
    return runner.layer_name


def stock_runner_forward(runner: nn.Module) -> Callable[..., torch.Tensor]:
    """The class's `forward` bound to `runner` (unaffected by `shadow_runner_forward`)."""
    return type(runner).forward.__get__(runner, type(runner))


def shadow_runner_forward(runner: nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    """Make `runner(...)` call `forward` (nn.Module.__call__ reads the instance's `forward`)."""
    runner.forward = forward


def reduce_final_output(runner: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """The stock block's TP reduction of the routed experts' output (same condition, same collective)."""
    return runner._maybe_reduce_final_output(states, None, False)


def shared_experts_module(runner: nn.Module) -> nn.Module | None:
    """The model's shared-expert module a runner runs densely on every token (None if it has none).
    Its output (per TP rank, unreduced) is added to the routed experts' output before the reduction."""
    shared = runner.shared_experts
    return None if shared is None else shared._layer


def runner_shared_expert_gate(runner: nn.Module) -> nn.Module | None:
    """A shared-expert gate the runner itself applies (ROCm fused gate path); None when the model's
    shared-expert module applies its own gate (Qwen2-MoE)."""
    return runner.shared_expert_gate


def run_shared_experts(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The shared experts' output for `hidden_states` (as `SharedExperts.forward` computes it)."""
    out = module(hidden_states)
    return out[0] if isinstance(out, tuple) else out


def runner_gate(runner: nn.Module) -> nn.Module | None:
    """The router-logits linear when the runner computes logits itself (else None)."""
    return runner.gate


def router_top_k(runner: nn.Module) -> tuple[int, bool]:
    """(top_k, renormalize) of the runner's router."""
    return int(runner.router.top_k), bool(runner.router.renormalize)


def unsupported_features(runner: nn.Module) -> list[str]:
    """Features of this MoE block the sparse path (softmax top-k routing, SiLU-gated unquantized
    experts without bias, shared experts only as a separate module that gates itself, no EP/DP) does
    not reproduce; empty if none."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    experts = runner.routed_experts
    router = runner.router
    cfg = runner.moe_config
    quant = experts.quant_method
    if not isinstance(quant, UnquantizedFusedMoEMethod):
        return [f"quantized experts ({type(quant).__name__}); MoE sparsity needs unquantized "
                f"(bf16/fp16/fp32) expert weights"]
    checks = [
        (type(router).__name__ in PLAIN_TOPK_ROUTERS, f"router {type(router).__name__}"),
        (not getattr(router, "use_grouped_topk", False), "grouped top-k routing"),
        (getattr(router, "scoring_func", "softmax") == "softmax", "non-softmax scoring"),
        (getattr(router, "custom_routing_function", None) is None, "a custom routing function"),
        (getattr(router, "e_score_correction_bias", None) is None, "an expert score correction bias"),
        (getattr(router, "routed_scaling_factor", 1.0) == 1.0
         and getattr(runner, "routed_scaling_factor", 1.0) == 1.0, "a routed scaling factor"),
        (runner.shared_experts is None or isinstance(shared_experts_module(runner), nn.Module),
         "shared experts without a module"),
        (runner_shared_expert_gate(runner) is None, "a shared-expert gate applied by the runner"),
        (runner.routed_input_transform is None and runner.routed_output_transform is None,
         "routed input/output transforms (latent MoE)"),
        (cfg.activation == MoEActivation.SILU, f"activation {cfg.activation}"),
        (not cfg.has_bias, "expert biases"),
        (not experts.apply_router_weight_on_input, "router weights applied on the input"),
        (experts.expert_map is None and not cfg.moe_parallel_config.use_ep, "expert parallelism"),
        (cfg.dp_size == 1 and cfg.pcp_size == 1 and not cfg.is_sequence_parallel,
         "data/context/sequence parallelism"),
        (getattr(router, "eplb_state", None) is None, "EPLB"),
        (cfg.hidden_dim == experts.w13_weight.shape[-1], "padded hidden size"),
    ]
    return [what for ok, what in checks if not ok]
