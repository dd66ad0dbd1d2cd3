"""EVICT: truncate the step's draft trees to what pays for its verification.

Per step, before verification, over the whole batch:
- benefit: each node's probability of being accepted, estimated from the drafter's path
  probability and calibrated online against what verification accepted (`AcceptanceCalibration`:
  acceptance frequency per path-probability bin, starting from the path probability itself), made
  non-increasing along every path (a node is never accepted without its parent);
- cost: the verify step's time from the offline profile (adaptive/cost.py), as a function of every
  row's tokens and context: batch-aware, since a bigger step turns compute-bound sooner; on MoE
  targets also of the routed experts the step reads, predicted per row from its token count by the
  expert-union model the target's verify steps calibrate (adaptive/experts.py; rows route
  independently of each other, a row's tree nodes share experts);
- decision: nodes are taken in order of benefit (a prefix-closed set at every size), and the size
  that maximises expected emitted tokens per second of the step, (rows + sum of benefits) /
  (drafting time + verification cost), wins. The drafting time is already spent, but it is part of
  the step a node's verification makes longer: counting only verification would cut nodes whose
  cost is small next to the whole step. Size 0 (no drafts: a plain decode step) is one of the
  candidates, so a step is never verified at an expected loss.
- guard (Cascade's worst case), before drafting: per batch size (rows in the step), it keeps running
  averages of the drafting time, the expected gain per row, the tokens per row and the verification
  time of the truncations it chose; a step whose expected tokens per second with drafting,
  rows * (1 + gain) / (drafting + verification), falls below plain decoding's,
  rows / cost(one token per row), does not draft at all. A batch size never seen inherits the
  nearest seen one's averages (gain per row as it is, drafting time scaled by rows, verification
  from the profile); only the very first drafting step is taken blind. Skipping, it probes (drafts
  once anyway, to refresh its averages: acceptance and load change) when the plain decoding time
  skipped since the last probe reaches 1/PROBE_BUDGET of what the probe is expected to cost over a
  plain step: the drafting step's extra time plus the drafter's catch-up over the tokens it has not
  seen (a draft model's K/V falls behind while it skips; the catch-up time per token is measured).
  Probing then costs at most PROBE_BUDGET of the time spent skipping.

Chains are the one-branch case: an adaptive draft length per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_sparsever.adaptive.cost import VerifyCostProfile
from vllm_sparsever.adaptive.experts import ExpertUnionModel
from vllm_sparsever.drafting.tree import DraftTree

BINS = 20  # path-probability bins over log10 in [-5, 0]
PRIOR = 8.0  # pseudo-observations at the drafter's own probability
PROBE_BUDGET = 0.05  # guard: probes cost at most this share of the plain decoding time skipped
FIRST_PROBE_SKIPS = 32  # guard: a probe with a catch-up whose cost was never measured
EMA = 0.3  # guard: weight of the newest drafting step in its batch size's averages


class AcceptanceCalibration:
    """P(node accepted | drafter path probability), per log-probability bin."""

    def __init__(self) -> None:
        self.accepted = np.zeros(BINS)
        self.verified = np.zeros(BINS)

    @staticmethod
    def _bin(score: float) -> int:
        x = math.log10(max(score, 1e-12))
        return min(BINS - 1, max(0, int((x + 5.0) / 5.0 * BINS)))

    def estimate(self, score: float) -> float:
        b = self._bin(score)
        return float((self.accepted[b] + PRIOR * score) / (self.verified[b] + PRIOR))

    def observe(self, tree: DraftTree, verified: int, accepted_nodes: list[int]) -> None:
        """The first `verified` nodes of `tree` were verified; `accepted_nodes` were accepted."""
        accepted = set(accepted_nodes)
        for n in range(min(verified, len(tree))):
            b = self._bin(tree.scores[n])
            self.verified[b] += 1
            self.accepted[b] += n in accepted


@dataclass
class EvictStats:
    steps: int = 0
    nodes_drafted: int = 0
    nodes_kept: int = 0
    truncated_steps: int = 0  # steps where some nodes were cut
    empty_steps: int = 0  # steps verified with no drafts at all (speculation did not pay)
    skipped_drafting_steps: int = 0  # steps the guard skipped drafting in
    probe_steps: int = 0  # steps the guard drafted in although drafting did not pay, to re-measure
    expected_tokens: float = 0.0  # sum over steps of the chosen expected emitted tokens
    predicted_verify_s: float = 0.0  # sum of the chosen predicted verify costs

    def summary(self) -> dict[str, Any]:
        return {
            "evict_steps": self.steps,
            "evict_nodes_drafted": self.nodes_drafted,
            "evict_nodes_kept": self.nodes_kept,
            "evict_truncated_steps": self.truncated_steps,
            "evict_empty_steps": self.empty_steps,
            "evict_skipped_drafting_steps": self.skipped_drafting_steps,
            "evict_probe_steps": self.probe_steps,
            "evict_expected_tokens": self.expected_tokens,
            "evict_predicted_verify_s": self.predicted_verify_s,
        }


class Evict:
    def __init__(self, profile: VerifyCostProfile, *, min_draft_tokens: int = 0, guard: bool = True) -> None:
        self.profile = profile
        self.min_draft_tokens = min_draft_tokens
        self.guard = guard
        self.calibration = AcceptanceCalibration()
        self.stats = EvictStats()
        # MoE targets: distinct experts per request's tokens (fed by the target's expert counter).
        self.experts = ExpertUnionModel(*profile.moe) if profile.moe else None
        # guard, per batch size: running (drafting s, expected gain per row, tokens per row,
        # verification s); the plain decoding time skipped since the last probe
        self._averages: dict[int, tuple[float, float, float, float]] = {}
        self._skipped_s: dict[int, float] = {}
        self._skips: dict[int, int] = {}
        self._catch_up_s_per_token: float | None = None  # the drafter's catch-up time per token

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A drafter's catch-up pass over `tokens` tokens took `seconds` (for the probe's cost)."""
        if tokens >= 16:  # fewer: the pass's fixed cost dominates
            per_token = seconds / tokens
            old = self._catch_up_s_per_token
            self._catch_up_s_per_token = per_token if old is None else EMA * per_token + (1 - EMA) * old

    def _guard_averages(self, rows: int, contexts: list[int]) -> tuple[float, float, float] | None:
        """(drafting s, gain per row, verification s) expected at `rows` rows: its own averages, else
        the nearest seen batch size's, rescaled; None before any drafting step."""
        seen = self._averages.get(rows)
        if seen is not None:
            draft_s, gain, _, verify_s = seen
            return draft_s, gain, verify_s
        if not self._averages:
            return None
        nearest = min(self._averages, key=lambda r: (abs(r - rows), r))
        draft_s, gain, tokens, _ = self._averages[nearest]
        return draft_s * rows / nearest, gain, self.cost([max(1, round(tokens))] * rows, contexts)

    def should_draft(self, contexts: list[int], catch_up_tokens: int = 0) -> bool:
        """Whether to draft at this batch (rows with these contexts; the drafter has
        `catch_up_tokens` tokens to catch up on first); see the module docstring. Counts skips and
        probes."""
        rows = len(contexts)
        expected = self._guard_averages(rows, contexts) if self.guard and rows else None
        if expected is None:
            return True
        draft_s, gain, verify_s = expected
        plain_s = self.cost([1] * rows, contexts, "chain")
        if rows * (1 + gain) / (draft_s + verify_s) >= rows / plain_s:
            self._skipped_s[rows] = 0.0
            self._skips[rows] = 0
            return True
        skipped_s = self._skipped_s.get(rows, 0.0) + plain_s
        skips = self._skips.get(rows, 0) + 1
        if catch_up_tokens and self._catch_up_s_per_token is None:
            probe = skips >= FIRST_PROBE_SKIPS
        else:
            catch_up_s = catch_up_tokens * self._catch_up_s_per_token if catch_up_tokens else 0.0
            probe_s = max(draft_s + verify_s - plain_s, 0.0) + catch_up_s
            probe = PROBE_BUDGET * skipped_s >= probe_s
        if probe:
            self._skipped_s[rows], self._skips[rows] = 0.0, 0
            self.stats.probe_steps += 1
            return True
        self._skipped_s[rows], self._skips[rows] = skipped_s, skips
        self.stats.skipped_drafting_steps += 1
        return False

    def cost(self, query_tokens: list[int], contexts: list[int], mask: str = "tree") -> float:
        """Predicted seconds of a verify step with these rows (query tokens incl. the root)."""
        experts = None
        if self.experts is not None:  # union over rows routing independently of each other
            experts = 1.0 - math.prod(1.0 - self.experts.fraction(q) for q in query_tokens)
        return self.profile.predict(query_tokens, contexts, mask, experts)

    def benefits(self, tree: DraftTree) -> list[float]:
        out: list[float] = []
        for n, p in enumerate(tree.parents):
            a = self.calibration.estimate(tree.scores[n])
            out.append(min(a, out[p]) if p >= 0 else a)
        return out

    def truncate(self, trees: list[DraftTree], contexts: list[int], draft_time_s: float = 0.0,
                 mask: str = "tree") -> list[DraftTree]:
        """The step's trees cut to the batch-wide best size (module docstring). `contexts[i]`: the
        tokens in request i's KV cache before this step's verification."""
        self.stats.steps += 1
        candidates = []  # (-benefit, request, node): benefit order, parents first on ties
        for i, tree in enumerate(trees):
            for n, a in enumerate(self.benefits(tree)):
                candidates.append((-a, n, i))
        candidates.sort()
        rows = len(trees)
        tokens = [1] * rows
        forced = [min(self.min_draft_tokens, len(t)) for t in trees]
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
        best_cost = self.cost(tokens, contexts, mask)
        best_rate = (rows + gain) / (best_cost + draft_time_s)
        best_k, k_gain, trial = 0, gain, list(tokens)
        for k, (neg_a, n, i) in enumerate(rest, start=1):
            trial[i] += 1
            k_gain += -neg_a
            cost = self.cost(trial, contexts, mask)
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
        if drafted:
            new = (draft_time_s, gain / rows, sum(tokens) / rows + best_k / rows, best_cost)
            old = self._averages.get(rows)
            self._averages[rows] = new if old is None else tuple(
                EMA * n + (1 - EMA) * o for n, o in zip(new, old, strict=True))
        return out
