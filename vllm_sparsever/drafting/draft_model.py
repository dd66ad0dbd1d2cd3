"""A separate draft model as the drafter of hierarchical verification (draft_source='draft_model').

vLLM loads the draft model (its `draft_model` method: weights, and the draft's layers in the KV
cache); this drafter runs it in rounds, after the hierarchy's pending tokens, which vLLM's own
proposer cannot do (it drafts once per step from committed tokens). It keeps the draft model's KV
itself (drafting/draft_kv.py): per request, which positions hold the draft's K/V for which tokens,
and per KV block, which prefix the draft's K/V there is of, so a request vLLM's prefix cache hands
blocks an earlier request filled starts after them. Each round it first runs, in one pass, the
tokens whose draft K/V is missing or stale (the prompt on a request's first round, but for the
blocks it shares; afterwards the tokens the full or intermediate level changed), then drafts
greedily one token per pass. Positions past the committed tokens are rewritten whenever their
tokens change, so what the draft attends to is always the current sequence.

With `tree` or `adaptive` (config sections), it drafts a dynamic tree per request instead of a
chain (drafting/tree_drafter.py): the catch-up pass ends at the request's last token (the root),
then one pass per level over the nodes expanded so far under the tree mask. It then proposes on
its own (no hierarchy), after `sample_tokens` like in a hierarchy.

With `draft_vocab` it drafts over part of the vocabulary (drafting/draft_vocab.py,
`ContextDraftVocab`): the LM head is a large share of a small draft model's bytes; where the
draft's projections run on sparsever's int8 / int4 ops, its head rows run W8A8 too (half their
bytes, no loss in agreement: verification/lossless/linear_kernel.py `int8_head_rows_linear`). With
`draft_attention_window` its passes attend to the context's first block and its last N positions
only (StreamingLLM-style): at long context the draft's attention reads more bytes than its
weights. The window only moves forward, so a catch-up runs the first block and the window and
skips the stale positions between, which no pass reads again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sparsever.metrics import counters_summary
from vllm_sparsever.step import DraftStep
from vllm_sparsever.drafting.draft_kv import DraftKV, SharedDraftBlocks
from vllm_sparsever.drafting.draft_vocab import ContextDraftVocab
from vllm_sparsever.drafting.drafter import DraftRequests, RoundDrafter
from vllm_sparsever.drafting.proposer import ProposesAfterBookkeeping
from vllm_sparsever.drafting.queries import final_hidden, flatten_queries
from vllm_sparsever.drafting.tree_drafter import TreeDrafting


@dataclass
class DraftModelStats:
    rounds: int = 0  # draft() calls
    forward_passes: int = 0  # draft-model passes (catch-up passes included)
    catch_up_tokens: int = 0  # tokens run to bring the draft's KV up to date (prompts included)
    shared_prefix_tokens: int = 0  # positions a request found its draft K/V at, in blocks an earlier one filled
    window_skipped_tokens: int = 0  # stale positions a catch-up skipped: behind the attention window for good
    window_gap_tokens: int = 0  # window positions run before blocks an earlier request filled (a gap)
    draft_tokens: int = 0
    slot_limited: int = 0  # see SelfDraftStats.slot_limited
    vocab_tokens: int = 0  # draft_vocab: the token ids the last draft was taken from (0: all)
    draft_time_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return counters_summary(self, "draft_model_", {"draft_tokens": "draft_model_tokens",
                                                       "draft_time_s": "draft_model_time_s"})


def _token_weights(config: Any) -> tuple[int, int] | None:
    """(projection weights, LM head weights) one token multiplies through in a dense decoder, from its
    config; None where the config does not describe one (an MoE, a config without these fields)."""
    try:
        h, layers, inter = int(config.hidden_size), int(config.num_hidden_layers), int(config.intermediate_size)
        heads, vocab = int(config.num_attention_heads), int(config.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return None
    if any(getattr(config, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts")):
        return None
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    return layers * (2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter), vocab * h


def _weight_bits(config: Any, dtype_bits: int) -> int:
    """Bits per projection weight as stored: a quantization config's weight `num_bits` (compressed-
    tensors) or `bits` (GPTQ, AWQ), else the model's dtype."""
    q = getattr(config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    if not q:
        return dtype_bits
    groups = q.get("config_groups") or {}
    for group in groups.values():
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return int(q.get("bits") or dtype_bits)


def _dtype_bits(model: Any) -> int:
    """Bits per value of a model's floating-point parameters (16 where it has none)."""
    return 8 * next((p.element_size() for p in model.parameters() if p.is_floating_point()), 2)


def _relative_cost(draft: Any, target: Any, vocab: ContextDraftVocab | None, head_bits: int | None = None) -> Any:
    """EVICT's price of this draft before a pass is measured (adaptive.policy.DraftCost), from the two
    models' configs (their loaded parameters are not what a pass reads: CPU kernels repack weights
    outside them): a pass's bytes, projections at their stored bits plus the LM head rows it reads
    (with `draft_vocab`, those rows, at `head_bits` where the drafter quantized them, else the
    model's dtype), against the target's; a catch-up token's weights against the target's. None where
    a config does not describe a dense decoder (no price: drafting is measured blind)."""
    from vllm_sparsever.adaptive.policy import DraftCost

    draft_w, target_w = _token_weights(getattr(draft, "config", None)), _token_weights(getattr(target, "config", None))
    if draft_w is None or target_w is None:
        return None

    head_rows = min(vocab.size / int(draft.config.vocab_size), 1.0) if vocab is not None else 1.0
    draft_bits, target_bits = _dtype_bits(draft), _dtype_bits(target)
    draft_bytes = (draft_w[0] * _weight_bits(draft.config, draft_bits) + draft_w[1] * head_rows * (head_bits or draft_bits)) / 8
    target_bytes = (target_w[0] * _weight_bits(target.config, target_bits) + target_w[1] * target_bits) / 8
    return DraftCost(pass_share=draft_bytes / target_bytes, prompt_share=sum(draft_w) / sum(target_w))


class DraftModelDrafter(ProposesAfterBookkeeping, TreeDrafting, RoundDrafter):
    level = "draft_model"
    # (after the bookkeeping: vLLM's own draft_model proposes from device tensors, before it)

    def __init__(self, *, num_speculative_tokens: int, max_model_len: int, tree: Any = None,
                 draft_vocab: int | None = None, attention_window: int | None = None) -> None:
        """`tree`: a DraftTreeConfig to draft trees (EVICT-cut under drafting/evict_proposer.py), or
        None for chains in rounds. `draft_vocab`: draft over the lowest this many
        token ids plus the context's (None: the whole vocabulary). `attention_window`: the recent
        positions the draft attends to besides the first block (None: the whole context)."""
        super().__init__(DraftModelStats(), num_speculative_tokens=num_speculative_tokens,
                         max_model_len=max_model_len)
        self._stack: Any = None
        self._kv: dict[str, DraftKV] = {}
        self._shared = SharedDraftBlocks()
        self._holes: dict[str, list[tuple[int, int]]] = {}  # request -> spans of positions its catch-ups skipped
        self._gaps: dict[str, tuple[int, int]] = {}  # request -> span inside its window its first catch-up runs
        self._draft_vocab = draft_vocab
        self._vocab: ContextDraftVocab | None = None
        self.head_bits: int | None = None  # bits per LM head weight a pass reads (None: the model's dtype)
        self._window = (1, attention_window) if attention_window is not None else None  # (sink, recent)
        self.init_trees(tree)

    def load(self, target: Any) -> None:
        from vllm_sparsever.compat.model import decoder_stack, plain_lm_head, use_c_kernels_where_faster
        from vllm_sparsever.compat.worker import is_cpu_platform

        super().load(target)
        model = target.draft_model()
        cpu = is_cpu_platform()
        if cpu:  # the draft's passes run eagerly: its norms (and one-token SwiGLUs) on C kernels
            use_c_kernels_where_faster(model)
        self._stack = decoder_stack(model, lean=cpu)  # (after: the lean layers call those kernels)
        if self._draft_vocab is not None:
            from vllm_sparsever import _custom_ops as ops
            from vllm_sparsever.config import SparseverConfigError
            from vllm_sparsever.verification.lossless.linear_kernel import (
                head_rows_linear,
                int8_head_rows_linear,
                projections_on_int_ops,
                resolve_linear_kernel,
                slow_16bit_cpu_linear,
            )

            try:
                head = plain_lm_head(model)
                # torch's 16-bit linear is the slow one on CPUs without AVX-512 (verification/lossless/linear_kernel.py)
                linear = ops.dense_linear if slow_16bit_cpu_linear(head.weight.dtype) else torch.nn.functional.linear
                if projections_on_int_ops(model):  # the head's fixed rows W8A8 too, as the projections run
                    prepare, self.head_bits = int8_head_rows_linear, 8
                else:
                    kernel = target.linear_kernel or resolve_linear_kernel("auto", head.weight.dtype)
                    prepare = lambda rows: head_rows_linear(rows, kernel)  # noqa: E731
                self._vocab = ContextDraftVocab(head, self._draft_vocab, always=target.stop_token_ids(),
                                                linear=linear, prepare=prepare)
            except ValueError as e:
                raise SparseverConfigError(f"draft_vocab: {e}") from e
        self.draft_cost = _relative_cost(model, target.model, self._vocab, self.head_bits)

    def forget(self, req_ids: set[str]) -> None:
        super().forget(req_ids)
        for req_id in req_ids:
            self._kv.pop(req_id, None)
            self._holes.pop(req_id, None)
            self._gaps.pop(req_id, None)
            self._shared.forget(req_id)

    def request_state(self) -> dict[str, int]:
        return {**super().request_state(), "draft_kv": len(self._kv)}

    def requests(self, step: DraftStep, cap: int | None = None) -> DraftRequests:
        reqs = super().requests(step, cap)
        live = set(step.req_ids)
        for req_id in [r for r in self._kv if r not in live]:  # finished or preempted
            del self._kv[req_id]
            self._holes.pop(req_id, None)
            self._gaps.pop(req_id, None)
            self._shared.forget(req_id)
        if self._vocab is not None:
            self._vocab.update(reqs.req_ids, reqs.histories)
            self.stats.vocab_tokens = self._vocab.num_tokens
        return reqs

    def _top(self, normed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's top-k (probabilities, token ids) after each row of `normed`."""
        if self._vocab is not None:
            return self._vocab.top(normed, k)
        return torch.softmax(self._stack.compute_logits(normed).float(), dim=-1).topk(k, dim=-1)

    def propose(self, step: DraftStep) -> list[list[int]]:
        start = time.perf_counter()
        if self.tree is None:
            return super().propose(step)
        drafts = self.propose_trees(step)
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.draft_time_s += time.perf_counter() - start
        return drafts

    # ---- where the draft's K/V is valid (drafting/draft_kv.py) ---------------------------------

    def _draft_blocks(self) -> tuple[torch.Tensor, int] | None:
        """(block table, block size) of the draft's KV cache group (None: its layers span several)."""
        return self.target.block_table(self._stack.attention_layer_names)

    def _valid(self, reqs: DraftRequests, i: int, pending: list[int]) -> int:
        """How many leading positions of request `i` (its committed tokens, then `pending`) hold
        the draft's K/V: those it ran, or on its first round those an earlier request left in the
        blocks vLLM's prefix cache gave it."""
        req_id, history = reqs.req_ids[i], reqs.histories[i]
        kv = self._kv.get(req_id)
        if kv is not None:
            return kv.valid_for(history, pending)
        blocks = self._draft_blocks()
        if blocks is None:
            return 0
        table, block_size = blocks
        window_from = None
        if self._window is not None:  # as windowed_block_table
            window_from = (len(history) + len(pending) - self._window[1]) // block_size * block_size
        valid, hole, gap = self._shared.matched(req_id, history, table[reqs.rows[i]], block_size, window_from)
        if valid:
            self._kv[req_id] = DraftKV(length=valid, tail_start=valid, tail=[])
            if hole is not None:
                self._holes.setdefault(req_id, []).append(hole)
            if gap is not None:
                self._gaps[req_id] = gap
                self.stats.window_gap_tokens += gap[1] - gap[0]
            self.stats.shared_prefix_tokens += valid - sum(span[1] - span[0] for span in (hole, gap) if span)
        return valid

    def _writing(self, rows: list[int], positions: torch.Tensor, lens: list[int]) -> None:
        """A pass is about to write the draft's K/V at `positions` (flattened, `lens[i]` of batch
        row `rows[i]`): the blocks it writes no longer hold what they were registered for."""
        blocks = self._draft_blocks()
        if blocks is None or not len(self._shared):
            return
        table, block_size = blocks
        token_rows = torch.tensor(rows, dtype=torch.long).repeat_interleave(torch.tensor(lens))
        self._shared.written(table[token_rows, positions.cpu().long() // block_size].unique().tolist())

    def _committed(self, reqs: DraftRequests, i: int, length: int) -> None:
        """Request `i`'s draft K/V holds its committed tokens at positions < `length`, but for the
        spans its catch-ups skipped."""
        blocks = self._draft_blocks()
        if blocks is not None:
            table, block_size = blocks
            req_id = reqs.req_ids[i]
            self._shared.record(req_id, reqs.histories[i], length, table[reqs.rows[i]], block_size,
                                self._holes.get(req_id, []))

    def _catch_up(self, reqs: DraftRequests, i: int, pending: list[int]) -> tuple[tuple[int, int] | None, int, int]:
        """Where request `i`'s catch-up runs (its sequence: committed tokens, then `pending`):
        (a span to run before, or None; the first position of the run that ends at its last
        token; where the stale positions it skips begin, or -1). With `draft_attention_window` the
        draft never reads again the positions between the first block and the window's start, so a
        catch-up skips those; the span before is then the rest of the first block, or the window's
        blocks before those an earlier request filled (`SharedDraftBlocks.matched`'s gap)."""
        sequence_len = len(reqs.histories[i]) + len(pending)
        valid = self._valid(reqs, i, pending)
        first = min(valid, sequence_len - 1)  # the last token always runs: its logits draft
        blocks = self._draft_blocks() if self._window else None
        if blocks is None:
            return None, first, -1
        block_size = blocks[1]
        gap = self._gaps.get(reqs.req_ids[i])
        window_start = (sequence_len - self._window[1]) // block_size * block_size  # as windowed_block_table
        if window_start <= max(valid, block_size):
            return gap, first, -1
        return ((valid, block_size) if valid < block_size else gap), window_start, max(valid, block_size)

    def _catch_up_size(self, reqs: DraftRequests, i: int, pending: list[int]) -> int:
        before, first, _ = self._catch_up(reqs, i, pending)
        return len(reqs.histories[i]) + len(pending) - 1 - first + (0 if before is None else before[1] - before[0])

    def _catch_up_runs(self, reqs: DraftRequests, idx: list[int], pending: list[list[int]]) -> list[int]:
        """Run the spans before requests `idx`'s catch-ups (`_catch_up`) and note what they skip;
        returns the first position of each one's run to its last token."""
        firsts, before_rows, before_seqs, before_firsts = [], [], [], []
        for i, more in zip(idx, pending, strict=True):
            before, first, skipped_from = self._catch_up(reqs, i, more)
            if before is not None:
                before_rows.append(reqs.rows[i])
                before_seqs.append(_tokens(reqs.histories[i], more, *before))
                before_firsts.append(before[0])
            if skipped_from >= 0:
                self._holes.setdefault(reqs.req_ids[i], []).append((skipped_from, first))
                self.stats.window_skipped_tokens += first - skipped_from
            firsts.append(first)
        if before_rows:
            tokens, positions, lens = flatten_queries(before_seqs, before_firsts, self.target.device)
            self._writing(before_rows, positions, lens)
            # Each span attends to the first block and itself, as a catch-up from the window's start does.
            final_hidden(self.target, self._stack, before_rows, tokens, positions, lens, window=(self._window[0], 1))
            self.stats.forward_passes += 1
            self.stats.catch_up_tokens += sum(lens)
            for i in idx:
                self._gaps.pop(reqs.req_ids[i], None)
        return firsts

    # ---- trees (TreeDrafting) ----------------------------------------------------------------

    def catch_up_tokens(self, reqs: DraftRequests) -> int:
        return sum(self._catch_up_size(reqs, i, []) for i in range(len(reqs.rows)))

    def _tree_root_top(self, reqs: DraftRequests, idx: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up pass of each request (its stale draft K/V, ending at the root)."""
        seqs, firsts = [], self._catch_up_runs(reqs, idx, [[] for _ in idx])
        for i, first in zip(idx, firsts, strict=True):
            history = reqs.histories[i]
            assert len(history) - 1 == reqs.positions[i], "the root must be the request's last committed token"
            seqs.append([int(t) for t in history[first:]])
            self.stats.catch_up_tokens += len(seqs[-1]) - 1
        self.stats.rounds += 1
        device = self.target.device
        tokens, positions, lens = flatten_queries(seqs, firsts, device)
        rows = [reqs.rows[i] for i in idx]
        self._writing(rows, positions, lens)
        normed = final_hidden(self.target, self._stack, rows, tokens, positions, lens, window=self._window)
        self.stats.forward_passes += 1
        for i in idx:  # the draft's K/V now holds the committed tokens, root included; nodes are scratch
            root = reqs.positions[i]
            self._kv[reqs.req_ids[i]] = DraftKV(length=root + 1, tail_start=root + 1, tail=[])
            self._committed(reqs, i, root + 1)
        last = torch.tensor(lens, device=device).cumsum(0) - 1
        return self._top(normed[last], k)

    def _tree_level_top(self, rows, tokens, positions, kv_positions, lens, tree_mask, wanted, k, topologies):
        self._writing(list(rows), kv_positions, lens)
        normed = final_hidden(self.target, self._stack, rows, tokens, positions, lens,
                              kv_positions=kv_positions, tree_mask=tree_mask, window=self._window)
        self.stats.forward_passes += 1
        return self._top(normed[wanted], k)

    @torch.inference_mode()
    def draft(self, reqs: DraftRequests, pending: list[list[int]] | None = None) -> list[list[int]]:
        """Up to min(num_speculative_tokens, budget) greedy drafts per request, after its committed
        tokens and `pending[i]` (which end with `reqs.tokens[i]`)."""
        start = time.perf_counter()
        pending = pending or [[] for _ in reqs.rows]
        drafts: list[list[int]] = [[] for _ in reqs.rows]
        # First pass per request: the tokens from its first stale draft position to its last token.
        active = [(i, min(self.num_speculative_tokens, reqs.budgets[i])) for i in range(len(reqs.rows))]
        active = [(i, budget) for i, budget in active if budget > 0]
        firsts = self._catch_up_runs(reqs, [i for i, _ in active], [pending[i] for i, _ in active])
        seqs = []
        for (i, _), first in zip(active, firsts, strict=True):
            sequence_len = len(reqs.histories[i]) + len(pending[i])
            assert sequence_len - 1 == reqs.positions[i], "pending tokens must end at the request's position"
            seqs.append(_tokens(reqs.histories[i], pending[i], first, sequence_len))
            self.stats.catch_up_tokens += len(seqs[-1]) - 1
        self.stats.rounds += 1
        while active:  # one pass per draft position; requests leave at their budget
            predicted = self._predict([reqs.rows[i] for i, _ in active], seqs, firsts)
            self.stats.forward_passes += 1
            still, next_seqs, next_firsts = [], [], []
            for (i, budget), token, seq, first in zip(active, predicted, seqs, firsts, strict=True):
                drafts[i].append(token)
                if len(drafts[i]) < budget:
                    still.append((i, budget))
                    next_seqs.append([token])
                    next_firsts.append(first + len(seq))
            active, seqs, firsts = still, next_seqs, next_firsts
        # Record what the draft's K/V now holds: the sequence, then the drafts it ran (all but the last).
        for i in range(len(reqs.rows)):
            if not drafts[i]:
                continue
            committed = reqs.positions[i] + 1 - len(pending[i])
            tail = pending[i] + drafts[i][:-1]
            self._kv[reqs.req_ids[i]] = DraftKV(length=committed + len(tail), tail_start=committed, tail=tail)
            self._committed(reqs, i, committed)
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.draft_time_s += time.perf_counter() - start
        return drafts

    def _predict(self, rows: list[int], seqs: list[list[int]], firsts: list[int]) -> list[int]:
        """The draft model's greedy next token after the last of `seqs[i]` (run at positions
        `firsts[i]`..., writing the draft's K/V there)."""
        device = self.target.device
        tokens, positions, lens = flatten_queries(seqs, firsts, device)
        self._writing(rows, positions, lens)
        normed = final_hidden(self.target, self._stack, rows, tokens, positions, lens, window=self._window)
        last = torch.tensor(lens, device=device).cumsum(0) - 1
        if self._vocab is not None:
            return self._vocab.argmax(normed[last])
        return self._stack.compute_logits(normed[last]).argmax(dim=-1).tolist()


def _tokens(history: Any, pending: list[int], start: int, end: int) -> list[int]:
    """Positions `start`..`end` - 1 of a sequence: the committed tokens `history`, then `pending`."""
    committed = len(history)
    return [int(t) for t in history[start: min(end, committed)]] + pending[max(0, start - committed): end - committed]
