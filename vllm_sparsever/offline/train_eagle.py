"""`vllm-sparsever train-eagle MODEL`: an EAGLE-3 head trained by self-distillation, in vLLM's format.

The target is frozen (Hugging Face transformers, CPU, fp32). Steps:

1. text: the target's own continuations of the calibration prompts, as `train-exits` makes them
   (same options, same cache: `<model>/exit_heads/generated.jsonl`; held-out articles disjoint), or
   with `text="chat"` its answers to chat, math and code prompts (`chat_prompt_rows`; the
   benchmarks' prompts left out);
   with `code_tokens`, chunks of Python source too (data/python_source.py; held-out files disjoint),
   read teacher-forced, which costs a forward pass but no generation.
2. features: one fp32 forward pass of the target per sequence gives, at every position, the
   residual streams vLLM hands an EAGLE-3 head (`aux_layers`: 0 = the embeddings, l = after
   decoder layer l) and the final-normed hidden state (the teacher's logits come from it). They
   are cached in `<model>/eagle3_features/`, one file per text holding every layer computed so
   far, so recipes compared on the same text pay for the forward passes once.
3. training (EAGLE-3's training-time test): the head runs `ttt_steps` steps as it will in vLLM.
   Step 1 at base position s reads token s+1 and the target's streams at s; step k > 1 reads
   token s+k and the head's own output of step k-1. Step 1 attends causally to step 1's keys;
   step k also to its own earlier steps at the same base. Each step is trained towards the
   target's distribution at s+k (KL over the draft vocabulary), on generated positions only
   (`train_positions="all"`: the prompts' positions too; every position of the Python source).
   The LM head starts as the target's rows of the draft vocabulary and stays frozen; the token
   embeddings are the target's (not saved: vLLM shares them). With `feature_scale="rms"` the head
   trains on streams divided per dimension by their RMS over the training text (the later layers'
   streams are several times the early ones', a few dimensions tens of times the rest); the scale
   is folded into `fc` on save, so the saved head reads the raw streams as vLLM hands them. Measured
   worse than the raw streams at equal steps (bench/results/README.md), so not the default.
4. report: per step, the held-out top-1 agreement with the target (the head's token mapped to the
   target's vocabulary against the target's argmax over the full vocabulary), and the mean length
   of the agreeing prefix of a chain of `ttt_steps` (teacher-forced).

Output: `config.json` (architecture `LlamaForCausalLMEagle3`, the aux layer ids, the draft vocabulary
size) and `model.safetensors` (`midlayer.*`, `fc`, `norm`, `lm_head`, and `d2t`/`t2d` when the draft
vocabulary is trimmed), which stock vLLM's `{"method": "eagle3"}` loads; `sparsever_eagle.json` holds
the training record and the held-out agreement.

The job's parts live in `eagle3/`: options.py, text.py, features.py, head.py and training.py; the
target's loading, the shared text and the training loop in common.py, training_text.py and training.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from vllm_sparsever.data.python_source import LICENSE as PYTHON_SOURCE_LICENSE
from vllm_sparsever.offline.common import eos_token_ids, load_target, read_config, resolve_model_dir
from vllm_sparsever.offline.eagle3.features import cached_features, stream_rms
from vllm_sparsever.offline.eagle3.head import new_head, save_head
from vllm_sparsever.offline.eagle3.options import (
    DEFAULT_MAX_INTERMEDIATE,
    FEATURE_SCALES,
    TEXTS,
    TRAIN_POSITIONS,
    TrainEagleError,
    TrainEagleOptions,
)
from vllm_sparsever.offline.eagle3.text import generated_text, python_code
from vllm_sparsever.offline.eagle3.training import STEP_WEIGHT_DECAY, draft_vocabulary, evaluate, train_head
from vllm_sparsever.offline.training import TrainingResult

HEAD_DIRNAME = "eagle3_head"
MANIFEST_NAME = "sparsever_eagle.json"
# Targets whose layer outputs vLLM's EAGLE-3 drafter reads (their vLLM classes support EAGLE-3).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def head_dir(model_dir: str | Path) -> Path:
    return Path(model_dir) / HEAD_DIRNAME


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """(2, L/2, L) where that names three distinct layers, else three spread over 0..L. vLLM's own
    default is (2, L/2, L-3); the last layer's output, which vLLM hands a head as well, taught the
    heads trained here more at equal steps (bench/results/README.md)."""
    layers = (2, num_layers // 2, num_layers)
    if len(set(layers)) == 3 and min(layers) >= 0:
        return layers
    return tuple(sorted({round(i * num_layers / 2) for i in range(3)}))


def validate(options: TrainEagleOptions, config: dict[str, Any]) -> tuple[int, ...]:
    """The aux layers; every bad option as a TrainEagleError naming its flag."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TrainEagleError(f"MODEL: vLLM's EAGLE-3 drafter reads the layer outputs of model types "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}; this model is {model_type!r}")
    layers = int(config["num_hidden_layers"])
    aux = tuple(options.aux_layers) if options.aux_layers else default_aux_layers(layers)
    if len(aux) < 1 or any(not 0 <= a <= layers for a in aux) or list(aux) != sorted(set(aux)):
        raise TrainEagleError(f"--aux-layers: increasing distinct layer ids in 0..{layers} (0 = the embeddings), "
                              f"got {list(aux)}")
    vocab = int(config["vocab_size"])
    if options.draft_vocab is not None and not 1 <= options.draft_vocab:
        raise TrainEagleError(f"--draft-vocab: at least 1 (at most the vocabulary, {vocab}), got {options.draft_vocab}")
    if options.feature_scale not in FEATURE_SCALES:
        raise TrainEagleError(f"--feature-scale: one of {', '.join(FEATURE_SCALES)}, got {options.feature_scale!r}")
    if options.text not in TEXTS:
        raise TrainEagleError(f"--text: one of {', '.join(TEXTS)}, got {options.text!r}")
    if options.train_positions not in TRAIN_POSITIONS:
        raise TrainEagleError(f"--train-positions: one of {', '.join(TRAIN_POSITIONS)}, got {options.train_positions!r}")
    for flag, value in (("--code-tokens", options.code_tokens), ("--code-heldout-tokens", options.code_heldout_tokens)):
        if value < 0:
            raise TrainEagleError(f"{flag}: at least 0, got {value}")
    for flag, value in (("--ttt-steps", options.ttt_steps), ("--epochs", options.epochs),
                        ("--samples-per-prompt", options.samples_per_prompt)):
        if value < 1:
            raise TrainEagleError(f"{flag}: at least 1, got {value}")
    if options.intermediate_size is not None and options.intermediate_size < 1:
        raise TrainEagleError(f"--intermediate-size: at least 1, got {options.intermediate_size}")
    if options.lr <= 0:
        raise TrainEagleError(f"--lr: greater than 0, got {options.lr}")
    if options.time_budget_min <= 0:
        raise TrainEagleError(f"--time-budget: must be > 0 minutes, got {options.time_budget_min}")
    return aux



