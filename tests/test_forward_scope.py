"""forward_scope: the plan and tree mask of the forward now running, scoped and restored."""

import numpy as np
import torch

from vllm_sparsever.forward_scope import active_plan, current_plan, current_tree_mask, tree_attention
from vllm_sparsever.plan import build_verification_plan
from vllm_sparsever.trees import DraftTopology


def _plan(topologies=None):
    return build_verification_plan(
        step=3, req_ids=["a"], num_scheduled_tokens=np.array([3]), num_computed_tokens=np.array([5]),
        scheduled_spec_decode_tokens={"a": [7, 8]}, block_table=torch.zeros(1, 4, dtype=torch.int32),
        block_size=4, topologies=topologies)


def test_active_plan_is_scoped():
    plan = _plan()
    assert current_plan() is None and current_tree_mask() is None
    with active_plan(plan):
        assert current_plan() is plan and current_tree_mask() is None  # a chain: attention stays causal
    assert current_plan() is None


def test_a_plan_with_trees_shows_its_mask_and_a_drafting_mask_hides_no_plan():
    tree = _plan({"a": DraftTopology(parents=(-1, 0, 0))})
    assert tree.tree is not None
    mask = torch.ones(2, 2, dtype=torch.uint8)
    with active_plan(tree):
        assert current_tree_mask() is tree.tree.mask
        with tree_attention(mask):  # a drafting pass inside: its mask, the plan unchanged
            assert current_tree_mask() is mask and current_plan() is tree
        assert current_tree_mask() is tree.tree.mask
        with active_plan(None):  # a forward that verifies nothing: no plan and no mask
            assert current_plan() is None and current_tree_mask() is None
        assert current_plan() is tree
    with tree_attention(mask):  # drafting outside a target forward is never taken for a verification
        assert current_plan() is None and current_tree_mask() is mask
    assert current_tree_mask() is None
