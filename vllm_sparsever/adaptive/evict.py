"""EVICT: how far to draft, and which drafts to verify, by what pays for its time.

Every decision maximises the step's expected emitted tokens per second, (rows + expected accepted
drafts) / (step time), over the whole batch, where the step time is the engine's time between
steps + drafting + verification:

1. depth, before drafting (`plan_depth`): the number of draft levels (chain: drafts; tree: levels)
   from 0 to the cap (`num_speculative_tokens` for chains, `tree.depth` for trees). A level's
   expected gain comes from the acceptance measured per depth (`DepthAcceptance`: the share of
   requests that got past depth d among those that got past d - 1); its cost from one measured
   draft pass plus the verify tokens it adds. Depth 0 is a plain decode step.
2. stop, after each draft pass (`keep_drafting`): the same comparison, from what this step's drafts
   already say: the probability that a request's accepted path reaches the newest level (the
   calibrated path probabilities of its newest nodes, summed), then the measured per-depth
   acceptance below it. Drafting stops when no further level raises the step's rate (the stopping
   rule of DEL / SpecDec++, on a calibrated path probability).
3. truncate, before verification (`truncate`): each node's probability of being accepted, from the
   drafter's path probability calibrated online against what verification accepted
   (`AcceptanceCalibration`), made non-increasing along every path; nodes are taken in order of
   benefit (a prefix-closed set at every size), and the size with the best rate wins. Drafting is
   spent by then but is part of the step, so it counts in the denominator.

Times (`StepClock`) are measured end to end on this engine, or predicted by the offline profile
(adaptive/cost.py) scaled to such measurements, so like is compared with like:
- a plain step and a verify step: the runner's measured step time (forward, sampling, bookkeeping).
  The profile gives the shape (tokens, rows, context, MoE experts); a running ratio measured /
  predicted per batch size and context band gives the level, one for plain steps and one for
  verify steps (each stands in for the other until it is measured). A profile taken on a quieter or
  noisier machine corrects itself within a few steps; one step counts as at most STEP_OUTLIER
  times the running ratio (a host hiccup is not a price);
- the engine's own time between steps (scheduling, outputs): measured, part of every step;
- one draft pass at this batch size, and a drafting step's cost besides its passes: measured
  (a step's median pass; a faster measurement replaces the running value at once, a slower one
  moves it by EMA: interference and first runs of a shape only add time, and a warm-up step taken
  for the steady cost would lock a cheap drafter out until its next probe);
- catch-up (a draft model's prompt, or the tokens it did not see while drafting was skipped) is a
  one-off: it is kept out of the pass time and priced in a probe's cost, in the rent-or-buy of a
  long catch-up (`_defer_catch_up`), and against what drafting can still save before the requests
  reach their max_tokens (`_pays_back`).
Before the first of these is measured, a drafter that knows its cost relative to the target
(`DraftCost`: a draft model's bytes and weights per token against the target's) prices a pass and a
catch-up token as that share of the profile's plain step and prompt token. The first decision is then
a priced one: a batch of new short requests is not made to pay every prompt's catch-up through the
draft before drafting was ever measured to pay. A drafter with no such estimate drafts to the cap
until its first pass is measured. A catch-up known only by its price is weighed optimistically (at
PRICE_OPTIMISM of it, and bought at once where it pays back, not rented first): the price and the
acceptance prior are estimates, and a catch-up refused on them would never be measured to correct
them (a prompt the prefix cache supplied whose draft K/V no request computed: refused on every step,
a long request decoded plainly where drafting would have paid from its first steps).

Guard (Cascade's worst case): when the best depth is 0 the step does not draft. Skipping, it probes
(drafts anyway, to refresh the acceptance measurements) once the plain decoding time skipped since
the last probe reaches 1/PROBE_BUDGET of the probe's expected extra cost (its extra step time and
the catch-up); probing then costs at most PROBE_BUDGET of the time spent skipping. It cannot lock
itself out on a wrong time: while it skips, plain steps are measured and the plain time follows
them. The converse holds too: while drafting pays, only verify steps are measured, and a plain
step's time read from them carries the profile's error wherever its grid did not reach (long
contexts); so the guard decodes one step plainly, to measure it, in a context band where no plain
step was measured, and again every PLAIN_CHECK_EVERY drafting steps there (per band and batch-size
class, 1, 2-3, 4-7, 8-15, ... rows: the profile's error is in how time grows with context and rows,
and a batch size measured plainly stands in for its neighbours, not for 8x as many rows). A catch-up
(new prompts included) is a one-off that cannot be taken back, so it is bought only against a plain
step measured in its band and rows class: until one is (the runner reports a step's time after
planning the next, so two steps; at most MAX_CATCH_UP_WAITS, as steps with prefill rows go
unmeasured), the step decodes plainly, counted as a plain check. The profile's cost of extra rows,
fitted over few shapes, can be several times the measured one, and a batch of new short requests
would then pay every prompt's catch-up for drafting that a measured plain step shows never pays.
Last, the model's drafting step can miss
what a measured one shows (a batch's rows ending apart, acceptance below its estimate, drafting's
Python): per batch-size class and context band the guard keeps the realized tokens per second of
drafting steps (their drafting, verification and the engine's gap; a catch-up left out, it is priced
above) and of plain steps, over about the last ten of each; once REALIZED_MIN_STEPS drafting steps
(fewer at several rows: REALIZED_MIN_STEPS request-steps, at least two steps) were measured there,
realized drafting slower than realized plain decoding skips drafting whatever the model says
(`realized_skipped_steps`), probes included. `adaptive.guard: false` always drafts at
least one level;
`adaptive.depth: "cap"` drafts to the cap (EVICT then only truncates, and the guard compares the cap
with plain decoding).
Depth probe: a depth below which drafting always stops is never verified, so its acceptance would
stay the depth above's forever, while acceptance given an accepted parent is often higher (drafts
agree in runs). While drafting pays at a depth d below the cap, a drafting step
drafts d + 1 levels (the stopping rule does not cut it short) every DEPTH_PROBE_EVERY drafting steps
while depth d + 1 has had fewer than DEPTH_PROBES probes and DEPTH_PROBE_TRIALS measurements, then
every PLAIN_CHECK_EVERY. A probe costs the rate difference the estimates predict between d and d + 1
on that step, and the measurement then decides the depth.

Chains are the one-branch case: an adaptive draft length per request.

Seeded sampled requests are drafted to the configured depth and verified whole (`evict_seeded_steps`):
their random draws per step follow their drafts' shape, and a shape chosen from measurements and
other requests would give the same seed another text (vLLM's fixed `num_speculative_tokens` keeps
a seed's text too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from vllm_sparsever.adaptive.cost import VerifyCostProfile
from vllm_sparsever.adaptive.experts import ExpertUnionModel
from vllm_sparsever.trees import DraftTree

BINS = 20  # path-probability bins over log10 in [-5, 0]
PRIOR = 8.0  # pseudo-observations at the drafter's own probability
PROBE_BUDGET = 0.05  # guard: probes cost at most this share of the plain decoding time skipped
FIRST_PROBE_SKIPS = 32  # guard: a probe with a catch-up whose cost was never measured
EMA = 0.3  # weight of the newest measurement in a running average
STEP_OUTLIER = 2.0  # a step's measured / predicted ratio counts as at most this many times the running one
DEPTH_PRIOR = 0.6  # acceptance of depth 1 before any is measured (deeper: the depth above's)
DEPTH_PRIOR_WEIGHT = 4.0  # pseudo-observations behind a depth's prior
DEPTH_DECAY = 0.995  # per observed request: older acceptance counts fade (prompts and load change)
MAX_GAP_S = 1.0  # engine time between steps above this is idle time, not per-step work
CATCH_UP_MIN_TOKENS = 16  # a roots' pass over fewer catch-up tokens is a draft pass like the others
PLAIN_CHECK_EVERY = 64  # guard: drafting steps between measured plain steps in a context band
DEPTH_PROBE_EVERY = 4  # depth probe: drafting steps between probes of a depth still unmeasured
DEPTH_PROBES = 24  # depth probe: probes of a depth at DEPTH_PROBE_EVERY; later ones at PLAIN_CHECK_EVERY
DEPTH_PROBE_TRIALS = 16  # depth probe: (decayed) measurements that make a depth measured
REALIZED_DECAY = 0.9  # guard: per step, older realized steps fade (a window of about ten steps)
REALIZED_MIN_STEPS = 8  # guard: drafting request-steps (steps x rows; at least 2 steps) measured before
# their realized rate may overrule the model
PREFILL_SLOPE_TOKENS = 256  # a prompt token's cost: the profile's slope from 1 to this many query tokens
PRICE_OPTIMISM = 0.5  # a catch-up only priced (never measured here) is weighed at this share of its price
MAX_CATCH_UP_WAITS = 4  # guard: plain steps a catch-up waits for a plain step measured in its band and rows class


class AcceptanceCalibration:
    """P(node accepted | drafter path probability), per log-probability bin."""

    def __init__(self) -> None:
        self.accepted = np.zeros(BINS)
        self.verified = np.zeros(BINS)

    @staticmethod
    def _bin(score: float) -> int:
        x = math.log10(max(score, 1e-12))
        return min(BINS - 1, max(0, int((x + 5.0) / 5.0 * BINS)))

    def estimate(self, score: float, prior: float | None = None) -> float:
        """Observed acceptance in the score's bin, behind PRIOR pseudo-observations at `prior` (the
        score itself by default)."""
        b = self._bin(score)
        prior = score if prior is None else prior
        return float((self.accepted[b] + PRIOR * prior) / (self.verified[b] + PRIOR))

    def observe(self, tree: DraftTree, verified: int, accepted_nodes: list[int]) -> None:
        """The first `verified` nodes of `tree` were verified; `accepted_nodes` were accepted."""
        accepted = set(accepted_nodes)
        for n in range(min(verified, len(tree))):
            b = self._bin(tree.scores[n])
            self.verified[b] += 1
            self.accepted[b] += n in accepted


class DepthAcceptance:
    """Per depth d: the share of verified requests whose accepted path reached depth d among those
    that reached d - 1 (and had depth d verified). A depth never measured inherits the estimate of
    the depth above it; depth 1's prior is `first_prior`."""

    def __init__(self, first_prior: float = DEPTH_PRIOR) -> None:
        self.first_prior = first_prior
        self.trials: list[float] = []
        self.hits: list[float] = []

    def observe(self, verified_depth: int, accepted_depth: int) -> None:
        self.trials = [t * DEPTH_DECAY for t in self.trials]
        self.hits = [h * DEPTH_DECAY for h in self.hits]
        for d in range(1, verified_depth + 1):
            if accepted_depth < d - 1:
                break
            while len(self.trials) < d:
                self.trials.append(0.0)
                self.hits.append(0.0)
            self.trials[d - 1] += 1
            self.hits[d - 1] += accepted_depth >= d

    def trials_at(self, depth: int) -> float:
        """The (decayed) number of requests whose depth `depth` was verified after reaching depth - 1."""
        return self.trials[depth - 1] if 0 < depth <= len(self.trials) else 0.0

    def conditional(self, depths: int) -> list[float]:
        """Estimated P(reach d | reach d - 1) for d = 1..depths."""
        out, prior = [], self.first_prior
        for d in range(depths):
            t = self.trials[d] if d < len(self.trials) else 0.0
            h = self.hits[d] if d < len(self.hits) else 0.0
            prior = (h + DEPTH_PRIOR_WEIGHT * prior) / (t + DEPTH_PRIOR_WEIGHT)
            out.append(prior)
        return out


