"""What sparsever's drafters share: the requests to draft for in a step (`DraftRequests`, collected
from the step's input, `step.DraftStep`, within each request's reserved KV slots) and
`RoundDrafter`, the base of the drafters hierarchical verification runs in rounds (n-gram prompt
lookup, the draft model): each drafts after the tokens the hierarchy holds pending, and proposes on
its own when the hierarchy is switched off."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm_sparsever.step import DraftStep
from vllm_sparsever.drafting.proposer import Proposer


@dataclass(frozen=True)
class DraftRequests:
    """Requests to draft for: batch rows, the last token of each (not yet run through any layer)
    and its position, how many drafts each may get (max_model_len, allocated KV slots), and each
    one's request id and committed tokens (prompt + accepted output, ending with `tokens[i]`)."""

    rows: list[int]
    tokens: list[int]
    positions: list[int]
    budgets: list[int]
    req_ids: list[str]
    histories: list[Any]  # np.ndarray views of vLLM's buffer (DraftStep.history)

    def subset(self, idx: list[int], **changed: list) -> "DraftRequests":
        """Requests `idx` of these, with the fields in `changed` replaced."""
        picked = {f.name: [getattr(self, f.name)[i] for i in idx] for f in fields(self)}
        return DraftRequests(**(picked | changed))


def collect_draft_requests(step: DraftStep, cap: int | None = None) -> DraftRequests:
    """The rows of `step` with a draft budget, each budget cut to `cap` (None: the step's budget,
    the positions the proposer's lookahead allows)."""
    out = DraftRequests([], [], [], [], [], [])
    for row, budget in enumerate(step.budgets):
        budget = int(budget) if cap is None else min(int(budget), cap)
        if budget <= 0:
            continue
        out.rows.append(row)
        out.tokens.append(step.sampled[row][-1])
        out.positions.append(int(step.num_tokens[row]) - 1)  # where the token sampled this step sits
        out.budgets.append(budget)
        out.req_ids.append(step.req_ids[row])
        out.histories.append(step.history(row))
    return out


class RoundDrafter(Proposer):
    """Base of a drafter the hierarchy calls once per round: `draft(reqs, pending)` (subclasses),
    `requests()`, `propose()` on its own, `load()`, and per-level stats (`stats`: a dataclass with
    `slot_limited` and `summary()`, reported under `level`)."""

    level = ""

    def __init__(self, stats: Any, *, num_speculative_tokens: int, max_model_len: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.stats = stats
        self.target: Any = None  # step.TargetView, once loaded

    def load(self, target: Any) -> None:
        self.target = target

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        return {self.level: self.stats.summary()}

    def reset_stats(self) -> None:
        self.stats = type(self.stats)()

    @property
    def lookahead(self) -> int:
        return self.num_speculative_tokens

    def requests(self, step: DraftStep, cap: int | None = None) -> DraftRequests:
        """The requests to draft for this step, their budgets cut to `cap` (counts the rows the
        allocated KV slots limited: call once per step)."""
        self.stats.slot_limited += step.slot_limited
        return collect_draft_requests(step, cap)

    def draft(self, reqs: DraftRequests, pending: list[list[int]] | None = None) -> list[list[int]]:
        raise NotImplementedError

    def propose(self, step: DraftStep) -> list[list[int]]:
        """On its own (hierarchical verification switched off at run time): drafts per batch row
        (as vLLM's n-gram drafter returns them)."""
        reqs = self.requests(step, min(self.num_speculative_tokens, step.depth))
        drafts: list[list[int]] = [[] for _ in step.sampled]
        for row, tokens in zip(reqs.rows, self.draft(reqs), strict=True):
            drafts[row] = tokens
        return drafts