@dataclass
class TrainEagleResult(TrainingResult):
    before: dict[str, Any]
    after: dict[str, Any]
    code: dict[str, Any] | None = None  # held-out Python source: {"untrained": ..., "trained": ...}



def train_eagle(model: str, options: TrainEagleOptions | None = None) -> TrainEagleResult:
    options = options or TrainEagleOptions()
    start = time.monotonic()
    deadline = start + options.time_budget_min * 60.0
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    aux_layers = validate(options, config)
    output_dir = Path(options.output_dir) if options.output_dir else head_dir(model_dir)
    torch.manual_seed(options.seed)
    seconds: dict[str, float] = {}

    t0 = time.monotonic()
    text = generated_text(model_dir, options)
    train_rows, heldout_rows, train_seqs, hf_model = text.train_rows, text.heldout_rows, text.train, text.model
    seconds["generate"] = time.monotonic() - t0
    all_positions = options.train_positions == "all"
    code_train, code_heldout = python_code(model_dir, options)

    t0 = time.monotonic()
    if hf_model is None:
        hf_model, _ = load_target(model_dir)
    features = partial(cached_features, model_dir, hf_model, aux_layers=aux_layers, show_progress=options.show_progress)
    train = features(train_seqs, desc="features (train)", all_positions=all_positions)
    generated_tokens = sum(len(s.tokens) - s.first for s in train)
    train += features(code_train, desc="features (code)", all_positions=True) if code_train else []
    heldout = features(text.heldout, desc="features (held-out)")
    heldout_code = features(code_heldout, desc="features (held-out code)", all_positions=True) if code_heldout else []
    seconds["features"] = time.monotonic() - t0

    vocab = int(config["vocab_size"])
    draft_ids = draft_vocabulary(
        [s["prompt_ids"] + s["generated_ids"] if all_positions else s["generated_ids"] for s in train_seqs]
        + [s["generated_ids"] for s in code_train], vocab, options.draft_vocab, eos_token_ids(hf_model.generation_config))
    intermediate = options.intermediate_size or min(DEFAULT_MAX_INTERMEDIATE, int(config["intermediate_size"]))
    head = new_head(config, len(aux_layers), intermediate,
                    hf_model.get_output_embeddings().weight.detach().float()[draft_ids])
    if options.feature_scale == "rms":
        head.aux_inv_scale.copy_(1.0 / stream_rms(train))
    embed = hf_model.get_input_embeddings().float().requires_grad_(False)
    del hf_model

    t0 = time.monotonic()
    before = evaluate(head, embed, heldout, options.ttt_steps, draft_ids)
    code = {"untrained": evaluate(head, embed, heldout_code, options.ttt_steps, draft_ids)} if heldout_code else None
    seconds["evaluate"] = time.monotonic() - t0
    t0 = time.monotonic()
    steps, planned, stopped, epoch_loss = train_head(head, embed, train, options,
                                                     deadline - 1.5 * seconds["evaluate"] - 5.0)
    seconds["train"] = time.monotonic() - t0
    t0 = time.monotonic()
    after = evaluate(head, embed, heldout, options.ttt_steps, draft_ids)
    if code is not None:
        code["trained"] = evaluate(head, embed, heldout_code, options.ttt_steps, draft_ids)
    seconds["evaluate"] += time.monotonic() - t0

    save_head(output_dir, head, draft_ids, config, aux_layers)
    seconds["total"] = time.monotonic() - start
    record = {
        "tool": "vllm-sparsever train-eagle",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": {"model_dir": model_dir, "architecture": config["architectures"][0],
                   "num_hidden_layers": int(config["num_hidden_layers"])},
        "settings": {**{k: v for k, v in asdict(options).items() if k not in ("prompt_rows", "output_dir")},
                     "aux_layers": list(aux_layers), "draft_vocab_size": len(draft_ids),
                     "intermediate_size": intermediate},
        "data": {"train_ids": [r["id"] for r in train_rows], "heldout_ids": [r["id"] for r in heldout_rows],
                 "positions": ("every position of the generated sequences (prompts teacher-forced)" if all_positions
                               else "generated tokens only"),
                 "train_tokens_generated_text": generated_tokens,
                 "code": {"source": PYTHON_SOURCE_LICENSE, "positions": "every position (teacher-forced)",
                          "train_files": [s["id"] for s in code_train],
                          "heldout_files": [s["id"] for s in code_heldout]} if code_train or code_heldout else None},
        "loss": "KL(target || head) over the draft vocabulary per training-time-test step, weights "
                f"{STEP_WEIGHT_DECAY}^(k-1); LM head frozen (the target's rows), embeddings the target's",
        "train_tokens": sum(len(s.tokens) - s.first for s in train),
        "heldout_tokens": sum(len(s.tokens) - s.first for s in heldout),
        "steps": steps, "planned_steps": planned, "stopped_by_time_budget": stopped,
        "train_loss_per_epoch": [round(v, 4) for v in epoch_loss],
        "heldout": {"untrained": before, "trained": after},
        "heldout_code": code,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    (output_dir / MANIFEST_NAME).write_text(json.dumps(record, indent=1) + "\n")
    return TrainEagleResult(model_dir=model_dir, output_dir=output_dir, before=before, after=after,
                            train_tokens=record["train_tokens"], heldout_tokens=record["heldout_tokens"],
                            steps=steps, planned_steps=planned, stopped_by_budget=stopped, seconds=seconds,
                            code=code)



def summary(result: TrainEagleResult) -> str:
    per_step = lambda r: " ".join(f"{a:.3f}" for a in r["agreement_per_step"])  # noqa: E731
    return "\n".join([
        *result.summary_head("EAGLE-3 head"),
        "held-out top-1 agreement with the target per draft step (teacher-forced):",
        f"  untrained: {per_step(result.before)}  (mean accepted prefix {result.before['mean_accepted_prefix']:.2f})",
        f"  trained:   {per_step(result.after)}  (mean accepted prefix {result.after['mean_accepted_prefix']:.2f})",
        *([f"held-out Python source: untrained {per_step(result.code['untrained'])}, trained "
           f"{per_step(result.code['trained'])}  (mean accepted prefix "
           f"{result.code['trained']['mean_accepted_prefix']:.2f})"] if result.code else []),
        f"use it: --speculative-config '{{\"method\": \"sparsever\", \"draft_source\": \"eagle3\", "
        f"\"model\": \"{result.output_dir}\", \"num_speculative_tokens\": 3}}'",
    ])
