"""EVICT's decision without an engine (adaptive/evict.py) on a synthetic cost profile."""

import math

import pytest

from vllm_sparsever.adaptive.cost import Measurement, VerifyCostProfile
from vllm_sparsever.adaptive.evict import PLAIN_CHECK_EVERY, PRICE_OPTIMISM, AcceptanceCalibration, Evict
from vllm_sparsever.trees import DraftTree

from .evict_helpers import chain_of, made_up_profile


def test_cost_profile_fit_recovers_a_linear_cost():
    profile = made_up_profile(0.002, per_ctx_s=1e-6)
    assert profile.fit_error["tree"] < 0.02
    assert profile.predict([5], [1000]) == pytest.approx(0.05 + 0.01 + 0.001, rel=0.05)


def test_cheap_tokens_keep_the_confident_drafts_and_cut_the_rest():
    evict = Evict(made_up_profile(0.001), guard=False, depth_prior=1e-3)  # the drafter's scores decide
    tree = chain_of([0.95, 0.9, 0.9, 0.02, 0.9])
    out = evict.truncate([tree], [256])
    # Each confident draft adds ~0.9 expected tokens for 2% more time; the 4th node's path
    # probability (~0.015) does not pay, nor anything under it.
    assert out[0].tokens == tree.tokens[:3]
    assert evict.stats.truncated_steps == 1 and evict.stats.nodes_kept == 3


def _measured(evict: Evict, pass_s: float, rows: int = 1, fixed_s: float = 0.0) -> Evict:
    """`evict` after a drafting step at `rows` rows measured one draft pass at `pass_s`, and a verify
    step of one draft per row and a plain step that took what the profile predicts."""
    evict.observe_drafting(rows, [pass_s], pass_s + fixed_s)
    evict.observe_step([2] * rows, [256] * rows, evict.cost([2] * rows, [256] * rows, "chain"))
    evict.observe_step([1] * rows, [256] * rows, evict.cost([1] * rows, [256] * rows, "chain"))
    return evict


def _rate_by_hand(evict: Evict, depth: int, alpha: float, pass_s: float, ctx: int = 256) -> float:
    """Expected tokens per second of a one-row chain step drafting `depth` tokens, each accepted with
    probability `alpha` given its parent: (1 + sum_j alpha^j) / (depth passes + verify of depth + 1)."""
    tokens = 1 + sum(alpha ** j for j in range(1, depth + 1))
    return tokens / (depth * pass_s + evict.cost([depth + 1], [ctx], "chain"))


def test_depth_is_the_one_with_the_best_expected_rate():
    from vllm_sparsever.adaptive.evict import DraftShape

    shape = DraftShape(cap=8, budgets=(8,))
    for alpha, pass_s in ((0.7, 0.02), (0.9, 0.01), (0.5, 0.03), (0.95, 0.004)):
        evict = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=alpha), pass_s)
        rates = [_rate_by_hand(evict, d, alpha, pass_s) for d in range(9)]
        want = max(range(9), key=lambda d: (rates[d], -d))
        assert evict.plan_depth([256], shape) == want, (alpha, pass_s, rates)
    # The cases above cover an interior optimum and the cap.
    cases = [(0.7, 0.02), (0.95, 0.004)]
    got = []
    for alpha, pass_s in cases:
        evict = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=alpha), pass_s)
        got.append(evict.plan_depth([256], shape))
    assert 1 < got[0] < 8 and got[1] == 8


def test_one_slow_step_does_not_switch_drafting_off():
    """A host hiccup: one verify step measured at ten times its time. Taken whole into the running
    ratio it priced verification above plain decoding until probes, rare while skipping, re-measured
    it (likely what made a batch-1 round on a Zen 4 skip drafting on 208 of 286 steps); a step counts as at most
    STEP_OUTLIER times the running ratio, so drafting goes on. A lasting slowdown is still followed."""
    from vllm_sparsever.adaptive.evict import EMA, STEP_OUTLIER, DraftShape

    shape = DraftShape(cap=3, budgets=(3,))
    evict = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.8), 0.01)
    assert evict.plan_depth([256], shape) > 0
    verify = evict.cost([2], [256], "chain")
    evict.observe_step([2], [256], 10 * verify, "chain")
    assert evict.clock.ratio["verify"][(1, 0)] == pytest.approx(1 - EMA + EMA * STEP_OUTLIER)
    assert evict.plan_depth([256], shape) > 0
    # (taken whole, the same step would have switched drafting off)
    whole = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.8), 0.01)
    whole.clock.ratio["verify"][(1, 0)] = 1 - EMA + EMA * 10
    assert whole.plan_depth([256], shape) == 0
    # Every verify step 3x slower from now on: the ratio follows within a few steps.
    for _ in range(6):
        evict.observe_step([2], [256], 3 * verify, "chain")
    assert evict.clock.ratio["verify"][(1, 0)] > 2.6


def test_a_costly_drafter_drafts_shorter_chains_than_a_cheap_one():
    from vllm_sparsever.adaptive.evict import DraftShape

    shape = DraftShape(cap=6, budgets=(6,))
    depths = {}
    for pass_s in (0.002, 0.02, 0.06, 0.2):
        depths[pass_s] = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.8), pass_s).plan_depth([256], shape)
    assert depths[0.002] == 6 and depths[0.002] > depths[0.02] > depths[0.06] > 0
    assert depths[0.2] == 0  # a pass costs twice a plain step: plain decoding wins


def test_one_pass_drafters_draft_to_the_depth_verification_pays_for():
    """n-gram: one lookup gives every level, so only verification prices depth."""
    from vllm_sparsever.adaptive.evict import DraftShape

    cheap_tokens = _measured(Evict(made_up_profile(0.001, base_s=0.1), depth_prior=0.5), 0.001)
    costly_tokens = _measured(Evict(made_up_profile(0.05, base_s=0.1), depth_prior=0.5), 0.001)
    one_pass = DraftShape(cap=5, budgets=(5,), one_pass=True)
    assert cheap_tokens.plan_depth([256], one_pass) == 5
    # 0.5 ** d expected tokens for 50 ms each: the first pays (0.5 / 0.05 = 10 tok/s against 1 / 0.151),
    # the second (0.25 / 0.05) does not.
    assert costly_tokens.plan_depth([256], one_pass) == 1


