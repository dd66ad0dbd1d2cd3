"""An EAGLE / EAGLE-3 head as the drafter of hierarchical verification (draft_source 'eagle' / 'eagle3'
with `early_exit.enabled` and the sparse target as the intermediate verifier).

vLLM loads the head (its `eagle` / `eagle3` method: weights, and the head's layer in the KV cache).
vLLM's proposer drafts once per step from the tokens the target just verified; it cannot draft after
the hierarchy's pending tokens. So this drafter runs the head itself, in rounds, as the draft-model
drafter runs the draft model. At position p the head reads the target's states of token p (EAGLE-3:
the streams of three layers, combined by its fc; EAGLE: the final hidden state) and the token at
p + 1, and keeps its own K/V there. Target states come from every pass over the target: the full pass
(the runner hands over the step's states: `observe_target_states`) and each round's intermediate
pass (the sparse target). The sparse target's states are approximate, which is harmless: they only
shape drafts, and the full target verifies every draft.

Per request it keeps the target states not yet run through the head, each with the token it was
computed for, and which positions hold head K/V for which next token. A round first runs the head
over the positions whose K/V is missing or stale, up to the one before the request's last token
(the last always runs: its output drafts). New states, or a changed next token, make a position
stale. It drafts from the last output, then runs one head pass per further draft, each fed the
head's own hidden state (as vLLM's proposer does). K/V written at those draft positions comes from
the head's states, not the target's, so it is never counted as valid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_sparsever.drafting.drafter import DraftRequests, RoundDrafter
from vllm_sparsever.drafting.proposer import ProposesAfterBookkeeping
from vllm_sparsever.drafting.queries import flatten_queries
from vllm_sparsever.drafting.tree_drafter import TreeDrafting
from vllm_sparsever.step import DraftPlan


@dataclass
class EagleHeadStats:
    rounds: int = 0  # draft() calls
    forward_passes: int = 0  # head passes (catch-up passes included)
    catch_up_tokens: int = 0  # positions run to bring the head's K/V up to date (prompts included)
    draft_tokens: int = 0
    missing_states: int = 0  # requests not drafted for: the target's states of their last tokens missing
    slot_limited: int = 0  # see SelfDraftStats.slot_limited
    draft_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        from vllm_sparsever.metrics import counters_summary

        return counters_summary(self, "eagle_head_", {"draft_tokens": "eagle_head_tokens",
                                                      "draft_time_s": "eagle_head_time_s"})


@dataclass
class HeadRecord:
    """One request's target states and head K/V.

    `states[j]` (the head's input, combined) is the target's state of token `state_tokens[j]` at
    position `states_base + j`. Positions below `kv_len` hold head K/V; those at and above `kv_base`
    were computed with next token `kv_next[p - kv_base]`, those below with committed tokens."""

    states_base: int = 0
    state_tokens: list[int] = field(default_factory=list)
    states: torch.Tensor | None = None
    kv_len: int = 0
    kv_base: int = 0
    kv_next: list[int] = field(default_factory=list)

    def add_states(self, first: int, tokens: list[int], states: torch.Tensor) -> None:
        """The target's states of `tokens` at positions `first`, ...: they replace what is kept from
        `first` on, and the head's K/V from `first` on is stale."""
        end = self.states_base + len(self.state_tokens)
        if self.states is None or not self.states_base <= first <= end:
            self.states_base, self.state_tokens, self.states = first, list(tokens), states
        else:
            keep = first - self.states_base
            self.state_tokens = self.state_tokens[:keep] + list(tokens)
            self.states = torch.cat([self.states[:keep], states])
        self.kv_len = min(self.kv_len, first)

    def kv_valid(self, token_at: Any, length: int) -> int:
        """How many leading positions hold head K/V of the current sequence (`length` tokens,
        `token_at(p)`)."""
        valid = min(self.kv_len, self.kv_base)
        if valid < self.kv_base:
            return valid
        for j, token in enumerate(self.kv_next):
            p = self.kv_base + j
            if p >= self.kv_len or p + 1 >= length or token_at(p + 1) != token:
                break
            valid = p + 1
        return valid

    def states_for(self, start: int, stop: int, token_at: Any) -> tuple[int, torch.Tensor] | None:
        """(first position, states) covering positions [first, stop) with first >= `start` as
        close to it as kept (a position no state was kept for, e.g. a prefix cached by an earlier
        request, keeps its head K/V as it is); None when the states up to `stop` are missing or
        were computed for other tokens."""
        first = max(start, self.states_base)
        if self.states is None or first >= stop or stop > self.states_base + len(self.state_tokens):
            return None
        for p in range(first, stop):
            if self.state_tokens[p - self.states_base] != token_at(p):
                return None
        return first, self.states[first - self.states_base: stop - self.states_base]

    def ran(self, first: int, next_tokens: list[int], committed_last: int) -> None:
        """The head ran positions first, ..., first + len(next_tokens) - 1 with these next tokens;
        positions before `committed_last` (next tokens committed) never change again."""
        stop = first + len(next_tokens)
        if first < self.kv_base:
            self.kv_base, self.kv_next = first, list(next_tokens)
        else:
            self.kv_next = self.kv_next[: first - self.kv_base] + list(next_tokens)
        self.kv_len = stop
        new_base = min(committed_last, stop)
        if new_base > self.kv_base:
            self.kv_next = self.kv_next[new_base - self.kv_base:]
            self.kv_base = new_base
        keep_from = committed_last - 1  # a round with nothing pending reruns the last committed position
        if self.states is not None and keep_from > self.states_base:
            cut = min(keep_from - self.states_base, len(self.state_tokens))
            self.state_tokens = self.state_tokens[cut:]
            self.states = self.states[cut:]
            self.states_base += cut


class EagleHeadDrafter(ProposesAfterBookkeeping, TreeDrafting, RoundDrafter):
    level = "eagle_head"

    def __init__(self, *, num_speculative_tokens: int, max_model_len: int, tree: Any = None) -> None:
        """`tree`: a DraftTreeConfig to draft trees (EAGLE-2 style; EVICT-cut under
        drafting/evict_proposer.py), or None for chains in rounds (the hierarchy's drafter)."""
        super().__init__(EagleHeadStats(), num_speculative_tokens=num_speculative_tokens,
                         max_model_len=max_model_len)
        self.head: Any = None  # compat.drafter.EagleHead
        self.aux_layers: tuple[int, ...] | None = None  # EAGLE-3: the target layers whose streams it reads
        self._records: dict[str, HeadRecord] = {}
        # Trees, per batch row of the step: the head's hidden state after the root, and after each node
        # of the last level's query (a node's children read their parent's).
        self._root_hidden: dict[int, torch.Tensor] = {}
        self._node_hidden: dict[int, torch.Tensor] = {}
        self.init_trees(tree)

    def load(self, target: Any) -> None:
        from vllm_sparsever.compat.model import aux_hidden_state_layers

        super().load(target)
        self.head = target.eagle_head()
        if self.head.reads_aux_streams:
            self.aux_layers = aux_hidden_state_layers(target.model)
            if not self.aux_layers:
                raise ValueError("EAGLE-3 head: the target collects no aux layer streams")

    def plan(self) -> DraftPlan:
        """From the committed tokens and the step's target states."""
        return DraftPlan(after_bookkeeping=True, target_states=True)

    @property
    def state_layers(self) -> tuple[int, ...] | None:
        """What the head reads of a target pass: these layers' incoming streams, or (None) the
        final hidden states."""
        return self.aux_layers

    def forget(self, req_ids: set[str]) -> None:
        super().forget(req_ids)
        for req_id in req_ids:
            self._records.pop(req_id, None)

    def request_state(self) -> dict[str, int]:
        return {**super().request_state(), "eagle_head_records": len(self._records)}

    def requests(self, step: Any, cap: int | None = None) -> DraftRequests:
        reqs = super().requests(step, cap)
        live = set(step.req_ids)
        for req_id in [r for r in self._records if r not in live]:  # finished or preempted
            del self._records[req_id]
        if self.tree is None:
            return reqs
        # Trees: a request without the states of its last tokens gets no tree (hierarchy rounds
        # find out per round, in `draft`).
        keep = [i for i in range(len(reqs.rows)) if self._catch_up(reqs, i, []) is not None]
        self.stats.missing_states += len(reqs.rows) - len(keep)
        return reqs.subset(keep) if len(keep) < len(reqs.rows) else reqs

    def propose(self, step: Any) -> list[list[int]]:
        if self.tree is None:
            return super().propose(step)
        start = time.perf_counter()
        drafts = self.propose_trees(step)
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.draft_time_s += time.perf_counter() - start
        return drafts

    def _catch_up(self, reqs: DraftRequests, i: int, pending: list[int]) -> tuple[int, list[int], Any] | None:
        """Request `i`'s head pass up to its last token (committed tokens, then `pending`): (first
        position, the next token at each position, the target's states there), or None when those
        states are missing."""
        record = self._records.get(reqs.req_ids[i])
        if record is None:
            return None
        history = reqs.histories[i]
        committed = len(history)
        length = committed + len(pending)
        last = reqs.positions[i]
        assert length - 1 == last, "pending tokens must end at the request's position"

        def token_at(p: int) -> int:
            return int(history[p]) if p < committed else pending[p - committed]

        found = record.states_for(min(record.kv_valid(token_at, length), last - 1), last, token_at)
        if found is None:
            return None
        first, states = found
        return first, [token_at(p + 1) for p in range(first, last)], states

    def _start_runs(self, reqs: DraftRequests, idx: list[int], pending: list[list[int]]) -> tuple[list[int], ...]:
        """The catch-up runs of requests `idx` (`_catch_up`), recorded as run: (the requests that have
        one, and per such request its next tokens, first position and states); the others are
        counted as missing their states."""
        ran, next_tokens, firsts, hidden = [], [], [], []
        for i in idx:
            run = self._catch_up(reqs, i, pending[i])
            if run is None:
                self.stats.missing_states += 1
                continue
            first, run_next, states = run
            self._records[reqs.req_ids[i]].ran(first, run_next, len(reqs.histories[i]) - 1)
            ran.append(i)
            next_tokens.append(run_next)
            firsts.append(first)
            hidden.append(states)
            self.stats.catch_up_tokens += len(run_next) - 1
        return ran, next_tokens, firsts, hidden

    @torch.inference_mode()
    def observe_target_states(self, req_id: str, first_position: int, token_ids: list[int],
                              states: torch.Tensor) -> None:
        """The target's states (as `state_layers` says: aux streams concatenated, or final hidden
        states) of `token_ids` at positions `first_position`, ... of request `req_id`."""
        record = self._records.setdefault(req_id, HeadRecord())
        record.add_states(first_position, token_ids, self.head.combine(states))

    @torch.inference_mode()
    def draft(self, reqs: DraftRequests, pending: list[list[int]] | None = None) -> list[list[int]]:
        """Up to min(num_speculative_tokens, budget) greedy drafts per request, after its committed
        tokens and `pending[i]` (which end with `reqs.tokens[i]`)."""
        start_time = time.perf_counter()
        pending = pending or [[] for _ in reqs.rows]
        drafts: list[list[int]] = [[] for _ in reqs.rows]
        budgets = [min(self.num_speculative_tokens, b) for b in reqs.budgets]
        ran, next_tokens, firsts, hidden = self._start_runs(
            reqs, [i for i, b in enumerate(budgets) if b > 0], pending)
        active = [(i, budgets[i]) for i in ran]
        self.stats.rounds += 1
        while active:  # one pass per draft position; requests leave at their budget
            tokens, out_hidden, last_positions = self._predict([reqs.rows[i] for i, _ in active], next_tokens,
                                                               firsts, hidden)
            still, next_tokens, next_firsts, next_hidden = [], [], [], []
            for j, ((i, budget), token) in enumerate(zip(active, tokens, strict=True)):
                drafts[i].append(token)
                if len(drafts[i]) < budget:
                    still.append((i, budget))
                    next_tokens.append([token])
                    next_firsts.append(last_positions[j] + 1)
                    next_hidden.append(out_hidden[j: j + 1])
            active, firsts, hidden = still, next_firsts, next_hidden
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.draft_time_s += time.perf_counter() - start_time
        return drafts

    # ---- trees (TreeDrafting) ----------------------------------------------------------------

    def catch_up_tokens(self, reqs: DraftRequests) -> int:
        total = 0
        for i in range(len(reqs.rows)):
            run = self._catch_up(reqs, i, [])
            total += 0 if run is None else len(run[1]) - 1
        return total

    def _tree_root_top(self, reqs: DraftRequests, idx: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's catch-up pass, ending at the position before its root (the root is the
        next token there): the head's top-k after the root, and (kept per batch row) its hidden
        state for the root's children."""
        ran, next_tokens, firsts, hidden = self._start_runs(reqs, idx, [[] for _ in reqs.rows])
        assert ran == idx, "requests() keeps only requests with the states of their last tokens"
        rows = [reqs.rows[i] for i in idx]
        self.stats.rounds += 1
        tokens, positions, lens = flatten_queries(next_tokens, firsts, self.target.device)
        for_logits, for_next = self._head_pass(rows, tokens, positions, lens, torch.cat(hidden))
        last = torch.tensor(lens, device=tokens.device).cumsum(0) - 1
        self._root_hidden = {row: for_next[j: j + 1] for row, j in zip(rows, last.tolist(), strict=True)}
        self._node_hidden = {}
        return torch.softmax(self.head.compute_logits(for_logits[last]).float(), dim=-1).topk(k, dim=-1)

    def _tree_level_top(self, rows, tokens, positions, kv_positions, lens, tree_mask, wanted, k, topologies):
        """A level's pass over the growing trees' expanded nodes and frontiers under the tree mask.
        The head runs a node one position before the node's own (it reads the state there and the
        node as next token) and keeps its K/V one slot before the node's (the root's slot is free:
        the head's K/V ends before it); a node is fed its parent's hidden state from the last pass
        (the expanded nodes lead each query, in the last query's order)."""
        from vllm_sparsever.forward_scope import tree_attention

        inputs = []
        for row, topology in zip(rows, topologies, strict=True):
            previous = self._node_hidden.get(row)
            inputs.extend(self._root_hidden[row] if parent < 0 else previous[parent: parent + 1]
                          for parent in topology.parents)
        with tree_attention(tree_mask):
            for_logits, for_next = self._head_pass(rows, tokens, positions - 1, lens, torch.cat(inputs),
                                                   kv_positions=kv_positions - 1)
        for row, nodes in zip(rows, for_next.split(lens), strict=True):
            self._node_hidden[row] = nodes
        return torch.softmax(self.head.compute_logits(for_logits[wanted]).float(), dim=-1).topk(k, dim=-1)

    # ---- head passes ------------------------------------------------------------------------

    def _predict(self, rows: list[int], next_tokens: list[list[int]], firsts: list[int],
                 hidden: list[torch.Tensor]) -> tuple[list[int], torch.Tensor, list[int]]:
        """One chain pass: per request, `next_tokens[i]` at positions `firsts[i]`, ... with the
        states `hidden[i]`; returns each request's greedy draft after its last position, the head's
        hidden state there (fed to the next draft step) and that position."""
        tokens, positions, lens = flatten_queries(next_tokens, firsts, self.target.device)
        for_logits, for_next = self._head_pass(rows, tokens, positions, lens, torch.cat(hidden))
        last = torch.tensor(lens, device=tokens.device).cumsum(0) - 1
        ids = self.head.compute_logits(for_logits[last]).argmax(dim=-1).tolist()
        return ids, for_next[last], positions[last].tolist()

    def _head_pass(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor, lens: list[int],
                   hidden: torch.Tensor, kv_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over `lens[i]` query tokens of batch row `rows[i]` (flattened), on the target's
        KV cache: (hidden states for the logits, hidden states for the next draft step)."""
        from vllm_sparsever.compat.forward_context import query_forward_context

        metadata, slots = self.target.attention_context(self.head.layer_names, torch.tensor(rows, dtype=torch.long),
                                                        positions, lens, kv_positions=kv_positions)
        with query_forward_context(metadata, self.target.vllm_config, int(tokens.numel()), slots):
            out = self.head.forward(tokens, positions, hidden)
        self.stats.forward_passes += 1
        return out
