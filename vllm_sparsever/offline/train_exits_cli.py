"""`vllm-sparsever train-exits MODEL`; the main CLI calls `add_subparser`.

The parser imports nothing heavy: knobs left unset keep `TrainExitsOptions`' defaults, which are
read only when the command runs (and listed by `--help` through this table).
"""

from __future__ import annotations

import argparse

from vllm_sparsever.offline.args import positive_int

# The text both train-exits and train-eagle generate and train on: flag -> (options field, type, help).
TEXT_KNOBS = {
    "--num-prompts": ("num_prompts", positive_int, "training prompts (default: every article not held out)"),
    "--num-heldout-prompts": ("num_heldout_prompts", positive_int,
                              "articles held out for the agreement report (default: 8)"),
    "--max-prompt-tokens": ("max_prompt_tokens", positive_int, "prompt text cut to this (default: 256)"),
    "--max-new-tokens": ("max_new_tokens", positive_int, "tokens generated per prompt (default: 384)"),
    "--temperature": ("temperature", float, "sampling temperature of the generated text (default: 0.7)"),
    "--seed": ("seed", int, "seed of sampling, initialisation and training order (default: 0)"),
}  # fmt: skip

# flag -> (TrainExitsOptions field, type, help); default None = the options' default.
_KNOBS = {
    "--adapter-size": ("adapter_size", int, "adapter bottleneck width (default: hidden_size / 2)"),
    "--time-budget": ("time_budget_min", float,
                      "minutes for the whole job; training stops early to stay inside (default: 55)"),
    **TEXT_KNOBS,
    "--min-new-tokens": ("min_new_tokens", int, "no end of text before this many tokens (default: 0)"),
    "--epochs": ("epochs", int, "passes over the training tokens (default: 2)"),
    "--lr": ("lr", float, "AdamW peak learning rate (default: 5e-3)"),
    "--batch-tokens": ("batch_tokens", int, "tokens per training step (default: 64)"),
    "--output": ("output_dir", str, "heads folder (default: <model>/exit_heads)"),
}  # fmt: skip


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train-exits",
        help="train early-exit heads (self-distillation on the model's own text); write them next to it",
        description="Generates text with the target from the calibration prompts (wikipedia), then "
        "trains a small head per exit layer to match the target's final-layer distribution (HF "
        "transformers, CPU, fp32, target frozen). Reports per layer the held-out top-1 agreement "
        "with the final layer before and after training, and writes <model>/exit_heads/.",
    )
    parser.add_argument("model", help="built model name or model folder (as given to vLLM)")
    parser.add_argument("--exit-layers", type=int, nargs="+", default=None,
                        help="decoder layers to exit after, 1..num_layers-1 (default: about 1/4, "
                        "1/2 and 3/4 of depth)")  # fmt: skip
    for flag, (dest, kind, text) in _KNOBS.items():
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    add_text_flags(parser)
    parser.set_defaults(func=_cmd_train_exits)
    return parser


def add_text_flags(parser: argparse.ArgumentParser) -> None:
    """Who generates the training text, whether to regenerate it, and progress bars."""
    parser.add_argument("--generator", choices=["vllm", "hf"], default=None,
                        help="who generates the training text: vLLM offline (default) or HF generate")
    parser.add_argument("--regenerate", action="store_true",
                        help="generate the text again even when the cached text matches")
    parser.add_argument("--no-progress", action="store_true")


# Tokens a chat template adds around a prompt, and the engine's margin (train_exits._generate_vllm).
TEMPLATE_MARGIN = 72


def fit_text_lengths(command: str, model: str, given: dict, defaults) -> None:
    """A prompt and the text generated after it must fit the model: `given`'s (or the defaults')
    --max-prompt-tokens and --max-new-tokens, clamped or refused (models.limits.fit_length)."""
    from vllm_sparsever.models.limits import fit_length, model_max_len

    limit = model_max_len(model)
    prompt = fit_length(command, "--max-prompt-tokens", given.get("max_prompt_tokens"), defaults.max_prompt_tokens,
                        limit, TEMPLATE_MARGIN + 1)
    given["max_new_tokens"] = fit_length(command, "--max-new-tokens", given.get("max_new_tokens"),
                                         defaults.max_new_tokens, limit, prompt + TEMPLATE_MARGIN)
    given["max_prompt_tokens"] = prompt


def _cmd_train_exits(args: argparse.Namespace) -> int:
    import sys

    from vllm_sparsever.models import resolve_model_arg
    from vllm_sparsever.offline.train_exits import TrainExitsError, TrainExitsOptions, summary, train_exits

    given = {dest: getattr(args, dest) for dest, _, _ in _KNOBS.values() if getattr(args, dest) is not None}
    model = resolve_model_arg(args.model, "MODEL")
    fit_text_lengths("train-exits", model, given, TrainExitsOptions())
    if args.exit_layers:
        given["exit_layers"] = tuple(args.exit_layers)
    if args.generator:
        given["generator"] = args.generator
    options = TrainExitsOptions(**given, regenerate=args.regenerate, show_progress=not args.no_progress)
    try:
        result = train_exits(model, options)
    except TrainExitsError as exc:
        print(f"vllm-sparsever train-exits: error: {exc}", file=sys.stderr)
        return 2
    print(summary(result), flush=True)
    return 0