def test_drafting_stops_when_the_path_probability_no_longer_pays():
    """Decision 2: after a pass, the calibrated probability of reaching the newest level decides."""
    from vllm_sparsever.adaptive.evict import DraftShape

    shape = DraftShape(cap=6, budgets=(6,))
    evict = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.8), 0.02)
    assert evict.plan_depth([256], shape) >= 3
    # Verification showed drafts scored 0.9 accepted, drafts scored 0.001 rejected.
    for _ in range(50):
        evict.calibration.observe(chain_of([0.9]), 1, [0])
        evict.calibration.observe(chain_of([0.001]), 1, [])
    # One draft with path probability 0.9: the next pays; at 0.001 it cannot (~0 expected tokens for a
    # 25 ms pass + token, at a step rate near 10 tokens/s).
    assert evict.keep_drafting([256], shape, 1, [chain_of([0.9])], [[0]])
    assert not evict.keep_drafting([256], shape, 1, [chain_of([0.001])], [[0]])
    # By hand: continuing pays iff some further depth beats stopping here.
    evict2 = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.8), 0.02)
    decisions = []
    for p in (0.05, 0.1, 0.2, 0.4):
        for _ in range(60):
            evict2.calibration.observe(chain_of([p]), 1, [0] if p > 0.1 else [])
        reach = evict2.benefits(chain_of([p]))[0]
        now = (1 + reach) / (0.02 + evict2.cost([2], [256], "chain"))
        later = [(1 + reach + sum(reach * 0.8 ** j for j in range(1, e + 1)))
                 / ((1 + e) * 0.02 + evict2.cost([2 + e], [256], "chain")) for e in range(1, 6)]
        decisions.append(evict2.keep_drafting([256], shape, 1, [chain_of([p])], [[0]]))
        assert decisions[-1] == (max(later) > now), p
    assert decisions == [False, False, True, True]
    # A request that finished (empty frontier) adds nothing.
    assert not evict.keep_drafting([256], shape, 1, [chain_of([0.9])], [[]])


def test_guard_skips_when_depth_zero_wins_and_probes_by_the_time_budget():
    from vllm_sparsever.adaptive.evict import FIRST_PROBE_SKIPS, PROBE_BUDGET, DraftShape

    shape = DraftShape(cap=4, budgets=(4,))
    evict = Evict(made_up_profile(0.2, base_s=0.01), guard=True)  # a token costs 20x the step base
    assert evict.plan_depth([256], shape) == 4  # nothing measured yet: drafts blind, to the cap
    evict.observe_drafting(1, [0.01], 0.01)
    assert evict.plan_depth([256], shape) == 4  # no step measured yet: the profile's level is unknown
    _measured(evict, 0.01)
    # Drafting does not pay at one row: skipped; before any catch-up time was measured, a probe
    # every FIRST_PROBE_SKIPS steps.
    decisions = [evict.plan_depth([256], shape, catch_up_tokens=500) for _ in range(FIRST_PROBE_SKIPS)]
    assert [d > 0 for d in decisions].index(True) == FIRST_PROBE_SKIPS - 1 and sum(d > 0 for d in decisions) == 1
    assert evict.stats.skipped_drafting_steps == FIRST_PROBE_SKIPS - 1
    # A batch size never seen is priced from the nearest measured pass: it does not pay either.
    assert evict.plan_depth([256, 256], DraftShape(cap=4, budgets=(4, 4)), catch_up_tokens=500) == 0
    # With the catch-up measured (10 ms a token), a probe waits until the plain decoding time it
    # skipped pays for it PROBE_BUDGET-fold: 500 tokens = 5 s of catch-up + the probe step's extra time.
    evict.observe_catch_up(100, 1.0)
    plain_s = evict.step_s([1], [256])
    extra_s = 0.01 + evict.step_s([2], [256], "chain") - plain_s  # the probe drafts one level
    expected = math.ceil((500 * 0.01 + extra_s) / PROBE_BUDGET / plain_s)
    decisions = [evict.plan_depth([256], shape, catch_up_tokens=500) > 0 for _ in range(expected + 5)]
    assert decisions.index(True) == pytest.approx(expected - 1, abs=1) and sum(decisions) == 1
    # Nothing to catch up on (a self-drafter, n-gram): a probe every extra_s / PROBE_BUDGET of skipping.
    cheap = [evict.plan_depth([256], shape, catch_up_tokens=0) > 0 for _ in range(100)]
    every = math.ceil(extra_s / PROBE_BUDGET / plain_s)
    assert sum(cheap) == pytest.approx(100 / every, abs=1) and 100 / every >= 4


def test_guard_cannot_lock_itself_out_on_an_underestimated_plain_step():
    """The issue-24 failure: the profile predicts a plain step 1.5x too fast, so drafting looks like a
    loss. Measured plain steps (taken while skipping) scale the profile, and drafting resumes."""
    from vllm_sparsever.adaptive.evict import DraftShape

    shape = DraftShape(cap=3, budgets=(3,))
    evict = _measured(Evict(made_up_profile(0.002, base_s=0.1), depth_prior=0.9), 0.1)
    assert evict.plan_depth([256], shape) == 0  # a pass costs a plain step: 1.9 tokens / 0.2 s < 1 / 0.1 s
    predicted = evict.cost([1], [256], "chain")
    for _ in range(10):
        evict.observe_step([1], [256], 1.5 * predicted)  # plain steps take 1.5x the profile's time
    assert evict.step_s([1], [256]) == pytest.approx(1.5 * predicted, rel=0.01)
    assert evict.step_s([2], [256], "chain") == pytest.approx(evict.cost([2], [256], "chain"), rel=0.01)
    assert evict.plan_depth([256], shape) >= 1


