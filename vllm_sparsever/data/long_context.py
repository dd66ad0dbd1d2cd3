"""Long-context prompts at a chosen length: cut a document to N tokens of a given tokenizer."""

from __future__ import annotations

import os
from typing import Any

from vllm_sparsever.data.builders import make_long_prompt

STANDARD_LENGTHS = (1024, 8192, 32768)


def _as_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def count_tokens(text: str, tokenizer) -> int:
    return len(_as_tokenizer(tokenizer)(text, add_special_tokens=False)["input_ids"])


def cut_to_tokens(text: str, tokenizer, num_tokens: int, *, at_line: bool = True) -> str:
    """The longest prefix of `text` with at most `num_tokens` tokens (cut at a line end when
    `at_line`, so that no speech or verse is split mid-line). Texts already short enough are returned whole."""
    if num_tokens <= 0:
        return ""
    tok = _as_tokenizer(tokenizer)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) <= num_tokens:
        return text
    end = offsets[num_tokens - 1][1]  # character end of the last kept token
    prefix = text[:end]
    if at_line and "\n" in prefix:
        prefix = prefix[: prefix.rindex("\n")]
    return prefix.rstrip()


def long_context_prompts(
    tokenizer,
    target_tokens: int,
    *,
    task: str = "qa",
    n: int | None = None,
    root: str | os.PathLike | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One prompt per long document, each at most `target_tokens` tokens long (prompt template
    included). `task="qa"` asks who speaks a line that lies inside the kept part (plays only; Milton
    falls back to summarization); `task="summarize"` asks for a summary of the kept part."""
    from vllm_sparsever.data import load_prompts

    tok = _as_tokenizer(tokenizer)
    rows = []
    for row in load_prompts("long_context", root=root):
        doc_task = task if row["author"] == "William Shakespeare" else "summarize"
        template, _ = make_long_prompt("", row["title"], "summarize")
        # The QA question quotes one line; leave room for the longest speech line (~100 tokens).
        overhead = count_tokens(template, tok) + (128 if doc_task == "qa" else 0)
        document = cut_to_tokens(row["document"], tok, target_tokens - overhead)
        prompt, answer = make_long_prompt(document, row["title"], doc_task, seed=seed)
        rows.append(
            {
                "id": f"{row['id']}/{target_tokens}",
                "category": "long_context",
                "task": doc_task,
                "title": row["title"],
                "prompt": prompt,
                "answer": answer,
                "num_tokens": count_tokens(prompt, tok),
                "target_tokens": target_tokens,
                "source": row["source"],
                "license": row["license"],
            }
        )
        if n is not None and len(rows) >= n:
            break
    return rows
