"""Hierarchical verification (HiSpec): drafter -> intermediate verifier -> full target.

The intermediate verifier is the target's first L_v layers plus the head trained at L_v. Each round,
the self-drafter proposes up to `round_tokens` drafts per request; the intermediate verifier runs
[last pending token, drafts] through layers 0..L_v-1 in one pass and keeps the drafts its head agrees
with (greedy) plus its own next token (the correction, or a bonus when all agree). These tokens
accumulate as *pending*. Rounds repeat up to `rounds` times or until `cap` tokens are pending; then
the pending tokens go to vLLM as this step's drafts, and the full target verifies them all in one
pass with vLLM's rejection sampler.

Only fully verified tokens are ever emitted: pending tokens are drafts to vLLM, so the scheduler
emits what the full target accepts, plus its own correction or bonus token, and nothing else. A
pending token the full target rejects is rolled back the way vLLM rolls back any rejected draft:
its KV slots are rewritten by the next step. The output is therefore the target's, token for token
(greedy), and distributed as the target's when sampling (the pending tokens are one-hot proposals
to the rejection sampler).

KV: every intermediate pass writes layers 0..L_v-1's K/V at the positions of its tokens, the drafter
layers 0..L_d-1's; all these positions are rewritten by the next full verification before being
read, and the scheduler reserves cap + round_tokens lookahead slots for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.drafting.early_exit_model import EarlyExitModel
from vllm_sparsever.drafting.self_draft import DraftRequests, SelfDraftProposer


@dataclass
class HierarchicalStats:
    rounds: int = 0  # drafter + intermediate-verifier rounds, summed over requests
    intermediate_passes: int = 0  # batched intermediate-verifier forward passes
    intermediate_drafts: int = 0  # drafts the intermediate verifier checked
    intermediate_accepted: int = 0  # ... and accepted
    pending_tokens: int = 0  # tokens sent to the full target (accepted drafts + corrections, capped)
    draft_time_s: float = 0.0
    intermediate_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "hier_rounds": self.rounds,
            "hier_intermediate_passes": self.intermediate_passes,
            "hier_intermediate_drafts": self.intermediate_drafts,
            "hier_intermediate_accepted": self.intermediate_accepted,
            "hier_intermediate_acceptance_rate": self.intermediate_accepted / max(self.intermediate_drafts, 1),
            "hier_pending_tokens": self.pending_tokens,
            "hier_draft_time_s": self.draft_time_s,
            "hier_intermediate_time_s": self.intermediate_time_s,
        }


class HierarchicalProposer:
    def __init__(
        self,
        drafter: SelfDraftProposer,
        model: EarlyExitModel,
        *,
        verify_layer: int,
        cap: int,
        rounds: int,
    ) -> None:
        self.drafter = drafter
        self.model = model
        self.verify_layer = verify_layer
        self.cap = cap
        self.rounds = rounds
        self.round_tokens = drafter.num_speculative_tokens
        self.stats = HierarchicalStats()

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        return {**self.drafter.stats_by_level(), "hierarchical": self.stats.summary()}

    def reset_stats(self) -> None:
        self.drafter.reset_stats()
        self.stats = HierarchicalStats()

    def propose(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Pending tokens per batch row, to be verified by the full target as this step's drafts."""
        reqs = self.drafter.requests(sampled_token_ids, reserve=self.cap + self.round_tokens)
        n = len(reqs.rows)
        pending: list[list[int]] = [[] for _ in range(n)]
        live = [True] * n
        for _ in range(self.rounds):
            # Positions P+m .. P+m+g are written this round (drafter: g, verifier: g + 1).
            idx = [i for i in range(n) if live[i] and len(pending[i]) < self.cap]
            budgets = [min(self.round_tokens, reqs.budgets[i] - len(pending[i]) - 1,
                           self.cap - len(pending[i])) for i in idx]
            idx = [i for i, b in zip(idx, budgets, strict=True) if b > 0]
            budgets = [b for b in budgets if b > 0]
            if not idx:
                break
            sub = DraftRequests(
                rows=[reqs.rows[i] for i in idx],
                tokens=[pending[i][-1] if pending[i] else reqs.tokens[i] for i in idx],
                positions=[reqs.positions[i] + len(pending[i]) for i in idx],
                budgets=budgets,
            )
            start = time.perf_counter()
            drafts = self.drafter.draft(sub)
            self.stats.draft_time_s += time.perf_counter() - start
            start = time.perf_counter()
            kept = self._verify(sub, drafts)
            self.stats.intermediate_time_s += time.perf_counter() - start
            for i, d, k in zip(idx, drafts, kept, strict=True):
                if not d:  # the drafter stopped (confidence): nothing more for this request
                    live[i] = False
                    continue
                self.stats.rounds += 1
                pending[i].extend(k)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        for i, row in enumerate(reqs.rows):
            out[row] = pending[i][: self.cap]
            self.stats.pending_tokens += len(out[row])
        return out

    @torch.inference_mode()
    def _verify(self, sub: DraftRequests, drafts: list[list[int]]) -> list[list[int]]:
        """Per request: the drafts the intermediate head agrees with, then its own next token."""
        which = [j for j, d in enumerate(drafts) if d]
        kept: list[list[int]] = [[] for _ in drafts]
        if not which:
            return kept
        device = self.model.device
        tokens, positions, lens = [], [], []
        for j in which:
            seq = [sub.tokens[j], *drafts[j]]
            tokens.extend(seq)
            positions.extend(range(sub.positions[j], sub.positions[j] + len(seq)))
            lens.append(len(seq))
        predicted_t, _ = self.model.predict(
            self.verify_layer, torch.tensor([sub.rows[j] for j in which], dtype=torch.long),
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device), lens,
        )
        predicted = predicted_t.tolist()
        self.stats.intermediate_passes += 1
        offset = 0
        for j, length in zip(which, lens, strict=True):
            pred = predicted[offset: offset + length]  # pred[t]: the head's token after position t
            d = drafts[j]
            accepted = 0
            while accepted < len(d) and d[accepted] == pred[accepted]:
                accepted += 1
            kept[j] = d[:accepted] + [pred[accepted]]
            self.stats.intermediate_drafts += len(d)
            self.stats.intermediate_accepted += accepted
            offset += length
        return kept