def test_verify_time_follows_measured_steps_per_batch_size_and_context_band():
    evict = Evict(made_up_profile(0.002, base_s=0.1))
    predicted = evict.cost([4], [256], "chain")
    for _ in range(20):
        evict.observe_step([4], [256], 2.0 * predicted, gap_s=0.01)
    assert evict.step_s([4], [256], "chain") == pytest.approx(2.0 * predicted + 0.01, rel=0.01)
    # Plain steps were never measured: they take the verify steps' ratio.
    assert evict.step_s([1], [256]) == pytest.approx(2.0 * evict.cost([1], [256], "chain") + 0.01, rel=0.01)
    # Another context band and another batch size inherit the nearest measured ratio until measured.
    assert evict.step_s([4], [8000], "chain") == pytest.approx(2.0 * evict.cost([4], [8000], "chain") + 0.01, rel=0.01)
    for _ in range(20):
        evict.observe_step([4], [8000], 0.5 * evict.cost([4], [8000], "chain"))
    assert evict.step_s([4], [8000], "chain") == pytest.approx(0.5 * evict.cost([4], [8000], "chain") + 0.01, rel=0.01)
    assert evict.step_s([4], [256], "chain") == pytest.approx(2.0 * predicted + 0.01, rel=0.01)
    # Idle time between steps is not per-step work.
    evict.observe_step([4], [256], 2.0 * predicted, gap_s=30.0)
    assert evict.clock.gap_s == pytest.approx(0.01)


def test_depth_acceptance_is_measured_per_depth_and_extrapolated():
    from vllm_sparsever.adaptive.evict import DepthAcceptance

    acc = DepthAcceptance(first_prior=0.5)
    for _ in range(400):  # 3 drafts verified; depth 1 always accepted, depth 2 half the time, never depth 3
        acc.observe(3, 1)
        acc.observe(3, 2)
    a = acc.conditional(5)
    assert a[0] == pytest.approx(1.0, abs=0.02) and a[1] == pytest.approx(0.5, abs=0.02) and a[2] < 0.02
    assert a[3] == pytest.approx(a[2], abs=0.01) and a[4] == pytest.approx(a[2], abs=0.01)  # never verified


def test_guard_keeps_drafting_when_it_pays():
    from vllm_sparsever.adaptive.evict import DraftShape

    evict = _measured(Evict(made_up_profile(0.001), guard=True, depth_prior=0.9), 0.005)
    shape = DraftShape(cap=3, budgets=(3,))
    depths = [evict.plan_depth([256], shape) for _ in range(100)]
    # One plain step to re-measure it, PLAIN_CHECK_EVERY drafting steps after the last one measured.
    assert depths.count(3) == 99 and depths.index(0) == PLAIN_CHECK_EVERY
    assert evict.stats.skipped_drafting_steps == 0 and evict.stats.plain_check_steps == 1


def test_a_warm_up_drafting_step_does_not_lock_a_cheap_drafter_out():
    """A fresh engine's first drafting step runs each pass on shapes it never ran (here 10x the
    steady time, as on a 2-core CI machine): taken as the steady cost it makes a cheap drafter look
    costly. The next step's faster passes replace it at once; a slower step later only moves the
    running time by EMA, and a stray slow pass within a step (its median) not at all."""
    from vllm_sparsever.adaptive.evict import EMA, DraftShape

    shape = DraftShape(cap=3, budgets=(3,))
    evict = Evict(made_up_profile(0.001), guard=True, depth_prior=0.9)
    evict.observe_drafting(1, [0.05, 0.05, 0.05], 0.15)  # the warm-up step: 50 ms a pass
    _measured(evict, 0.005)  # the next one: 5 ms a pass
    assert evict.clock.pass_s[1] == pytest.approx(0.005)
    assert [evict.plan_depth([256], shape) for _ in range(3)] == [3, 3, 3]
    evict.observe_drafting(1, [0.005, 0.2, 0.005], 0.21)  # one pass hit by interference
    assert evict.clock.pass_s[1] == pytest.approx(0.005)
    evict.observe_drafting(1, [0.01, 0.01, 0.01], 0.03)  # slower for real: followed by EMA
    assert evict.clock.pass_s[1] == pytest.approx(EMA * 0.01 + (1 - EMA) * 0.005)
    # A drafter whose passes do take 50 ms does not pay here: the warm-up step alone would skip.
    slow = _measured(Evict(made_up_profile(0.001), guard=True, depth_prior=0.9), 0.05)
    assert slow.plan_depth([256], shape) == 0 and slow.stats.skipped_drafting_steps == 1


def test_guard_measures_a_plain_step_where_drafting_measured_only_verify_steps():
    """The long-context failure: verify steps at 32K take 3x the profile's time (its grid stopped at
    4K), and plain steps read their time from them, so drafting looked like it paid. One plain step,
    measured, shows it does not: the guard then skips."""
    from vllm_sparsever.adaptive.evict import DraftShape

    shape = DraftShape(cap=3, budgets=(3,))
    evict = Evict(made_up_profile(0.002, base_s=0.1), guard=True, depth_prior=0.9)
    evict.observe_drafting(1, [0.02], 0.02)
    for _ in range(10):
        evict.observe_step([2], [32768], 3.0 * evict.cost([2], [32768], "chain"))
    # Priced from the verify steps' ratio, a plain step looks 3x slower than it is: drafting would win.
    assert evict._best(evict._outlook([32768], shape, 0, [1.0], [0.0], [1])) > 0
    assert evict.plan_depth([32768], shape) == 0 and evict.stats.plain_check_steps == 1
    evict.observe_step([1], [32768], evict.cost([1], [32768], "chain"))  # the plain step, as the profile says
    assert all(evict.plan_depth([32768], shape) == 0 for _ in range(10))
    assert evict.stats.skipped_drafting_steps == 10 and evict.stats.plain_check_steps == 1
    # At a short context verify steps take the profile's time and drafting pays; plain steps were
    # never measured in that band: one check there, then drafting.
    for _ in range(10):
        evict.observe_depth(1, 1)  # its draft accepted
        evict.observe_step([2], [512], evict.cost([2], [512], "chain"))
    assert evict.plan_depth([512], shape) == 0 and evict.stats.plain_check_steps == 2
    evict.observe_step([1], [512], evict.cost([1], [512], "chain"))
    assert evict.plan_depth([512], shape) == 3 and evict.stats.plain_check_steps == 2
    # Guard off: always drafts, no checks.
    unguarded = Evict(made_up_profile(0.002, base_s=0.1), guard=False, depth_prior=0.9)
    unguarded.observe_drafting(1, [0.02], 0.02)
    unguarded.observe_step([2], [32768], 3.0 * unguarded.cost([2], [32768], "chain"))
    assert unguarded.plan_depth([32768], shape) > 0 and unguarded.stats.plain_check_steps == 0


