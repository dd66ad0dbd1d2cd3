"""`vllm-sparsever train-exits MODEL`: early-exit heads trained by self-distillation.

The target is frozen (Hugging Face transformers, CPU, fp32). Steps:

1. text: the target itself continues the project's calibration prompts (training_text.py: the
   `wikipedia` data set, never an evaluation set), cached next to the heads (`generated.jsonl`).
   The last `num_heldout_prompts` articles are held out for evaluation (disjoint by article id).
2. features: one fp32 forward pass of the target over prompt + generation gives, at every
   position where the target sampled the next token, the residual stream after each exit layer
   L (`hidden_states[L]`) and the final-normed hidden state (teacher = the model's own last layer).
   Prompt positions are not used: the prompt is Wikipedia text, the runtime drafts and verifies
   the target's own text.
3. training: per head, KL(teacher || head) over the full vocabulary, both sides through the
   frozen LM head (teacher logits recomputed per batch from the stored final hidden state, so
   nothing is truncated), on the shared loop (training.py: AdamW, cosine learning rate, deterministic
   seed, a few epochs or until the time budget, the whole job's, runs out).
4. report: per exit layer the top-1 agreement with the final layer on held-out generated text,
   untrained (final norm + LM head at L) and trained; heads + manifest go to `heads_dir(model)`.
"""


from __future__ import annotations

import math
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
from vllm_sparsever.offline.common import TrainingError, eos_token_ids, load_target, read_config, resolve_model_dir
from vllm_sparsever.offline.training import TrainingResult, train_loop
from vllm_sparsever.offline.training_text import (
    DATA_CATEGORY,
    GENERATED_NAME,
    GENERATORS,
    TextOptions,
    split_prompts,
    target_text,
)


class TrainExitsError(TrainingError):
    """train-exits cannot run as asked (names the flag and the allowed values)."""


@dataclass
class TrainExitsOptions(TextOptions):
    """The text's options (TextOptions: prompts, generation, seed), then the heads' and training's."""

    exit_layers: tuple[int, ...] | None = None  # None: about 1/4, 1/2 and 3/4 of depth
    adapter_size: int | None = None  # None: hidden_size // 2
    epochs: int = 2
    lr: float = 5e-3
    weight_decay: float = 0.01
    batch_tokens: int = 64  # small steps: more updates per token beat bigger batches (measured)
    time_budget_min: float = 55.0  # the whole job; training stops early to stay inside it
    output_dir: str | None = None  # None: heads_dir(model_dir)


@dataclass
class LayerResult:
    exit_layer: int
    agreement_untrained: float
    agreement_trained: float
    kl_untrained: float
    kl_trained: float


@dataclass
class TrainExitsResult(TrainingResult):
    manifest: ExitHeadManifest
    layers: list[LayerResult]
    heads: dict[int, ExitHead] = field(repr=False, default_factory=dict)


# ---- validation (before any heavy work) -------------------------------------------------------


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




def train_heads(heads: dict[int, ExitHead], train: Features, lm_head: torch.Tensor,
                options: TrainExitsOptions, deadline: float) -> tuple[int, int, bool, list[float]]:
    """Train all heads on the same token batches (one teacher product per batch, shared).
    Returns (steps done, steps planned, stopped by the time budget, mean KL per epoch)."""
    params = [p for head in heads.values() for p in head.parameters()]
    for head in heads.values():
        head.train().requires_grad_(True)
    n = train.num_tokens

    def batches(generator: torch.Generator) -> list[torch.Tensor]:
        order = torch.randperm(n, generator=generator)
        return [order[s: s + options.batch_tokens] for s in range(0, n, options.batch_tokens)]

    def step(idx: torch.Tensor) -> tuple[float, int]:
        with torch.no_grad():
            teacher_logp = F.log_softmax(train.final[idx] @ lm_head.T, dim=-1)
            teacher_p = teacher_logp.exp()
        losses = []
        for layer, head in heads.items():
            student_logp = F.log_softmax(head(train.residual[layer][idx]) @ lm_head.T, dim=-1)
            loss = (teacher_p * (teacher_logp - student_logp)).sum(-1).mean()
            loss.backward()  # heads are independent: per-head backward frees its graph early
            losses.append(float(loss.detach()))
        return sum(losses) / len(losses), len(idx)

    run = train_loop(params, batches, step, steps_per_epoch=math.ceil(n / options.batch_tokens),
                     epochs=options.epochs, lr=options.lr, weight_decay=options.weight_decay, seed=options.seed,
                     deadline=deadline, show_progress=options.show_progress, metric="kl")
    for head in heads.values():
        head.eval().requires_grad_(False)
    return run


# ---- the job -----------------------------------------------------------------------------------


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


def summary(result: TrainExitsResult) -> str:
    lines = [
        *result.summary_head("exit heads"),
        "held-out top-1 agreement with the final layer (and KL):",
        f"  {'layer':>5}  {'untrained':>9}  {'trained':>7}  {'KL untrained':>12}  {'KL trained':>10}",
    ]
    for r in result.layers:
        lines.append(f"  {r.exit_layer:>5}  {r.agreement_untrained:>9.3f}  {r.agreement_trained:>7.3f}"
                     f"  {r.kl_untrained:>12.3f}  {r.kl_trained:>10.3f}")  # fmt: skip
    return "\n".join(lines)
