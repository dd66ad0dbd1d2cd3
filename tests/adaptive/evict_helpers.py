"""Made-up verify-cost profiles and draft chains the EVICT tests (engine and facade) price."""

from __future__ import annotations

from vllm_sparsever.adaptive.cost import Measurement, VerifyCostProfile
from vllm_sparsever.trees import DraftTree


def made_up_profile(per_token_s: float = 0.001, base_s: float = 0.05, per_ctx_s: float = 0.0,
                    dtype: str = "float32", moe: list[int] | None = None) -> VerifyCostProfile:
    """A profile whose step time is base + per_token * rows * tokens + per_ctx * rows * context."""
    ms = [Measurement(mask, r, q, c, base_s + per_token_s * r * q + per_ctx_s * r * c,
                      **({"experts": 0.5} if moe else {}))
          for mask in ("tree", "chain") for r in (1, 4, 8) for q in (1, 2, 4, 8, 16) for c in (256, 4096)]
    return VerifyCostProfile(model="m", hardware="h", dtype=dtype, measurements=ms, moe=moe).fit()


def chain_of(probs: list[float]) -> DraftTree:
    """A chain drafted with these per-token probabilities (scores: their running products)."""
    scores, s = [], 1.0
    for p in probs:
        s *= p
        scores.append(s)
    return DraftTree(list(range(10, 10 + len(probs))), list(range(-1, len(probs) - 1)), scores)