def test_depth_cap_mode_drafts_to_the_cap_or_not_at_all():
    from vllm_sparsever.adaptive.evict import DraftShape

    shape = DraftShape(cap=6, budgets=(6,))
    interior = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.7, depth="cap"), 0.02)
    assert interior.plan_depth([256], shape) == 6
    assert interior.keep_drafting([256], shape, 1, [chain_of([0.001])], [[0]])
    losing = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.7, depth="cap"), 0.2)
    assert losing.plan_depth([256], shape) == 0
    unguarded = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.7, guard=False), 0.2)
    assert unguarded.plan_depth([256], shape) == 1  # guard off: at least one level


def test_batch_is_taken_into_account():
    """The same trees are worth less in a bigger step once it is compute-bound."""
    knee = [Measurement(mask, r, q, 256, 0.05 + (0.0005 * r * q if r * q <= 16 else 0.008 + 0.01 * (r * q - 16)))
            for mask in ("tree", "chain") for r in (1, 4, 8) for q in (1, 2, 4, 8, 16)]
    profile = VerifyCostProfile(model="m", hardware="h", dtype="float32", measurements=knee).fit()
    trees = [chain_of([0.7] * 6) for _ in range(8)]
    one = Evict(profile, guard=False).truncate(trees[:1], [256])
    eight = Evict(profile, guard=False).truncate(trees, [256] * 8)
    assert len(one[0]) > sum(len(t) for t in eight) / 8


def test_min_draft_tokens_and_prefix_closure():
    evict = Evict(made_up_profile(1.0), min_draft_tokens=2, guard=False, depth_prior=1e-3)  # tokens far too expensive
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 2], [0.6, 0.3, 0.5, 0.4])
    out = evict.truncate([tree], [256])
    assert out[0].tokens == [1, 3]  # the two best nodes, prefix-closed (3 hangs under 1)


def test_calibration_moves_toward_observed_acceptance():
    cal = AcceptanceCalibration()
    tree = chain_of([0.9])
    before = cal.estimate(0.9)
    for _ in range(50):
        cal.observe(tree, 1, [])  # never accepted
    assert cal.estimate(0.9) < before / 4


def test_drafting_time_makes_verifying_more_nodes_worth_it():
    """The step already spent its drafting time: a node's verification cost is smaller next to it."""
    tree = chain_of([0.9, 0.5, 0.3, 0.3, 0.3])
    quick = Evict(made_up_profile(0.01), guard=False).truncate([tree], [256], draft_time_s=0.0)
    slow = Evict(made_up_profile(0.01), guard=False).truncate([tree], [256], draft_time_s=0.5)
    assert len(slow[0]) > len(quick[0])


def test_fit_flags_non_monotone_points():
    ms = [Measurement("chain", 1, q, 256, t) for q, t in ((1, 0.10), (2, 0.11), (4, 0.09), (8, 0.12))]
    ms += [Measurement("chain", 1, q, 1024, t) for q, t in ((1, 0.10), (2, 0.099), (4, 0.12))]  # within noise
    profile = VerifyCostProfile(model="m", hardware="h", dtype="float32", measurements=ms).fit()
    assert len(profile.warnings) == 1 and "4 tokens took 90.0 ms" in profile.warnings[0]
    assert "rows=1 context=256" in profile.warnings[0]


def test_guard_defers_a_long_catch_up_until_drafting_would_have_saved_its_cost():
    """Rent or buy: a new long request (its prompt prefix-cached for the target, never run through the
    draft) decodes plainly until the time drafting would have saved reaches the catch-up's measured
    cost; then it drafts. Few catch-up tokens, or an unmeasured catch-up, are not deferred."""
    from vllm_sparsever.adaptive.evict import DraftShape

    evict = _measured(Evict(made_up_profile(0.001), guard=True, depth_prior=0.9), 0.005)
    shape = DraftShape(cap=3, budgets=(3,))
    assert evict.plan_depth([256], shape, catch_up_tokens=5000) == 3  # catch-up cost never measured
    evict.observe_catch_up(1000, 2.0)  # 2 ms a token: 10 s for 5000
    assert evict.plan_depth([256], shape, catch_up_tokens=8) == 3
    (plain_tokens, plain_s), (tokens, seconds) = evict._outlook([256], shape, 0, [1.0], [0.0], [1])[::3]
    saved = plain_s - plain_tokens * seconds / tokens
    expected = math.ceil(5000 * 0.002 / saved)
    assert expected > 10
    deferred = 0
    while evict.plan_depth([256], shape, catch_up_tokens=5000) == 0 and deferred <= expected + 3:
        deferred += 1
    assert deferred == pytest.approx(expected - 1, abs=1)
    assert evict.stats.catch_up_deferred_steps == deferred and evict.stats.skipped_drafting_steps == 0
    # Drafting caught up: the next long catch-up (another new request) is deferred afresh.
    assert evict.plan_depth([256], shape, catch_up_tokens=5000) == 0
    # With the guard off, drafting is never deferred.
    unguarded = _measured(Evict(made_up_profile(0.001), guard=False, depth_prior=0.9), 0.005)
    unguarded.observe_catch_up(1000, 2.0)
    assert unguarded.plan_depth([256], shape, catch_up_tokens=5000) == 3


def _run_chain_steps(evict: Evict, shape, steps: int, later_alpha: float) -> list[int]:
    """`steps` decode steps of one request drafting chains as EVICT plans them: depth 1 accepted half
    the time, each deeper draft with probability `later_alpha` given its parent (seeded); returns the
    planned depths."""
    import random

    rng = random.Random(0)
    planned = []
    for _ in range(steps):
        depth = evict.plan_depth([256], shape)
        planned.append(depth)
        if depth == 0:
            continue
        levels = 1
        while levels < depth and evict.keep_drafting([256], shape, levels, [chain_of([0.001] * levels)], [[levels - 1]]):
            levels += 1
        accepted = 0
        if rng.random() < 0.5:
            accepted = 1
            while accepted < levels and rng.random() < later_alpha:
                accepted += 1
        evict.observe_depth(levels, accepted)
    return planned


