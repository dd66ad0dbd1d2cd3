"""Training text that needs no download and no generation: Python source from the interpreter's own
standard library (PSF-2.0), cut into token chunks.

`train-eagle --code-tokens N` adds such chunks to the target's generated text. The target reads them
teacher-forced, so every position is labelled by the target's own distribution at no generation cost
(a forward pass reads tokens several times faster than decoding writes them on a CPU).
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

LICENSE = "PSF-2.0 (the Python standard library's source, as installed with the interpreter)"
# Test suites hold deliberately broken or odd files; `encodings` is mostly code-point tables.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                           "__pycache__"})
CHARS_PER_TOKEN_BOUND = 8  # a window of chunk_tokens * this many characters holds a chunk


def stdlib_root() -> Path:
    return Path(sysconfig.get_path("stdlib"))


def source_files(root: Path | None = None) -> list[Path]:
    """Every .py file under the standard library outside EXCLUDED_DIRS, in a stable order."""
    root = root or stdlib_root()
    return sorted(p for p in root.rglob("*.py")
                  if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1]))


def _window(text: str, chars: int, rng: random.Random) -> str:
    """A `chars`-long window of `text` that starts at a line start (the whole text if shorter)."""
    if len(text) <= chars:
        return text
    start = rng.randrange(len(text) - chars)
    line = text.rfind("\n", 0, start)
    return text[line + 1: line + 1 + chars]


def python_source_chunks(tokenizer, train_tokens: int, heldout_tokens: int, chunk_tokens: int = 512,
                         seed: int = 0, root: Path | None = None) -> tuple[list[dict], list[dict]]:
    """(training chunks, held-out chunks), one chunk per file from a seeded random window; held-out
    chunks come from files no training chunk reads. Each chunk: {"id": relative path, "token_ids"}.
    Each part stops at the chunk that reaches its token count; chunks shorter than a quarter of
    `chunk_tokens` are skipped."""
    root = root or stdlib_root()
    files = source_files(root)
    rng = random.Random(seed)
    rng.shuffle(files)
    heldout: list[dict] = []
    train: list[dict] = []
    have = {"heldout": 0, "train": 0}
    for path in files:
        part, out, want = (("heldout", heldout, heldout_tokens) if have["heldout"] < heldout_tokens
                           else ("train", train, train_tokens))
        if have[part] >= want:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(_window(text, chunk_tokens * CHARS_PER_TOKEN_BOUND, rng),
                        add_special_tokens=False)["input_ids"][:chunk_tokens]
        if len(ids) < max(2, chunk_tokens // 4):
            continue
        out.append({"id": str(path.relative_to(root)), "token_ids": ids})
        have[part] += len(ids)
    return train, heldout
