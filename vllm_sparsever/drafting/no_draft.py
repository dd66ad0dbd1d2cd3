"""Drafting off (draft_source='none'): every step is a plain decode step of sparsever's engine.

What the benchmarks measure as "sparsever's kernels alone" (its attention and linear kernels on plain
steps, no speculation), and the state EVICT's guard puts a step in when drafting does not pay: a depth of
0. It reads nothing and proposes nothing; vLLM's own drafter does not run either (the runner asks this
proposer instead).
"""

from __future__ import annotations

from typing import Any

from vllm_sparsever.step import DraftStep
from vllm_sparsever.drafting.proposer import Proposer


class NoDraftProposer(Proposer):
    def load(self, target: Any) -> None:
        pass

    @property
    def lookahead(self) -> int:
        return 0

    def plan_depth(self, step: DraftStep) -> int:
        return 0

    def propose(self, step: DraftStep) -> list[list[int]]:
        return [[] for _ in step.req_ids]