def test_depth_probe_measures_the_depth_below_which_drafting_stops():
    """A chain held at depth d never verifies depth d + 1, whose acceptance would stay the depth
    above's: one drafting step in DEPTH_PROBE_EVERY drafts one level deeper (the stopping rule does
    not cut the probe short) until that depth is measured; the measurement then decides the depth."""
    from vllm_sparsever.adaptive.evict import DEPTH_PROBE_EVERY, DEPTH_PROBES, DraftShape

    shape = DraftShape(cap=4, budgets=(4,))

    def engine() -> Evict:
        # 30 ms passes for a 100 ms step: with every depth accepted half the time (depth 1's estimate,
        # inherited below it) one draft is the best depth: 1.5 / 0.14 s against 1.75 / 0.175 s for two.
        evict = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.5), 0.03)
        for _ in range(20):
            evict.observe_depth(1, 0)
            evict.observe_depth(1, 1)
        return evict

    probed = engine()
    first = [probed.plan_depth([256], shape) for _ in range(DEPTH_PROBE_EVERY)]
    assert first == [1] * (DEPTH_PROBE_EVERY - 1) + [2] and probed.stats.depth_probe_steps == 1
    # The probe drafts its second level even from a draft the stopping rule would stop at.
    assert probed.keep_drafting([256], shape, 1, [chain_of([0.001])], [[0]])
    assert not probed.keep_drafting([256], shape, 2, [chain_of([0.001, 0.001])], [[1]])

    # Depth 2 accepted 90% of the time given depth 1: once measured, chains draft deeper.
    deep = _run_chain_steps(engine(), shape, 200, later_alpha=0.9)
    assert deep[:DEPTH_PROBE_EVERY] == [1] * (DEPTH_PROBE_EVERY - 1) + [2]
    assert all(d >= 2 for d in deep[-50:] if d)  # (0: the guard's plain checks)
    # Depth 2 accepted 10% of the time: depth 1 stays, and probes drop to one per PLAIN_CHECK_EVERY.
    shallow_engine = engine()
    shallow = _run_chain_steps(shallow_engine, shape, 300, later_alpha=0.1)
    assert set(shallow[-100:]) <= {0, 1, 2} and shallow[-100:].count(1) >= 95
    assert DEPTH_PROBES <= shallow_engine.stats.depth_probe_steps <= DEPTH_PROBES + 3


def test_seeded_requests_keep_their_configured_shape():
    """A seeded sampled request's random draws per step follow its drafts' shape: EVICT leaves it
    whole while it cuts the rest of the batch, and a step with one drafts to the configured depth
    (no stale depth probe either)."""
    from vllm_sparsever.adaptive.evict import DraftShape

    evict = Evict(made_up_profile(1.0), guard=False, depth_prior=1e-3)  # tokens far too expensive
    trees = [chain_of([0.2, 0.2, 0.2]), chain_of([0.2, 0.2, 0.2])]
    out = evict.truncate(trees, [256, 256], whole=[True, False])
    assert [len(t) for t in out] == [3, 0]
    assert [len(t) for t in evict.truncate(trees, [256, 256])] == [0, 0]

    shape = DraftShape(cap=4, budgets=(4,))
    probed = _measured(Evict(made_up_profile(0.005, base_s=0.1), depth_prior=0.5), 0.03)
    while not probed.stats.depth_probe_steps:
        probed.plan_depth([256], shape)
    assert probed.keep_drafting([256], shape, 1, [chain_of([0.001])], [[0]])  # the probe's level
    assert probed.plan_seeded(4) == 4 and probed.stats.seeded_steps == 1
    assert not probed.keep_drafting([256], shape, 1, [chain_of([0.001])], [[0]])


class _ScoredDrafter:
    """Built lazily (imports the drafting package): a tree drafter whose every draft token has
    probability `p` (token = position + 1), over a stand-in target with `seeded` rows."""

    @staticmethod
    def make(p: float, seeded: set[int], evict: "EvictPolicy"):
        from types import SimpleNamespace

        import torch

        from vllm_sparsever.drafting.drafter import RoundDrafter
        from vllm_sparsever.drafting.evict_proposer import EvictProposer
        from vllm_sparsever.drafting.tree_drafter import TreeDrafting, chain_tree

        class Stats:
            slot_limited = 0

            def summary(self):
                return {}

        class Drafter(TreeDrafting, RoundDrafter):
            def __init__(self):
                super().__init__(Stats(), num_speculative_tokens=4, max_model_len=1000)
                self.init_trees(chain_tree(4))  # EVICT over chains: one-branch trees
                self.target = SimpleNamespace(device="cpu", tree_sampling_supported=lambda row: True,
                                              seeded_sampling=lambda row: row in seeded)

            def propose(self, step):
                return self.propose_trees(step)

            def _tree_root_top(self, reqs, idx, k):
                return (torch.full((len(idx), k), p),
                        torch.tensor([[reqs.positions[i] + 1] for i in idx]).expand(len(idx), k))

            def _tree_level_top(self, rows, tokens, positions, kv_positions, lens, tree_mask, wanted, k, topologies):
                picked = positions[wanted] + 1
                return torch.full((len(wanted), k), p), picked[:, None].expand(len(wanted), k)

        proposer = EvictProposer(Drafter(), adaptive=None)
        proposer.evict = evict  # in place of load(), which reads the cost profile
        return proposer


def test_a_seeded_request_is_drafted_and_verified_as_configured():
    """Through the tree drafter under EVICT's proposer: with drafts not worth their cost, EVICT stops
    drafting and cuts the unseeded request's chain, while the seeded one (row 0) grows to the
    configured 4 levels, whole."""
    import numpy as np

    from vllm_sparsever.adaptive.policy import EvictPolicy
    from vllm_sparsever.step import DraftStep, RequestLimits

    def step(rows: int) -> DraftStep:
        return DraftStep(req_ids=[f"r{i}" for i in range(rows)], sampled=[[7]] * rows,
                         num_tokens=np.array([100] * rows), budgets=np.array([4] * rows), depth=4,
                         token_ids=np.zeros((rows, 101), dtype=np.int64),
                         limits=[RequestLimits(frozenset(), None)] * rows, slot_limited=0)

    def engine() -> EvictPolicy:
        policy = EvictPolicy(made_up_profile(0.05, base_s=0.1), guard=False, depth_prior=0.05)
        _measured(policy._evict, 0.03, rows=2)
        for _ in range(20):
            policy._evict.observe_depth(1, 0)
        return policy

    plain = _ScoredDrafter.make(0.05, set(), engine())
    depth = plain.plan_depth(step(2))
    assert depth < 4
    assert [len(d) for d in plain.propose(step(2).with_depth(depth))] == [0, 0]

    seeded = _ScoredDrafter.make(0.05, {0}, engine())
    depth = seeded.plan_depth(step(2))
    assert depth == 4 and seeded.evict.summary()["evict_seeded_steps"] == 1
    drafts = seeded.propose(step(2).with_depth(depth))
    assert drafts[0] == [100, 101, 102, 103] and drafts[1] == []
    assert seeded.evict.summary()["evict_stopped_early_steps"] == 1  # row 1 stopped; row 0 grew on


