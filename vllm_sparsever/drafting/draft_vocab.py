"""VocabTrim: a draft head over the target's most frequent output tokens.

The LM head of a 150K-token vocabulary is a large share of a shallow draft's bytes (15% of
Qwen2.5-1.5B, 21% of SmolLM2-135M whose head is its tied embedding). Drafting over the few thousand
tokens the target actually emits reads only their LM head rows; a draft outside them is simply not
proposed (lossless: drafts are only proposals). The ranking comes from the text the target itself
generated for `train-exits` (its training sequences, not the held-out ones), never from evaluation
sets; `train-exits` writes it next to the heads.

    exit_heads/draft_vocab.safetensors   token_ids [n]: every token seen, most frequent first

A separate draft model (`draft_vocab` with draft_source='draft_model') needs no ranking file:
`ContextDraftVocab` drafts over the lowest token ids, the stop tokens and every token of the live
requests' sequences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def rank_tokens(sequences: list[list[int]], always: tuple[int, ...] = ()) -> torch.Tensor:
    """Token ids by frequency (most frequent first, ties by id), `always` (e.g. EOS) in front."""
    counts = Counter(t for seq in sequences for t in seq)
    ranked = [t for t in always] + [
        t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in always
    ]
    return torch.tensor(ranked, dtype=torch.long)


def save_draft_vocab(heads_dir: str | Path, ranked: torch.Tensor) -> Path:
    """Write `rank_tokens` output as the heads' draft vocabulary."""
    from safetensors.torch import save_file

    path = Path(heads_dir) / DRAFT_VOCAB_FILE
    save_file({"token_ids": ranked.long().contiguous()}, str(path))
    return path


def available_draft_vocab(heads_dir: str | Path) -> int:
    """How many ranked tokens the heads' draft vocabulary holds (0 when there is none)."""
    from safetensors import safe_open

    path = Path(heads_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return 0
    with safe_open(str(path), "pt") as f:
        return int(f.get_slice("token_ids").get_shape()[0])


def load_draft_vocab(heads_dir: str | Path, size: int) -> torch.Tensor:
    """The `size` most frequent token ids (ValueError when fewer were ranked)."""
    from safetensors.torch import load_file

    path = Path(heads_dir) / DRAFT_VOCAB_FILE
    ids = load_file(str(path))["token_ids"]
    if ids.numel() < size:
        raise ValueError(f"{path}: {ids.numel()} ranked tokens, {size} asked for")
    return ids[:size].clone()


class ContextDraftVocab:
    """A draft model's LM head over part of the vocabulary: the `size` lowest token ids, the stop
    tokens, and every token of the live requests' sequences (prompt and output).

    Byte-level BPE tokenizers number tokens in merge order and learn merges most frequent first, so
    the lowest ids are the tokens text uses most; names and identifiers copied from the context are
    added per request. A token outside the set is never drafted (lossless: drafts are proposals),
    and each draft reads `size` plus a few LM head rows instead of the whole vocabulary.
    `head`: compat.model.PlainLMHead of the draft model; `linear(x, weight, bias)`: the product;
    `prepare(rows)`: the product `x -> x @ rows.T` with the `size` lowest ids' rows, prepared once
    (e.g. over a packed copy of them: verification/lossless/linear_kernel.py `head_rows_linear`), or None for
    `linear` over them.
    """

    def __init__(self, head: Any, size: int, always: Iterable[int] = (),
                 linear: Any = torch.nn.functional.linear, prepare: Any = None) -> None:
        vocab = int(head.weight.shape[0])
        if not 1 <= size <= vocab:
            raise ValueError(f"draft_vocab: must be between 1 and the draft model's vocabulary ({vocab}), got {size}")
        self.head = head
        self.linear = linear
        self.size = size
        rows = head.weight[:size]
        self._lowest = (prepare and prepare(rows)) or (lambda x: linear(x, rows, None))
        self._always = {int(t) for t in always if size <= int(t) < vocab}
        self._seen: dict[str, tuple[int, set[int]]] = {}  # req id -> (tokens scanned, its ids >= size)
        self._extra: list[int] | None = None
        self.ids = torch.arange(size, device=head.weight.device)  # the drafted token ids, in logits order
        self._extra_rows = head.weight[:0]
        self.rebuilds = 0

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def update(self, req_ids: list[str], histories: list[np.ndarray]) -> None:
        """Track the live requests (`histories[i]`: request `req_ids[i]`'s committed tokens)."""
        changed = False
        live = set(req_ids)
        for req_id in [r for r in self._seen if r not in live]:
            del self._seen[req_id]
            changed = True
        vocab = int(self.head.weight.shape[0])
        for req_id, history in zip(req_ids, histories, strict=True):
            scanned, rare = self._seen.get(req_id, (0, set()))
            if len(history) < scanned:  # not this request's tokens any more: rescan
                scanned, rare = 0, set()
            if len(history) > scanned or req_id not in self._seen:
                new = np.asarray(history[scanned:])
                added = set(np.unique(new[(new >= self.size) & (new < vocab)]).tolist()) - rare
                rare |= added
                changed |= bool(added)
                self._seen[req_id] = (len(history), rare)
        if not changed and self._extra is not None:
            return
        extra = sorted(self._always.union(*(rare for _, rare in self._seen.values())))
        if extra == self._extra:
            return
        self._extra = extra
        device = self.head.weight.device
        index = torch.tensor(extra, dtype=torch.long, device=device)
        self._extra_rows = self.head.weight[index]
        self.ids = torch.cat([torch.arange(self.size, device=device), index])
        self.rebuilds += 1

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits of `self.ids` (the full head's logits at those ids)."""
        logits = self.head.logits(hidden, self.head.weight[: self.size], lambda x, rows, bias: self._lowest(x))
        if self._extra_rows.shape[0]:
            logits = torch.cat([logits, self.head.logits(hidden, self._extra_rows, self.linear)], dim=-1)
        return logits

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.ids[self.logits(hidden).argmax(dim=-1)].tolist()

    def top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, token ids) of the top `k`, the softmax taken over the drafted ids."""
        probs, index = torch.softmax(self.logits(hidden), dim=-1).topk(k, dim=-1)
        return probs, self.ids[index]
