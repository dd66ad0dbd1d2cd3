"""EVICT as drafting asks it: the one interface to adaptive verification outside adaptive/.

`EvictPolicy` wraps the decision engine (evict.py: `Evict`, its calibration, depth acceptance, step
clock and MoE expert model) behind the questions a drafter asks per step and what it reports back:

- before drafting: `plan_depth` (levels to draft; 0 skips drafting);
- while drafting: `keep_drafting` (after each level: does one more pay?);
- after drafting: `observe_drafting` (the passes' times; a long catch-up is a one-off), then
  `truncate` (the step's trees cut to what pays for its verification);
- after verification: `observe_acceptance` (per request) and `observe_step` (the step's time);
- `experts_observer` (an MoE target's routed experts), `summary` and `reset_stats` (metrics).

Every decision is the same on every tensor-parallel rank (`agree`, given by the caller: rank 0's).
drafting/evict_proposer.py is its one user; nothing outside adaptive/ reads the engine's members
(import-linter: only this module of adaptive/ is imported from drafting/ and integration/).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_sparsever.adaptive.cost import VerifyCostProfile, resolve_cost_profile
from vllm_sparsever.adaptive.evict import CATCH_UP_MIN_TOKENS, DEPTH_PRIOR, DraftCost, DraftShape, Evict
from vllm_sparsever.trees import DraftTree

__all__ = ["DraftCost", "DraftShape", "EvictPolicy"]

logger = logging.getLogger("vllm_sparsever")


def _as_is(decision: Any) -> Any:
    return decision


class EvictPolicy:
    def __init__(self, profile: VerifyCostProfile, *, min_draft_tokens: int = 0, guard: bool = True,
                 depth: str = "auto", depth_prior: float = DEPTH_PRIOR, draft_cost: DraftCost | None = None,
                 moe_target: bool = False, agree: Callable[[Any], Any] = _as_is) -> None:
        """`draft_cost`: the drafter's cost relative to the target, pricing drafting before it is
        measured (None: draft to the cap until then); `moe_target`: the target is an MoE (its routed
        experts are observed where the profile prices them); `agree`: a decision as every
        tensor-parallel rank takes it."""
        self._evict = Evict(profile, min_draft_tokens=min_draft_tokens, guard=guard, depth=depth,
                            depth_prior=depth_prior, draft_cost=draft_cost)
        self._moe_target = moe_target
        self._agree = agree

    @classmethod
    def for_target(cls, adaptive: Any, model: str, dtype: Any, moe_routing: tuple[int, int] | None, *,
                   depth_prior: float, draft_cost: DraftCost | None = None,
                   agree: Callable[[Any], Any] = _as_is) -> "EvictPolicy":
        """For the target `model` served in `dtype` (its `moe_routing` (experts, top_k) where an MoE),
        with the config's adaptive section (`AdaptiveVerificationConfig`): its cost profile resolved and
        checked against the target."""
        profile = resolve_cost_profile(adaptive.cost_profile, model)
        served = str(dtype).removeprefix("torch.")
        if profile.dtype not in (served, "auto"):
            # EVICT scales the profile to measured steps, but its shape (how time grows with
            # tokens) differs between a compute-bound fp32 step and a bandwidth-bound bf16 one.
            logger.warning("adaptive.cost_profile: measured in %s, the engine serves in %s; measure it "
                           "again with `vllm-sparsever profile-verify %s --dtype %s`", profile.dtype, served,
                           model, served)
        if profile.moe and moe_routing is not None and tuple(profile.moe) != tuple(moe_routing):
            raise RuntimeError(f"adaptive.cost_profile: measured on an MoE with (experts, top_k) = "
                               f"{tuple(profile.moe)}, the target has {tuple(moe_routing)}; measure it again "
                               f"with `vllm-sparsever profile-verify`")
        return cls(profile, min_draft_tokens=adaptive.min_draft_tokens, guard=adaptive.guard, depth=adaptive.depth,
                   depth_prior=depth_prior, draft_cost=draft_cost, moe_target=moe_routing is not None, agree=agree)

    # ---- per step ---------------------------------------------------------------------------

    def plan_depth(self, contexts: list[int], shape: DraftShape, catch_up_tokens: int = 0, *, seeded: bool = False,
                   prompt_tokens: int = 0, horizon_tokens: int | None = None) -> int:
        """Levels to draft this step (0: skip drafting); with a seeded sampled request (`seeded`) the
        cap (evict.py's module docstring). `contexts[i]`: request i's tokens before its root;
        `catch_up_tokens`: what the drafter must catch up on first, besides `prompt_tokens` of new
        prompts; `horizon_tokens`: the most tokens any request may still emit (None: unbounded)."""
        if seeded:
            return self._evict.plan_seeded(shape.cap)
        return self._agree(self._evict.plan_depth(contexts, shape, catch_up_tokens, prompt_tokens=prompt_tokens,
                                                  horizon_tokens=horizon_tokens))

    def keep_drafting(self, contexts: list[int], shape: DraftShape, passes: int, trees: list[DraftTree],
                      frontiers: list[list[int]]) -> bool:
        """After `passes` levels: whether one more may raise the step's rate (`Evict.keep_drafting`)."""
        keep = self._agree(self._evict.keep_drafting(contexts, shape, passes, trees, frontiers))
        if not keep:
            self._evict.stats.stopped_early_steps += 1
        return keep

    def observe_drafting(self, rows: int, pass_times: list[float], total_s: float, catch_up_tokens: int) -> None:
        """A drafting step at `rows` rows: each pass's time (the roots' first) and the whole drafting
        time; a roots' pass that caught up on many tokens is a one-off, neither a pass nor fixed cost."""
        one_off = pass_times[0] if catch_up_tokens >= CATCH_UP_MIN_TOKENS and pass_times else 0.0
        if one_off:
            self._evict.observe_catch_up(catch_up_tokens, one_off)
        steady = pass_times[1:] if one_off else pass_times
        self._evict.observe_drafting(rows, steady, total_s - one_off)

    def truncate(self, trees: list[DraftTree], contexts: list[int], *, passes: int, mask: str,
                 whole: list[bool] | None = None) -> list[DraftTree]:
        """The step's trees (drafted in `passes` passes) cut to the batch-wide best size, verified with
        `mask` ("chain" or "tree"); `whole[i]`: request i's tree is kept uncut (seeded sampling)."""
        stats = self._evict.stats
        depth = max((t.depth() for t in trees), default=0)
        stats.drafted_depths[depth] = stats.drafted_depths.get(depth, 0) + 1
        draft_s = self._evict.draft_s(contexts, passes) or 0.0
        return self._agree(self._evict.truncate(trees, contexts, draft_time_s=draft_s, mask=mask, whole=whole))

    def observe_acceptance(self, tree: DraftTree, verified: int, accepted_nodes: list[int]) -> None:
        """Verification's verdict on a request's `tree`: its first `verified` nodes verified,
        `accepted_nodes` accepted (calibrates the node scores and the per-depth acceptance)."""
        self._evict.calibration.observe(tree, verified, accepted_nodes)
        self._evict.observe_depth(max(tree.node_depths()[:verified], default=0), len(accepted_nodes))

    def observe_step(self, query_tokens: list[int], contexts: list[int], seconds: float, mask: str,
                     gap_s: float | None) -> None:
        """A measured decode step (`Evict.observe_step`)."""
        self._evict.observe_step(query_tokens, contexts, seconds, mask, gap_s)

    @staticmethod
    def catch_up_rides_with_prompt(catch_up_tokens: int, prompt_credit: int) -> bool:
        """Whether a drafting step's catch-up was mostly prompt tokens the target computed (what is
        left is no more than a draft pass's own)."""
        return bool(catch_up_tokens and prompt_credit and catch_up_tokens - prompt_credit < CATCH_UP_MIN_TOKENS)

    # ---- wiring and metrics ---------------------------------------------------------------

    def experts_observer(self) -> Callable[[int, int], None] | None:
        """What an MoE target's layers report (tokens, distinct experts) to, where the cost profile
        prices distinct experts; else None."""
        experts = self._evict.experts
        return experts.observe if experts is not None and self._moe_target else None

    def summary(self) -> dict[str, Any]:
        """EVICT's counters and what its clock measured (and, on an MoE, how alike tokens route)."""
        out = {**self._evict.stats.summary(), **self._evict.clock.summary()}
        if self._evict.draft_cost is not None:  # the drafter's price before its first pass
            out["evict_price_pass_share"] = self._evict.draft_cost.pass_share
            out["evict_price_prompt_share"] = self._evict.draft_cost.prompt_share
        if self._evict.experts is not None:
            out["evict_moe_expert_sharing"] = self._evict.experts.sharing
        return out

    def reset_stats(self) -> None:
        """Zero the counters (not what EVICT learned)."""
        self._evict.stats = type(self._evict.stats)()