def test_guard_measures_a_plain_step_at_a_batch_size_it_never_decoded_plainly():
    """The batch-8 failure: plain steps were measured at one row only (a warm-up, the first requests),
    and an 8-row plain step priced from them looked costlier than it is, so drafting kept on at batch
    8 where it did not pay. A plain step at 1 row does not stand in for 8 rows: the guard measures one
    there, and then skips."""
    from vllm_sparsever.adaptive.evict import DraftShape

    evict = _measured(Evict(made_up_profile(0.002, base_s=0.02), guard=True, depth_prior=0.8), 0.01)  # 1 row, plain seen
    rows, ctx = 8, [256] * 8
    evict.observe_drafting(rows, [0.03], 0.03)
    for _ in range(5):  # verify steps at 8 rows take what the profile says
        evict.observe_step([2] * rows, ctx, evict.cost([2] * rows, ctx, "chain"))
    # An 8-row plain step priced at the 1-row ratio (3x: one row's fixed costs) makes drafting look paying.
    evict.observe_step([1], [256], 3.0 * evict.cost([1], [256], "chain"))
    shape = DraftShape(cap=3, budgets=(3,) * rows)
    assert evict._best(evict._outlook(ctx, shape, 0, [1.0] * rows, [0.0] * rows, [1] * rows)) > 0
    assert evict.plan_depth(ctx, shape) == 0 and evict.stats.plain_check_steps == 1
    evict.observe_step([1] * rows, ctx, evict.cost([1] * rows, ctx, "chain"))  # measured: as the profile says
    assert all(evict.plan_depth(ctx, shape) == 0 for _ in range(10))
    assert evict.stats.skipped_drafting_steps == 10 and evict.stats.plain_check_steps == 1
    # A 12-row batch is in the same class (8-15 rows): no new check there.
    ctx12 = [256] * 12
    evict.plan_depth(ctx12, DraftShape(cap=3, budgets=(3,) * 12))
    assert evict.stats.plain_check_steps == 1


def test_guard_decodes_plainly_when_the_requests_end_before_drafting_pays_back_its_catch_up():
    """The batch-8 failure: new short requests at a high batch size, where drafting saves a little a
    step, and the draft model's prefill of their prompts (its catch-up) costs more than drafting can
    save before they end. Requests with many tokens left, or no max_tokens, still draft."""
    from vllm_sparsever.adaptive.evict import DraftShape

    rows, ctx = 8, [256] * 8
    shape = DraftShape(cap=3, budgets=(3,) * rows)

    def fresh() -> Evict:
        evict = _measured(Evict(made_up_profile(0.002, base_s=0.05), guard=True, depth_prior=0.9), 0.01, rows=rows)
        evict.observe_catch_up(1000, 0.5)  # 0.5 ms a token of prompt
        return evict

    evict = fresh()
    outlook = evict._outlook(ctx, shape, 0, [1.0] * rows, [0.0] * rows, [1] * rows)
    best = evict._best(outlook)
    assert best > 0  # drafting pays per step...
    (pt, ps), (t, s) = outlook[0], outlook[best]
    saving_per_token = ps / pt - s / t
    prompts = 8 * 150  # ...but 8 new prompts' catch-up costs 0.6 s
    break_even = 0.6 / (rows * saving_per_token)  # tokens per request that would pay it back
    short, long = int(break_even * 0.5), int(break_even * 2) + 1
    assert evict.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=short) == 0
    assert evict.stats.catch_up_deferred_steps == 1
    assert fresh().plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=long) > 0
    assert fresh().plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=None) > 0
    assert fresh().plan_depth(ctx, shape, 0, prompt_tokens=0, horizon_tokens=short) > 0  # nothing to catch up on
    unguarded = _measured(Evict(made_up_profile(0.002, base_s=0.05), guard=False, depth_prior=0.9), 0.01, rows=rows)
    unguarded.observe_catch_up(1000, 0.5)
    assert unguarded.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=short) > 0


