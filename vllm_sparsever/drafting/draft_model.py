"""A separate draft model as the drafter of hierarchical verification (draft_source='draft_model').

vLLM loads the draft model (its `draft_model` method: weights, and the draft's layers in the KV
cache); this drafter runs it in rounds, after the hierarchy's pending tokens, which vLLM's own
proposer cannot do (it drafts once per step from committed tokens). It keeps the draft model's KV
itself: per request, which positions hold the draft's K/V for which tokens. Each round it first
runs, in one pass, the tokens whose draft K/V is missing or stale (the whole prompt on a request's
first round; afterwards the tokens the full or intermediate level changed), then drafts greedily one
token per pass. Positions past the committed tokens are rewritten whenever their tokens change, so
what the draft attends to is always the current sequence.

With `tree` (config section tree), it drafts a dynamic tree per request instead of a chain
(drafting/tree.py): the catch-up pass ends at the request's last token (the root), then one pass
per level over the nodes expanded so far under the tree mask. It then proposes on its own (no
hierarchy), after `sample_tokens` like in a hierarchy, and hands vLLM the tree's nodes (parents
first) as the step's drafts; `topologies()` tells the runner's plan how they hang together.
Requests whose sampling needs vLLM's own rejection sampler (penalties, logprobs, bad words,
allowed tokens, min_tokens, logit bias, structured output) get the tree's most probable path as a
chain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.drafting.drafter import DraftRequests, RoundDrafter
from vllm_sparsever.drafting.queries import final_hidden, flatten_queries
from vllm_sparsever.drafting.tree import DraftTree, TreeGrowth


@dataclass
class DraftModelStats:
    rounds: int = 0  # draft() calls
    forward_passes: int = 0  # draft-model passes (catch-up passes included)
    catch_up_tokens: int = 0  # tokens run to bring the draft's KV up to date (prompts included)
    draft_tokens: int = 0
    slot_limited: int = 0  # see SelfDraftStats.slot_limited
    draft_time_s: float = 0.0
    trees: int = 0  # trees drafted (tree mode)
    tree_nodes: int = 0  # nodes in them (what the target verifies)
    tree_nodes_grown: int = 0  # nodes created before the most probable were kept
    tree_levels: int = 0  # expansion passes (levels after the first), summed over steps
    chains_for_plain_sampling: int = 0  # requests given a chain: their sampling needs vLLM's sampler

    def summary(self) -> dict[str, Any]:
        return {
            "draft_model_rounds": self.rounds,
            "draft_model_forward_passes": self.forward_passes,
            "draft_model_catch_up_tokens": self.catch_up_tokens,
            "draft_model_tokens": self.draft_tokens,
            "draft_model_slot_limited": self.slot_limited,
            "draft_model_time_s": self.draft_time_s,
            "draft_model_trees": self.trees,
            "draft_model_tree_nodes": self.tree_nodes,
            "draft_model_tree_nodes_grown": self.tree_nodes_grown,
            "draft_model_tree_levels": self.tree_levels,
            "draft_model_tree_chains": self.chains_for_plain_sampling,
        }


@dataclass
class _DraftKV:
    """A request's draft K/V: positions < `length` hold it; those below `tail_start` for committed
    tokens (which never change), the rest for `tail` (tokens that were pending or drafts then)."""

    length: int
    tail_start: int
    tail: list[int]

    def valid_for(self, history: Any, pending: list[int]) -> int:
        """How many leading positions hold K/V of the current sequence (`history`, the committed
        tokens, then `pending`)."""
        valid = min(self.length, self.tail_start)
        committed, n = len(history), len(history) + len(pending)
        for j, token in enumerate(self.tail):
            position = self.tail_start + j
            if position >= n:
                break
            current = int(history[position]) if position < committed else pending[position - committed]
            if current != token:
                break
            valid = position + 1
        return valid


class DraftModelDrafter(RoundDrafter):
    level = "draft_model"

    def __init__(self, *, num_speculative_tokens: int, max_model_len: int, tree: Any = None,
                 adaptive: Any = None) -> None:
        """`tree`: a DraftTreeConfig to draft trees (branching, expand, depth), or None for chains;
        `adaptive`: an AdaptiveVerificationConfig to truncate them with EVICT (a chain is then
        grown as a one-branch tree, for its path probabilities)."""
        super().__init__(DraftModelStats(), num_speculative_tokens=num_speculative_tokens,
                         max_model_len=max_model_len)
        self._stack: Any = None
        self._kv: dict[str, _DraftKV] = {}
        if adaptive is not None and tree is None:
            from vllm_sparsever.config import DraftTreeConfig

            tree = DraftTreeConfig(enabled=True, branching=1, expand=1, depth=num_speculative_tokens)
        self.tree = tree
        self.adaptive = adaptive
        self.evict: Any = None  # adaptive.evict.Evict, once the target's cost profile is loaded
        self._trees: dict[str, DraftTree] = {}  # req id -> the tree proposed for its next step

    def load(self, runner: Any) -> None:
        from vllm_sparsever.integration.compat.model import decoder_stack
        from vllm_sparsever.integration.compat.runner import draft_model

        super().load(runner)
        self._stack = decoder_stack(draft_model(runner))
        if self.adaptive is not None:
            from vllm_sparsever.adaptive.cost import resolve_cost_profile
            from vllm_sparsever.adaptive.evict import Evict

            profile = resolve_cost_profile(self.adaptive.cost_profile, runner.model_config.model)
            self.evict = Evict(profile, min_draft_tokens=self.adaptive.min_draft_tokens, guard=self.adaptive.guard)

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        levels = super().stats_by_level()
        if self.evict is not None:
            levels["evict"] = self.evict.stats.summary()
        return levels

    def reset_stats(self) -> None:
        super().reset_stats()
        if self.evict is not None:
            self.evict.stats = type(self.evict.stats)()

    def requests(self, sampled_token_ids: list[list[int]], reserve: int) -> DraftRequests:
        reqs = super().requests(sampled_token_ids, reserve)
        live = set(self._runner.input_batch.req_ids)
        for req_id in [r for r in self._kv if r not in live]:  # finished or preempted
            del self._kv[req_id]
        self._trees.clear()
        return reqs

    # ---- trees ----------------------------------------------------------------------------

    def propose(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        if self.tree is None:
            return super().propose(sampled_token_ids)
        from vllm_sparsever.integration.compat.runner import tree_sampling_supported

        reqs = self.requests(sampled_token_ids, self.num_speculative_tokens)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not reqs.rows or (self.evict is not None and not self.evict.should_draft()):
            return drafts
        batch = self._runner.input_batch
        start = time.perf_counter()
        trees = self.draft_trees(reqs)
        for k, row in enumerate(reqs.rows):
            if len(trees[k]) and not trees[k].is_chain() and not tree_sampling_supported(self._runner, row):
                trees[k] = trees[k].subtree(_best_path(trees[k]))
                self.stats.chains_for_plain_sampling += 1
        if self.evict is not None:
            # A request's verify step has its root (last committed token) at `position`: the
            # context before it is `position` tokens.
            trees = self.evict.truncate(trees, list(reqs.positions), draft_time_s=time.perf_counter() - start)
        for row, tree in zip(reqs.rows, trees, strict=True):
            if len(tree):
                self._trees[batch.req_ids[row]] = tree
            drafts[row] = list(tree.tokens)
        return drafts

    def observe_acceptance(self, req_id: str, verified: int, accepted_nodes: list[int]) -> None:
        """What verification made of the drafts proposed for `req_id`: the first `verified` nodes
        were verified, `accepted_nodes` (tree node indices) accepted. Calibrates EVICT."""
        tree = self._trees.get(req_id)
        if self.evict is not None and tree is not None:
            self.evict.calibration.observe(tree, verified, accepted_nodes)

    def topologies(self, scheduled: dict[str, list[int]]) -> dict[str, Any]:
        """req id -> the topology of its scheduled drafts, for the trees this drafter proposed
        (scheduled drafts are the tree's nodes, or a prefix of them)."""
        out = {}
        for req_id, drafts in scheduled.items():
            tree = self._trees.get(req_id)
            if tree is not None and not tree.is_chain() and list(drafts) == tree.tokens[: len(drafts)]:
                out[req_id] = tree.topology()
        return out

    @torch.inference_mode()
    def draft_trees(self, reqs: DraftRequests) -> list[DraftTree]:
        """A dynamic draft tree per request (drafting/tree.py), of at most
        min(num_speculative_tokens, budget) nodes, after its committed tokens."""
        from vllm_sparsever.integration.compat.runner import token_history
        from vllm_sparsever.plan import stacked_tree_mask

        start = time.perf_counter()
        batch = self._runner.input_batch
        device = self._runner.device
        cfg = self.tree
        growths: list[TreeGrowth | None] = [None] * len(reqs.rows)
        seqs, firsts, idx = [], [], []
        for i, row in enumerate(reqs.rows):
            budget = min(self.num_speculative_tokens, reqs.budgets[i])
            if budget <= 0:
                continue
            history = token_history(self._runner, row)
            assert len(history) - 1 == reqs.positions[i], "the root must be the request's last committed token"
            kv = self._kv.get(batch.req_ids[row])
            valid = kv.valid_for(history, []) if kv is not None else 0
            first = min(valid, len(history) - 1)
            seqs.append([int(t) for t in history[first:]])
            firsts.append(first)
            idx.append(i)
            self.stats.catch_up_tokens += len(seqs[-1]) - 1
            # Node K/V slots after the root: budget - 1 (the slots the scheduler reserved).
            growths[i] = TreeGrowth(branching=cfg.branching, expand=cfg.expand, depth=cfg.depth,
                                    budget=budget, max_expanded=budget - 1)
        self.stats.rounds += 1
        if idx:
            # First pass: catch-up tokens ending at the root; children of the root from its logits.
            tokens, positions, lens = flatten_queries(seqs, firsts, device)
            normed = final_hidden(self._runner, self._stack, [reqs.rows[i] for i in idx], tokens, positions, lens)
            last = torch.tensor(lens, device=device).cumsum(0) - 1
            probs = torch.softmax(self._stack.compute_logits(normed[last]).float(), dim=-1)
            self.stats.forward_passes += 1
            for k, i in enumerate(idx):
                growths[i].grow(probs[k: k + 1])
                root = reqs.positions[i]  # the draft's K/V now holds the committed tokens, root included
                self._kv[batch.req_ids[reqs.rows[i]]] = _DraftKV(length=root + 1, tail_start=root + 1, tail=[])
        while True:  # one pass per level over every growing tree
            live = [i for i in idx if not growths[i].done]
            if not live:
                break
            tokens_l, pos_l, kv_l, lens, topologies, frontier_rows = [], [], [], [], [], []
            offset = 0
            for i in live:
                g = growths[i]
                nodes, topology = g.query()
                root = reqs.positions[i]
                tokens_l.extend(g.tree.tokens[n] for n in nodes)
                pos_l.extend(root + d for d in g.node_depths(nodes))
                kv_l.extend(range(root + 1, root + 1 + len(nodes)))
                lens.append(len(nodes))
                topologies.append(topology)
                frontier_rows.append(list(range(offset + len(nodes) - len(g.frontier), offset + len(nodes))))
                offset += len(nodes)
            as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
            normed = final_hidden(self._runner, self._stack, [reqs.rows[i] for i in live], as_long(tokens_l),
                                  as_long(pos_l), lens, kv_positions=as_long(kv_l),
                                  tree_mask=stacked_tree_mask(topologies).to(device))
            wanted = as_long([r for rows in frontier_rows for r in rows])
            probs = torch.softmax(self._stack.compute_logits(normed[wanted]).float(), dim=-1)
            self.stats.forward_passes += 1
            self.stats.tree_levels += 1
            offset = 0
            for i, rows in zip(live, frontier_rows, strict=True):
                growths[i].grow(probs[offset: offset + len(rows)])
                offset += len(rows)
        trees = []
        for g in growths:
            tree = g.result() if g is not None else DraftTree()
            if g is not None:
                self.stats.trees += 1
                self.stats.tree_nodes += len(tree)
                self.stats.tree_nodes_grown += len(g.tree)
            trees.append(tree)
        self.stats.draft_tokens += sum(len(t) for t in trees)
        self.stats.draft_time_s += time.perf_counter() - start
        return trees

    @torch.inference_mode()
    def draft(self, reqs: DraftRequests, pending: list[list[int]] | None = None) -> list[list[int]]:
        """Up to min(num_speculative_tokens, budget) greedy drafts per request, after its committed
        tokens and `pending[i]` (which end with `reqs.tokens[i]`)."""
        from vllm_sparsever.integration.compat.runner import token_history

        start = time.perf_counter()
        pending = pending or [[] for _ in reqs.rows]
        batch = self._runner.input_batch
        drafts: list[list[int]] = [[] for _ in reqs.rows]
        # First pass per request: the tokens from its first stale draft position to its last token.
        active, seqs, firsts = [], [], []
        for i, row in enumerate(reqs.rows):
            budget = min(self.num_speculative_tokens, reqs.budgets[i])
            if budget <= 0:
                continue
            history = token_history(self._runner, row)
            committed = len(history)
            sequence_len = committed + len(pending[i])
            assert sequence_len - 1 == reqs.positions[i], "pending tokens must end at the request's position"
            kv = self._kv.get(batch.req_ids[row])
            valid = kv.valid_for(history, pending[i]) if kv is not None else 0
            first = min(valid, sequence_len - 1)  # the last token always runs: its logits draft
            tokens = [int(t) for t in history[first:]] + pending[i][max(0, first - committed):]
            active.append((i, budget))
            seqs.append(tokens)
            firsts.append(first)
            self.stats.catch_up_tokens += len(tokens) - 1
        self.stats.rounds += 1
        while active:  # one pass per draft position; requests leave at their budget
            predicted = self._predict([reqs.rows[i] for i, _ in active], seqs, firsts)
            self.stats.forward_passes += 1
            still, next_seqs, next_firsts = [], [], []
            for (i, budget), token, seq, first in zip(active, predicted, seqs, firsts, strict=True):
                drafts[i].append(token)
                if len(drafts[i]) < budget:
                    still.append((i, budget))
                    next_seqs.append([token])
                    next_firsts.append(first + len(seq))
            active, seqs, firsts = still, next_seqs, next_firsts
        # Record what the draft's K/V now holds: the sequence, then the drafts it ran (all but the last).
        for i, row in enumerate(reqs.rows):
            if not drafts[i]:
                continue
            committed = reqs.positions[i] + 1 - len(pending[i])
            tail = pending[i] + drafts[i][:-1]
            self._kv[batch.req_ids[row]] = _DraftKV(length=committed + len(tail), tail_start=committed, tail=tail)
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.draft_time_s += time.perf_counter() - start
        return drafts

    def _predict(self, rows: list[int], seqs: list[list[int]], firsts: list[int]) -> list[int]:
        """The draft model's greedy next token after the last of `seqs[i]` (run at positions
        `firsts[i]`..., writing the draft's K/V there)."""
        device = self._runner.device
        tokens, positions, lens = flatten_queries(seqs, firsts, device)
        normed = final_hidden(self._runner, self._stack, rows, tokens, positions, lens)
        last = torch.tensor(lens, device=device).cumsum(0) - 1
        return self._stack.compute_logits(normed[last]).argmax(dim=-1).tolist()


def _best_path(tree: DraftTree) -> list[int]:
    """Node indices of the tree's greedy path: the most probable child from the root down."""
    children: dict[int, list[int]] = {}
    for n, p in enumerate(tree.parents):
        children.setdefault(p, []).append(n)
    path, node = [], -1
    while children.get(node):
        node = max(children[node], key=lambda c: tree.scores[c])
        path.append(node)
    return path
