"""vLLM's n-gram prompt-lookup matcher, for drafting over tokens vLLM has not committed yet.

Private symbols touched (`vllm/v1/spec_decode/ngram_proposer.py`):
- `_find_longest_matched_ngram_and_propose_tokens(origin_tokens, min_ngram, max_ngram,
  max_model_len, k) -> np.ndarray` (numba): the longest suffix n-gram (min..max) matched earlier in
  the tokens, and up to k tokens that followed it (none if no match);
- `runner.drafter.min_n` / `.max_n` (`NgramProposer`, the prompt-lookup bounds vLLM resolved).
Hierarchical verification with draft_source='ngram' drafts after its pending tokens, which vLLM's
`NgramProposer.propose` cannot see (it reads committed tokens only).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def ngram_bounds(runner: Any) -> tuple[int, int]:
    """(min, max) n-gram length of the runner's n-gram drafter."""
    drafter = runner.drafter
    return int(drafter.min_n), int(drafter.max_n)


def match_ngram(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> list[int]:
    """Up to k tokens that followed the longest earlier match of `tokens`' suffix (n in
    [min_n, max_n]); [] when nothing matches."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

    found = _find_longest_matched_ngram_and_propose_tokens(
        origin_tokens=np.ascontiguousarray(tokens, dtype=np.int32), min_ngram=min_n, max_ngram=max_n,
        max_model_len=max_model_len, k=k,
    )
    return [int(t) for t in found]
