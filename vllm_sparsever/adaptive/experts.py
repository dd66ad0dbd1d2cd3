"""How many routed experts a verify step of N tokens reads on an MoE target, for EVICT's cost.

Independent routing of N tokens over E experts, k per token, touches E(1-(1-k/E)^N) experts per
layer. A draft tree's tokens share context, so they share experts: real MoEs sit at 55-72% of the
independent curve, the fine-grained MoEfied SmolLM2 at 71-84% (bench/results/moefication_fg_*.md).
`ExpertUnionModel` keeps the independent form with an effective token count: N tokens route like
1 + s(N - 1) independent ones, s in [0, 1] (s = 1: independent; s = 0: every token picks the same
k). s is measured online from the target's verify steps (verification/lossless/expert_counter.py hands over
each layer's tokens and distinct experts) and starts at 1, the conservative guess: until steps are
seen, a step is predicted to read as many experts as random tokens do, which is what the offline
cost profile measured.
"""

from __future__ import annotations

import math

DECAY = 0.995  # per observed layer: about the last 200 layer-steps count (a few verify steps)


class ExpertUnionModel:
    def __init__(self, num_experts: int, top_k: int) -> None:
        if not 0 < top_k <= num_experts:
            raise ValueError(f"MoE routing: top_k={top_k} of num_experts={num_experts} (allowed: 0 < top_k <= experts)")
        self.num_experts = num_experts
        self.top_k = top_k
        self._miss = math.log1p(-top_k / num_experts) if top_k < num_experts else None  # log P(expert not picked)
        self._shared = 0.0  # decayed sum of observed effective extra tokens (N_eff - 1)
        self._extra = 0.0  # decayed sum of extra tokens (N - 1)

    @property
    def sharing(self) -> float:
        """s: extra tokens count as s independent ones (1 until steps are observed)."""
        return self._shared / self._extra if self._extra > 0 else 1.0

    def distinct(self, tokens: float, sharing: float | None = None) -> float:
        """Expected distinct routed experts per layer among `tokens` tokens of one step."""
        if tokens <= 0:
            return 0.0
        if self._miss is None:
            return float(self.num_experts)
        s = self.sharing if sharing is None else sharing
        effective = 1.0 + s * (tokens - 1.0)
        return self.num_experts * -math.expm1(effective * self._miss)

    def fraction(self, tokens: float) -> float:
        """Share of a layer's routed expert weights a step of `tokens` tokens reads."""
        return self.distinct(tokens) / self.num_experts

    def observe(self, tokens: int, distinct: int) -> None:
        """One MoE layer of a verify step: `tokens` tokens routed to `distinct` experts."""
        if tokens <= 1 or self._miss is None:
            return
        d = min(max(distinct, self.top_k), self.num_experts - 0.5)  # inside the curve's range
        effective = math.log1p(-d / self.num_experts) / self._miss
        self._shared = DECAY * self._shared + min(max(effective - 1.0, 0.0), tokens - 1.0)
        self._extra = DECAY * self._extra + (tokens - 1.0)
