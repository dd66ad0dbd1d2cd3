"""What a drafter needs to propose draft trees (config section tree; with adaptive, chains as
one-branch trees): `TreeDrafting`, mixed into a `RoundDrafter` that can give the top tokens after a
set of query tokens (`_tree_root_top` for the requests' roots, `_tree_level_top` for a level's tree
query under the ancestor mask). It grows one tree per request (drafting/tree.py), gives requests
whose sampling needs vLLM's own sampler the tree's best path as a chain, lets a `GrowthRule` (EVICT:
drafting/evict_proposer.py) stop the growth and cut the step's trees, and hands vLLM the nodes
(parents first) as drafts; `topologies()` tells the runner's plan how they hang together.

Drafters: the draft model (drafting/draft_model.py), the self-drafter (drafting/self_draft.py), an
EAGLE / EAGLE-3 head sparsever runs itself (drafting/eagle_head.py), n-gram lookup
(drafting/prompt_lookup.py) and vLLM's own drafter's chains (drafting/vllm_drafter.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.step import DraftStep
from vllm_sparsever.drafting.drafter import DraftRequests
from vllm_sparsever.drafting.tree import TreeGrowth
from vllm_sparsever.trees import DraftTree


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


def chain_tree(num_speculative_tokens: int) -> Any:
    """The tree config of chains grown as one-branch trees (EVICT over a chain drafter: the chain's
    path probabilities are its node scores)."""
    from vllm_sparsever.config import DraftTreeConfig

    return DraftTreeConfig(enabled=True, branching=1, expand=1, depth=num_speculative_tokens)


class GrowthRule(Protocol):
    """What stops a tree drafter's growth and cuts its trees, step by step (`TreeDrafting.grow_under`;
    EVICT: drafting/evict_proposer.py). Per drafting step: `begin`, `keep_growing` after each level,
    `cut`."""

    def begin(self, reqs: DraftRequests) -> bool:
        """Before growing: whether the catch-up the roots' pass runs rides with prompts the target
        computed (counted)."""

    def keep_growing(self, reqs: DraftRequests, shape: Any, idx: list[int], passes: int, trees: list[DraftTree],
                     frontiers: list[list[int]]) -> bool:
        """After `passes` levels: whether requests `idx` (`trees`, `frontiers`: theirs) grow one more."""

    def cut(self, reqs: DraftRequests, trees: list[DraftTree], passes: list[float], seconds: float) -> list[DraftTree]:
        """The step's grown trees (each pass's time, the whole drafting's `seconds`) as verified."""


class TreeDrafting:
    """Mixin, before `RoundDrafter`: call `init_trees()` in the constructor; the per-level stats and
    their reset add the tree levels to the drafter's."""

    tree: Any = None
    rule: GrowthRule | None = None
    depth_prior = 0.6  # EVICT's acceptance of depth 1 before any is measured
    draft_cost: Any = None  # EVICT's price of a pass before any is measured (a DraftCost; None: unknown)
    one_pass = False  # True: one pass drafts every level (a lookup), so deeper drafts cost no more passes

    def init_trees(self, tree: Any) -> None:
        """`tree`: a DraftTreeConfig (`chain_tree` for chains as one-branch trees), or None."""
        self.tree = tree
        self.tree_stats = TreeDraftStats()
        self._trees: dict[str, DraftTree] = {}  # req id -> the tree proposed for its next step

    def grow_under(self, rule: GrowthRule) -> None:
        """Let `rule` stop the growth and cut the trees from now on."""
        self.rule = rule

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        levels = super().stats_by_level()
        if self.tree is not None:
            levels["tree_drafting"] = self.tree_stats.summary()
        return levels

    def forget(self, req_ids: set[str]) -> None:
        super().forget(req_ids)
        for req_id in req_ids:
            self._trees.pop(req_id, None)

    def request_state(self) -> dict[str, int]:
        return {**super().request_state(), "draft_trees": len(self._trees)}

    def reset_stats(self) -> None:
        super().reset_stats()
        self.tree_stats = TreeDraftStats()

    # ---- proposing ------------------------------------------------------------------------

    def plan_depth(self, step: DraftStep) -> int:
        """The tree's levels for this step (chains: the cap)."""
        if self.tree is None:
            return super().plan_depth(step)
        return min(step.depth, self.tree.depth)

    def propose_trees(self, step: DraftStep) -> list[list[int]]:
        """Trees of `step.depth` levels at most (`plan_depth`), each within its request's budget."""
        start = time.perf_counter()
        self._trees.clear()
        reqs = self.requests(step, self.num_speculative_tokens)
        drafts: list[list[int]] = [[] for _ in step.sampled]
        levels = min(step.depth, self.tree.depth)
        if not reqs.rows or levels <= 0:
            return drafts
        shape = self.draft_shape(reqs)
        if self.rule is not None:
            self.tree_stats.catch_ups_with_prompt += self.rule.begin(reqs)
        trees, passes = self.grow_trees(reqs, levels, shape)
        for k, row in enumerate(reqs.rows):
            if len(trees[k]) and not trees[k].is_chain() and not self.target.tree_sampling_supported(row):
                trees[k] = trees[k].subtree(trees[k].best_path())
                self.tree_stats.chains_for_sampler += 1
        if self.rule is not None:
            trees = self.rule.cut(reqs, trees, passes, time.perf_counter() - start)
        for row, req_id, tree in zip(reqs.rows, reqs.req_ids, trees, strict=True):
            if len(tree):
                self._trees[req_id] = tree
            drafts[row] = list(tree.tokens)
            self.tree_stats.nodes += len(tree)
        self.tree_stats.time_s += time.perf_counter() - start
        return drafts

    def proposed_tree(self, req_id: str) -> DraftTree | None:
        """The tree proposed for `req_id`'s next step, if one."""
        return self._trees.get(req_id)

    def seeded(self, reqs: DraftRequests) -> list[bool]:
        """Per request, whether it samples with a seed: EVICT leaves its draft shape as configured
        (adaptive/evict.py)."""
        return [self.target.seeded_sampling(row) for row in reqs.rows]

    def draft_shape(self, reqs: DraftRequests) -> Any:
        """How this step's drafts can grow (EVICT's DraftShape): the tree config's levels, node
        budgets and widths; chains are one-branch trees."""
        from vllm_sparsever.adaptive.policy import DraftShape

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

    # ---- growing --------------------------------------------------------------------------

    @torch.inference_mode()
    def grow_trees(self, reqs: DraftRequests, levels: int, shape: Any) -> tuple[list[DraftTree], list[float]]:
        """A dynamic draft tree per request of at most min(num_speculative_tokens, budget) nodes and
        `levels` levels: the roots' pass (with the catch-up, if any), then one pass per level over
        every growing tree, while the growth rule (EVICT) finds that one more level pays.
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
        rule = self.rule
        seeded = self.seeded(reqs) if rule is not None else [False] * len(reqs.rows)
        adaptive = [i for i in idx if not seeded[i]]  # seeded requests grow as configured
        while True:
            live = [i for i in idx if not growths[i].done]
            if not live:
                break
            if (rule is not None and any(not growths[i].done for i in adaptive)
                    and not rule.keep_growing(reqs, shape, adaptive, len(passes), [growths[i].tree for i in adaptive],
                                              [list(growths[i].frontier) for i in adaptive])):
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

    def catch_up_tokens(self, reqs: DraftRequests) -> int:
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
