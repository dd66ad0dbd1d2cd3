"""Which targets and platforms each verification path supports (the sparsities, tree attention, the
CPU-only lossless kernels): checked in the front end, before any process starts."""

from __future__ import annotations

from typing import Any

from vllm_sparsever.config import SparseverConfig, SparseverConfigError

# Dense SwiGLU MLPs (gate_up_proj + SiluAndMul + down_proj) the FFN wrapper handles.
FFN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# MoE blocks the MoE wrapper handles (Qwen2-MoE: routed experts pruned, shared expert always dense).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")


def check_sparsity_supported(config: SparseverConfig, model_config: Any) -> None:
    architectures = list(getattr(model_config, "architectures", None) or [])
    arch = architectures[0] if architectures else "unknown"
    quantization = getattr(model_config, "quantization", None)
    # Block-sparse attention and tree attention both run sparsever's kernel inside vLLM's CPU backend.
    for section, what in (("attention", "block-sparse verification attention"),
                          ("tree", "tree attention (draft trees)")):
        if not getattr(config, section).enabled:
            continue
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise SparseverConfigError(
                f"{section}.enabled: {what} runs on vLLM's CPU attention backend in this version "
                f"(allowed on this platform: false)"
            )
        window = model_config.get_sliding_window() if hasattr(model_config, "get_sliding_window") else None
        if window:
            raise SparseverConfigError(
                f"{section}.enabled: {arch} uses sliding-window attention, which {what} does not "
                f"support (allowed for this model: false)"
            )
    for section, supported in (("ffn", FFN_ARCHITECTURES), ("moe", MOE_ARCHITECTURES)):
        if not getattr(config, section).enabled:
            continue
        if arch not in supported:
            raise SparseverConfigError(
                f"{section}.enabled: {arch} is not supported by {section} sparsity "
                f"(supported architectures: {', '.join(supported)}; allowed for this model: false)"
            )
        if quantization:
            raise SparseverConfigError(
                f"{section}.enabled: {section} sparsity needs unquantized weights, the target uses "
                f"quantization={quantization!r} (allowed for this model: false)"
            )


def check_cpu_only_kernels(config: SparseverConfig, platform_is_cpu: bool) -> None:
    """Refuse, before start, the lossless kernel choices that exist for CPUs only."""
    if platform_is_cpu:
        return
    for field, value in (("linear_kernel", config.linear_kernel), ("ffn.dense_kernel", config.ffn.dense_kernel),
                         ("draft_int8_kernel", config.draft_int8_kernel),
                         ("draft_int4_kernel", config.draft_int4_kernel)):
        if value in ("sparsever", "hybrid", "vllm-padded"):
            raise SparseverConfigError(f"{field}: {value!r} runs on CPU only (allowed on this platform: 'auto', 'vllm')")


def check_cuda_graphs(config: SparseverConfig, platform_is_cpu: bool, cuda_graphs: bool) -> None:
    """Refuse sparse FFN/MoE verification under CUDA graphs. The wrappers decide per step in Python
    (the step's plan, run-time switches, fallbacks) around opaque ops; a captured graph would replay
    the choices and the tensors of the capture step. vLLM-CPU captures no graphs."""
    if platform_is_cpu or not cuda_graphs:
        return
    for section in ("ffn", "moe"):
        if getattr(config, section).enabled:
            raise SparseverConfigError(
                f"{section}.enabled: {section} sparsity decides per verify step in Python, which CUDA graphs "
                f"would freeze at capture; run with enforce_eager=True (`--enforce-eager`) or "
                f"compilation_config cudagraph_mode 'NONE' (allowed with CUDA graphs: false)")