def test_a_priced_drafter_decides_its_first_step_instead_of_drafting_blind():
    """Cold start with the drafter's DraftCost: a pass and a catch-up token are priced as its share of
    the profile's plain step and prompt token, so the first step is decided like the others: a batch
    of new short requests does not pay every prompt's catch-up through the draft before drafting was
    measured to pay, and one long request drafts at once. Measurements replace the prices; a drafter
    without one drafts blind to the cap."""
    from vllm_sparsever.adaptive.evict import DraftCost, DraftShape

    profile = made_up_profile(0.002, base_s=0.05)
    rows, ctx = 8, [256] * 8
    shape = DraftShape(cap=3, budgets=(3,) * rows)

    def priced() -> Evict:
        return Evict(profile, guard=True, depth_prior=0.9, draft_cost=DraftCost(pass_share=0.1, prompt_share=0.3))

    evict = priced()
    evict.observe_step([1] * rows, ctx, evict.cost([1] * rows, ctx, "chain"))  # a plain step as the profile says
    assert evict.draft_s(ctx, 2) == pytest.approx(2 * 0.1 * evict.cost([1] * rows, ctx, "chain"))
    assert evict.catch_up_s_per_token() == pytest.approx(0.3 * 0.002, rel=0.05)  # the profile's 2 ms a token
    outlook = evict._outlook(ctx, shape, 0, [1.0] * rows, [0.0] * rows, [1] * rows)
    best = evict._best(outlook)
    assert best > 0  # drafting pays per step, by the prices...
    (pt, ps), (t, s) = outlook[0], outlook[best]
    prompts = rows * 150  # ...but 8 new prompts' catch-up costs 0.72 s, weighed at PRICE_OPTIMISM of that
    break_even = PRICE_OPTIMISM * prompts * evict.catch_up_s_per_token() / (rows * (ps / pt - s / t))
    short, long = int(break_even * 0.5), int(break_even * 2) + 1
    assert evict.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=short) == 0
    assert evict.stats.catch_up_deferred_steps == 1
    for rows_ctx, rows_shape, tokens, horizon in ((ctx, shape, prompts, long),
                                                  ([256], DraftShape(cap=3, budgets=(3,)), 150, None)):
        drafts = priced()  # drafting pays: a plain step is measured first (the guard's plain check), then it drafts
        assert drafts.plan_depth(rows_ctx, rows_shape, 0, prompt_tokens=tokens, horizon_tokens=horizon) == 0
        assert drafts.stats.plain_check_steps == 1 and drafts.stats.catch_up_deferred_steps == 0
        plain = [1] * len(rows_ctx)
        drafts.observe_step(plain, rows_ctx, drafts.cost(plain, rows_ctx, "chain"))
        assert drafts.plan_depth(rows_ctx, rows_shape, 0, prompt_tokens=tokens, horizon_tokens=horizon) > 0
    # No price: the first steps draft blind, to the cap, whatever the catch-up.
    blind = Evict(profile, guard=True, depth_prior=0.9)
    assert blind.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=short) == 3
    # A costly drafter's price says no at once (a pass at 3x a plain step never pays).
    costly = Evict(profile, guard=True, depth_prior=0.9, draft_cost=DraftCost(pass_share=3.0, prompt_share=1.0))
    assert costly.plan_depth([256], DraftShape(cap=3, budgets=(3,))) == 0
    # Measured values replace the prices at once.
    evict.observe_drafting(rows, [0.5], 0.5)
    evict.observe_catch_up(100, 1.0)
    assert evict.draft_s(ctx, 2) == pytest.approx(1.0) and evict.catch_up_s_per_token() == pytest.approx(0.01)
    with pytest.raises(ValueError, match="shares must be >= 0"):
        DraftCost(pass_share=-1.0, prompt_share=0.3)


def test_a_catch_up_waits_for_a_plain_step_measured_at_its_batch_size():
    """The batch-8 start on a Zen 4: the profile priced an 8-row plain step at 1.8x what it took, so a
    batch of new 48-token requests bought every prompt's catch-up through the draft before one
    8-row step was measured, and measured steps then showed that drafting never paid. A catch-up is
    bought only against a plain step measured in its band and rows class; the runner reports a step's
    time after planning the next one, so the first two steps decode plainly. Once measured, the same
    model decides as before; without a catch-up nothing waits; and steps that go unmeasured (prefill
    rows) hold a catch-up back for MAX_CATCH_UP_WAITS steps at most."""
    from vllm_sparsever.adaptive.evict import MAX_CATCH_UP_WAITS, DraftCost, DraftShape

    profile = made_up_profile(0.002, base_s=0.05)
    rows, ctx = 8, [256] * 8
    shape = DraftShape(cap=3, budgets=(3,) * rows)
    prompts = rows * 100

    def evict_with(catch_up_s: float) -> Evict:
        evict = Evict(profile, guard=True, depth_prior=0.9, draft_cost=DraftCost(pass_share=0.1, prompt_share=0.3))
        evict.observe_catch_up(1000, 1000 * catch_up_s)  # measured (at one row, on an earlier request)
        return evict

    def runner_order(evict: Evict, plain_s: float, steps: int) -> list[int]:
        """Plan step n + 1, then report step n's time (a plain step taking `plain_s`), as the runner does."""
        depths = []
        for n in range(steps):
            depths.append(evict.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=48))
            if n and depths[-2] == 0:
                evict.observe_step([1] * rows, ctx, plain_s)
        return depths

    probe = evict_with(0.0)
    predicted = probe.cost([1] * rows, ctx, "chain")
    outlook = probe._outlook(ctx, shape, 0, [1.0] * rows, [0.0] * rows, [1] * rows)
    (pt, ps), (t, s) = outlook[0], outlook[probe._best(outlook)]
    # a catch-up that drafting pays back over 48 tokens at the profile's plain step, not at half of it
    catch_up_s = 0.75 * rows * 48 * (ps / pt - s / t) / prompts
    assert runner_order(evict_with(catch_up_s), predicted, 4) == [0, 0, 3, 3]
    fast = evict_with(catch_up_s)
    assert runner_order(fast, predicted / 2, 6) == [0] * 6
    assert fast.stats.plain_check_steps == 2 and fast.stats.catch_up_deferred_steps == 4
    # No catch-up (a drafter with its prompts already run): the one plain check, then drafting, with
    # no wait for the check's time.
    no_catch_up = evict_with(catch_up_s)
    assert [no_catch_up.plan_depth(ctx, shape, 0, prompt_tokens=0, horizon_tokens=48) for _ in range(2)] == [0, 3]
    # Steps never measured (every one mixing prefill rows): the catch-up waits MAX_CATCH_UP_WAITS steps.
    unmeasured = evict_with(catch_up_s)
    depths = [unmeasured.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=48)
              for _ in range(MAX_CATCH_UP_WAITS + 1)]
    assert depths[:MAX_CATCH_UP_WAITS] == [0] * MAX_CATCH_UP_WAITS and depths[-1] > 0
    # A plain step measured at one row stands in for nothing at 8 rows (another rows class).
    one_row = evict_with(catch_up_s)
    one_row.observe_step([1], [256], one_row.cost([1], [256], "chain"))
    assert one_row.plan_depth(ctx, shape, 0, prompt_tokens=prompts, horizon_tokens=48) == 0


