"""Draft trees without an engine: EAGLE-2 growth (drafting/tree.py), tree acceptance and the
accepted path's K/V compaction (verification/lossless/tree_acceptance.py), and the plan's tree step (plan.py)."""

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sparsever.drafting.tree import TreeGrowth
from vllm_sparsever.plan import build_verification_plan
from vllm_sparsever.trees import DraftTopology, DraftTree, stacked_tree_mask
from vllm_sparsever.verification.lossless.tree_acceptance import accept_greedy, accept_sampled, compact_accepted_kv

V = 16


def _probs(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.softmax(torch.tensor(rng.normal(size=(n, V)) * 2.0, dtype=torch.float32), dim=-1)


def _grow(seed: int, branching: int, expand: int, depth: int, budget: int, max_expanded: int):
    rng = np.random.default_rng(seed)
    g = TreeGrowth(branching=branching, expand=expand, depth=depth, budget=budget, max_expanded=max_expanded)
    passes = []
    g.grow(_probs(rng, 1))  # the root's pass
    while not g.done:
        nodes, topology = g.query()
        passes.append((nodes, topology, list(g.frontier)))
        g.grow(_probs(rng, len(g.frontier)))
    return g, passes


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), branching=st.integers(1, 4), expand=st.integers(1, 4),
       depth=st.integers(1, 6), budget=st.integers(1, 24), slots=st.integers(0, 24))
def test_tree_growth_invariants(seed, branching, expand, depth, budget, slots):
    g, passes = _grow(seed, branching, expand, depth, budget, slots)
    tree = g.result()
    assert len(tree) == min(budget, len(g.tree))
    # Prefix-closed, parents first, and the kept nodes are the most probable ones.
    assert all(p < j for j, p in enumerate(tree.parents))
    kept = sorted(tree.scores, reverse=True)
    assert kept == sorted(g.tree.scores, reverse=True)[: len(tree)]
    # Path probabilities never grow along a path; depth bounded; children of a node distinct.
    for j, p in enumerate(tree.parents):
        if p >= 0:
            assert tree.scores[j] <= tree.scores[p] + 1e-12
    assert tree.depth() <= depth
    for parent in set(tree.parents):
        kids = [tree.tokens[j] for j, p in enumerate(tree.parents) if p == parent]
        assert len(kids) == len(set(kids))
    # Every pass stays within the slots and runs each query node's ancestors before it.
    for nodes, topology, frontier in passes:
        assert len(nodes) <= slots and nodes[-len(frontier):] == frontier
        for k, parent in enumerate(topology.parents):
            want = g.tree.parents[nodes[k]]
            assert (parent == -1 and want == -1) or nodes[parent] == want


def test_tree_growth_expands_the_most_probable_nodes():
    g = TreeGrowth(branching=2, expand=1, depth=3, budget=10, max_expanded=10)
    p = torch.zeros(1, V)
    p[0, 3], p[0, 5] = 0.6, 0.3
    g.grow(p)  # root -> 3 (0.6), 5 (0.3)
    assert g.frontier == [0]
    nodes, topology = g.query()
    assert nodes == [0] and topology.parents == (-1,)
    q = torch.zeros(1, V)
    q[0, 7], q[0, 9] = 0.5, 0.4
    g.grow(q)  # 3 -> 7 (0.30), 9 (0.24)
    assert g.frontier == [2]
    nodes, topology = g.query()
    assert nodes == [0, 2] and topology.parents == (-1, 0)
    assert g.node_depths(nodes) == [1, 2]
    tree = g.result()
    assert tree.tokens[:2] == [3, 5]


def test_draft_tree_topology_and_subtree():
    tree = DraftTree([3, 5, 7, 9], [-1, -1, 0, 2], [0.6, 0.3, 0.3, 0.1])
    assert tree.topology().parents == (-1, 0, 0, 1, 3)
    sub = tree.subtree([0, 2, 3])
    assert sub.tokens == [3, 7, 9] and sub.parents == [-1, 0, 1] and sub.is_chain()
    with pytest.raises(ValueError, match="without its parent"):
        tree.subtree([0, 3])


# ---- acceptance ---------------------------------------------------------------------------

TOPOLOGY = DraftTopology((-1, 0, 0, 1, 1, 2))  # root; a, b; a->c, a->d; b->e
TOKENS = [-1, 4, 6, 8, 9, 11]


def _one_hot_logits(argmax: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmax), V)
    for i, t in enumerate(argmax):
        logits[i, t] = 5.0
    return logits


def test_accept_greedy_walks_the_matching_branch():
    # target: after root 6 (b), after b 11 (e), after e 2 -> path b, e then 2.
    path, final = accept_greedy(TOPOLOGY, TOKENS, _one_hot_logits([6, 8, 11, 0, 0, 2]))
    assert path == [2, 5] and final == 2
    # target disagrees at the root: no draft accepted, its own token emitted.
    path, final = accept_greedy(TOPOLOGY, TOKENS, _one_hot_logits([13, 8, 11, 0, 0, 2]))
    assert path == [] and final == 13
    # second child of a: a, d, then the bonus after d.
    path, final = accept_greedy(TOPOLOGY, TOKENS, _one_hot_logits([4, 9, 0, 0, 15, 0]))
    assert path == [1, 4] and final == 15