def _ema(table: dict, key: Any, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else EMA * value + (1 - EMA) * old


def _fast_down(old: float | None, value: float) -> float:
    """A running time that follows a faster measurement at once (the module docstring: drafting)."""
    return value if old is None or value < old else EMA * value + (1 - EMA) * old


def context_band(contexts: list[int]) -> int:
    """Context bands for the verify-time ratio: <512, <1K, <2K, ... tokens per row (mean)."""
    mean = sum(contexts) / max(len(contexts), 1)
    return max(0, int(math.log2(max(mean, 1.0) / 256.0)))


def plain_check_key(contexts: list[int]) -> tuple[int, int]:
    """Where a measured plain step stands in for others: its rows class (1, 2-3, 4-7, ... rows) and
    context band."""
    return len(contexts).bit_length(), context_band(contexts)


@dataclass(frozen=True)
class DraftCost:
    """What a drafter costs relative to the target, before anything was measured: `pass_share`, one
    draft pass's bytes read against a plain target step's (weights: a decode pass is bound by them);
    `prompt_share`, a catch-up token's work against a target prompt token's (parameters: a prompt
    pass is bound by compute)."""

    pass_share: float
    prompt_share: float

    def __post_init__(self) -> None:
        if not (self.pass_share >= 0 and self.prompt_share >= 0):
            raise ValueError(f"DraftCost: shares must be >= 0, got {self.pass_share}, {self.prompt_share}")


class StepClock:
    """This engine's step times, measured end to end (see the module docstring)."""

    def __init__(self) -> None:
        self.ratio: dict[str, dict[tuple[int, int], float]] = {"plain": {}, "verify": {}}
        self.gap_s: float | None = None  # the engine's time between steps
        self.pass_s: dict[int, float] = {}  # rows -> one draft pass
        self.fixed_s: dict[int, float] = {}  # rows -> a drafting step's time besides its passes
        self.catch_up_s_per_token: float | None = None

    def observe_ratio(self, kind: str, rows: int, contexts: list[int], measured_s: float, predicted_s: float) -> None:
        """A step's measured / predicted time into its kind's running ratio. A step slower than
        STEP_OUTLIER times the running ratio counts as that: one host hiccup (a verify step taking
        seconds) would otherwise price verification so high that plain steps win until probes,
        rare while skipping, re-measure it; a lasting slowdown is still followed, at EMA's pace."""
        if measured_s > 0 and predicted_s > 0:
            key = (rows, context_band(contexts))
            old = self.ratio[kind].get(key)
            ratio = measured_s / predicted_s if old is None else min(measured_s / predicted_s, STEP_OUTLIER * old)
            _ema(self.ratio[kind], key, ratio)

    def observe_gap(self, seconds: float) -> None:
        if 0.0 <= seconds <= MAX_GAP_S:
            self.gap_s = seconds if self.gap_s is None else EMA * seconds + (1 - EMA) * self.gap_s

    def observe_drafting(self, rows: int, pass_times: list[float], total_s: float) -> None:
        """A drafting step at `rows` rows: its steady passes' times and the whole step's drafting time
        (passes, catch-up, Python around them)."""
        if pass_times:
            self.pass_s[rows] = _fast_down(self.pass_s.get(rows), float(np.median(pass_times)))
            self.fixed_s[rows] = _fast_down(self.fixed_s.get(rows), max(total_s - sum(pass_times), 0.0))

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens >= CATCH_UP_MIN_TOKENS:
            self.catch_up_s_per_token = _fast_down(self.catch_up_s_per_token, seconds / tokens)

    def scale(self, kind: str, rows: int, contexts: list[int]) -> float:
        """Measured / predicted for a step of this kind and shape: its own, else the nearest measured
        batch size and band, else the other kind's; 1 before any step was measured."""
        band = context_band(contexts)
        for table in (self.ratio[kind], self.ratio["verify" if kind == "plain" else "plain"]):
            if (rows, band) in table:
                return table[(rows, band)]
            if table:
                key = min(table, key=lambda k: (abs(k[0] - rows), abs(k[1] - band), k))
                return table[key]
        return 1.0

    @property
    def measured(self) -> bool:
        """A draft pass and a decode step (plain or verify) were measured."""
        return bool(self.pass_s) and bool(self.ratio["plain"] or self.ratio["verify"])

    def summary(self) -> dict[str, float]:
        """What the clock measured (the latest values; ratios: measured / the profile's prediction, at
        one row where measured, else the mean)."""
        out: dict[str, float] = {}
        for kind, table in self.ratio.items():
            ones = [v for (rows, _), v in table.items() if rows == 1] or list(table.values())
            if ones:
                out[f"evict_clock_{kind}_ratio"] = sum(ones) / len(ones)
        if self.gap_s is not None:
            out["evict_clock_gap_s"] = self.gap_s
        if self.catch_up_s_per_token is not None:
            out["evict_clock_catch_up_s_per_token"] = self.catch_up_s_per_token
        for rows, v in self.pass_s.items():
            out[f"evict_clock_pass_s_rows{rows}"] = v
            out[f"evict_clock_fixed_s_rows{rows}"] = self.fixed_s.get(rows, 0.0)
        return out

    def draft_s(self, rows: int, passes: int) -> float | None:
        """Drafting time of `passes` passes at `rows` rows (nearest measured batch size; the draft's
        passes are weight-bound at small batches); None before any drafting step was measured."""
        if passes <= 0:
            return 0.0
        if not self.pass_s:
            return None
        near = rows if rows in self.pass_s else min(self.pass_s, key=lambda r: (abs(r - rows), r))
        return self.fixed_s.get(near, 0.0) + passes * self.pass_s[near]


@dataclass
class EvictStats:
    steps: int = 0
    nodes_drafted: int = 0
    nodes_kept: int = 0
    truncated_steps: int = 0  # steps where some nodes were cut
    empty_steps: int = 0  # steps verified with no drafts at all (speculation did not pay)
    skipped_drafting_steps: int = 0  # steps the guard skipped drafting in
    probe_steps: int = 0  # steps the guard drafted in although drafting did not pay, to re-measure
    plain_check_steps: int = 0  # steps the guard decoded plainly although drafting paid, to measure a plain step
    catch_up_deferred_steps: int = 0  # steps decoded plainly although drafting paid, its catch-up not yet earned
    realized_skipped_steps: int = 0  # steps the model said drafting pays and measured steps said not (skipped or probed)
    depth_probe_steps: int = 0  # steps drafted one level deeper than planned, to measure that depth
    stopped_early_steps: int = 0  # drafting steps stopped before the planned depth (stopping rule)
    seeded_steps: int = 0  # steps with a seeded sampled request: drafted to the configured depth
    expected_tokens: float = 0.0  # sum over steps of the chosen expected emitted tokens
    predicted_verify_s: float = 0.0  # sum of the chosen predicted verify times (scaled)
    planned_depths: dict[int, int] = field(default_factory=dict)  # depth planned before drafting -> steps
    drafted_depths: dict[int, int] = field(default_factory=dict)  # levels actually drafted -> steps

    def summary(self) -> dict[str, Any]:
        out = {
            "evict_steps": self.steps,
            "evict_nodes_drafted": self.nodes_drafted,
            "evict_nodes_kept": self.nodes_kept,
            "evict_truncated_steps": self.truncated_steps,
            "evict_empty_steps": self.empty_steps,
            "evict_skipped_drafting_steps": self.skipped_drafting_steps,
            "evict_probe_steps": self.probe_steps,
            "evict_plain_check_steps": self.plain_check_steps,
            "evict_catch_up_deferred_steps": self.catch_up_deferred_steps,
            "evict_realized_skipped_steps": self.realized_skipped_steps,
            "evict_depth_probe_steps": self.depth_probe_steps,
            "evict_stopped_early_steps": self.stopped_early_steps,
            "evict_seeded_steps": self.seeded_steps,
            "evict_expected_tokens": self.expected_tokens,
            "evict_predicted_verify_s": self.predicted_verify_s,
        }
        for d, n in sorted(self.planned_depths.items()):
            out[f"evict_planned_depth_{d}"] = n
        for d, n in sorted(self.drafted_depths.items()):
            out[f"evict_drafted_depth_{d}"] = n
        return out


@dataclass(frozen=True)
class DraftShape:
    """How a step's drafts grow: `cap` levels at most, `first` nodes per request at the first level
    and `later` at each later one, at most `budgets[i]` nodes for request i; `mask`: "chain" or
    "tree" (how the target verifies them); `one_pass`: one drafter pass gives every level (n-gram
    lookup), else one pass per level."""

    cap: int
    budgets: tuple[int, ...]
    first: int = 1
    later: int = 1
    mask: str = "chain"
    one_pass: bool = False

    def passes(self, levels: int) -> int:
        return min(levels, 1) if self.one_pass else levels


class Evict:
    def __init__(self, profile: VerifyCostProfile, *, min_draft_tokens: int = 0, guard: bool = True,
                 depth: str = "auto", depth_prior: float = DEPTH_PRIOR, draft_cost: DraftCost | None = None) -> None:
        self.profile = profile
        self.draft_cost = draft_cost  # prices drafting before it is measured (module docstring)
        self.min_draft_tokens = min_draft_tokens
        self.guard = guard
        self.depth_mode = depth
        self.calibration = AcceptanceCalibration()
        self.depths = DepthAcceptance(depth_prior)
        self.clock = StepClock()
        self.stats = EvictStats()
        # MoE targets: distinct experts per request's tokens (fed by the target's expert counter).
        self.experts = ExpertUnionModel(*profile.moe) if profile.moe else None
        self._skipped_s: dict[int, float] = {}  # guard, per batch size: plain time skipped since the last probe
        self._catch_up_forgone_s = 0.0  # guard: time drafting would have saved while a catch-up was deferred
        self._skips: dict[int, int] = {}
        self._since_plain: dict[tuple[int, int], int] = {}  # guard: drafting steps since a plain step, per (rows class, band)
        self._plain_measured: set[tuple[int, int]] = set()  # guard: (rows class, band) with a measured plain step
        self._catch_up_waits: dict[tuple[int, int], int] = {}  # guard: plain steps a catch-up waited for one there
        self._since_depth_probe = 0  # depth probe: drafting steps since the last one
        self._depth_probes: dict[int, int] = {}  # depth probe: probes made per depth
        self._forced_levels = 0  # levels this step drafts whatever the stopping rule says (a depth probe)
        # guard: realized (tokens, seconds, steps) per kind ("draft", "plain") and plain_check_key, decayed;
        # a step's drafting ran during the step before it, and its acceptance is seen before its time
        self._realized: dict[str, dict[tuple[int, int], list[float]]] = {"draft": {}, "plain": {}}
        self._draft_s_next = 0.0  # steady drafting for the next step (catch-ups are one-offs, left out)
        self._draft_s_step = 0.0  # drafting for the step being measured
        self._accepted_step = 0  # drafts accepted in the step being measured

    # ---- costs ------------------------------------------------------------------------------

    def cost(self, query_tokens: list[int], contexts: list[int], mask: str = "tree") -> float:
        """The profile's seconds for a verify forward with these rows (query tokens incl. the root)."""
        experts = None
        if self.experts is not None:  # union over rows routing independently of each other
            experts = 1.0 - math.prod(1.0 - self.experts.fraction(q) for q in query_tokens)
        return self.profile.predict(query_tokens, contexts, mask, experts)

    def step_s(self, query_tokens: list[int], contexts: list[int], mask: str = "tree") -> float:
        """Expected seconds of a step with these rows on this engine, drafting excluded: the engine's
        time between steps + the step, the profile scaled to measured steps."""
        plain = all(q == 1 for q in query_tokens)
        kind, mask = ("plain", "chain") if plain else ("verify", mask)
        seconds = self.clock.scale(kind, len(query_tokens), contexts) * self.cost(query_tokens, contexts, mask)
        return seconds + (self.clock.gap_s or 0.0)

    def draft_s(self, contexts: list[int], passes: int) -> float | None:
        """Drafting time of `passes` passes over these rows: measured (`StepClock.draft_s`), else the
        drafter's `DraftCost` share of a plain step here; None with neither."""
        measured = self.clock.draft_s(len(contexts), passes)
        if measured is not None or self.draft_cost is None:
            return measured
        plain = self.clock.scale("plain", len(contexts), contexts) * self.cost([1] * len(contexts), contexts, "chain")
        return passes * self.draft_cost.pass_share * plain

    def catch_up_s_per_token(self) -> float | None:
        """One catch-up token's drafting time: measured, else the drafter's `DraftCost` share of a
        target prompt token (the profile's slope over query tokens); None with neither."""
        measured = self.clock.catch_up_s_per_token
        if measured is not None or self.draft_cost is None:
            return measured
        n = PREFILL_SLOPE_TOKENS
        slope = (self.cost([n], [0], "chain") - self.cost([1], [0], "chain")) / (n - 1)
        return self.draft_cost.prompt_share * self.clock.scale("plain", 1, [0]) * max(slope, 0.0)

    def observe_step(self, query_tokens: list[int], contexts: list[int], seconds: float, mask: str = "chain",
                     gap_s: float | None = None) -> None:
        """The runner measured a decode step (no prefill rows): `query_tokens[i]` tokens (1 + drafts)
        for row i after `contexts[i]` tokens took `seconds`; the engine spent `gap_s` before it."""
        if not query_tokens:
            return
        plain = all(q == 1 for q in query_tokens)
        kind, mask = ("plain", "chain") if plain else ("verify", mask)
        self.clock.observe_ratio(kind, len(query_tokens), contexts, seconds, self.cost(query_tokens, contexts, mask))
        if plain:
            self._since_plain[plain_check_key(contexts)] = 0
            self._plain_measured.add(plain_check_key(contexts))
        if gap_s is not None:
            self.clock.observe_gap(gap_s)
        # Realized: what the step emitted per second, its drafting and the engine's gap included.
        drafted = not plain or self._draft_s_step > 0
        seconds += self._draft_s_step + (gap_s if gap_s is not None and gap_s <= MAX_GAP_S else 0.0)
        table = self._realized["draft" if drafted else "plain"]
        tokens, total, steps = table.get(plain_check_key(contexts), (0.0, 0.0, 0))
        table[plain_check_key(contexts)] = [REALIZED_DECAY * tokens + len(query_tokens) + self._accepted_step,
                                            REALIZED_DECAY * total + seconds, steps + 1]
        self._draft_s_step, self._accepted_step = 0.0, 0

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A drafter's catch-up pass over `tokens` tokens took `seconds` (for the probe's cost)."""
        self.clock.observe_catch_up(tokens, seconds)

    def observe_drafting(self, rows: int, pass_times: list[float], total_s: float) -> None:
        """A drafting step's passes and its whole drafting time, catch-up left out (for the next step)."""
        self.clock.observe_drafting(rows, pass_times, total_s)
        self._draft_s_next += total_s

    def observe_depth(self, verified_depth: int, accepted_depth: int) -> None:
        """A request's drafts verified to `verified_depth`, accepted to `accepted_depth`."""
        self.depths.observe(verified_depth, accepted_depth)
        self._accepted_step += accepted_depth

    def _next_step(self) -> None:
        """Planning the next step: the drafting measured so far belongs to the step now running."""
        self._draft_s_step, self._draft_s_next = self._draft_s_next, 0.0

    def _realized_loses(self, contexts: list[int]) -> bool:
        """Guard: whether this engine's measured drafting steps emitted fewer tokens per second than its
        measured plain steps, at this batch-size class and context band (the model's estimate of a
        drafting step can miss: a batch's rows ending apart, acceptance below its calibration, Python
        around the passes). Needs REALIZED_MIN_STEPS drafting request-steps (at least two steps) and a
        plain step measured there."""
        key = plain_check_key(contexts)
        draft, plain = self._realized["draft"].get(key), self._realized["plain"].get(key)
        if not draft or not plain or draft[2] < max(2, math.ceil(REALIZED_MIN_STEPS / len(contexts))):
            return False
        return draft[0] / draft[1] < plain[0] / plain[1]

    # ---- depth: before and while drafting ----------------------------------------------------

    def _outlook(self, contexts: list[int], shape: DraftShape, passes: int, reach: list[float],
                 gains: list[float], tokens: list[int]) -> list[tuple[float, float]] | None:
        """(expected emitted tokens, expected seconds) of the step if drafting went e = 0, 1, ... more
        levels (up to the cap), after `passes` levels drafted with `tokens[i]` query tokens (1 +
        nodes), an expected `gains[i]` accepted drafts and a probability `reach[i]` of reaching the
        newest level; None before a draft pass and a decode step were measured (the profile's
        level is then unknown on this engine), unless the drafter's `DraftCost` prices it."""
        rows = len(contexts)
        if not self.clock.measured and self.draft_cost is None:
            return None
        alphas = self.depths.conditional(shape.cap)
        reach, tokens = list(reach), list(tokens)
        gain = sum(gains)
        out = []
        for e in range(shape.cap - passes + 1):
            level = passes + e  # levels drafted
            if e:
                width = shape.first if level == 1 else shape.later
                for i in range(rows):
                    if tokens[i] - 1 < shape.budgets[i]:
                        reach[i] *= alphas[level - 1]
                        gain += reach[i]
                        tokens[i] = min(tokens[i] + width, shape.budgets[i] + 1)
            draft_s = self.draft_s(contexts, shape.passes(level))
            if draft_s is None:
                return None
            out.append((rows + gain, draft_s + self.step_s(tokens if level else [1] * rows, contexts, shape.mask)))
        return out

    @staticmethod
    def _best(outlook: list[tuple[float, float]], floor: int = 0) -> int:
        """The number of further levels with the best rate (the fewest on a tie)."""
        return max(range(floor, len(outlook)), key=lambda e: (outlook[e][0] / outlook[e][1], -e))

    def plan_depth(self, contexts: list[int], shape: DraftShape, catch_up_tokens: int = 0, *,
                   prompt_tokens: int = 0, horizon_tokens: int | None = None) -> int:
        """Levels to draft this step, 0 to skip drafting (the module docstring's decision 1 and the
        guard). `contexts[i]`: request i's tokens before its root; the drafter has `catch_up_tokens`
        tokens to catch up on before it drafts, besides `prompt_tokens` of new prompts (rented
        with their prompt, not deferred); `horizon_tokens`: the most output tokens any of the
        step's requests may still emit (their max_tokens; None: unbounded)."""
        rows = len(contexts)
        self._forced_levels = 0
        self._next_step()
        if not rows or shape.cap <= 0:
            return 0
        outlook = self._outlook(contexts, shape, 0, [1.0] * rows, [0.0] * rows, [1] * rows)
        if outlook is None:  # the first drafting steps: nothing measured or priced yet
            return self._planned(shape.cap)
        floor = 1 if (not self.guard or self.min_draft_tokens) else 0
        if self.depth_mode == "cap":
            rate = [tokens / seconds for tokens, seconds in outlook]
            best = shape.cap if (floor or rate[shape.cap] >= rate[0]) else 0
        else:
            best = self._best(outlook, floor)
        if best and not floor and self._realized_loses(contexts):
            self.stats.realized_skipped_steps += 1
            best = 0
        if best and not floor and self._catch_up_waits_for_plain(contexts, catch_up_tokens + prompt_tokens):
            self.stats.plain_check_steps += 1
            return self._planned(0)
        if best and self.min_draft_tokens and shape.mask == "chain":
            best = max(best, min(self.min_draft_tokens, shape.cap))
        if best and not floor and (self._defer_catch_up(outlook, best, catch_up_tokens) or not self._pays_back(
                outlook, best, rows, catch_up_tokens + prompt_tokens, horizon_tokens)):
            self.stats.catch_up_deferred_steps += 1
            return self._planned(0)
        if best:
            self._skipped_s[rows], self._skips[rows] = 0.0, 0
            if not floor and self._plain_check_due(contexts):
                self.stats.plain_check_steps += 1
                return self._planned(0)
            if self.depth_mode != "cap" and self._depth_probe_due(best, shape.cap):
                self.stats.depth_probe_steps += 1
                self._forced_levels = best + 1
                return self._planned(best + 1)
            return self._planned(best)
        # Skipping: probe once the plain time skipped pays for the probe PROBE_BUDGET-fold.
        plain_s = outlook[0][1]
        probe = self._best(outlook, 1)
        skipped_s = self._skipped_s.get(rows, 0.0) + plain_s
        skips = self._skips.get(rows, 0) + 1
        catch_up_s = self.catch_up_s_per_token()
        if catch_up_tokens and catch_up_s is None:
            probing = skips >= FIRST_PROBE_SKIPS
        else:
            extra_s = max(outlook[probe][1] - plain_s, 0.0) + catch_up_tokens * (catch_up_s or 0.0)
            probing = PROBE_BUDGET * skipped_s >= extra_s
        if probing:
            self._skipped_s[rows], self._skips[rows] = 0.0, 0
            self.stats.probe_steps += 1
            return self._planned(probe)
        self._skipped_s[rows], self._skips[rows] = skipped_s, skips
        self.stats.skipped_drafting_steps += 1
        return self._planned(0)

    def plan_seeded(self, depth: int) -> int:
        """The depth of a step with a seeded sampled request: `depth`, the configured one (module
        docstring)."""
        self._forced_levels = 0
        self._next_step()
        self.stats.seeded_steps += 1
        return self._planned(depth)

    def _defer_catch_up(self, outlook: list[tuple[float, float]], best: int, catch_up_tokens: int) -> bool:
        """Guard, while drafting pays per step but the drafter must first catch up on many tokens (a
        new long request's prompt, prefix-cached for the target but never run through the draft):
        rent or buy. Decode plainly while the time drafting would have saved so far is below the
        catch-up's measured cost, then draft: at most twice the better choice in hindsight, however
        long the request turns out to be. A catch-up never measured here is not deferred (it gets
        measured; only priced, it is weighed by `_pays_back`: the module docstring).
        (A catch-up riding with a prompt the target has just computed never reaches here:
        drafting.evict_proposer.EvictProposer._catch_up_to_plan.)"""
        per_token_s = self.clock.catch_up_s_per_token
        if catch_up_tokens < CATCH_UP_MIN_TOKENS or per_token_s is None:
            self._catch_up_forgone_s = 0.0
            return False
        (plain_tokens, plain_s), (tokens, seconds) = outlook[0], outlook[best]
        self._catch_up_forgone_s += max(plain_s - plain_tokens * seconds / tokens, 0.0)
        if self._catch_up_forgone_s >= catch_up_tokens * per_token_s:
            self._catch_up_forgone_s = 0.0
            return False
        return True

    def _pays_back(self, outlook: list[tuple[float, float]], best: int, rows: int, catch_up_tokens: int,
                   horizon_tokens: int | None) -> bool:
        """Guard: whether drafting can save its catch-up's cost before the step's requests end. At
        most `horizon_tokens` more tokens per request are emitted, so drafting saves at most
        rows * horizon_tokens * (plain seconds per token - drafting seconds per token); a catch-up
        that costs more (new short requests at a high batch size, where drafting saves little a
        step) is never paid back, and the step decodes plainly. Unbounded or unpriced: it pays. Only
        priced: at PRICE_OPTIMISM of its price (the module docstring)."""
        per_token_s = self.catch_up_s_per_token()
        if catch_up_tokens < CATCH_UP_MIN_TOKENS or horizon_tokens is None or per_token_s is None:
            return True
        if self.clock.catch_up_s_per_token is None:
            per_token_s *= PRICE_OPTIMISM
        (plain_tokens, plain_s), (tokens, seconds) = outlook[0], outlook[best]
        saving_per_token = plain_s / plain_tokens - seconds / tokens
        return rows * max(horizon_tokens, 0) * saving_per_token >= catch_up_tokens * per_token_s

    def _catch_up_waits_for_plain(self, contexts: list[int], tokens: int) -> bool:
        """Guard: whether a catch-up of `tokens` (new prompts included) waits, the step decoding
        plainly, for a plain step measured in this band and rows class (module docstring)."""
        key = plain_check_key(contexts)
        if tokens < CATCH_UP_MIN_TOKENS or key in self._plain_measured:
            return False
        waits = self._catch_up_waits.get(key, 0)
        if waits >= MAX_CATCH_UP_WAITS:
            return False
        self._catch_up_waits[key] = waits + 1
        self._since_plain[key] = 0  # a plain check
        return True

    def _plain_check_due(self, contexts: list[int]) -> bool:
        """Guard, while drafting pays: whether to decode this step plainly to measure a plain step in
        this context band and rows class (none measured there, or PLAIN_CHECK_EVERY drafting steps ago;
        module docstring)."""
        key = plain_check_key(contexts)
        since = self._since_plain.get(key)
        due = since is None or since >= PLAIN_CHECK_EVERY
        self._since_plain[key] = 0 if due else since + 1  # (a check whose step mixed in a prefill waits too)
        return due

    def _depth_probe_due(self, best: int, cap: int) -> bool:
        """Whether this drafting step, planned `best` levels deep, drafts one more to measure it (the
        module docstring's depth probe)."""
        if best >= cap:
            return False
        depth = best + 1
        unmeasured = (self._depth_probes.get(depth, 0) < DEPTH_PROBES
                      and self.depths.trials_at(depth) < DEPTH_PROBE_TRIALS)
        self._since_depth_probe += 1
        if self._since_depth_probe < (DEPTH_PROBE_EVERY if unmeasured else PLAIN_CHECK_EVERY):
            return False
        self._since_depth_probe = 0
        self._depth_probes[depth] = self._depth_probes.get(depth, 0) + 1
        return True

    def _planned(self, levels: int) -> int:
        self.stats.planned_depths[levels] = self.stats.planned_depths.get(levels, 0) + 1
        return levels

    def keep_drafting(self, contexts: list[int], shape: DraftShape, passes: int, trees: list[DraftTree],
                      frontiers: list[list[int]]) -> bool:
        """After `passes` draft levels: whether one more level may raise the step's rate (decision 2).
        `trees[i]`: request i's nodes so far; `frontiers[i]`: the nodes the next level would expand
        (empty: request i is done)."""
        if self.depth_mode == "cap" or passes >= shape.cap:
            return passes < shape.cap
        if passes < self._forced_levels:  # a depth probe
            return True
        if self.min_draft_tokens and shape.mask == "chain" and passes < min(self.min_draft_tokens, shape.cap):
            return True
        reach, gains, tokens, budgets = [], [], [], []
        for tree, frontier, budget in zip(trees, frontiers, shape.budgets, strict=True):
            benefits = self.benefits(tree)
            reach.append(min(1.0, sum(benefits[n] for n in frontier)) if frontier else 0.0)
            gains.append(sum(sorted(benefits, reverse=True)[:budget]))
            tokens.append(1 + min(len(tree), budget))
            budgets.append(budget if frontier else min(len(tree), budget))  # a finished request grows no more
        outlook = self._outlook(contexts, replace(shape, budgets=tuple(budgets)), passes, reach, gains, tokens)
        return outlook is None or self._best(outlook) > 0

    # ---- truncation: before verification -----------------------------------------------------

    def benefits(self, tree: DraftTree) -> list[float]:
        """Each node's estimated probability of being accepted: its score's calibrated acceptance, behind
        a prior that is the larger of the score and the measured chance of reaching its depth (an
        optimistic prior gets a bin verified and so measured; a pessimistic one would keep a drafter
        whose probabilities say little, e.g. an overconfident or flat one, from ever being tried)."""
        depths = tree.node_depths()
        reach = np.cumprod(self.depths.conditional(max(depths, default=0))).tolist()
        out: list[float] = []
        for n, p in enumerate(tree.parents):
            score = tree.scores[n]
            a = self.calibration.estimate(score, max(score, reach[depths[n] - 1]))
            out.append(min(a, out[p]) if p >= 0 else a)
        return out

    def truncate(self, trees: list[DraftTree], contexts: list[int], draft_time_s: float = 0.0,
                 mask: str = "tree", whole: list[bool] | None = None) -> list[DraftTree]:
        """The step's trees cut to the batch-wide best size (module docstring, decision 3).
        `contexts[i]`: the tokens in request i's KV cache before this step's verification;
        `whole[i]`: request i's tree is kept uncut (a seeded sampled request)."""
        self.stats.steps += 1
        candidates = []  # (-benefit, request, node): benefit order, parents first on ties
        for i, tree in enumerate(trees):
            for n, a in enumerate(self.benefits(tree)):
                candidates.append((-a, n, i))
        candidates.sort()
        rows = len(trees)
        tokens = [1] * rows
        forced = [len(t) if whole and whole[i] else min(self.min_draft_tokens, len(t)) for i, t in enumerate(trees)]
        chosen: list[list[int]] = [[] for _ in trees]
        # Nodes every request must keep (min_draft_tokens): its most beneficial prefix-closed ones.
        gain = 0.0
        rest = []
        for neg_a, n, i in candidates:
            if len(chosen[i]) < forced[i]:
                chosen[i].append(n)
                tokens[i] += 1
                gain += -neg_a
            else:
                rest.append((neg_a, n, i))
        best_cost = self.step_s(tokens, contexts, mask)
        best_rate = (rows + gain) / (best_cost + draft_time_s)
        best_k, k_gain, trial = 0, gain, list(tokens)
        for k, (neg_a, n, i) in enumerate(rest, start=1):
            trial[i] += 1
            k_gain += -neg_a
            cost = self.step_s(trial, contexts, mask)
            rate = (rows + k_gain) / (cost + draft_time_s)
            if rate > best_rate:
                best_rate, best_k, best_cost = rate, k, cost
        for neg_a, n, i in rest[:best_k]:
            chosen[i].append(n)
            gain += -neg_a
        out = [tree.subtree(sorted(keep)) for tree, keep in zip(trees, chosen, strict=True)]
        kept = sum(len(t) for t in out)
        drafted = sum(len(t) for t in trees)
        self.stats.nodes_drafted += drafted
        self.stats.nodes_kept += kept
        self.stats.truncated_steps += kept < drafted
        self.stats.empty_steps += kept == 0 and drafted > 0
        self.stats.expected_tokens += rows + gain
        self.stats.predicted_verify_s += best_cost
        return out
