"""EVICT's view of vLLM's EAGLE chains (drafting/vllm_drafter.py): each chain as a one-branch tree
scored by its path probabilities, cut to the planned levels and each request's budget."""

import pytest
import torch

from vllm_sparsever.compat.drafter import DraftRecorder
from vllm_sparsever.drafting.drafter import DraftRequests
from vllm_sparsever.drafting.vllm_drafter import VllmDrafterChains


def _drafter(proposed, probabilities, seconds=0.02):
    drafter = VllmDrafterChains(num_speculative_tokens=3, max_model_len=100)
    recorder = DraftRecorder()
    recorder.probabilities = [torch.tensor(p) for p in probabilities]
    recorder.seconds = seconds
    drafter._recorder, drafter._proposed = recorder, proposed
    return drafter


def _requests(rows, budgets):
    return DraftRequests(rows=rows, tokens=[7] * len(rows), positions=[10] * len(rows), budgets=budgets,
                         req_ids=[f"r{r}" for r in rows], histories=[None] * len(rows))


def test_chains_are_scored_by_path_probability_and_cut_to_levels_and_budget():
    drafter = _drafter([[5, 6, 7], [8, 9, 10], [1, 2, 3]], [[0.9, 0.5, 0.1], [0.8, 0.4, 0.2], [0.7, 0.6, 0.3]])
    trees, passes = drafter.grow_trees(_requests([0, 2], [3, 2]), levels=3, shape=None)
    assert passes == pytest.approx([0.02 / 3] * 3)  # the drafter's three passes (the depth it ran)
    assert trees[0].tokens == [5, 6, 7] and trees[0].is_chain()
    assert trees[0].scores == pytest.approx([0.9, 0.9 * 0.8, 0.9 * 0.8 * 0.7])
    assert trees[1].tokens == [1, 2]  # budget 2
    assert trees[1].scores == pytest.approx([0.1, 0.1 * 0.2])
    shallow, _ = drafter.grow_trees(_requests([1], [3]), levels=1, shape=None)
    assert shallow[0].tokens == [8] and shallow[0].scores == pytest.approx([0.5])