def test_accept_sampled_emits_the_target_distribution():
    """Whatever the children, the first emitted token is distributed as the target's p at the root."""
    rng = np.random.default_rng(0)
    probs = _probs(rng, len(TOPOLOGY.parents))
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    first = Counter()
    for _ in range(n):
        path, final = accept_sampled(TOPOLOGY, TOKENS, probs, gen)
        first[TOKENS[path[0]] if path else final] += 1
    p = probs[0].double()
    expected = p * n
    keep = expected >= 5
    observed = torch.tensor([first[t] for t in range(V)], dtype=torch.float64)
    stat = float((((observed - expected) ** 2 / expected)[keep]).sum())
    dof = int(keep.sum()) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2)))
    assert pvalue > 1e-3
    # It does accept drafts (not just sample corrections).
    assert first[TOKENS[1]] > 0 and first[TOKENS[2]] > 0


def test_accept_sampled_second_token_given_first_follows_the_child_distribution():
    rng = np.random.default_rng(1)
    probs = _probs(rng, len(TOPOLOGY.parents))
    gen = torch.Generator().manual_seed(1)
    seconds = Counter()
    n = 0
    for _ in range(40_000):
        path, final = accept_sampled(TOPOLOGY, TOKENS, probs, gen)
        if path[:1] == [1]:  # first token = a: the next one must follow p after a (row 1)
            seconds[TOKENS[path[1]] if len(path) > 1 else final] += 1
            n += 1
    expected = probs[1].double() * n
    keep = expected >= 5
    observed = torch.tensor([seconds[t] for t in range(V)], dtype=torch.float64)
    stat = float((((observed - expected) ** 2 / expected)[keep]).sum())
    dof = int(keep.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2))) > 1e-3


# ---- K/V compaction -----------------------------------------------------------------------


class _Layer:
    isa = "vec"  # the KV layout vLLM's builder set on the layer

    class impl:  # noqa: N801 - stands in for the attention impl (no summaries)
        pass


class _LKV:
    def __init__(self, kv, table, bs):
        self.layer, self.kv_cache, self.block_table, self.block_size = _Layer(), kv, table, bs


def test_compact_accepted_kv_moves_the_path_into_place():
    from vllm_sparsever.verification.lossless.kv_layout import paged_kv_views

    nb, hkv, bs, d = 6, 2, 4, 8
    kv = torch.randn(nb, hkv, bs, 2 * d)
    table = torch.tensor([[4, 1, 3], [0, 2, 5]], dtype=torch.int32)
    before = kv.clone()
    key0, value0 = paged_kv_views(before)
    # row 0: ctx 2, path nodes 2 then 5 -> positions 4, 7 move to 3, 4; row 1: path [1] stays.
    moved = compact_accepted_kv([_LKV(kv, table, bs)], [(0, 2, [2, 5]), (1, 5, [1])])
    assert moved == 2
    key, value = paged_kv_views(kv)

    def at(t, row, pos):
        return t[int(table[row, pos // bs]), :, pos % bs]

    assert torch.equal(at(key, 0, 3), at(key0, 0, 4)) and torch.equal(at(value, 0, 3), at(value0, 0, 4))
    assert torch.equal(at(key, 0, 4), at(key0, 0, 7)) and torch.equal(at(value, 0, 4), at(value0, 0, 7))
    # Nothing else changed.
    changed = (kv != before).flatten(2).any(-1)  # [nb, hkv]
    blocks = {int(table[0, 0]), int(table[0, 1])}
    assert all(int(b) in blocks for b in changed.nonzero()[:, 0])


# ---- plan -----------------------------------------------------------------------------------


def test_plan_tree_step_mask_and_positions():
    topology = DraftTopology((-1, 0, 0, 1))
    plan = build_verification_plan(
        step=1, req_ids=["a", "b", "c"], num_scheduled_tokens=np.array([4, 3, 1]),
        num_computed_tokens=np.array([10, 20, 30]),
        scheduled_spec_decode_tokens={"a": [5, 6, 7], "b": [8, 9]},
        block_table=torch.zeros(3, 8, dtype=torch.int32), block_size=16, topologies={"a": topology},
    )
    a, b = plan.requests
    assert a.topology == topology and b.topology.is_chain
    assert plan.tree is not None and plan.tree.tree_requests == (0,)
    assert plan.tree.positions.tolist() == [10, 11, 11, 12, 20, 21, 22, 30]
    assert torch.equal(plan.tree.mask, stacked_tree_mask([topology, DraftTopology.chain(3), DraftTopology.chain(1)]))
    assert plan.tree.mask[3, :4].tolist() == [1, 1, 0, 1]
    # The scheduler cut a's drafts: the prefix of its tree verifies.
    cut = build_verification_plan(
        step=2, req_ids=["a"], num_scheduled_tokens=np.array([3]), num_computed_tokens=np.array([10]),
        scheduled_spec_decode_tokens={"a": [5, 6]}, block_table=torch.zeros(1, 8, dtype=torch.int32),
        block_size=16, topologies={"a": topology},
    )
    assert cut.requests[0].topology.parents == (-1, 0, 0)
    # No trees: no tree step.
    chain = build_verification_plan(
        step=3, req_ids=["a"], num_scheduled_tokens=np.array([3]), num_computed_tokens=np.array([10]),
        scheduled_spec_decode_tokens={"a": [5, 6]}, block_table=torch.zeros(1, 8, dtype=torch.int32), block_size=16,
    )
    assert chain.tree is None
