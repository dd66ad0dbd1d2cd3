"""EVICT's facade (adaptive/policy.py, `EvictPolicy`): what drafting asks and reports, without
reaching into the engine (no engine, synthetic cost profiles)."""

from __future__ import annotations

import logging

import pytest

from vllm_sparsever.adaptive.evict import CATCH_UP_MIN_TOKENS
from vllm_sparsever.adaptive.policy import DraftShape, EvictPolicy
from vllm_sparsever.config import AdaptiveVerificationConfig

from .evict_helpers import chain_of, made_up_profile


def _measured(policy: EvictPolicy, pass_s: float = 0.01, rows: int = 1) -> EvictPolicy:
    """`policy` after a drafting step (one pass) and a verify and a plain decode step at `rows` rows."""
    policy.observe_drafting(rows, [pass_s], pass_s, catch_up_tokens=0)
    policy.observe_step([2] * rows, [256] * rows, 0.06, "chain", None)
    policy.observe_step([1] * rows, [256] * rows, 0.05, "chain", None)
    return policy


def test_for_target_reads_the_profile_and_checks_it_against_the_target(tmp_path, caplog):
    path = made_up_profile(dtype="float32").save(tmp_path / "profile.json")
    adaptive = AdaptiveVerificationConfig(enabled=True, cost_profile=str(path))
    with caplog.at_level(logging.WARNING, logger="vllm_sparsever"):
        policy = EvictPolicy.for_target(adaptive, "m", "torch.bfloat16", None, depth_prior=0.6)
    assert "measured in float32, the engine serves in bfloat16" in caplog.text
    assert policy.experts_observer() is None  # a dense target: no expert counter

    moe = made_up_profile(moe=[8, 2]).save(tmp_path / "moe.json")
    adaptive = AdaptiveVerificationConfig(enabled=True, cost_profile=str(moe))
    assert EvictPolicy.for_target(adaptive, "m", "float32", (8, 2), depth_prior=0.6).experts_observer() is not None
    with pytest.raises(RuntimeError, match=r"\(experts, top_k\) = \(8, 2\), the target has \(16, 2\)"):
        EvictPolicy.for_target(adaptive, "m", "float32", (16, 2), depth_prior=0.6)
    with pytest.raises(RuntimeError, match="no verify-cost profile"):
        EvictPolicy.for_target(AdaptiveVerificationConfig(enabled=True, cost_profile=str(tmp_path / "none.json")),
                               "m", "float32", None, depth_prior=0.6)


def test_every_decision_goes_through_agree_and_a_stop_is_counted():
    agreed = []

    def agree(decision):
        agreed.append(decision)
        return decision

    policy = _measured(EvictPolicy(made_up_profile(per_token_s=0.05), guard=False, depth_prior=0.05, agree=agree))
    shape = DraftShape(cap=3, budgets=(3,))
    depth = policy.plan_depth([256], shape)
    assert agreed == [depth]
    # A first level of a hopeless chain: one more level does not pay.
    assert policy.keep_drafting([256], shape, 1, [chain_of([0.01])], [[0]]) is False
    assert agreed[-1] is False and policy.summary()["evict_stopped_early_steps"] == 1
    policy.truncate([chain_of([0.01])], [256], passes=1, mask="chain")
    assert len(agreed) == 3  # the cut trees too


def test_a_seeded_step_is_planned_to_the_cap_without_asking_the_model():
    policy = EvictPolicy(made_up_profile(per_token_s=0.05), guard=False, agree=lambda d: pytest.fail("no decision to agree"))
    assert policy.plan_depth([256], DraftShape(cap=4, budgets=(4,)), seeded=True) == 4
    assert policy.summary()["evict_seeded_steps"] == 1


def test_a_long_catch_up_is_a_one_off_not_a_draft_pass():
    policy = EvictPolicy(made_up_profile())
    policy.observe_drafting(1, [2.0, 0.01, 0.01], 2.05, catch_up_tokens=CATCH_UP_MIN_TOKENS * 10)
    clock = policy.summary()
    assert clock["evict_clock_pass_s_rows1"] == pytest.approx(0.01)  # the roots' pass with the catch-up left out
    assert clock["evict_clock_fixed_s_rows1"] == pytest.approx(0.03)  # 2.05 - 2.0 - two passes
    assert clock["evict_clock_catch_up_s_per_token"] == pytest.approx(2.0 / (CATCH_UP_MIN_TOKENS * 10))
    short = EvictPolicy(made_up_profile())
    short.observe_drafting(1, [0.02, 0.01, 0.01], 0.05, catch_up_tokens=CATCH_UP_MIN_TOKENS - 1)
    assert short.summary()["evict_clock_pass_s_rows1"] == pytest.approx(0.01)  # the median of all three
    assert "evict_clock_catch_up_s_per_token" not in short.summary()  # no catch-up measured


def test_truncate_counts_the_drafted_depth_and_keeps_a_seeded_tree_whole():
    policy = _measured(EvictPolicy(made_up_profile(per_token_s=0.05), guard=False, depth_prior=1e-3))
    trees = [chain_of([0.9, 0.01, 0.01]), chain_of([0.9, 0.01, 0.01])]
    cut = policy.truncate(trees, [256, 256], passes=3, mask="chain", whole=[True, False])
    assert len(cut[0]) == 3 and len(cut[1]) < 3
    summary = policy.summary()
    assert summary["evict_drafted_depth_3"] == 1 and summary["evict_steps"] == 1


def test_acceptance_calibrates_what_truncation_keeps():
    """Trees whose drafts verification keeps accepting are kept deeper than the drafter's (low)
    probabilities alone would keep them."""
    fresh = _measured(EvictPolicy(made_up_profile(per_token_s=0.004), guard=False, depth_prior=1e-3))
    taught = _measured(EvictPolicy(made_up_profile(per_token_s=0.004), guard=False, depth_prior=1e-3))
    tree = chain_of([0.05, 0.9, 0.9])
    for _ in range(200):
        taught.observe_acceptance(tree, 3, [0, 1, 2])
    kept = [len(p.truncate([tree], [256], passes=3, mask="chain")[0]) for p in (fresh, taught)]
    assert kept[0] < kept[1] == 3


def test_reset_zeroes_the_counters_but_keeps_what_was_learned():
    policy = _measured(EvictPolicy(made_up_profile()))
    policy.truncate([chain_of([0.9])], [256], passes=1, mask="chain")
    assert policy.summary()["evict_steps"] == 1
    policy.reset_stats()
    summary = policy.summary()
    assert summary["evict_steps"] == 0 and "evict_clock_pass_s_rows1" in summary


def test_a_catch_up_rides_with_a_prompt_when_what_is_left_is_short():
    rides = EvictPolicy.catch_up_rides_with_prompt
    assert rides(1100, 1100) and rides(1100 + CATCH_UP_MIN_TOKENS - 1, 1100)
    assert not rides(1100 + CATCH_UP_MIN_TOKENS, 1100) and not rides(1100, 0) and not rides(0, 500)
