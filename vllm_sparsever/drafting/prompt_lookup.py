"""n-gram prompt lookup as the drafter of hierarchical verification (draft_source='ngram').

Each round drafts what followed the longest earlier match of the request's suffix, where the suffix
includes the tokens the hierarchy holds pending (vLLM's own n-gram drafter sees committed tokens
only, so it cannot draft a second round). The matcher is vLLM's (compat.ngram), with the
prompt-lookup bounds vLLM resolved for this engine. It reads no weights and writes no KV.

Under EVICT (`adaptive`, drafting/evict_proposer.py) it proposes on its own as one-branch trees (chains): an n-gram match has
no probabilities, so draft d of a chain gets the score NGRAM_SCORE**d, one calibration bin per
depth, and EVICT's online calibration learns each depth's acceptance rate from what verification
accepted. EVICT then cuts every request's chain to the length that pays for its verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_sparsever.step import DraftStep
from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.drafting.drafter import DraftRequests, RoundDrafter
from vllm_sparsever.trees import DraftTree
from vllm_sparsever.drafting.tree_drafter import TreeDrafting

# Prior score of an n-gram draft per depth (calibrated online): half the drafts at each depth accepted.
NGRAM_SCORE = 0.5


@dataclass
class PromptLookupStats:
    rounds: int = 0  # draft() calls
    lookups: int = 0  # requests looked up
    no_match: int = 0  # ... that found no n-gram match
    draft_tokens: int = 0
    slot_limited: int = 0  # see SelfDraftStats.slot_limited
    draft_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return counters_summary(self, "prompt_lookup_", {"draft_tokens": "prompt_lookup_tokens",
                                                         "draft_time_s": "prompt_lookup_time_s"})


class PromptLookupDrafter(TreeDrafting, RoundDrafter):
    level = "prompt_lookup"
    depth_prior = NGRAM_SCORE
    one_pass = True

    def __init__(self, *, num_speculative_tokens: int, max_model_len: int, tree: Any = None) -> None:
        """`tree`: `tree_drafter.chain_tree` for chains as one-branch trees (EVICT-cut), or None."""
        super().__init__(PromptLookupStats(), num_speculative_tokens=num_speculative_tokens,
                         max_model_len=max_model_len)
        self._bounds = (0, 0)
        self.init_trees(tree)

    def load(self, target: Any) -> None:
        from vllm_sparsever.compat.ngram import match_ngram

        super().load(target)
        self._bounds = target.ngram_bounds()
        # Compile the numba matcher now (seconds), not on the first request.
        match_ngram(np.arange(4, dtype=np.int32), *self._bounds, self.max_model_len, 1)

    def draft(self, reqs: DraftRequests, pending: list[list[int]] | None = None,
              limit: int | None = None) -> list[list[int]]:
        """Up to min(num_speculative_tokens, `limit`, budget) drafts per request: what followed the
        longest earlier match of its committed tokens + `pending[i]` (which end with `reqs.tokens[i]`)."""
        from vllm_sparsever.compat.ngram import match_ngram

        start = time.perf_counter()
        min_n, max_n = self._bounds
        drafts = []
        for i, history in enumerate(reqs.histories):
            tail = pending[i] if pending else []
            tokens = np.concatenate([history, np.asarray(tail, dtype=history.dtype)]) if tail else history
            k = min(self.num_speculative_tokens, limit or self.num_speculative_tokens, reqs.budgets[i])
            found = match_ngram(tokens, min_n, max_n, self.max_model_len, k) if k > 0 else []
            self.stats.lookups += 1
            self.stats.no_match += not found
            self.stats.draft_tokens += len(found)
            drafts.append(found)
        self.stats.rounds += 1
        self.stats.draft_time_s += time.perf_counter() - start
        return drafts

    def propose(self, step: DraftStep) -> list[list[int]]:
        if self.tree is None:
            return super().propose(step)
        return self.propose_trees(step)

    def grow_trees(self, reqs: DraftRequests, levels: int, shape: Any) -> tuple[list[DraftTree], list[float]]:
        """EVICT's chains: each request's n-gram continuation of at most `levels` drafts, with a score
        per depth (module docstring); and the lookups' time (one pass for every level)."""
        start = time.perf_counter()
        trees = []
        for found in self.draft(reqs, limit=levels):
            n = len(found)
            trees.append(DraftTree(list(found), list(range(-1, n - 1)), [NGRAM_SCORE ** (d + 1) for d in range(n)]))
            self.tree_stats.trees += bool(n)
            self.tree_stats.nodes_grown += n
        return trees, [time.perf_counter() - start]
