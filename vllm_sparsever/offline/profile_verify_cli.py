"""`vllm-sparsever profile-verify MODEL`: measure the target's verification cost for EVICT.

Starts the target in vLLM (a dedicated engine: the measurement writes K/V into blocks no request
owns), times synthetic verify steps on every worker over a grid of rows x query tokens x context
(adaptive/measure.py), fits the cost model (adaptive/cost.py) and writes it to
<model folder>/sparsever_verify_cost.json, where `"adaptive": {"enabled": true}` finds it.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from vllm_sparsever.offline.args import positive_int


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile-verify", help="measure the target's verify cost (for adaptive/EVICT)")
    p.add_argument("model", help="target: built model name or folder")
    p.add_argument("--out", default=None, help="also write the profile here")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the dtype the engine will serve in (default auto: the model's own, as vLLM picks it); "
                        "a profile measured in another dtype has another shape (fp32 steps are compute-bound)")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help=f"largest context length measured (default {DEFAULT_MAX_CONTEXT}, or what the model's "
                        f"maximum length leaves room for)")
    p.add_argument("--rows", default="1,4,8", help="requests per step (comma-separated)")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64", help="query tokens per request")
    p.add_argument("--contexts", default="256,1024,4096,16384", help="context lengths")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--quick", action="store_true",
                   help=f"a small grid (rows {QUICK['rows']}, tokens {QUICK['tokens']}, contexts {QUICK['contexts']}, "
                        f"repeats {QUICK['repeats']}): a few minutes at most; EVICT scales it to the steps it measures")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.set_defaults(func=cmd_profile_verify)
    return p


DEFAULT_MAX_CONTEXT = 16384


# --quick: enough points for the fit's terms (tokens with knees, rows, context) on 2 cores.
# Steps up to 8 x 16 tokens: batched verify steps pass both knees of the fit (16 and 64 tokens).
QUICK = {"rows": "1,8", "tokens": "1,4,16", "contexts": "256,2048", "repeats": 2}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def hardware() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({len(__import__('os').sched_getaffinity(0))} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_dtype(model: str | Path) -> str:
    """The dtype the model's config names (bfloat16 or float16), else float32: what "auto" profiles."""
    config = json.loads((Path(model) / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "float32")


def cmd_profile_verify(args: argparse.Namespace) -> int:
    from vllm import LLM

    from vllm_sparsever.adaptive.cost import Measurement, VerifyCostProfile, default_cost_profile_path, \
        measurement_grid, summarize
    from vllm_sparsever.models import resolve_model_arg
    from vllm_sparsever.models.limits import fit_length, model_max_len
    from vllm_sparsever.offline.profile_verify import MEASURE_ON_WORKER

    model = resolve_model_arg(args.model, "MODEL")
    dtype = args.dtype if args.dtype != "auto" else model_dtype(model)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    headroom = max(_ints(args.tokens)) + 16  # the query tokens after the context, and a margin
    args.max_context = fit_length("profile-verify", "--max-context", args.max_context, DEFAULT_MAX_CONTEXT,
                                  model_max_len(model), headroom)
    contexts = tuple(c for c in _ints(args.contexts) if c <= args.max_context)
    max_len = args.max_context + headroom
    grid = measurement_grid(max_len, _ints(args.rows), _ints(args.tokens), contexts)
    kv_tokens = max(r * (c + q) for r, q, c in grid)
    print(f"profile-verify: {model}, {len(grid)} grid points x 2 masks, up to {kv_tokens} KV tokens", flush=True)
    # Any sparsever config puts sparsever's runner in the worker and, with attention.dense_kernel
    # "auto", its attention backend: verify steps (chains, trees) attend as served, in the KV layout
    # vLLM picks (no sparsity set-up to change it). No request runs.
    spec = {"method": "sparsever", "draft_source": "ngram", "num_speculative_tokens": 1, "profile": "none"}
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_len,
              max_num_batched_tokens=max(max_len, 2048), tensor_parallel_size=args.tensor_parallel_size,
              speculative_config=spec, seed=0)
    try:
        per_rank = llm.collective_rpc("sparsever_call", args=(MEASURE_ON_WORKER, grid, args.repeats))
        rows = per_rank[0]  # ranks run in lockstep (TP all-reduces): rank 0's times are the step's
        moe = llm.collective_rpc("sparsever_moe_routing")[0]
    finally:
        from vllm_sparsever.compat.engine import shutdown_llm

        shutdown_llm(llm)
    profile = VerifyCostProfile(model=str(model), hardware=hardware(), dtype=dtype,
                                measurements=[Measurement(**m) for m in rows],
                                moe=list(moe) if moe else None).fit()
    path = profile.save(default_cost_profile_path(model))
    for warning in profile.warnings:
        print(f"profile-verify: warning: {warning}", flush=True)
    print(f"wrote {path}")
    if args.out:
        print(f"wrote {profile.save(args.out)}")
    print(json.dumps(summarize(profile), indent=1))
    return 0
