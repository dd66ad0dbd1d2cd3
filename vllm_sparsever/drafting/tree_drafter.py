"""What a drafter needs to propose draft trees (config sections tree and adaptive): `TreeDrafting`,
mixed into a `RoundDrafter` that can give the top tokens after a set of query tokens
(`_tree_root_top` for the requests' roots, `_tree_level_top` for a level's tree query under the
ancestor mask). It grows one tree per request (drafting/tree.py), gives requests whose sampling
needs vLLM's own sampler the tree's best path as a chain, lets EVICT (adaptive/evict.py) cut the
step's trees, and hands vLLM the nodes (parents first) as drafts; `topologies()` tells the
runner's plan how they hang together, `observe_acceptance()` calibrates EVICT.

Drafters: the draft model (drafting/draft_model.py), the self-drafter (drafting/self_draft.py) and an
EAGLE / EAGLE-3 head sparsever runs itself (drafting/eagle_head.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.step import DraftStep
from vllm_sparsever.drafting.drafter import DraftRequests, collect_draft_requests
from vllm_sparsever.drafting.tree import TreeGrowth
from vllm_sparsever.trees import DraftTree

logger = logging.getLogger("vllm_sparsever")


@dataclass
class TreeDraftStats:
    trees: int = 0  # trees drafted
    nodes: int = 0  # nodes proposed (after EVICT): what the target verifies
    nodes_grown: int = 0  # nodes created before the most probable were kept
    levels: int = 0  # expansion passes (levels after the root's), summed over steps
    chains_for_sampler: int = 0  # requests given a chain: their sampling needs vLLM's sampler
    catch_ups_with_prompt: int = 0  # drafting steps whose catch-up rode on prompts the target computed itself
    time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return counters_summary(self, "tree_draft_", {"trees": "tree_drafted"})


class TreeDrafting:
    """Mixin, before `RoundDrafter`: call `init_trees()` in the constructor; `load`, the per-level
    stats and their reset add the tree levels to the drafter's."""

    tree: Any = None
    adaptive: Any = None
    depth_prior = 0.6  # EVICT's acceptance of depth 1 before any is measured
    one_pass = False  # True: one pass drafts every level (a lookup), so deeper drafts cost no more passes

    def init_trees(self, tree: Any, adaptive: Any, num_speculative_tokens: int) -> None:
        """`tree`: a DraftTreeConfig or None; `adaptive`: an AdaptiveVerificationConfig or None (a
        chain is then grown as a one-branch tree, for its path probabilities)."""
        if adaptive is not None and tree is None:
            from vllm_sparsever.config import DraftTreeConfig

            tree = DraftTreeConfig(enabled=True, branching=1, expand=1, depth=num_speculative_tokens)
        self.tree = tree
        self.adaptive = adaptive
        self.evict: Any = None  # adaptive.evict.Evict, once the target's cost profile is loaded
        self.tree_stats = TreeDraftStats()
        self._trees: dict[str, DraftTree] = {}  # req id -> the tree proposed for its next step
        self._prompts: dict[str, int] = {}  # req id -> prompt tokens the target computed, until it drafts

    def load(self, target: Any) -> None:
        super().load(target)
        if self.adaptive is not None:
            from vllm_sparsever.adaptive.cost import resolve_cost_profile
            from vllm_sparsever.adaptive.evict import Evict

            profile = resolve_cost_profile(self.adaptive.cost_profile, target.model_config.model)
            served = str(target.model_config.dtype).removeprefix("torch.")
            if profile.dtype not in (served, "auto"):
                # EVICT scales the profile to measured steps, but its shape (how time grows with
                # tokens) differs between a compute-bound fp32 step and a bandwidth-bound bf16 one.
                logger.warning("adaptive.cost_profile: measured in %s, the engine serves in %s; measure it "
                               "again with `vllm-sparsever profile-verify %s --dtype %s`", profile.dtype, served,
                               target.model_config.model, served)
            self.evict = Evict(profile, min_draft_tokens=self.adaptive.min_draft_tokens, guard=self.adaptive.guard,
                               depth=self.adaptive.depth, depth_prior=self.depth_prior)
            target_moe = target.moe_routing
            if self.evict.experts is not None and target_moe is not None and tuple(profile.moe) != tuple(target_moe):
                raise RuntimeError(f"adaptive.cost_profile: measured on an MoE with (experts, top_k) = "
                                   f"{tuple(profile.moe)}, the target has {tuple(target_moe)}; measure it again "
                                   f"with `vllm-sparsever profile-verify`")

    def experts_observer(self) -> Any:
        """EVICT's expert counter, for an MoE target whose cost profile prices distinct experts."""
        if self.evict is None or self.evict.experts is None or self.target.moe_routing is None:
            return None
        return self.evict.experts.observe

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        levels = super().stats_by_level()
        if self.tree is None:
            return levels
        levels["tree_drafting"] = self.tree_stats.summary()
        if self.evict is not None:
            levels["evict"] = {**self.evict.stats.summary(), **self.evict.clock.summary()}
            if self.evict.experts is not None:  # MoE target: how alike a request's tokens route
                levels["evict"]["evict_moe_expert_sharing"] = self.evict.experts.sharing
        return levels

    def forget(self, req_ids: set[str]) -> None:
        super().forget(req_ids)
        for req_id in req_ids:
            self._trees.pop(req_id, None)
            self._prompts.pop(req_id, None)

    def note_prompts(self, to_compute: dict[str, int]) -> None:
        super().note_prompts(to_compute)
        if self.evict is not None:
            self._prompts.update(to_compute)

    def _catch_up_to_plan(self, reqs: DraftRequests) -> int:
        """The catch-up EVICT weighs this step (rent or buy: adaptive/evict.py): the drafter's
        catch-up less the prompt tokens the target itself computed for the step's requests that
        have not drafted yet. That part rides with the prompt: the draft's prefill of it is no more
        work than the target's was, run on their first drafting step, as vLLM's draft_model
        prefills its draft. What is left is a prompt the prefix cache supplied, or the tokens
        decoded plainly since the prompt (each plain step adds one: a credit compared with the
        whole catch-up would never cover it again)."""
        return max(self._catch_up_tokens(reqs) - self._prompt_credit(reqs), 0)

    def _prompt_credit(self, reqs: DraftRequests) -> int:
        return sum(self._prompts.get(req_id, 0) for req_id in reqs.req_ids)

    def _spend_prompt_credits(self, reqs: DraftRequests, catch_up: int) -> None:
        """The step's requests draft: their prompts' credit (`_catch_up_to_plan`) is spent."""
        from vllm_sparsever.adaptive.evict import CATCH_UP_MIN_TOKENS

        credit = self._prompt_credit(reqs)
        for req_id in reqs.req_ids:
            self._prompts.pop(req_id, None)
        if catch_up and credit and catch_up - credit < CATCH_UP_MIN_TOKENS:
            self.tree_stats.catch_ups_with_prompt += 1

    def request_state(self) -> dict[str, int]:
        return {**super().request_state(), "draft_trees": len(self._trees)}

    def reset_stats(self) -> None:
        super().reset_stats()
        self.tree_stats = TreeDraftStats()
        if self.evict is not None:
            self.evict.stats = type(self.evict.stats)()

    # ---- proposing ------------------------------------------------------------------------

    def plan_depth(self, step: DraftStep) -> int:
        """The tree's levels for this step: EVICT's plan (0: skip drafting), else the tree's depth
        (chains without EVICT: the cap)."""
        if self.tree is None:
            return super().plan_depth(step)
        if self.evict is None:
            return min(step.depth, self.tree.depth)
        reqs = collect_draft_requests(step, self.num_speculative_tokens)
        if not reqs.rows:
            return 0
        catch_up = self._catch_up_to_plan(reqs)
        prompts = max(self._catch_up_tokens(reqs) - catch_up, 0)
        remaining = [lim.remaining_tokens for lim in step.limits_of(reqs.rows)]
        horizon = max(remaining) if remaining and all(r is not None for r in remaining) else None
        return self.plan_levels(list(reqs.positions), self._draft_shape(reqs), catch_up, seeded=any(self._seeded(reqs)),
                                prompt_tokens=prompts, horizon_tokens=horizon)

    def propose_trees(self, step: DraftStep) -> list[list[int]]:
        """Trees of `step.depth` levels at most (`plan_depth`), each within its request's budget."""
        start = time.perf_counter()
        self._trees.clear()
        reqs = self.requests(step, self.num_speculative_tokens)
        drafts: list[list[int]] = [[] for _ in step.sampled]
        levels = min(step.depth, self.tree.depth)
        if not reqs.rows or levels <= 0:
            return drafts
        # A request's verify step has its root (last committed token) at `position`: the context
        # before it is `position` tokens.
        contexts = list(reqs.positions)
        shape = self._draft_shape(reqs)
        catch_up = self._catch_up_tokens(reqs) if self.evict is not None else 0
        if self.evict is not None:
            self._spend_prompt_credits(reqs, catch_up)
        trees, passes = self.grow_trees(reqs, levels, shape, catch_up)
        for k, row in enumerate(reqs.rows):
            if len(trees[k]) and not trees[k].is_chain() and not self.target.tree_sampling_supported(row):
                trees[k] = trees[k].subtree(trees[k].best_path())
                self.tree_stats.chains_for_sampler += 1
        if self.evict is not None:
            from vllm_sparsever.adaptive.evict import CATCH_UP_MIN_TOKENS

            rows = len(reqs.rows)
            # A roots' pass that caught up on many tokens is a one-off: neither a pass nor fixed cost.
            one_off = passes[0] if catch_up >= CATCH_UP_MIN_TOKENS and passes else 0.0
            if one_off:
                self.evict.observe_catch_up(catch_up, one_off)
            steady = passes[1:] if one_off else passes
            self.evict.observe_drafting(rows, steady, time.perf_counter() - start - one_off)
            depth = max((t.depth() for t in trees), default=0)
            self.evict.stats.drafted_depths[depth] = self.evict.stats.drafted_depths.get(depth, 0) + 1
            draft_s = self.evict.clock.draft_s(rows, len(passes)) or 0.0
            # A step of chains only is verified without a tree mask (vLLM's attention path).
            mask = "chain" if all(t.is_chain() for t in trees) else "tree"
            trees = _agreed(self.evict.truncate(trees, contexts, draft_time_s=draft_s, mask=mask,
                                                whole=self._seeded(reqs)))
        for row, req_id, tree in zip(reqs.rows, reqs.req_ids, trees, strict=True):
            if len(tree):
                self._trees[req_id] = tree
            drafts[row] = list(tree.tokens)
            self.tree_stats.nodes += len(tree)
        self.tree_stats.time_s += time.perf_counter() - start
        return drafts

    def plan_levels(self, contexts: list[int], shape: Any, catch_up_tokens: int, seeded: bool = False, *,
                    prompt_tokens: int = 0, horizon_tokens: int | None = None) -> int:
        """EVICT's depth for this step (0: skip drafting), the same on every tensor-parallel rank;
        with a seeded sampled request (`seeded`) the cap. (Evict.plan_depth: the catch-up, the new
        prompts' and the requests' remaining tokens.)"""
        if seeded:
            return self.evict.plan_seeded(shape.cap)
        return _agreed(self.evict.plan_depth(contexts, shape, catch_up_tokens, prompt_tokens=prompt_tokens,
                                             horizon_tokens=horizon_tokens))

    def _seeded(self, reqs: DraftRequests) -> list[bool]:
        """Per request, whether it samples with a seed: EVICT leaves its draft shape as configured
        (adaptive/evict.py)."""
        return [self.target.seeded_sampling(row) for row in reqs.rows]

    def _draft_shape(self, reqs: DraftRequests) -> Any:
        """How this step's drafts can grow (EVICT's DraftShape): the tree config's levels, node
        budgets and widths; chains are one-branch trees."""
        from vllm_sparsever.adaptive.evict import DraftShape

        cfg = self.tree
        budgets = tuple(max(0, min(self.num_speculative_tokens, b)) for b in reqs.budgets)
        chain = cfg.branching == 1
        return DraftShape(cap=cfg.depth, budgets=budgets, first=cfg.branching, later=cfg.branching * cfg.expand,
                          mask="chain" if chain else "tree", one_pass=self.one_pass)

    def topologies(self, scheduled: dict[str, list[int]]) -> dict[str, Any]:
        """req id -> the topology of its scheduled drafts, for the trees this drafter proposed
        (scheduled drafts are the tree's nodes, or a prefix of them)."""
        out = {}
        for req_id, drafts in scheduled.items():
            tree = self._trees.get(req_id)
            if tree is not None and not tree.is_chain() and list(drafts) == tree.tokens[: len(drafts)]:
                out[req_id] = tree.topology()
        return out

    def observe_acceptance(self, req_id: str, verified: int, accepted_nodes: list[int]) -> None:
        """What verification made of the drafts proposed for `req_id`: the first `verified` nodes
        were verified, `accepted_nodes` (tree node indices) accepted. Calibrates EVICT: per node by
        path probability, per depth for the next step's depth decision."""
        tree = self._trees.get(req_id)
        if self.evict is not None and tree is not None:
            self.evict.calibration.observe(tree, verified, accepted_nodes)
            depths = tree.node_depths()
            self.evict.observe_depth(max(depths[:verified], default=0), len(accepted_nodes))

    def observe_step_time(self, query_tokens: list[int], contexts: list[int], seconds: float, mask: str,
                          gap_s: float | None) -> None:
        """The runner measured a decode step (see Evict.observe_step)."""
        if self.evict is not None:
            self.evict.observe_step(query_tokens, contexts, seconds, mask, gap_s)

    # ---- growing --------------------------------------------------------------------------

    @torch.inference_mode()
    def grow_trees(self, reqs: DraftRequests, levels: int, shape: Any,
                   catch_up_tokens: int = 0) -> tuple[list[DraftTree], list[float]]:
        """A dynamic draft tree per request of at most min(num_speculative_tokens, budget) nodes and
        `levels` levels: the roots' pass (with the catch-up, if any), then one pass per level over
        every growing tree, while EVICT finds that one more level pays (`Evict.keep_drafting`).
        Returns the trees and the time of each pass (the roots' first)."""
        from vllm_sparsever.trees import stacked_tree_mask

        cfg = self.tree
        device = self.target.device
        growths: list[TreeGrowth | None] = [None] * len(reqs.rows)
        idx = []
        for i, budget in enumerate(reqs.budgets):
            budget = min(self.num_speculative_tokens, budget)
            if budget > 0:
                # Node K/V slots after the root: budget - 1 (the slots the scheduler reserved).
                growths[i] = TreeGrowth(branching=cfg.branching, expand=cfg.expand, depth=min(cfg.depth, levels),
                                        budget=budget, max_expanded=budget - 1)
                idx.append(i)
        passes: list[float] = []
        if idx:
            start = time.perf_counter()
            top_p, top_t = self._tree_root_top(reqs, idx, cfg.branching)
            for k, i in enumerate(idx):
                growths[i].grow_top(top_p[k: k + 1], top_t[k: k + 1])
            passes.append(time.perf_counter() - start)
        seeded = self._seeded(reqs) if self.evict is not None else [False] * len(reqs.rows)
        adaptive = [i for i in idx if not seeded[i]]  # seeded requests grow as configured
        while True:
            live = [i for i in idx if not growths[i].done]
            if not live:
                break
            if (self.evict is not None and any(not growths[i].done for i in adaptive)
                    and not _agreed(self.evict.keep_drafting(
                        [reqs.positions[i] for i in adaptive], _shape_of(shape, adaptive), len(passes),
                        [growths[i].tree for i in adaptive], [list(growths[i].frontier) for i in adaptive]))):
                self.evict.stats.stopped_early_steps += 1
                for i in adaptive:
                    growths[i].stop()
                live = [i for i in live if seeded[i]]
                if not live:
                    break
            start = time.perf_counter()
            tokens, positions, kv_positions, lens, topologies, wanted = [], [], [], [], [], []
            offset = 0
            for i in live:
                g = growths[i]
                nodes, topology = g.query()
                root = reqs.positions[i]
                tokens.extend(g.tree.tokens[n] for n in nodes)
                positions.extend(root + d for d in g.node_depths(nodes))
                kv_positions.extend(range(root + 1, root + 1 + len(nodes)))
                lens.append(len(nodes))
                topologies.append(topology)
                wanted.extend(range(offset + len(nodes) - len(g.frontier), offset + len(nodes)))
                offset += len(nodes)
            as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
            # Chains: the ancestor mask is the causal one, so the drafter's plain causal attention runs.
            mask = None if all(t.is_chain for t in topologies) else stacked_tree_mask(topologies).to(device)
            top_p, top_t = self._tree_level_top(
                [reqs.rows[i] for i in live], as_long(tokens), as_long(positions), as_long(kv_positions), lens,
                mask, as_long(wanted), cfg.branching, topologies)
            self.tree_stats.levels += 1
            offset = 0
            for i in live:
                n = len(growths[i].frontier)
                growths[i].grow_top(top_p[offset: offset + n], top_t[offset: offset + n])
                offset += n
            passes.append(time.perf_counter() - start)
        trees = []
        for g in growths:
            tree = g.result() if g is not None else DraftTree()
            if g is not None:
                self.tree_stats.trees += 1
                self.tree_stats.nodes_grown += len(g.tree)
            trees.append(tree)
        return trees, passes

    def _catch_up_tokens(self, reqs: DraftRequests) -> int:
        """Tokens the roots' pass would run besides the roots (a draft model's K/V behind the
        committed tokens); 0 for a drafter that reads the target's own K/V."""
        return 0

    def _tree_root_top(self, reqs: DraftRequests, idx: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (probabilities, token ids) after each root `reqs.tokens[i]` (i in idx) at its position."""
        raise NotImplementedError

    def _tree_level_top(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor,
                        kv_positions: torch.Tensor, lens: list[int], tree_mask: torch.Tensor,
                        wanted: torch.Tensor, k: int, topologies: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k after the query tokens `wanted` of a level's tree query (K/V at `kv_positions`;
        `topologies[r]`: request r's query nodes' parents, -1 for the root's children)."""
        raise NotImplementedError


def _shape_of(shape: Any, idx: list[int]) -> Any:
    """`shape` for the requests `idx` only."""
    from dataclasses import replace

    return replace(shape, budgets=tuple(shape.budgets[i] for i in idx))


def _agreed(decision: Any) -> Any:
    """EVICT's `decision` as tensor-parallel rank 0 took it, on every rank: its times are measured on
    each rank, and ranks that drafted different depths would run different passes (the draft's
    collectives would hang) and verify different trees."""
    from vllm_sparsever.compat.sampling import same_on_every_tp_rank

    return same_on_every_tp_rank(decision)
