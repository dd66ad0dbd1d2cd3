"""`vllm-sparsever train-exits MODEL`; the main CLI calls `add_subparser`.

The parser imports nothing heavy: knobs left unset keep `TrainExitsOptions`' defaults, which are
read only when the command runs (and listed by `--help` through this table).
"""

from __future__ import annotations

import argparse

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

# flag -> (TrainExitsOptions field, type, help); default None = the options' default.
_KNOBS = {
    "--adapter-size": ("adapter_size", int, "adapter bottleneck width (default: hidden_size / 2)"),
    **TIME_BUDGET_KNOB,
    **TEXT_KNOBS,
    "--min-new-tokens": ("min_new_tokens", int, "no end of text before this many tokens (default: 0)"),
    "--epochs": ("epochs", int, "passes over the training tokens (default: 2)"),
    "--lr": ("lr", float, "AdamW peak learning rate (default: 5e-3)"),
    "--batch-tokens": ("batch_tokens", int, "tokens per training step (default: 64)"),
    "--output": ("output_dir", str, "heads folder (default: <model>/exit_heads)"),
}  # fmt: skip


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = training_parser(
        subparsers, "train-exits",
        help="train early-exit heads (self-distillation on the model's own text); write them next to it",
        description="Generates text with the target from the calibration prompts (wikipedia), then "
        "trains a small head per exit layer to match the target's final-layer distribution (HF "
        "transformers, CPU, fp32, target frozen). Reports per layer the held-out top-1 agreement "
        "with the final layer before and after training, and writes <model>/exit_heads/.",
    )
    parser.add_argument("--exit-layers", type=int, nargs="+", default=None,
                        help="decoder layers to exit after, 1..num_layers-1 (default: about 1/4, "
                        "1/2 and 3/4 of depth)")  # fmt: skip
    add_knobs(parser, _KNOBS)
    add_text_flags(parser)
    parser.set_defaults(func=_cmd_train_exits)
    return parser


def _cmd_train_exits(args: argparse.Namespace) -> int:
    from vllm_sparsever.models import resolve_model_arg
    from vllm_sparsever.offline.train_exits import TrainExitsOptions, summary, train_exits

    given = given_knobs(args, _KNOBS)
    model = resolve_model_arg(args.model, "MODEL")
    fit_text_lengths("train-exits", model, given, TrainExitsOptions())
    if args.exit_layers:
        given["exit_layers"] = tuple(args.exit_layers)
    if args.generator:
        given["generator"] = args.generator
    options = TrainExitsOptions(**given, regenerate=args.regenerate, show_progress=not args.no_progress)
    return run_job("train-exits", train_exits, model, options, summary)
