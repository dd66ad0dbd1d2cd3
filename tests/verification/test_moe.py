"""MoE expert pruning on verify steps (vllm_sparsever/verification/sparse/moe.py).

Unit tests build vLLM's own `MixtralMoE` blocks in this process (single-rank gloo group) and
compare the wrapped block with the stock block and with the reference ops; one engine test runs a
tiny random Mixtral with n-gram drafting.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools

import numpy as np
import pytest
import torch

from vllm_sparsever import reference as ref
from vllm_sparsever.config import SparseverConfig
from vllm_sparsever.forward_scope import active_plan
from vllm_sparsever.plan import build_verification_plan
from vllm_sparsever.verification.sparse.runtime import SparseVerificationRuntime, install_runtime

E, TOP_K, H, I = 8, 3, 128, 96
ATOL = 2e-5

_names = itertools.count()


@pytest.fixture(scope="module")
def vllm_env(vllm_env):
    """The shared vLLM environment (tests/conftest.py); afterwards no runtime stays installed."""
    yield vllm_env
    install_runtime(None)


class _Model(torch.nn.Module):
    """A stand-in target: one decoder layer holding one Mixtral MoE block."""

    def __init__(self, block: torch.nn.Module, layer: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(layer): torch.nn.ModuleDict({"block_sparse_moe": block})})

    @property
    def block(self):
        return next(iter(self.layers.values()))["block_sparse_moe"]


def _make_block(cfg, weights=None, preserve: str | None = None, layer: int | None = None):
    """A vLLM MixtralMoE with the given (or random) weights, post-processed as the loader would
    (inside `preserve_expert_weights(preserve)` if given). Returns (model, weights)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.mixtral import MixtralMoE

    from vllm_sparsever.verification.sparse import moe

    layer = next(_names) if layer is None else layer
    with set_current_vllm_config(cfg):
        block = MixtralMoE(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                           params_dtype=torch.float32, prefix=f"model.layers.{layer}.block_sparse_moe")
    experts = block.experts.routed_experts
    if weights is None:
        g = torch.Generator().manual_seed(1234)
        weights = {
            "gate": torch.randn(E, H, generator=g) * 0.2,
            "w13": torch.randn(E, 2 * I, H, generator=g) * 0.1,
            "w2": torch.randn(E, H, I, generator=g) * 0.1,
        }
    with torch.no_grad():
        block.gate.weight.copy_(weights["gate"])
        experts.w13_weight.copy_(weights["w13"])
        experts.w2_weight.copy_(weights["w2"])
    ctx = moe.preserve_expert_weights(preserve) if preserve else _nullcontext()
    with ctx:
        for m in block.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)
    return _Model(block, layer), weights


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _runtime(**moe_section) -> SparseVerificationRuntime:
    config = SparseverConfig.from_dict({
        "num_speculative_tokens": 3, "moe": {"enabled": True, **moe_section}, "profile": "none",
    })
    rt = SparseVerificationRuntime(config)
    rt.stats_sample_every = 1  # count the dense reference on every step
    install_runtime(rt)
    return rt


def _plan(rows):
    """rows: per request (num_scheduled_tokens, num_drafts); a request verifies when
    num_scheduled == num_drafts + 1, otherwise it is a prefill chunk."""
    req_ids = [f"r{i}" for i in range(len(rows))]
    sched = np.array([n for n, _ in rows])
    drafts = {rid: list(range(5, 5 + d)) for rid, (_, d) in zip(req_ids, rows, strict=True) if d}
    return build_verification_plan(
        step=1, req_ids=req_ids, num_scheduled_tokens=sched, num_computed_tokens=np.full(len(rows), 20),
        scheduled_spec_decode_tokens=drafts, block_table=torch.zeros(len(rows), 4, dtype=torch.int32),
        block_size=32,
    )


def _forward(cfg, model, x, plan=None):
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, cfg), active_plan(plan), torch.no_grad():
        return model.block(x)


def _reference(weights, x, threshold, group_start_loc, budget):
    logits = x @ weights["gate"].t()
    tw = torch.empty(x.shape[0], TOP_K)
    ti = torch.empty(x.shape[0], TOP_K, dtype=torch.int32)
    ref.moe_route_and_prune(logits, TOP_K, threshold, group_start_loc, budget, True, tw, ti)
    out = torch.empty_like(x)
    used = torch.empty(1, dtype=torch.int32)
    ref.moe_grouped_dispatch(out, x, tw, ti, weights["w13"], weights["w2"], used)
    return out, int(used), int((logits.topk(TOP_K, dim=-1).indices).unique().numel())


