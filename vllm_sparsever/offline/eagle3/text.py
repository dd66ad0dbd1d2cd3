"""train-eagle's text: the target's continuations of the calibration prompts (shared with
train-exits, training_text.py) or, with `text="chat"`, its answers to chat, math and code prompts
(the benchmarks' prompts left out), several samples per training prompt; and chunks of Python
source (data/python_source.py), read teacher-forced."""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm_sparsever.data.python_source import python_source_chunks
from vllm_sparsever.offline.eagle3.options import TrainEagleError, TrainEagleOptions
from vllm_sparsever.offline.training_text import GENERATED_NAME, split_prompts, target_text, text_options

# text="chat": the target's answers to chat, math and code prompts. Each category's first
# EVALUATION_PROMPTS are the benchmarks' prompts (bench/drafters.py takes the first few), never trained on.
CHAT_CATEGORIES = ("mt_bench", "gsm8k", "humaneval")
EVALUATION_PROMPTS = 16
CHAT_GENERATED_NAME = "generated_chat.jsonl"
CODE_CHUNK_TOKENS = 512


def _interleave(pools: list[list[dict]]) -> list[dict]:
    return [pool[i] for i in range(max(map(len, pools), default=0)) for pool in pools if i < len(pool)]


def chat_prompt_rows(num_heldout: int) -> list[dict]:
    """The prompts of text="chat": each of CHAT_CATEGORIES after its first EVALUATION_PROMPTS,
    interleaved so that `--num-prompts` takes from every category; the held-out prompts (the
    next few of each category) last, where `split_prompts` takes them."""
    from vllm_sparsever.data import load_prompts

    pools = []
    for category in CHAT_CATEGORIES:
        try:
            rows = load_prompts(category)[EVALUATION_PROMPTS:]
        except FileNotFoundError as exc:  # DataNotBuiltError names the build command
            raise TrainEagleError(f"--text chat: {exc}") from None
        pools.append([{"id": f"{category}:{r['id']}", "prompt": r["prompt"]} for r in rows])
    per_category = -(-num_heldout // len(pools))
    heldout = _interleave([pool[:per_category] for pool in pools])[:num_heldout]
    return _interleave([pool[per_category:] for pool in pools]) + heldout


def text_rows(options: TrainEagleOptions) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the generated text: several sampled continuations per
    training prompt, one per held-out prompt. The generated text's cache is keyed by exactly these."""
    prompts = text_options(options)
    if options.text == "chat" and options.prompt_rows is None:
        prompts.prompt_rows = chat_prompt_rows(options.num_heldout_prompts)
    train_rows, heldout_rows = split_prompts(prompts)
    return ([{**row, "id": f"{row['id']}#{k}"} if k else row
             for row in train_rows for k in range(options.samples_per_prompt)], heldout_rows)


class GeneratedText(NamedTuple):
    train_rows: list[dict]
    heldout_rows: list[dict]
    train: list[dict]  # the training rows' sequences (prompt_ids, generated_ids)
    heldout: list[dict]
    model: Any  # the target, if generating the text loaded it; else None


def generated_text(model_dir: str, options: TrainEagleOptions) -> GeneratedText:
    """train-eagle's text for `options`: the target's continuations of `text_rows`, generated once
    and cached in `<model>/exit_heads/` (the calibration text's file is shared with train-exits)."""
    from vllm_sparsever.drafting.exit_head import heads_dir

    train_rows, heldout_rows = text_rows(options)
    name = CHAT_GENERATED_NAME if options.text == "chat" else GENERATED_NAME
    seqs, model = target_text(model_dir, train_rows + heldout_rows, text_options(options),
                              heads_dir(model_dir) / name)
    held = {r["id"] for r in heldout_rows}
    return GeneratedText(train_rows, heldout_rows, [s for s in seqs if s["id"] not in held],
                         [s for s in seqs if s["id"] in held], model)



def python_code(model_dir: str, options: TrainEagleOptions) -> tuple[list[dict], list[dict]]:
    """(training, held-out) Python source chunks as sequences (a one-token prompt), none without
    `code_tokens`."""
    if not options.code_tokens:
        return [], []
    from transformers import AutoTokenizer

    train, heldout = python_source_chunks(AutoTokenizer.from_pretrained(model_dir), options.code_tokens,
                                          options.code_heldout_tokens, CODE_CHUNK_TOKENS, seed=options.seed)
    as_seq = lambda c: {"id": f"code:{c['id']}", "prompt_ids": c["token_ids"][:1],  # noqa: E731
                        "generated_ids": c["token_ids"][1:]}
    return [as_seq(c) for c in train], [as_seq(c) for c in heldout]
