"""Dynamic draft trees (EAGLE-2): grown level by level from the drafter's own probabilities.

A tree hangs below the root (the request's last accepted token). Each level, the drafter runs the
`expand` most probable nodes of the newest level (by path probability: the product of the draft
probabilities along the path) and gives each of them its top-`branching` tokens as children. After
`depth` levels, the `budget` most probable nodes are kept. Since a child's path probability never
exceeds its parent's (and ties keep the older node), the kept set is prefix-closed: a tree.

The drafter's first pass runs the root (with whatever catch-up tokens precede it); each later
level runs every node expanded so far plus the new frontier (the new nodes' ancestors are among
them) under the tree's ancestor mask (`forward_scope.tree_attention`), after the root: the k-th query node's
K/V go to slot ctx + 1 + k and are rewritten identically on later levels, so no draft K/V past the
root has to be kept between levels or after drafting.

`DraftTree` (trees.py, where verification and EVICT read it too) is what a drafter hands to
verification: the nodes' tokens, their parents (-1 = the root) and path probabilities (EVICT's
benefit estimate), parents before children.
"""

from __future__ import annotations

import torch

from vllm_sparsever.trees import DraftTopology, DraftTree


class TreeGrowth:
    """One request's tree while it grows (see the module docstring)."""

    def __init__(self, *, branching: int, expand: int, depth: int, budget: int, max_expanded: int) -> None:
        self.branching = branching
        self.expand = expand
        self.depth = depth
        self.budget = budget  # nodes kept at the end
        self.max_expanded = max_expanded  # nodes the drafter may run (K/V slots after the root)
        self.tree = DraftTree()
        self.expanded: list[int] = []  # nodes run through the drafter, in order (ancestors first)
        self.frontier: list[int] = [-1]  # nodes to run this level (-1 = the root, first level)
        self.level = 0

    def query(self) -> tuple[list[int], DraftTopology]:
        """This level's pass (after the first, which runs the root): the expanded nodes, then the
        frontier, at slots ctx + 1 + k after the root (which is context by then); and the pass's
        topology (-1 = a child of the root)."""
        nodes = self.expanded + self.frontier
        index = {n: k for k, n in enumerate(nodes)}
        return nodes, DraftTopology(tuple(index.get(self.tree.parents[n], -1) for n in nodes))

    def node_depths(self, nodes: list[int]) -> list[int]:
        """Depth below the root of each of `nodes` (the root's children: 1)."""
        depths = self.tree.node_depths()
        return [depths[n] for n in nodes]

    def grow(self, probs: torch.Tensor) -> None:
        """Children for this level's frontier from the drafter's distributions after each frontier
        node (`probs[k]` for frontier[k]); then choose the next frontier."""
        self.grow_top(*probs.float().topk(self.branching, dim=-1))

    def grow_top(self, top_p: torch.Tensor, top_t: torch.Tensor) -> None:
        """`grow` from each frontier node's top tokens ([n, branching] probabilities, token ids)."""
        new: list[int] = []
        for k, node in enumerate(self.frontier):
            base = 1.0 if node < 0 else self.tree.scores[node]
            for p, t in zip(top_p[k].tolist(), top_t[k].tolist(), strict=True):
                self.tree.tokens.append(int(t))
                self.tree.parents.append(node)
                self.tree.scores.append(base * float(p))
                new.append(len(self.tree.tokens) - 1)
        self.expanded.extend(n for n in self.frontier if n >= 0)
        self.level += 1
        room = self.max_expanded - len(self.expanded)
        best = sorted(new, key=lambda n: -self.tree.scores[n])[: max(0, min(self.expand, room))]
        self.frontier = sorted(best) if self.level < self.depth else []

    def stop(self) -> None:
        """Grow no further (EVICT found that another level does not pay)."""
        self.frontier = []

    @property
    def done(self) -> bool:
        return not self.frontier

    def result(self) -> DraftTree:
        """The `budget` most probable nodes (prefix-closed), parents first."""
        order = sorted(range(len(self.tree)), key=lambda n: (-self.tree.scores[n], n))[: self.budget]
        return self.tree.subtree(sorted(order))