@pytest.fixture(scope="module")
def blocks(vllm_env):
    """Stock block, and wrapped blocks with shared / copied expert weights (same weights)."""
    from vllm_sparsever.verification.sparse import moe

    stock, weights = _make_block(vllm_env)
    shared, _ = _make_block(vllm_env, weights, preserve="shared")
    copied, _ = _make_block(vllm_env, weights, preserve="copy")
    assert moe.install_moe(shared) == 1 and moe.install_moe(copied) == 1
    assert moe.describe_weights(shared)["modes"] == ["shared"]
    assert moe.describe_weights(copied)["modes"] == ["copy"]
    assert moe.describe_weights(stock)["modes"] == ["stock"]
    return stock, shared, copied, weights


def _x(n, seed=0):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_stock_block_matches_reference(vllm_env, blocks):
    """Sanity: vLLM's stock CPU path is the reference's dense top-k routing + dispatch."""
    stock, _, _, weights = blocks
    x = _x(9)
    want, _, _ = _reference(weights, x, 0.0, None, 0)
    torch.testing.assert_close(_forward(vllm_env, stock, x), want, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("which", ["shared", "copy"])
def test_dense_steps_unchanged(vllm_env, blocks, which):
    """No plan (prefill/decode/draft) or moe off at run time: the stock forward."""
    stock, shared, copied, _ = blocks
    model = shared if which == "shared" else copied
    x = _x(7, seed=1)
    want = _forward(vllm_env, stock, x)
    rt = _runtime(ratio_threshold=0.5, expert_budget=1)
    torch.testing.assert_close(_forward(vllm_env, model, x), want, atol=ATOL, rtol=1e-5)
    plan = _plan([(4, 3), (3, 2)])
    rt.set_sections({"moe": {"enabled": False}})
    got = _forward(vllm_env, model, x, plan)
    if which == "copy":
        assert torch.equal(got, want)  # the stock kernel on the stock prepacked weights
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert rt.stats_summary() == {}


@pytest.mark.parametrize("which", ["shared", "copy"])
def test_threshold_zero_equals_stock(vllm_env, blocks, which):
    stock, shared, copied, _ = blocks
    model = shared if which == "shared" else copied
    x = _x(7, seed=2)
    rt = _runtime(ratio_threshold=0.0)
    got = _forward(vllm_env, model, x, _plan([(4, 3), (3, 2)]))
    torch.testing.assert_close(got, _forward(vllm_env, stock, x), atol=ATOL, rtol=1e-5)
    stats = rt.stats_summary()
    assert stats["moe_layers"] == stats["moe_layers_sampled"] == 1
    assert stats["moe_experts_read"] == stats["moe_experts_read_sampled"] == stats["moe_experts_dense_sampled"] > 0


@pytest.mark.parametrize("threshold,budget", [(0.5, 0), (0.3, 2), (0.9, 1)])
def test_pruned_verify_matches_reference(vllm_env, blocks, threshold, budget):
    _, shared, _, weights = blocks
    x = _x(8, seed=3)
    rt = _runtime(ratio_threshold=threshold, expert_budget=budget or None)
    plan = _plan([(4, 3), (4, 3)])
    gsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    want, used, dense = _reference(weights, x, threshold, gsl, budget)
    got = _forward(vllm_env, shared, x, plan)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    stats = rt.stats_summary()
    assert (stats["moe_experts_read"], stats["moe_experts_dense_sampled"]) == (used, dense)
    if budget:
        assert used <= 2 * budget < dense


def test_step_budget_caps_the_union_of_requests(vllm_env, blocks):
    """budget_scope "step": one budget over all verify tokens of the step, so the experts read
    are at most the budget however many requests verify."""
    _, shared, _, weights = blocks
    x = _x(8, seed=4)
    rt = _runtime(ratio_threshold=0.3, expert_budget=2, budget_scope="step")
    want, used, dense = _reference(weights, x, 0.3, torch.tensor([0, 8], dtype=torch.int32), 2)
    got = _forward(vllm_env, shared, x, _plan([(4, 3), (4, 3)]))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    stats = rt.stats_summary()
    assert (stats["moe_experts_read"], stats["moe_experts_dense_sampled"]) == (used, dense)
    assert used <= 2 < dense


def test_mixed_step(vllm_env, blocks):
    """Verify rows sparse; the prefill chunk between them takes the stock path."""
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


def test_error_falls_back_to_stock(vllm_env, blocks, monkeypatch):
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


def test_programming_error_is_not_hidden(vllm_env, blocks, monkeypatch):
    """A TypeError (e.g. an op whose signature changed) must propagate, not verify densely."""
    from vllm_sparsever.verification.sparse import moe

    _, shared, _, _ = blocks
    rt = _runtime(ratio_threshold=0.9, expert_budget=1)

    def changed(*args, **kwargs):
        raise TypeError("moe_route_and_prune() got an unexpected keyword argument")

    monkeypatch.setattr(moe.ops, "moe_route_and_prune", changed)
    with pytest.raises(TypeError, match="unexpected keyword"):
        _forward(vllm_env, shared, _x(4, seed=5), _plan([(4, 3)]))
    assert rt.stats_summary() == {}


def test_sampled_steps_only_route_twice(vllm_env, blocks):
    """The dense-expert count (a second routing) is taken on sampled steps only."""
    _, shared, _, _ = blocks
    rt = _runtime(ratio_threshold=0.5)
    rt.stats_sample_every = 4
    for step in range(1, 9):
        plan = _plan([(4, 3)])
        _forward(vllm_env, shared, _x(4, seed=step), dataclasses.replace(plan, step=step))
    stats = rt.stats_summary()
    assert stats["moe_layers"] == 8 and stats["moe_layers_sampled"] == 2
    assert 0 < stats["moe_experts_read_sampled"] <= stats["moe_experts_dense_sampled"]


def test_reference_check_hook(vllm_env, blocks):
    """With check_reference, the block compares its sparse output with the reference op."""
    _, shared, _, _ = blocks
    rt = _runtime(ratio_threshold=0.4, expert_budget=2)
    rt.check_reference = True
    _forward(vllm_env, shared, _x(8, seed=6), _plan([(4, 3), (4, 3)]))
    stats = rt.stats_summary()
    assert stats["moe_reference_checks"] == 1 and stats["moe_reference_max_abs_err"] < ATOL


def test_install_errors(vllm_env):
    from vllm_sparsever.verification.sparse import moe

    with pytest.raises(RuntimeError, match="no MoE block found in Linear; supported: MixtralForCausalLM"):
        moe.install_moe(torch.nn.Linear(4, 4))
    prepacked, _ = _make_block(vllm_env)  # loaded without preserve_expert_weights
    with pytest.raises(RuntimeError, match="preserve_expert_weights"):
        moe.install_moe(prepacked)


# ---- engine ------------------------------------------------------------------------------------------

MAX_TOKENS = 24
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    from tiny_moe import make_tiny_mixtral

    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny_moe") / "mixtral", seed=0)


def _generate(llm):
    from vllm import SamplingParams

    from tiny_models import prompts

    outs = llm.generate(prompts(NUM_PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(model, speculative_config=None):
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
               max_num_seqs=8, seed=0, speculative_config=speculative_config)


def run_moe_sparsity_engine(model, monkeypatch):
    """Plain greedy, then sparsever with lossless MoE verification (ratio 0: every routed expert),
    then pruned (ratio 0.9, budget 1), every MoE layer also checked against the reference on its
    real inputs. Returns (plain, lossless, lossless stats, pruned stats)."""
    from vllm_sparsever.metrics import get_metrics, reset_metrics

    monkeypatch.setenv("VLLM_SPARSEVER_CHECK_REFERENCE", "1")
    monkeypatch.setenv("VLLM_SPARSEVER_STATS_SAMPLE_EVERY", "1")  # count dense experts every step
    llm = _llm(model)
    try:
        plain = _generate(llm)
    finally:
        del llm
        gc.collect()
    assert len({tuple(t) for t in plain}) > 1

    llm = _llm(model, {
        "method": "sparsever", "draft_source": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "moe": {"enabled": True, "ratio_threshold": 0.0},
    })
    try:
        lossless = _generate(llm)
        stats = get_metrics(llm)["sparsity"]
        reset_metrics(llm)
        llm.collective_rpc("sparsever_set_sparsity",
                           args=({"moe": {"enabled": True, "ratio_threshold": 0.9, "expert_budget": 1}},))
        _generate(llm)
        pruned = get_metrics(llm)["sparsity"]
    finally:
        del llm
        gc.collect()
    return plain, lossless, stats, pruned


@pytest.mark.slow
@pytest.mark.e2e
def test_engine_moe_sparsity(tiny_mixtral, monkeypatch):
    plain, lossless, stats, pruned = run_moe_sparsity_engine(tiny_mixtral, monkeypatch)
    assert lossless == plain
    assert stats["moe_layers"] > 0 and not stats.get("moe_fallbacks")
    assert stats["moe_experts_read"] == stats["moe_experts_read_sampled"] == stats["moe_experts_dense_sampled"]
    assert pruned["moe_layers"] > 0 and not pruned.get("moe_fallbacks")
    assert pruned["moe_experts_read_sampled"] < pruned["moe_experts_dense_sampled"]
    for s in (stats, pruned):  # the sparse output equals the reference on the same inputs
        assert s["moe_reference_checks"] == s["moe_layers"] and s["moe_reference_max_abs_err"] < 1e-4, s
