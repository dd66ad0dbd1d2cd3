"""VocabTrim: a draft head over the target's most frequent output tokens.

The LM head of a 150K-token vocabulary is a large share of a shallow draft's bytes (15% of
Qwen2.5-1.5B, 21% of SmolLM2-135M whose head is its tied embedding). Drafting over the few thousand
tokens the target actually emits reads only their LM head rows; a draft outside them is simply not
proposed (lossless: drafts are only proposals). The ranking comes from the text the target itself
generated for `train-exits` (its training sequences, not the held-out ones), never from evaluation
sets; `train-exits` writes it next to the heads.

    exit_heads/draft_vocab.safetensors   token_ids [n]: every token seen, most frequent first
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

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
