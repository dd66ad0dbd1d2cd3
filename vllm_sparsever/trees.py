"""Draft trees, the plugin's own types on the base floor: drafting grows them, EVICT prices and cuts
them, the verification plan lays them out and tree acceptance walks them.

`DraftTopology` is how a request's query tokens hang together in a verify step (a chain, or a tree:
each token's parent); `DraftTree` is a drafter's tree for one request (tokens, parents, path
probabilities); `stacked_tree_mask` is the ancestor mask of a step's consecutive requests, as the
tree-attention kernel reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTopology:
    """How a request's query tokens hang together: `parents[i]` is the query index of token i's
    parent, -1 for the root (the last accepted token). A chain is (-1, 0, 1, ...)."""

    parents: tuple[int, ...]

    @classmethod
    def chain(cls, num_query_tokens: int) -> "DraftTopology":
        return cls(tuple(range(-1, num_query_tokens - 1)))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def prefix(self, n: int) -> "DraftTopology":
        """The first `n` tokens' topology (parents precede children, so still a tree)."""
        return DraftTopology(self.parents[:n])

    def depths(self) -> list[int]:
        """Depth of every token below the root (root 0)."""
        out: list[int] = []
        for i, parent in enumerate(self.parents):
            if parent >= i:
                raise ValueError(f"parents must precede their children: token {i} has parent {parent}")
            out.append(0 if parent < 0 else out[parent] + 1)
        return out

    def children(self) -> list[list[int]]:
        """Children of every token, in token order."""
        out: list[list[int]] = [[] for _ in self.parents]
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                out[parent].append(i)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: token i may attend to query token j (j is i or one of its ancestors)."""
        n = len(self.parents)
        if self.is_chain:
            return torch.ones(n, n, dtype=torch.bool).tril()
        mask = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= i:
                raise ValueError(f"parents must precede their children: token {i} has parent {parent}")
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask


@dataclass
class DraftTree:
    """A drafter's tree for one request (drafting/tree.py grows them): nodes' tokens, parents before
    children, and path probabilities (EVICT's benefit estimate)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index into tokens; -1 = the root
    scores: list[float] = field(default_factory=list)  # path probability under the drafter

    def __len__(self) -> int:
        return len(self.tokens)

    def topology(self) -> DraftTopology:
        """The verify step's topology: query token 0 is the root, node j is query token j + 1."""
        return DraftTopology((-1, *(p + 1 for p in self.parents)))

    def node_depths(self) -> list[int]:
        """Each node's depth below the root (the root's children: 1)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def depth(self) -> int:
        return max(self.node_depths(), default=0)

    def subtree(self, keep: list[int]) -> "DraftTree":
        """The nodes `keep` (ascending, prefix-closed), re-indexed."""
        index = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            p = self.parents[old]
            if p >= 0 and p not in index:
                raise ValueError(f"node {old} kept without its parent {p}")
            parents.append(index[p] if p >= 0 else -1)
        return DraftTree([self.tokens[i] for i in keep], parents, [self.scores[i] for i in keep])

    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def best_path(self) -> list[int]:
        """Node indices of the greedy path: the most probable child from the root down."""
        children: dict[int, list[int]] = {}
        for n, p in enumerate(self.parents):
            children.setdefault(p, []).append(n)
        path, node = [], -1
        while children.get(node):
            node = max(children[node], key=lambda c: self.scores[c])
            path.append(node)
        return path


def stacked_tree_mask(topologies: Sequence[DraftTopology]) -> torch.Tensor:
    """[T, max_q_len] uint8 ancestor masks of consecutive requests' query tokens (the tree_mask of
    `block_sparse_tree_attention`)."""
    lens = [len(t.parents) for t in topologies]
    mask = torch.zeros(sum(lens), max(lens, default=0), dtype=torch.uint8)
    start = 0
    for t, n in zip(topologies, lens, strict=True):
        if n:
            mask[start: start + n, :n] = t.ancestor_mask().to(torch.uint8)
        start += n
    return mask
