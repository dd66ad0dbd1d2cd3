"""Hierarchical verification (HiSpec): drafter -> intermediate verifier -> full target.

Each round, the drafter (the self-drafter, n-gram prompt lookup, the draft model, or an EAGLE /
EAGLE-3 head: drafting/eagle_head.py) proposes up to `round_tokens`
drafts per request; the intermediate verifier (drafting/intermediate.py: the target's first L_v
layers plus their exit head, or the whole target with sparse verification) runs [last pending
token, drafts] in one pass and keeps the drafts it agrees with (greedy) plus its own next token
(the correction, or a bonus when all agree). These tokens accumulate as *pending*. Rounds repeat up
to `rounds` times, until `cap` tokens are pending, or until a request's pending tokens reach one of
its stop tokens or its max_tokens; then the pending tokens go to vLLM as this step's drafts, and
the full target verifies them all in one pass with vLLM's rejection sampler.

Only fully verified tokens are ever emitted: pending tokens are drafts to vLLM, so the scheduler
emits what the full target accepts, plus its own correction or bonus token, and nothing else. A
pending token the full target rejects is rolled back the way vLLM rolls back any rejected draft:
its KV slots are rewritten by the next step. The output is therefore the target's, token for token
(greedy), and distributed as the target's when sampling (the pending tokens are one-hot proposals
to the rejection sampler).

KV: every intermediate pass writes the K/V of the layers it runs at the positions of its tokens, the
self-drafter layers 0..L_d-1's; all these positions are rewritten by the next full verification
before being read, and the scheduler reserves cap + round_tokens lookahead slots for them.

With the sparse target as the intermediate verifier, a round whose drafter found nothing still runs
it on the last pending token alone: the sparse target then drafts for the dense one by itself.

Reuse across levels (`reuse_hidden_states`, early-exit intermediate verifier only): layers
0..L_v-1 are the target's own, so the intermediate passes have already computed them for the
request's sampled token and every pending token but the last (the verifier's own correction,
which no pass has run yet), and written their K/V. The hierarchy then drops that correction from
the pending tokens (the full target emits its own token there), keeps the residual stream at L_v
of each remaining token, and the full pass starts at layer L_v from those streams
(`ReusableStates`; `streams_for_step`, asked by the runner before its forward, then
`forward_from_streams`): at batch 1 it reads L_v fewer layers' weights.
A step whose rows do not all have their streams (a prefill chunk, a row that drafted nothing) runs
the whole model as usual.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.step import DraftPlan, DraftStep
from vllm_sparsever.drafting.drafter import DraftRequests
from vllm_sparsever.drafting.proposer import Proposer


@dataclass(frozen=True)
class ReusableStates:
    """The residual streams after the intermediate layer of a request's next full-pass tokens: its
    sampled token at `first_position`, then its pending tokens (`token_ids`, in order)."""

    first_position: int
    token_ids: tuple[int, ...]
    states: torch.Tensor  # [len(token_ids), hidden]


@dataclass
class HierarchicalStats:
    rounds: int = 0  # drafter + intermediate-verifier rounds, summed over requests
    intermediate_passes: int = 0  # batched intermediate-verifier forward passes
    intermediate_drafts: int = 0  # drafts the intermediate verifier checked
    intermediate_accepted: int = 0  # ... and accepted
    pending_tokens: int = 0  # tokens sent to the full target (accepted drafts + corrections, capped)
    stopped_at_stop_token: int = 0  # requests whose rounds ended on a stop token (EOS, stop ids)
    stopped_at_max_tokens: int = 0  # requests whose pending tokens reached their max_tokens
    # Reuse across levels: full passes started at the intermediate layer, the layers and tokens
    # they skipped, the verifier corrections dropped for it, and steps that could not reuse.
    reuse_steps: int = 0
    reuse_layers_skipped: int = 0
    reuse_tokens: int = 0
    reuse_dropped_corrections: int = 0
    reuse_missed_steps: int = 0
    draft_time_s: float = 0.0
    intermediate_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {**counters_summary(self, "hier_"),
                "hier_intermediate_acceptance_rate": self.intermediate_accepted / max(self.intermediate_drafts, 1)}


class HierarchicalProposer(Proposer):
    def __init__(self, drafter: Any, verifier: Any, *, cap: int, rounds: int, reuse: bool = False) -> None:
        """`drafter`: `requests()`/`draft()` (SelfDraftProposer, PromptLookupDrafter,
        DraftModelDrafter, EagleHeadDrafter: it reads the sparse verifier's states); `verifier`:
        `predict()` (EarlyExitVerifier, SparseTargetVerifier)."""
        if reuse and verifier.name != "early_exit":
            raise ValueError("reuse of hidden states needs the early-exit intermediate verifier (the target's own layers)")
        # An EAGLE head drafts each round from the target's states of the pending tokens.
        self._drafter_reads_states = drafter.plan().target_states
        if self._drafter_reads_states and verifier.name != "sparse":
            raise ValueError("an EAGLE head drafts from the target's states of the pending tokens, which only the "
                             "sparse target as intermediate verifier computes")
        self.drafter = drafter
        self.verifier = verifier
        self.cap = cap
        self.rounds = rounds
        self.round_tokens = drafter.num_speculative_tokens
        # The sparse target is a drafter in its own right: it runs even when the drafter has nothing.
        self.verify_without_drafts = verifier.name == "sparse"
        self.reuse = reuse
        self._reusable: dict[str, ReusableStates] = {}
        self._stack: Any = None  # the target's decoder stack (forward_from_streams), looked up once
        self.target: Any = None  # step.TargetView, once loaded
        self.stats = HierarchicalStats()

    def streams_for_step(self, num_scheduled_tokens: Any) -> tuple[int, torch.Tensor] | None:
        """For the full pass about to run: (layer, the saved residual stream at that layer of every
        scheduled token, in step order) when every row of the step runs exactly tokens whose streams
        the last proposal saved (its sampled token, then a prefix of its pending tokens); else None.
        The saved streams are consumed either way (they describe this step only)."""
        saved, self._reusable = self._reusable, {}
        if not saved:
            return None
        target = self.target
        batch = target.batch()
        parts = []
        for row, req_id in enumerate(batch.req_ids):
            n = int(num_scheduled_tokens[row])
            state = saved.get(req_id)
            start = int(batch.num_computed_tokens[row])
            if (state is None or state.first_position != start or n > len(state.token_ids)
                    or tuple(target.scheduled_token_ids(row, start, n)) != state.token_ids[:n]):
                self.stats.reuse_missed_steps += 1
                return None
            parts.append(state.states[:n])
        layer = self.verifier.layer
        self.stats.reuse_steps += 1
        self.stats.reuse_layers_skipped += layer
        self.stats.reuse_tokens += sum(p.shape[0] for p in parts)
        return layer, torch.cat(parts)

    def forward_from_streams(self, reuse: tuple[int, torch.Tensor], positions: torch.Tensor) -> Any:
        """The target's forward for the step from `streams_for_step`'s saved streams: layers
        L_v..N-1, final norm (inside vLLM's forward context for the step; padded rows, if any, get
        zeros)."""
        from vllm_sparsever.compat.model import decoder_stack

        layer, streams = reuse
        padded = positions.shape[0]
        if padded > streams.shape[0]:
            streams = torch.cat([streams, streams.new_zeros(padded - streams.shape[0], streams.shape[1])])
        if self._stack is None:
            self._stack = decoder_stack(self.target.model)
        return self._stack.run_from(layer, streams, positions)

    def check_scheduling(self, async_scheduling: bool) -> None:
        self.drafter.check_scheduling(async_scheduling)

    def plan(self) -> DraftPlan:
        return self.drafter.plan()

    @property
    def state_layers(self) -> tuple[int, ...] | None:
        return self.drafter.state_layers

    def observe_target_states(self, req_id: str, first_position: int, token_ids: list[int], states: Any) -> None:
        self.drafter.observe_target_states(req_id, first_position, token_ids, states)

    @property
    def lookahead(self) -> int:
        return self.cap + self.round_tokens  # up to cap pending tokens, then a round of drafts

    def load(self, target: Any) -> None:
        self.target = target
        self.drafter.load(target)
        self.verifier.load(target)

    def stats_by_level(self) -> dict[str, dict[str, Any]]:
        return {**self.drafter.stats_by_level(), "hierarchical": self.stats.summary()}

    def reset_stats(self) -> None:
        self.drafter.reset_stats()
        self.stats = HierarchicalStats()

    def forget(self, req_ids: set[str]) -> None:
        self.drafter.forget(req_ids)
        for req_id in req_ids:
            self._reusable.pop(req_id, None)

    def request_state(self) -> dict[str, int]:
        return {**self.drafter.request_state(), "reusable_streams": len(self._reusable)}

    def propose(self, step: DraftStep) -> list[list[int]]:
        """Pending tokens per batch row, to be verified by the full target as this step's drafts."""
        reqs = self.drafter.requests(step)
        n = len(reqs.rows)
        limits = step.limits_of(reqs.rows)
        # Pending tokens past max_tokens would be verified for nothing: all accepted plus the full
        # target's own token make remaining_tokens.
        caps = [self.cap if lim.remaining_tokens is None else max(0, min(self.cap, lim.remaining_tokens - 1))
                for lim in limits]
        pending: list[list[int]] = [[] for _ in range(n)]
        live = [c > 0 for c in caps]
        # Reuse: per request, the streams of positions P, P+1, ... and how many lead with a kept token.
        streams: list[torch.Tensor | None] = [None] * n
        valid = [0] * n
        for _ in range(self.rounds):
            # Positions P+m .. P+m+g are written this round (drafter: g, verifier: g + 1).
            idx, budgets = [], []
            for i in range(n):
                m = len(pending[i])
                g = min(self.round_tokens, reqs.budgets[i] - m - 1, caps[i] - m)
                if live[i] and m < caps[i] and (g > 0 or (self.verify_without_drafts and g == 0)):
                    idx.append(i)
                    budgets.append(g)
            if not idx:
                break
            sub = reqs.subset(idx, tokens=[pending[i][-1] if pending[i] else reqs.tokens[i] for i in idx],
                              positions=[reqs.positions[i] + len(pending[i]) for i in idx], budgets=budgets)
            start = time.perf_counter()
            drafts = self.drafter.draft(sub, [pending[i] for i in idx])
            self.stats.draft_time_s += time.perf_counter() - start
            start = time.perf_counter()
            kept, round_streams = self._verify(sub, drafts)
            self.stats.intermediate_time_s += time.perf_counter() - start
            for j, (i, d, k) in enumerate(zip(idx, drafts, kept, strict=True)):
                if self.reuse and k:
                    offset = len(pending[i])  # this round ran positions P + offset ...
                    streams[i] = _write_rows(streams[i], offset, round_streams[j], self.cap + self.round_tokens + 1)
                    valid[i] = offset + len(k)  # its first token and the drafts it kept: all but the correction
                if not k:  # no drafts and no verification: nothing more for this request
                    live[i] = False
                    continue
                self.stats.rounds += 1
                stop = next((s for s, t in enumerate(k) if t in limits[i].stop_token_ids), None)
                if stop is not None:  # nothing after a stop token is ever emitted
                    k = k[: stop + 1]
                    live[i] = False
                    self.stats.stopped_at_stop_token += 1
                pending[i].extend(k)
                if live[i] and len(pending[i]) >= caps[i] and caps[i] < self.cap:
                    self.stats.stopped_at_max_tokens += 1
        out: list[list[int]] = [[] for _ in step.sampled]
        for i, row in enumerate(reqs.rows):
            out[row] = pending[i][: caps[i]]
            if self.reuse and streams[i] is not None:
                if len(out[row]) + 1 > valid[i]:  # the last token is the verifier's correction
                    out[row] = out[row][: valid[i] - 1]
                    self.stats.reuse_dropped_corrections += 1
                tokens = (reqs.tokens[i], *out[row])
                self._reusable[reqs.req_ids[i]] = ReusableStates(reqs.positions[i], tokens, streams[i][: len(tokens)])
            self.stats.pending_tokens += len(out[row])
        return out

    @torch.inference_mode()
    def _verify(self, sub: DraftRequests, drafts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
        """Per request: the drafts the intermediate verifier agrees with, then its own next token
        ([] for a request it does not run: no drafts, and the verifier only checks drafts); and,
        with reuse, the residual streams of [its first token, drafts] (None where it did not run)."""
        which = [j for j, d in enumerate(drafts) if d or self.verify_without_drafts]
        kept: list[list[int]] = [[] for _ in drafts]
        streams: list[Any] = [None] * len(drafts)
        if not which:
            return kept, streams
        args = ([sub.rows[j] for j in which], [[sub.tokens[j], *drafts[j]] for j in which],
                [sub.positions[j] for j in which])
        if self.reuse:
            predicted, ran = self.verifier.predict(*args, with_streams=True)
            for j, stream in zip(which, ran, strict=True):
                streams[j] = stream
        elif self._drafter_reads_states:  # an EAGLE head drafts the next round from them
            predicted, states = self.verifier.predict(*args, with_states=True, state_layers=self.drafter.state_layers)
            for j, seq, state in zip(which, args[1], states, strict=True):
                self.drafter.observe_target_states(sub.req_ids[j], sub.positions[j], seq, state)
        else:
            predicted = self.verifier.predict(*args)
        self.stats.intermediate_passes += 1
        for j, pred in zip(which, predicted, strict=True):  # pred[t]: the verifier's token after position t
            d = drafts[j]
            accepted = 0
            while accepted < len(d) and d[accepted] == pred[accepted]:
                accepted += 1
            kept[j] = d[:accepted] + [pred[accepted]]
            self.stats.intermediate_drafts += len(d)
            self.stats.intermediate_accepted += accepted
        return kept, streams


def _write_rows(buffer: torch.Tensor | None, offset: int, rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """`rows` written into `buffer` from row `offset` on (allocated on first use)."""
    if buffer is None:
        buffer = rows.new_empty(capacity, rows.shape[-1])
    buffer[offset: offset + rows.shape[0]] = rows
    return buffer
