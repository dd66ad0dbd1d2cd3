"""What the training commands' CLIs (`train-exits`, `train-eagle`) share: the text and time-budget
flags, the text lengths fitted to the model, and how a job runs and reports. Imports nothing heavy."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm_sparsever.offline.args import positive_int

# A flag table: flag -> (options field, type, help); a flag left unset keeps the options' default.
Knobs = dict[str, tuple[str, Callable[[str], Any], str]]

TIME_BUDGET_KNOB: Knobs = {
    "--time-budget": ("time_budget_min", float,
                      "minutes for the whole job; training stops early to stay inside (default: 55)"),
}  # fmt: skip

# The text both train-exits and train-eagle generate and train on (training_text.py).
TEXT_KNOBS: Knobs = {
    "--num-prompts": ("num_prompts", positive_int, "training prompts (default: every article not held out)"),
    "--num-heldout-prompts": ("num_heldout_prompts", positive_int,
                              "articles held out for the agreement report (default: 8)"),
    "--max-prompt-tokens": ("max_prompt_tokens", positive_int, "prompt text cut to this (default: 256)"),
    "--max-new-tokens": ("max_new_tokens", positive_int, "tokens generated per prompt (default: 384)"),
    "--temperature": ("temperature", float, "sampling temperature of the generated text (default: 0.7)"),
    "--seed": ("seed", int, "seed of sampling, initialisation and training order (default: 0)"),
}  # fmt: skip


def training_parser(subparsers: argparse._SubParsersAction, command: str, help: str,
                    description: str) -> argparse.ArgumentParser:
    """A training command's parser, with its MODEL argument."""
    parser = subparsers.add_parser(command, help=help, description=description)
    parser.add_argument("model", help="built model name or model folder (as given to vLLM)")
    return parser


def add_knobs(parser: argparse.ArgumentParser, knobs: Knobs) -> None:
    for flag, (dest, kind, text) in knobs.items():
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=text)


def given_knobs(args: argparse.Namespace, knobs: Knobs) -> dict[str, Any]:
    """The options fields the command line set (the others keep the options' defaults)."""
    return {dest: getattr(args, dest) for dest, _, _ in knobs.values() if getattr(args, dest) is not None}


def add_text_flags(parser: argparse.ArgumentParser) -> None:
    """Who generates the training text, whether to regenerate it, and progress bars."""
    parser.add_argument("--generator", choices=["vllm", "hf"], default=None,
                        help="who generates the training text: vLLM offline (default) or HF generate")
    parser.add_argument("--regenerate", action="store_true",
                        help="generate the text again even when the cached text matches")
    parser.add_argument("--no-progress", action="store_true")


# Tokens a chat template adds around a prompt, and the engine's margin (training_text._generate_vllm).
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


def run_job(command: str, job: Callable[[str, Any], Any], model: str, options: Any,
            summary: Callable[[Any], str]) -> int:
    """Run a training job and print its summary; a bad input (TrainingError) is reported, exit 2."""
    import sys

    from vllm_sparsever.offline.common import TrainingError

    try:
        result = job(model, options)
    except TrainingError as exc:
        print(f"vllm-sparsever {command}: error: {exc}", file=sys.stderr)
        return 2
    print(summary(result), flush=True)
    return 0
