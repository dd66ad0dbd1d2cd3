"""VocabTrim: a draft head over the target's most frequent output tokens.

The LM head of a 150K-token vocabulary is a large share of a shallow draft's bytes (15% of
Qwen2.5-1.5B, 21% of SmolLM2-135M whose head is its tied embedding). Drafting over the few thousand
tokens the target actually emits reads only their LM head rows; a draft outside them is simply not
proposed (lossless: drafts are only proposals). The ranking comes from the text the target itself
generated for `train-exits` (`exit_heads/generated.jsonl`, `generated_ids` per line), never from
evaluation sets.

    exit_heads/draft_vocab.safetensors   token_ids [n]: every token seen, most frequent first
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
GENERATED_FILE = "generated.jsonl"


def rank_tokens(sequences: list[list[int]], always: tuple[int, ...] = ()) -> torch.Tensor:
    """Token ids by frequency (most frequent first, ties by id), `always` (e.g. EOS) in front."""
    counts = Counter(t for seq in sequences for t in seq)
    ranked = [t for t in always] + [
        t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in always
    ]
    return torch.tensor(ranked, dtype=torch.long)


def build_draft_vocab(heads_dir: str | Path, always: tuple[int, ...] = ()) -> Path:
    """Write `draft_vocab.safetensors` from the generated text next to the heads."""
    from safetensors.torch import save_file

    heads_dir = Path(heads_dir)
    source = heads_dir / GENERATED_FILE
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no generated text to rank tokens from (run train-exits)")
    train_ids = _training_ids(heads_dir)  # held-out text stays out of the ranking
    sequences = []
    for line in source.read_text().splitlines():
        row = json.loads(line)
        if "generated_ids" in row and (train_ids is None or row.get("id") in train_ids):
            sequences.append(row["generated_ids"])
    path = heads_dir / DRAFT_VOCAB_FILE
    save_file({"token_ids": rank_tokens(sequences, always)}, str(path))
    return path


def _training_ids(heads_dir: Path) -> set[str] | None:
    """The training prompt ids recorded in the heads' manifest (None when it records none)."""
    path = heads_dir / "manifest.json"
    if not path.is_file():
        return None
    ids = ((json.loads(path.read_text()).get("training") or {}).get("data") or {}).get("train_ids")
    return set(ids) if ids else None


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
