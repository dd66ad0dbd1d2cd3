"""EVICT's decision without an engine (adaptive/evict.py) on a synthetic cost profile."""

import math

import pytest

from vllm_sparsever.adaptive.cost import Measurement, VerifyCostProfile
from vllm_sparsever.adaptive.evict import AcceptanceCalibration, Evict
from vllm_sparsever.drafting.tree import DraftTree


def _profile(per_token_s: float, base_s: float = 0.05, per_ctx_s: float = 0.0) -> VerifyCostProfile:
    ms = [Measurement(mask, r, q, c, base_s + per_token_s * r * q + per_ctx_s * r * c)
          for mask in ("tree", "chain") for r in (1, 4, 8) for q in (1, 2, 4, 8, 16) for c in (256, 4096)]
    return VerifyCostProfile(model="m", hardware="h", dtype="float32", measurements=ms).fit()


def _chain(probs: list[float]) -> DraftTree:
    scores, s = [], 1.0
    for p in probs:
        s *= p
        scores.append(s)
    return DraftTree(list(range(10, 10 + len(probs))), list(range(-1, len(probs) - 1)), scores)


def test_cost_profile_fit_recovers_a_linear_cost():
    profile = _profile(0.002, per_ctx_s=1e-6)
    assert profile.fit_error["tree"] < 0.02
    assert profile.predict([5], [1000]) == pytest.approx(0.05 + 0.01 + 0.001, rel=0.05)


def test_cheap_tokens_keep_the_confident_drafts_and_cut_the_rest():
    evict = Evict(_profile(0.001), guard=False)
    tree = _chain([0.95, 0.9, 0.9, 0.02, 0.9])
    out = evict.truncate([tree], [256])
    # Each confident draft adds ~0.9 expected tokens for 2% more time; the 4th node's path
    # probability (~0.015) does not pay, nor anything under it.
    assert out[0].tokens == tree.tokens[:3]
    assert evict.stats.truncated_steps == 1 and evict.stats.nodes_kept == 3


def test_expensive_tokens_verify_nothing_and_the_guard_skips_drafting():
    from vllm_sparsever.adaptive.evict import FIRST_PROBE_SKIPS, PROBE_BUDGET

    evict = Evict(_profile(0.2, base_s=0.01), guard=True)  # a token costs 20x the step base
    assert evict.should_draft([256])  # nothing seen yet: drafts
    out = evict.truncate([_chain([0.5, 0.5])], [256], draft_time_s=0.01)
    assert len(out[0]) == 0 and evict.stats.empty_steps == 1
    # Drafting did not pay at one row: skipped; before any catch-up time was measured, a probe
    # every FIRST_PROBE_SKIPS steps.
    decisions = [evict.should_draft([256], catch_up_tokens=500) for _ in range(FIRST_PROBE_SKIPS)]
    assert decisions.index(True) == FIRST_PROBE_SKIPS - 1 and sum(decisions) == 1
    # A batch size never seen inherits the nearest one's averages: it does not pay either.
    assert not evict.should_draft([256, 256], catch_up_tokens=500)
    # With the catch-up measured (10 ms a token), a probe waits until the plain decoding time it
    # skipped pays for it PROBE_BUDGET-fold: 500 tokens = 5 s of catch-up (+ the drafting step's extra
    # 10 ms) -> after ~(5.01 / PROBE_BUDGET) / plain step.
    evict.observe_catch_up(100, 1.0)
    plain_s = evict.cost([1], [256], "chain")
    expected = math.ceil((500 * 0.01 + 0.01) / PROBE_BUDGET / plain_s)
    decisions = [evict.should_draft([256], catch_up_tokens=500) for _ in range(expected + 5)]
    assert decisions.index(True) == pytest.approx(expected - 1, abs=1) and sum(decisions) == 1
    # Nothing to catch up on (a self-drafter): probing is cheap, so it happens often.
    cheap = [evict.should_draft([256], catch_up_tokens=0) for _ in range(50)]
    assert sum(cheap) >= 5
    assert evict.stats.probe_steps == 2 + sum(cheap)


def test_guard_without_catch_up_probes_by_the_time_budget_from_the_start():
    """A drafter with nothing to catch up on (self-drafter, n-gram) never waits for a catch-up
    measurement: its probes follow the time budget from the first skip."""
    from vllm_sparsever.adaptive.evict import FIRST_PROBE_SKIPS, PROBE_BUDGET

    evict = Evict(_profile(0.2, base_s=0.01), guard=True)
    out = evict.truncate([_chain([0.5, 0.5])], [256], draft_time_s=0.05)  # keeps nothing: skip from now on
    assert len(out[0]) == 0
    plain_s = evict.cost([1], [256], "chain")
    extra = 0.05 + evict.cost([1], [256]) - plain_s  # the drafting step's extra time
    expected = math.ceil(max(extra, 0.0) / PROBE_BUDGET / plain_s)
    decisions = [evict.should_draft([256], catch_up_tokens=0) for _ in range(FIRST_PROBE_SKIPS)]
    assert 1 < expected < FIRST_PROBE_SKIPS - 1
    assert decisions.index(True) == pytest.approx(expected - 1, abs=1)


def test_guard_keeps_drafting_when_it_pays():
    evict = Evict(_profile(0.001), guard=True)
    evict.truncate([_chain([0.9, 0.9, 0.9])], [256], draft_time_s=0.01)
    assert all(evict.should_draft([256]) for _ in range(100)) and evict.stats.skipped_drafting_steps == 0


def test_batch_is_taken_into_account():
    """The same trees are worth less in a bigger step once it is compute-bound."""
    knee = [Measurement(mask, r, q, 256, 0.05 + (0.0005 * r * q if r * q <= 16 else 0.008 + 0.01 * (r * q - 16)))
            for mask in ("tree", "chain") for r in (1, 4, 8) for q in (1, 2, 4, 8, 16)]
    profile = VerifyCostProfile(model="m", hardware="h", dtype="float32", measurements=knee).fit()
    trees = [_chain([0.7] * 6) for _ in range(8)]
    one = Evict(profile, guard=False).truncate(trees[:1], [256])
    eight = Evict(profile, guard=False).truncate(trees, [256] * 8)
    assert len(one[0]) > sum(len(t) for t in eight) / 8


def test_min_draft_tokens_and_prefix_closure():
    evict = Evict(_profile(1.0), min_draft_tokens=2, guard=False)  # tokens far too expensive
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 2], [0.6, 0.3, 0.5, 0.4])
    out = evict.truncate([tree], [256])
    assert out[0].tokens == [1, 3]  # the two best nodes, prefix-closed (3 hangs under 1)


def test_calibration_moves_toward_observed_acceptance():
    cal = AcceptanceCalibration()
    tree = _chain([0.9])
    before = cal.estimate(0.9)
    for _ in range(50):
        cal.observe(tree, 1, [])  # never accepted
    assert cal.estimate(0.9) < before / 4


def test_drafting_time_makes_verifying_more_nodes_worth_it():
    """The step already spent its drafting time: a node's verification cost is smaller next to it."""
    tree = _chain([0.9, 0.5, 0.3, 0.3, 0.3])
    quick = Evict(_profile(0.01), guard=False).truncate([tree], [256], draft_time_s=0.0)
    slow = Evict(_profile(0.01), guard=False).truncate([tree], [256], draft_time_s=0.5)
    assert len(slow[0]) > len(quick[0])
