"""`vllm-sparsever train-eagle MODEL`; the main CLI calls `add_subparser`.

The parser imports nothing heavy: knobs left unset keep `TrainEagleOptions`' defaults.
"""

from __future__ import annotations

import argparse

from vllm_sparsever.offline.args import positive_int
from vllm_sparsever.offline.training_cli import (
    TEXT_KNOBS,
    TIME_BUDGET_KNOB,
    add_knobs,
    add_text_flags,
    fit_text_lengths,
    given_knobs,
    run_job,
    training_parser,
)

# flag -> (TrainEagleOptions field, type, help)
_KNOBS = {
    **TIME_BUDGET_KNOB,
    "--draft-vocab": ("draft_vocab", positive_int,
                      "draft vocabulary: the N most frequent tokens of the training text (default: 8192; "
                      "the whole vocabulary if it is smaller)"),
    "--intermediate-size": ("intermediate_size", positive_int,
                            "the head's MLP width (default: the target's, at most 2048)"),
    "--ttt-steps": ("ttt_steps", positive_int, "draft steps unrolled while training (default: 3)"),
    "--samples-per-prompt": ("samples_per_prompt", positive_int,
                             "continuations sampled per training prompt (default: 4)"),
    "--code-tokens": ("code_tokens", int,
                      "tokens of Python source (the standard library's, teacher-forced: no generation) "
                      "added to the training text (default: 0)"),
    "--code-heldout-tokens": ("code_heldout_tokens", int,
                              "held-out Python source tokens, from other files (default: 4096)"),
    **TEXT_KNOBS,
    "--epochs": ("epochs", positive_int, "passes over the training text (default: 5)"),
    "--lr": ("lr", float, "AdamW peak learning rate (default: 2e-3)"),
    "--output": ("output_dir", str, "head folder (default: <model>/eagle3_head)"),
}  # fmt: skip


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = training_parser(
        subparsers, "train-eagle",
        help="train an EAGLE-3 draft head (self-distillation on the model's own text), in vLLM's format",
        description="Generates text with the target from the calibration prompts (wikipedia; the same "
        "cached text as train-exits) or, with --text chat, from chat, math and code prompts, then trains "
        "a one-layer EAGLE-3 head to draft the target's tokens from its hidden states (HF transformers, "
        "CPU, fp32, target frozen). Reports the held-out agreement per draft step and writes "
        "<model>/eagle3_head/, which vLLM's method 'eagle3' and sparsever's draft_source 'eagle3' load.",
    )
    parser.add_argument("--aux-layers", type=int, nargs="+", default=None,
                        help="target layers whose outputs the head reads, 0..num_layers (0 = the embeddings; "
                        "default: 2, L/2, L; vLLM's own default is 2, L/2, L-3)")
    add_knobs(parser, _KNOBS)
    parser.add_argument("--train-positions", choices=("generated", "all"), default=None,
                        help="positions trained on in the generated sequences: the generated tokens, or "
                        "the prompts' too, teacher-forced (default: all)")
    parser.add_argument("--text", choices=("calibration", "chat"), default=None,
                        help="what the target writes to train on: continuations of the calibration articles, "
                        "or answers to chat, math and code prompts (mt_bench, gsm8k, humaneval; each one's "
                        "first 16, the benchmarks' prompts, left out; its defaults: 150 prompts, one "
                        "320-token answer each, 3 epochs, a 65-minute budget) (default: calibration)")
    parser.add_argument("--feature-scale", choices=("rms", "none"), default=None,
                        help="train on the target's streams divided per dimension by their RMS (folded into "
                        "the saved head), or raw (default: none)")
    add_text_flags(parser)
    parser.set_defaults(func=_cmd_train_eagle)
    return parser


def _cmd_train_eagle(args: argparse.Namespace) -> int:
    from vllm_sparsever.models import resolve_model_arg
    from vllm_sparsever.offline.train_eagle import TrainEagleOptions, summary, train_eagle

    given = given_knobs(args, _KNOBS)
    model = resolve_model_arg(args.model, "MODEL")
    text = args.text or "calibration"
    fit_text_lengths("train-eagle", model, given, TrainEagleOptions.for_text(text))
    if args.aux_layers:
        given["aux_layers"] = tuple(args.aux_layers)
    if args.generator:
        given["generator"] = args.generator
    if args.train_positions:
        given["train_positions"] = args.train_positions
    if args.feature_scale:
        given["feature_scale"] = args.feature_scale
    options = TrainEagleOptions.for_text(text, **given, regenerate=args.regenerate, show_progress=not args.no_progress)
    return run_job("train-eagle", train_eagle, model, options, summary)
