"""What the presets over bench/harness.py (spec_decode.py, evict.py, drafters.py, lossless_sparse.py)
share: their common flags, a --methods subset of their candidates, and the harness runs they start
(or print, with --dry-run)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import harness


def add_run_flags(p: argparse.ArgumentParser, *, num_prompts: int, max_tokens: int, max_model_len: int | None,
                  default_methods: str = "all") -> None:
    """The flags every preset passes on to the harness (max_model_len None: the preset sets it)."""
    p.add_argument("--methods", nargs="+", metavar="NAME",
                   help=f"run only these candidates (names as above; default: {default_methods})")
    p.add_argument("--rounds", type=int, help="the harness's rounds (default 3; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="the harness's --quick: 2 rounds, plain and the candidates")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    if max_model_len is not None:
        p.add_argument("--max-model-len", type=int, default=max_model_len)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="torch.compile (default: enforce_eager)")
    p.add_argument("--dry-run", action="store_true", help="print the harness command lines, run nothing")


def run_flags(args: argparse.Namespace) -> list[str]:
    out = ["--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
    if getattr(args, "max_model_len", None):
        out += ["--max-model-len", str(args.max_model_len)]
    if getattr(args, "ks", None):
        out += ["--ks", *map(str, args.ks)]
    if args.rounds:
        out += ["--rounds", str(args.rounds)]
    if args.quick:
        out.append("--quick")
    if args.compile:
        out.append("--compile")
    return out


def pick(candidates: dict[str, dict], names: list[str] | None) -> dict[str, dict]:
    """The candidates --methods names (all without it)."""
    if not names:
        return candidates
    unknown = sorted(set(names) - set(candidates))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {', '.join(candidates)}")
    return {n: spec for n, spec in candidates.items() if n in names}


def method_flags(option: str, methods: dict[str, dict]) -> list[str]:
    """`option NAME=JSON` per method (option: --candidate, or --fixed for a vLLM chain)."""
    return [x for name, spec in methods.items() for x in (option, f"{name}={json.dumps(spec)}")]


def run(argvs: list[list[str]], dry_run: bool) -> int:
    """One harness run per argv, one after another (with dry_run: their command lines)."""
    for argv in argvs:
        if dry_run:
            print(shlex.join(["python", "bench/harness.py", *argv]))
            continue
        # A run records sys.argv as its command: the harness command line reruns this one run, where
        # the preset's (which may start several runs) would not.
        preset_argv, sys.argv = sys.argv, ["bench/harness.py", *argv]
        try:
            status = harness.main(argv)
        finally:
            sys.argv = preset_argv
        if status:
            return status
    return 0
