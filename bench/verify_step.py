"""A verify step's cost against a plain decode step's, at long context, with each attention kernel.

One engine (the target, sparsever's runner, no request) times whole synthetic steps through every
layer and the LM head, as `vllm-sparsever profile-verify` does (K/V of `context` tokens already in
the cache, so no prefill is needed): one query token (a plain decode step) and 4-16 causal query
tokens (a dense verify step of a chain), with `attention.dense_kernel` and `attention.decode_kernel`
both "sparsever" (sparsever's kernel) or both "vllm" (vLLM's: a plain vLLM decode step, the
baseline), switched at run time. The kernels alternate per round, in
alternating order, so the VM's drift moves both alike; each point is the median of `--repeats`
steps, and the table gives the best round.

    python bench/verify_step.py --contexts 8192 32768 --rounds 3 --tag zen3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, binding_env, hardware, versions  # noqa: E402

KERNELS = ("sparsever", "vllm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 16], help="verify query tokens (1 is always run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per point and round (median)")
    ap.add_argument("--spec-json", default=None,
                    help="JSON merged into the engine's sparsever config, e.g. '{\"ffn\": {\"enabled\": true, "
                         "\"weights\": \"shared\", \"keep_ratio\": 1.0}}' (every neuron, through sparsever's op)")
    ap.add_argument("--op-profile", action="store_true",
                    help="after the rounds, one more pass per (tokens, context) with sparsever's kernel under "
                         "torch's profiler: the ops that take a step's time (.ops.md)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from vllm import LLM

    from vllm_sparsever.compat.engine import shutdown_llm
    from vllm_sparsever.metrics import set_sparsity
    from vllm_sparsever.models import resolve_model_arg
    from vllm_sparsever.models.limits import fit_length, model_max_len
    from vllm_sparsever.offline.profile_verify import MEASURE_ON_WORKER, OP_PROFILE_ON_WORKER

    target = resolve_model_arg(args.target, "--target")
    tokens = sorted({1, *args.tokens})
    headroom = max(tokens) + 16
    limit = model_max_len(target)
    contexts = [fit_length("verify_step", "--contexts", None, c, limit, headroom) for c in args.contexts]
    max_len = max(contexts) + headroom
    grid = [(1, q, c) for c in contexts for q in tokens]
    started = dt.datetime.now(dt.timezone.utc)
    base = RESULTS / f"verify_step_{args.tag or Path(target).name}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "target": target, "args": vars(args),
              "started": started.isoformat(), "hardware": hardware(), "env": binding_env(), "versions": versions(),
              "contexts": contexts, "rounds": []}
    # As profile-verify: sparsever's runner and attention backend; no request runs.
    spec = {"method": "sparsever", "draft_source": "ngram", "num_speculative_tokens": 1, "profile": "none",
            **(json.loads(args.spec_json) if args.spec_json else {})}
    record["spec"] = spec
    llm = LLM(model=target, dtype=args.dtype, enforce_eager=True, max_model_len=max_len,
              max_num_batched_tokens=max(max_len, 2048), speculative_config=spec, seed=0)
    try:
        with tqdm(total=args.rounds * len(KERNELS), desc="verify steps", unit="kernel round") as bar:
            for rnd in range(args.rounds):
                for kernel in (KERNELS if rnd % 2 == 0 else KERNELS[::-1]):
                    set_sparsity(llm, attention={"dense_kernel": kernel, "decode_kernel": kernel})
                    load = os.getloadavg()[0]
                    start = time.perf_counter()
                    rows = llm.collective_rpc("sparsever_call", args=(MEASURE_ON_WORKER, grid, args.repeats))[0]
                    record["rounds"].append({"round": rnd, "kernel": kernel, "loadavg_1m_before": load,
                                             "wall_s": time.perf_counter() - start,
                                             "steps": [r for r in rows if r["mask"] == "chain"]})
                    base.with_suffix(".partial.json").write_text(json.dumps(record, default=str))
                    bar.update()
        if args.op_profile:
            set_sparsity(llm, attention={"dense_kernel": "sparsever"})
            record["op_profile"] = llm.collective_rpc("sparsever_call", args=(OP_PROFILE_ON_WORKER, grid,
                                                                               args.repeats))[0]
    finally:
        set_sparsity(llm, attention={"dense_kernel": "auto", "decode_kernel": "auto"})
        shutdown_llm(llm)
    record["summary"] = summarize(record, contexts, tokens)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    table = markdown(record)
    base.with_suffix(".md").write_text(table)
    if "op_profile" in record:
        base.with_suffix(".ops.md").write_text(op_table(record))
    base.with_suffix(".partial.json").unlink(missing_ok=True)
    print(table)
    print(f"results: {base}.md / .json")
    return 0


def summarize(record: dict, contexts: list[int], tokens: list[int]) -> dict:
    """Per context: the best round's step ms per (kernel, tokens); decode_1 is the 1-token step on
    vLLM's kernel (plain vLLM's), decode_1_sparsever_kernel on ours; ratios to decode_1."""
    best: dict[tuple[str, int, int], float] = {}
    for rnd in record["rounds"]:
        for s in rnd["steps"]:
            key = (rnd["kernel"], s["context"], s["query_tokens"])
            best[key] = min(best.get(key, float("inf")), 1e3 * s["seconds"])
    out = {}
    for c in contexts:
        decode = best[("vllm", c, 1)]
        row = {"decode_1": decode, "decode_1_sparsever_kernel": best[("sparsever", c, 1)],
               "decode_1_sparsever_kernel_vs_decode": best[("sparsever", c, 1)] / decode}
        for q in tokens:
            if q == 1:
                continue
            for k in KERNELS:
                row[f"verify_{q}_{k}_kernel"] = best[(k, c, q)]
                row[f"verify_{q}_{k}_kernel_vs_decode"] = best[(k, c, q)] / decode
        out[str(c)] = row
    return out


def markdown(record: dict) -> str:
    s = record["summary"]
    tokens = sorted({int(k.split("_")[1]) for row in s.values() for k in row if k.startswith("verify_")})
    lines = [f"# A verify step against a decode step: {Path(record['target']).name}", "",
             f"`{record['command']}`", "", f"hardware: {record['hardware']}", "", f"binding: {record['env']}", "",
             f"speculative_config: `{json.dumps(record['spec'])}`", "",
             "Whole synthetic steps (every layer and the LM head, batch 1, K/V already cached), ms, the best of "
             f"{len(record['rounds']) // len(KERNELS)} rounds (each point the median of "
             f"{record['args']['repeats']} steps); the kernels alternate per round. 'x decode' = the verify "
             "step's time / the 1-token decode step's.", "",
             "| context | decode (1 token, vLLM's) | decode on ours, x decode | " + " | ".join(
                 f"verify {q}: ours, x decode | verify {q}: vLLM's, x decode" for q in tokens) + " |",
             "|" + "---|" * (3 + 2 * len(tokens))]
    for c, row in s.items():
        cells = []
        for q in tokens:
            for k in KERNELS:
                cells.append(f"{row[f'verify_{q}_{k}_kernel']:.1f}, {row[f'verify_{q}_{k}_kernel_vs_decode']:.2f}x")
        ours = (f"{row['decode_1_sparsever_kernel']:.1f}, {row['decode_1_sparsever_kernel_vs_decode']:.2f}x"
                if "decode_1_sparsever_kernel" in row else "-")  # (runs before decode_kernel existed)
        lines.append(f"| {c} | {row['decode_1']:.1f} | {ours} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def op_table(record: dict) -> str:
    """Per grid point, the ops that took the most CPU time per chain step (self time, ms)."""
    lines = [f"# Where a step's time goes: {Path(record['target']).name}", "", f"`{record['command']}`", "",
             "torch profiler, sparsever's attention kernel, self CPU ms per step (the profiler's own overhead "
             "included: compare rows, not totals with the timed table).", ""]
    for point in record["op_profile"]:
        rows, q, ctx = point["point"]
        total = sum(op["self_ms_per_step"] for op in point["ops"])
        lines += [f"## {q} token(s), context {ctx} (top ops: {total:.1f} ms)", "", "| op | calls | ms |", "|---|---|---|"]
        lines += [f"| `{op['name']}` | {op['calls_per_step']:.0f} | {op['self_ms_per_step']:.2f} |" for op in point["ops"]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
