"""MoE expert pruning on a Qwen2-MoE block with a shared expert (vllm_sparsever/verification/sparse/moe.py).

vLLM's own `Qwen2MoeSparseMoeBlock` (routed experts + `shared_expert` with its sigmoid
`shared_expert_gate`, run by the runner's `SharedExperts`) is built in this process; the wrapped
block must prune/dispatch the routed experts as for Mixtral and always add the dense shared expert.
One engine test runs a tiny random Qwen2-MoE (a dense layer + an MoE layer) with n-gram drafting.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from vllm_sparsever import reference as ref
from verification.test_moe import _forward, _nullcontext, _plan, _runtime

E, TOP_K, H, I, S = 8, 3, 128, 64, 96
ATOL = 2e-5

_names = itertools.count(100)


@pytest.fixture(scope="module")
def vllm_env(vllm_env):
    from vllm_sparsever.verification.sparse.runtime import install_runtime

    yield vllm_env
    install_runtime(None)


class _Model(torch.nn.Module):
    """A stand-in target: one decoder layer holding one Qwen2-MoE block."""

    def __init__(self, block: torch.nn.Module, layer: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(layer): torch.nn.ModuleDict({"mlp": block})})

    @property
    def block(self):
        return next(iter(self.layers.values()))["mlp"]


def _config():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=I,
                          shared_expert_intermediate_size=S, norm_topk_prob=True, hidden_act="silu")  # fmt: skip


def _make_block(cfg, weights=None, preserve: str | None = None):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeSparseMoeBlock

    from vllm_sparsever.verification.sparse import moe

    layer = next(_names)
    with set_current_vllm_config(cfg):
        block = Qwen2MoeSparseMoeBlock(_config(), prefix=f"model.layers.{layer}.mlp")
    if weights is None:
        g = torch.Generator().manual_seed(4321)
        weights = {
            "gate": torch.randn(E, H, generator=g) * 0.2,
            "w13": torch.randn(E, 2 * I, H, generator=g) * 0.1,
            "w2": torch.randn(E, H, I, generator=g) * 0.1,
            "s_gate_up": torch.randn(2 * S, H, generator=g) * 0.1,
            "s_down": torch.randn(H, S, generator=g) * 0.1,
            "s_gate": torch.randn(1, H, generator=g) * 0.2,
        }
    experts = block.experts.routed_experts
    with torch.no_grad():
        block.gate.weight.copy_(weights["gate"])
        experts.w13_weight.copy_(weights["w13"])
        experts.w2_weight.copy_(weights["w2"])
        block.shared_expert.gate_up_proj.weight.copy_(weights["s_gate_up"])
        block.shared_expert.down_proj.weight.copy_(weights["s_down"])
        block.shared_expert_gate.weight.copy_(weights["s_gate"])
    with moe.preserve_expert_weights(preserve) if preserve else _nullcontext():
        for m in block.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)
    return _Model(block, layer), weights


def _shared_reference(weights, x):
    gate, up = (x @ weights["s_gate_up"].t()).chunk(2, dim=-1)
    return torch.sigmoid(x @ weights["s_gate"].t()) * ((F.silu(gate) * up) @ weights["s_down"].t())


def _reference(weights, x, threshold, group_start_loc, budget):
    """Routed experts pruned as for Mixtral, plus the dense shared expert."""
    logits = x @ weights["gate"].t()
    tw = torch.empty(x.shape[0], TOP_K)
    ti = torch.empty(x.shape[0], TOP_K, dtype=torch.int32)
    ref.moe_route_and_prune(logits, TOP_K, threshold, group_start_loc, budget, True, tw, ti)
    out = torch.empty_like(x)
    used = torch.empty(1, dtype=torch.int32)
    ref.moe_grouped_dispatch(out, x, tw, ti, weights["w13"], weights["w2"], used)
    return out + _shared_reference(weights, x), int(used), int(logits.topk(TOP_K, dim=-1).indices.unique().numel())


def _x(n, seed=0):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def blocks(vllm_env):
    from vllm_sparsever.compat import fused_moe as vllm_moe
    from vllm_sparsever.verification.sparse import moe

    stock, weights = _make_block(vllm_env)
    shared, _ = _make_block(vllm_env, weights, preserve="shared")
    copied, _ = _make_block(vllm_env, weights, preserve="copy")
    for model in (stock, shared, copied):
        (_, runner), = vllm_moe.find_moe_runners(model)
        assert vllm_moe.shared_experts_module(runner) is model.block.shared_expert
        assert vllm_moe.unsupported_features(runner) == []
    assert moe.install_moe(shared) == 1 and moe.install_moe(copied) == 1
    assert moe.describe_weights(shared)["modes"] == ["shared"]
    assert moe.describe_weights(copied)["modes"] == ["copy"]
    return stock, shared, copied, weights


def test_stock_block_is_routed_plus_shared(vllm_env, blocks):
    """Sanity: vLLM's stock Qwen2-MoE block = top-k routed experts + sigmoid-gated shared expert."""
    stock, _, _, weights = blocks
    x = _x(9)
    want, _, _ = _reference(weights, x, 0.0, None, 0)
    torch.testing.assert_close(_forward(vllm_env, stock, x), want, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("which", ["shared", "copy"])
def test_dense_steps_and_threshold_zero_equal_stock(vllm_env, blocks, which):
    stock, shared, copied, _ = blocks
    model = shared if which == "shared" else copied
    x = _x(7, seed=1)
    want = _forward(vllm_env, stock, x)
    rt = _runtime(ratio_threshold=0.0)
    torch.testing.assert_close(_forward(vllm_env, model, x), want, atol=ATOL, rtol=1e-5)  # no plan
    assert rt.stats_summary() == {}
    got = _forward(vllm_env, model, x, _plan([(4, 3), (3, 2)]))  # verify step, nothing pruned
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    stats = rt.stats_summary()
    assert stats["moe_layers"] == 1 and not stats.get("moe_fallbacks")
    assert stats["moe_experts_read"] == stats["moe_experts_dense_sampled"] > 0


@pytest.mark.parametrize("threshold,budget", [(0.5, 0), (0.3, 2), (0.9, 1)])
def test_pruned_routed_experts_shared_expert_dense(vllm_env, blocks, threshold, budget):
    _, shared, _, weights = blocks
    x = _x(8, seed=3)
    rt = _runtime(ratio_threshold=threshold, expert_budget=budget or None)
    rt.check_reference = True  # the routed part alone equals the reference routed dispatch
    gsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    want, used, dense = _reference(weights, x, threshold, gsl, budget)
    got = _forward(vllm_env, shared, x, _plan([(4, 3), (4, 3)]))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    stats = rt.stats_summary()
    assert (stats["moe_experts_read"], stats["moe_experts_dense_sampled"]) == (used, dense)
    assert stats["moe_reference_max_abs_err"] < ATOL
    if budget:
        assert used <= 2 * budget < dense
    # Without the shared expert the output would differ: it really is added.
    assert (got - (want - _shared_reference(weights, x))).abs().max() > 1e-3


def test_mixed_step_with_shared_expert(vllm_env, blocks):
    stock, shared, _, weights = blocks
    x = _x(12, seed=4)
    _runtime(ratio_threshold=0.6, expert_budget=1)
    plan = _plan([(3, 2), (5, 0), (4, 3)])  # tokens 0-2 verify, 3-7 prefill, 8-11 verify
    verify = torch.tensor([0, 1, 2, 8, 9, 10, 11])
    other = torch.tensor([3, 4, 5, 6, 7])
    got = _forward(vllm_env, shared, x, plan)
    want_v, _, _ = _reference(weights, x[verify], 0.6, torch.tensor([0, 3, 7], dtype=torch.int32), 1)
    torch.testing.assert_close(got[verify], want_v, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got[other], _forward(vllm_env, stock, x[other]), atol=ATOL, rtol=1e-5)


def test_fallback_runs_the_shared_expert(vllm_env, blocks, monkeypatch):
    """A run-time problem in the sparse path: the stock forward (routed + shared) answers."""
    from vllm_sparsever.verification.sparse import moe

    stock, shared, _, _ = blocks
    x = _x(4, seed=5)
    rt = _runtime(ratio_threshold=0.9, expert_budget=1)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(moe.ops, "moe_route_and_prune", broken)
    got = _forward(vllm_env, shared, x, _plan([(4, 3)]))
    torch.testing.assert_close(got, _forward(vllm_env, stock, x), atol=ATOL, rtol=1e-5)
    assert rt.stats_summary() == {"moe_fallbacks": 1, "moe_fallback_kernel_error": 1}


# ---- engine ------------------------------------------------------------------------------------------

MAX_TOKENS = 24
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory):
    from tiny_moe import make_tiny_qwen2_moe

    return make_tiny_qwen2_moe(tmp_path_factory.mktemp("tiny_qwen2_moe") / "qwen2moe", seed=0)


@pytest.mark.slow
@pytest.mark.e2e
def test_engine_qwen2_moe_sparsity(tiny_qwen2_moe, monkeypatch):
    from verification.test_moe import run_moe_sparsity_engine

    plain, lossless, stats, pruned = run_moe_sparsity_engine(tiny_qwen2_moe, monkeypatch)
    assert lossless == plain
    # one MoE layer (layer 0 is dense): every verify step wraps exactly that block
    assert stats["moe_layers"] > 0 and not stats.get("moe_fallbacks")
    assert stats["moe_experts_read"] == stats["moe_experts_dense_sampled"]
    assert pruned["moe_layers"] > 0 and not pruned.get("moe_fallbacks")
    assert pruned["moe_experts_read_sampled"] < pruned["moe_experts_dense_sampled"]
    for s in (stats, pruned):
        assert s["moe_reference_checks"] == s["moe_layers"] and s["moe_reference_max_abs_err"] < 1e-4, s
