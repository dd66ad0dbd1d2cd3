"""vLLM's own model-based drafters' chains for EVICT (draft_source 'eagle' / 'eagle3' / 'mtp',
`adaptive.enabled`; drafting/evict_proposer.py wraps this drafter).

Before vLLM's drafter (an EAGLE or EAGLE-3 head, or the target's MTP layers) runs in the step,
EVICT plans the step's depth from its cost model and the steps it measured, and the drafter runs
that many draft steps (at least one: its first pass also writes the head's KV for the tokens just
verified, which later steps attend to; a step EVICT skips drops that draft). sparsever records
each draft's probability as the head gave it (compat.drafter). After the step's bookkeeping,
EVICT decides how much of each request's chain is worth verifying: the chain is a one-branch tree
whose node scores are its path probabilities (calibrated online per score, as for the draft
model's trees), cut where one more verified token stops paying for itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_sparsever.step import DraftPlan, DraftStep
from vllm_sparsever.drafting.drafter import DraftRequests, RoundDrafter
from vllm_sparsever.drafting.proposer import ProposesAfterBookkeeping
from vllm_sparsever.drafting.tree_drafter import TreeDrafting, chain_tree
from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.trees import DraftTree


@dataclass
class VllmDrafterStats:
    proposals: int = 0  # steps vLLM's drafter proposed in
    drafts_proposed: int = 0  # its drafts (every row's chain)
    drafts_kept: int = 0  # ... left after EVICT's cut
    no_probabilities: int = 0  # steps without the drafts' probabilities (drafts kept as they are)
    slot_limited: int = 0
    draft_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return counters_summary(self, "vllm_drafter_", {"draft_time_s": "vllm_drafter_time_s"})


class VllmDrafterChains(ProposesAfterBookkeeping, TreeDrafting, RoundDrafter):
    level = "vllm_drafter"

    def __init__(self, *, num_speculative_tokens: int, max_model_len: int) -> None:
        super().__init__(VllmDrafterStats(), num_speculative_tokens=num_speculative_tokens,
                         max_model_len=max_model_len)
        self.init_trees(chain_tree(num_speculative_tokens))
        self._recorder: Any = None
        self._depth = num_speculative_tokens  # the draft steps vLLM's drafter runs this step

    def load(self, target: Any) -> None:
        super().load(target)
        self._recorder = target.record_vllm_drafter()

    def plan(self) -> DraftPlan:
        """The proposal is vLLM's drafter's (inside the step, up to the configured depth: EVICT's
        proposer plans how deep and says so through `run_vllm_drafter`); the cut comes after the
        step's bookkeeping."""
        return DraftPlan(after_bookkeeping=True, vllm_depth=self.num_speculative_tokens)

    def run_vllm_drafter(self, depth: int) -> None:
        """vLLM's drafter runs `depth` draft steps this step."""
        self._depth = depth

    def propose(self, step: DraftStep) -> list[list[int]]:
        self._proposed = self.target.vllm_drafts()
        self.stats.proposals += 1
        self.stats.drafts_proposed += sum(len(d) for d in self._proposed)
        self.stats.draft_time_s += self._recorder.seconds
        if len(self._recorder.probabilities) != self._depth:
            self.stats.no_probabilities += 1
            return self._proposed
        drafts = self.propose_trees(step)
        self.stats.drafts_kept += sum(len(d) for d in drafts)
        return drafts

    def grow_trees(self, reqs: DraftRequests, levels: int, shape: Any) -> tuple[list[DraftTree], list[float]]:
        """Each request's chain as vLLM drafted it, its first `levels` drafts, scored by path
        probability; and the time of each of the drafter's passes."""
        probabilities = [p.tolist() for p in self._recorder.probabilities]
        trees = []
        for row, budget in zip(reqs.rows, reqs.budgets, strict=True):
            chain = self._proposed[row][: min(levels, budget)]
            scores, path = [], 1.0
            for depth in range(len(chain)):
                path *= probabilities[depth][row]
                scores.append(path)
            trees.append(DraftTree(list(chain), list(range(-1, len(chain) - 1)), scores))
            self.tree_stats.trees += bool(chain)
            self.tree_stats.nodes_grown += len(chain)
        return trees, [self._recorder.seconds / self._depth] * self._depth
