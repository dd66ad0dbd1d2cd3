"""Where the draft model's K/V is valid: per request (`DraftKV`, the positions the drafter ran) and
per KV block (`SharedDraftBlocks`, the blocks it filled with a known prefix).

The draft model's layers live in the target's KV cache and use its block tables (vLLM's
`draft_model` method), so when vLLM's prefix cache hands a new request blocks the target computed
for an earlier one (a shared system prompt, the next turn of a chat, a preempted request resumed),
the draft's K/V for that prefix is there too if the drafter ran it then. The worker sees block ids,
not vLLM's block hashes: each block the drafter filled with a request's committed tokens is
registered under a key of the whole prefix through it (a hash chain, like vLLM's block hashes), and
any other draft write into a block drops its key. A new request's leading blocks whose ids carry the
key of its own prefix hold its draft K/V; the drafter runs only the rest (its catch-up). A windowed
draft (`draft_attention_window`) reads the first block and the window only, so the blocks a
catch-up skipped between them (a hole) are never registered, and a later request may skip them too
where its first block and its window's blocks carry its keys; where its window begins before the
blocks that carry them, it runs the window's blocks between (a gap) and takes the rest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np


@dataclass
class DraftKV:
    """A request's draft K/V: positions < `length` hold it; those below `tail_start` for committed
    tokens (which never change), the rest for `tail` (tokens that were pending or drafts then)."""

    length: int
    tail_start: int
    tail: list[int]

    def valid_for(self, history: Any, pending: list[int]) -> int:
        """How many leading positions hold K/V of the current sequence (`history`, the committed
        tokens, then `pending`)."""
        valid = min(self.length, self.tail_start)
        committed, n = len(history), len(history) + len(pending)
        for j, token in enumerate(self.tail):
            position = self.tail_start + j
            if position >= n:
                break
            current = int(history[position]) if position < committed else pending[position - committed]
            if current != token:
                break
            valid = position + 1
        return valid


def _chain(key: bytes, tokens: Any) -> bytes:
    """The key of a prefix: that of the prefix before it, then its last block's tokens."""
    return hashlib.blake2b(key + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class SharedDraftBlocks:
    """Which KV blocks hold the draft's K/V of which prefix (see the module docstring). Block ids
    are those of the draft's KV cache group; `history` is a request's committed tokens; a hole is
    a span of positions whose K/V the drafter skipped (a windowed draft never reads it)."""

    def __init__(self) -> None:
        self._keys: dict[int, bytes] = {}  # block id -> key of the prefix its draft K/V ends
        self._chains: dict[str, tuple[int, bytes]] = {}  # request -> (its leading blocks keyed, last key)

    def matched(self, req_id: str, history: Any, block_ids: Any, block_size: int,
                window_from: int | None = None
                ) -> tuple[int, tuple[int, int] | None, tuple[int, int] | None]:
        """(valid, hole, gap): request `req_id`'s positions < `valid` hold the draft's K/V of its own
        tokens, in blocks earlier requests filled, except the positions in `hole` (skipped: never
        read) and in `gap` (still to run); each a span or None. Whole blocks; the last token is
        never counted (its pass drafts). `window_from`: a windowed draft's first position read after
        the first block (None: the draft reads everything); it may then skip a hole between the
        first block and a run of matched blocks that ends the prefix, and run the window's blocks
        before that run (an earlier request's window that began later) as its gap."""
        key, keys, flags = b"", [b""], []
        while (len(flags) + 1) * block_size <= len(history) - 1:
            n = len(flags)
            key = _chain(key, history[n * block_size: (n + 1) * block_size])
            keys.append(key)
            flags.append(self._keys.get(int(block_ids[n])) == key)
        lead = next((n for n, ok in enumerate(flags) if not ok), len(flags))
        valid, hole, gap, chained = lead, None, None, lead
        if window_from is not None and lead >= 1:
            tail = len(flags)
            while tail > lead and flags[tail - 1]:
                tail -= 1
            if tail < len(flags):
                window_block = max(lead, window_from // block_size)
                skipped_to = min(tail, window_block)
                valid = chained = len(flags)
                hole = (lead * block_size, skipped_to * block_size) if skipped_to > lead else None
                if tail > window_block:
                    gap = (window_block * block_size, tail * block_size)
                    chained = window_block  # record() registers the gap's blocks once they ran
        self._chains[req_id] = (chained, keys[chained])
        return valid * block_size, hole, gap

    def record(self, req_id: str, history: Any, valid: int, block_ids: Any, block_size: int,
               holes: list[tuple[int, int]] = ()) -> None:
        """Request `req_id`'s draft K/V now holds its committed tokens at positions < `valid`,
        except in `holes`: register its blocks that filled."""
        n, key = self._chains.get(req_id, (0, b""))
        while (n + 1) * block_size <= min(valid, len(history)):
            key = _chain(key, history[n * block_size: (n + 1) * block_size])
            if not any(a < (n + 1) * block_size and n * block_size < b for a, b in holes):
                self._keys[int(block_ids[n])] = key
            n += 1
        self._chains[req_id] = (n, key)

    def written(self, block_ids: Iterable[int]) -> None:
        """The drafter is writing into these blocks: what they held no longer counts."""
        for block in block_ids:
            self._keys.pop(int(block), None)

    def forget(self, req_id: str) -> None:
        self._chains.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._keys)