def test_a_priced_catch_up_that_may_pay_back_is_bought_at_once_and_measured():
    """A long prompt the prefix cache supplied, whose draft K/V no request computed (an earlier short
    request over the same document never drafted), before any catch-up was measured: its price and
    the acceptance prior are estimates, so it is weighed at PRICE_OPTIMISM of its price and bought at
    once where that pays back before the request ends, not rented until the time forgone reaches the
    price (by then too few tokens are left to pay it back, so it was refused on every step). Measured,
    a catch-up is rented as before."""
    from vllm_sparsever.adaptive.evict import DraftCost, DraftShape

    profile = made_up_profile(0.002, base_s=0.05)
    shape, ctx = DraftShape(cap=3, budgets=(3,)), [8192]

    def priced() -> Evict:
        evict = Evict(profile, guard=True, depth_prior=0.9, draft_cost=DraftCost(pass_share=0.1, prompt_share=0.3))
        plain = evict.cost([1], ctx, "chain")
        evict.observe_step([1], ctx, plain)  # (its plain check)
        return evict

    evict = priced()
    outlook = evict._outlook(ctx, shape, 0, [1.0], [0.0], [1])
    best = evict._best(outlook)
    (pt, ps), (t, s) = outlook[0], outlook[best]
    saving = ps / pt - s / t
    price = evict.catch_up_s_per_token()
    # a catch-up whose full price 64 tokens of drafting cannot save, but half of it they can
    tokens = int(64 * saving / price * 1.5)
    assert 64 * saving < tokens * price and 64 * saving >= PRICE_OPTIMISM * tokens * price
    assert evict.plan_depth(ctx, shape, tokens, horizon_tokens=64) > 0
    assert evict.stats.catch_up_deferred_steps == 0
    # one that not even half its price pays back is refused
    assert priced().plan_depth(ctx, shape, 4 * tokens, horizon_tokens=64) == 0
    # once a catch-up was measured, a long one is rented first (rent or buy), as before
    measured = priced()
    measured.observe_catch_up(1000, 1000 * price)
    assert measured.plan_depth(ctx, shape, tokens, horizon_tokens=None) == 0
    assert measured.stats.catch_up_deferred_steps == 1


def _drafting_step(evict: Evict, rows: int, ctx: list[int], accepted: int, draft_s: float, verify_s: float) -> int:
    """One step as the runner drives EVICT: plan the next step (its drafting time measured), then the
    verify step of the drafts planned the step before, with `accepted` drafts accepted in all."""
    from vllm_sparsever.adaptive.evict import DraftShape

    depth = evict.plan_depth(ctx, DraftShape(cap=3, budgets=(3,) * rows))
    if depth:
        evict.observe_drafting(rows, [draft_s], draft_s)
    if evict._draft_s_step:  # drafts planned the step before: a verify step
        for i in range(rows):
            evict.observe_depth(1, 1 if i < accepted else 0)
        evict.observe_step([2] * rows, ctx, verify_s, "chain")
    else:
        evict.observe_step([1] * rows, ctx, evict.cost([1] * rows, ctx, "chain"), "chain")
    return depth


def test_guard_follows_realized_steps_where_the_model_says_drafting_pays():
    """The model's drafting step can miss (rows ending apart, acceptance below its calibration, Python
    around the passes): measured drafting steps that emit fewer tokens a second than measured plain
    steps at this batch size turn drafting off, whatever the model says; measured ones that emit more
    keep it on."""
    rows, ctx = 8, [256] * 8

    def optimistic() -> Evict:  # a model whose acceptance estimate stays at 0.9, whatever is accepted
        evict = _measured(Evict(made_up_profile(0.002, base_s=0.05), guard=True, depth_prior=0.9), 0.01, rows=rows)
        evict.depths.conditional = lambda depths: [0.9] * depths
        return evict

    # Verify steps as the profile says, but only 1 of 8 drafts accepted: 9 tokens a step against 8 in
    # a plain step that takes about half the time.
    evict = optimistic()
    depths = [_drafting_step(evict, rows, ctx, 1, 0.01, evict.cost([2] * rows, ctx, "chain")) for _ in range(12)]
    # (one drafting step measured before: one more makes the two steps that 8 rows need, REALIZED_MIN_STEPS
    # request-steps; the model alone would keep drafting)
    assert depths[0] and depths[1:] == [0] * 11, depths
    assert evict.stats.realized_skipped_steps == evict.stats.skipped_drafting_steps == 11
    # At one row it takes REALIZED_MIN_STEPS drafting steps.
    one = _measured(Evict(made_up_profile(0.002, base_s=0.05), guard=True, depth_prior=0.9), 0.01)
    one.depths.conditional = lambda depths: [0.9] * depths
    depths = [_drafting_step(one, 1, [256], 0, 0.01, one.cost([2], [256], "chain")) for _ in range(12)]
    assert all(depths[:7]) and depths[7:] == [0] * 5, depths
    # Every draft accepted: 16 tokens a step, more a second than plain: drafting stays on.
    good = optimistic()
    depths = [_drafting_step(good, rows, ctx, rows, 0.01, good.cost([2] * rows, ctx, "chain")) for _ in range(20)]
    assert all(depths) and good.stats.realized_skipped_steps == 0, depths


def test_a_steps_drafting_is_the_one_planned_the_step_before():
    """The runner drafts for the next step before it reports this step's time: EVICT charges each
    verify step the drafting planned in the step before it, and a catch-up not at all (a one-off)."""
    from vllm_sparsever.adaptive.evict import DraftShape, plain_check_key

    rows, ctx = 1, [256]
    evict = _measured(Evict(made_up_profile(0.002, base_s=0.05), guard=True, depth_prior=0.9), 0.01)
    shape = DraftShape(cap=3, budgets=(3,))
    evict._draft_s_next = 0.0  # (_measured's drafting was for a step it never ran)
    key = plain_check_key(ctx)
    (d_tokens, d_seconds, d_steps), (_, p_seconds, _) = evict._realized["draft"][key], evict._realized["plain"][key]
    evict.plan_depth(ctx, shape)
    evict.observe_drafting(rows, [0.01], 0.03)  # drafts for step 2
    evict.observe_step([1], ctx, 0.1, "chain")  # step 1: plain, nothing drafted for it
    evict.plan_depth(ctx, shape)
    evict.observe_catch_up(100, 5.0)  # a one-off, not the step's
    evict.observe_drafting(rows, [0.01], 0.02)  # drafts for step 3
    evict.observe_depth(1, 1)
    evict.observe_step([2], ctx, 0.2, "chain")  # step 2: its drafting, 0.03 s, was planned in step 1
    tokens, seconds, steps = evict._realized["draft"][key]
    assert tokens == pytest.approx(0.9 * d_tokens + 2) and steps == d_steps + 1
    assert seconds == pytest.approx(0.9 * d_seconds + 0.2 + 0.03)
    assert evict._realized["plain"][key][1] == pytest.approx(0.9 * p_seconds + 0.1)
