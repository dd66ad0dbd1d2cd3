"""A draft pass against its roof: how long one pass of the draft-model drafter takes in a served engine,
against the bytes it must read (its projections at their stored bits, the LM head rows it multiplies,
the K/V of its context) at the copy bandwidth measured in the same worker, and where the rest goes.

    python bench/draft_pass.py --draft qwen2.5-coder-0.5b-w8a8 --batch-sizes 1 8

One engine: EVICT's chains over --draft held at their cap (`"depth": "cap"`, no guard: every step
drafts --k passes), with `draft_vocab` --draft-vocab (0: the whole vocabulary). Each batch size decodes --num-prompts chat
prompts per row; every pass is timed inside the worker (bench/tools/draft_pass_worker.py, on the
worker's import path through PYTHONPATH) and split into: the attention metadata of its queries, the
decoder layers, the LM head, the prefix-sharing bookkeeping, and the Python around them. A pass whose
rows carry more than one token each (a round's first pass, catching up on the tokens the target
accepted) is reported apart from the one-token passes after it. --profile-passes passes are then run
under torch's profiler (not timed): the ops a pass spends its time in, and how much of the pass's time
no op accounts for (Python, dispatch). --split-layers times each module kind of the decoder layers
(through their modules: the drafter's lean layer calls off); --lean-ab alternates passes between the
lean layer calls and the modules' and reports them apart. Results: bench/results/draft_pass_<tag>_<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from record import RESULTS, binding_env, hardware, save_results, versions  # noqa: E402

PARTS = ("metadata", "layers", "head", "bookkeeping")
LAYER_PARTS = ("layer_linear", "layer_attention", "layer_rotary", "layer_norm", "layer_activation")


def summarize(passes: list[dict[str, Any]], nbytes: dict[str, Any], copy_GBps: float) -> dict[str, Any]:
    """Medians per kind of pass (one token per row, or a first pass with catch-up tokens), in ms, with
    the roof: the pass's bytes at the measured copy bandwidth."""
    out = {}
    kinds = [("one_token", [p for p in passes if p["tokens"] == p["rows"]]),
             ("catch_up", [p for p in passes if p["tokens"] > p["rows"]])]
    if any("lean" in p for p in passes):  # --lean-ab: each kind apart for lean and module calls
        kinds = [(f"{kind}, {'lean' if lean else 'modules'}", [p for p in chosen if p["lean"] == lean])
                 for kind, chosen in kinds for lean in (True, False)]
    for kind, chosen in kinds:
        if not chosen:
            continue
        med = lambda key: 1e3 * statistics.median(p.get(key, 0.0) for p in chosen)  # noqa: E731
        context = statistics.median(p["context"] for p in chosen)
        read = context if nbytes["attention_window"] is None else min(context, nbytes["attention_window"])
        rows = statistics.median(p["rows"] for p in chosen)
        pass_bytes = nbytes["projection_bytes"] + nbytes["head_bytes"] + rows * read * nbytes["kv_bytes_per_token"]
        total = med("total_s")
        parts = {k: med(k) for k in PARTS}
        roof = 1e3 * pass_bytes / (copy_GBps * 1e9)
        split = {f"{k}_ms": med(k) for k in LAYER_PARTS if any(k in p for p in chosen)}
        if split:  # --split-layers: the layers' time by module kind; the rest is the layers' own Python
            split["layer_python_ms"] = max(parts["layers"] - sum(split.values()), 0.0)
        out[kind] = {"passes": len(chosen), "rows": rows, "tokens": statistics.median(p["tokens"] for p in chosen),
                     **split,
                     "context": context, "total_ms": total, **{f"{k}_ms": v for k, v in parts.items()},
                     "other_ms": max(total - sum(parts.values()), 0.0), "bytes": pass_bytes, "roof_ms": roof,
                     "roof_fraction": roof / total}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-w8a8")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="0: the whole vocabulary")
    ap.add_argument("--draft-window", type=int, default=None, help="draft_attention_window (default: none)")
    ap.add_argument("--k", type=int, default=3, help="drafts per step (passes per round)")
    ap.add_argument("--draft-int8-kernel", choices=("auto", "sparsever", "hybrid", "vllm"), default="auto",
                    help="the int8 draft's linears: sparsever's int8_linear or vLLM-CPU's int8 GEMM (draft_int8_kernel)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per row of each batch size")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--profile-passes", type=int, default=6)
    ap.add_argument("--split-layers", action="store_true",
                    help="also time each decoder layer's linears, attention, rotary, norms and activation "
                         "(a timer per module call: about a microsecond each, in the layers' time)")
    ap.add_argument("--lean-ab", action="store_true",
                    help="alternate passes between the drafter's lean layer calls and the layers' modules, "
                         "reported apart (interleaved in one engine)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if args.lean_ab and args.split_layers:
        ap.error("--lean-ab times the lean calls, which --split-layers turns off")
    # The worker imports bench/tools/draft_pass_worker.py through PYTHONPATH, which vLLM's workers only
    # see when it was set before this interpreter started (set here, it did not reach them): re-run.
    tools = str(HERE / "tools")
    if tools not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")]))}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    from vllm import LLM, SamplingParams

    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.compat.engine import shutdown_llm
    from vllm_sparsever.data import load_prompts

    target, draft = resolve_model(args.target, "--target"), resolve_model(args.draft, "--draft")
    # EVICT's drafting path (chains grown level by level) held at the cap: every step drafts --k passes.
    spec: dict[str, Any] = {"method": "sparsever", "model": draft, "num_speculative_tokens": args.k,
                            "adaptive": {"enabled": True, "guard": False, "depth": "cap"},
                            "draft_int8_kernel": args.draft_int8_kernel}
    if args.draft_vocab:
        spec["draft_vocab"] = args.draft_vocab
    if args.draft_window:
        spec["draft_attention_window"] = args.draft_window
    rows_needed = max(args.batch_sizes) * args.num_prompts
    prompts = [r["prompt"] for c in ("mt_bench", "humaneval") for r in load_prompts(c, n=(rows_needed + 1) // 2)]
    started = dt.datetime.now(dt.timezone.utc)
    record: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "target": target, "spec": spec,
                              "args": vars(args), "started": started.isoformat(), "hardware": hardware(),
                              "env": binding_env(), "versions": versions(), "batch_sizes": {}}
    llm = LLM(model=target, dtype="bfloat16", enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=max(args.batch_sizes), seed=0, speculative_config=spec, async_scheduling=False)
    call = lambda name, *a: llm.collective_rpc("sparsever_call", args=(f"draft_pass_worker:{name}", *a))[0]  # noqa: E731

    def chat(batch: list[str], max_tokens: int) -> None:
        llm.chat([[{"role": "user", "content": x}] for x in batch],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)

    try:
        chat(prompts[:1], 8)  # warm-up
        call("install", args.split_layers, args.lean_ab)
        record["bandwidth"] = call("bandwidth")
        record["pass_bytes"] = nbytes = call("pass_bytes")
        for i, b in enumerate(args.batch_sizes):
            call("fetch")
            start = time.perf_counter()
            for j in range(args.num_prompts):
                chat(prompts[j * b: (j + 1) * b], args.max_tokens)
            got = call("fetch")
            entry = summarize(got["passes"], nbytes, record["bandwidth"]["copy_GBps"])
            record["batch_sizes"][str(b)] = {"seconds": time.perf_counter() - start, "summary": entry,
                                             "passes": got["passes"]}
            print(f"[{i + 1}/{len(args.batch_sizes)}] batch {b}: "
                  f"{ {k: round(v['total_ms'], 1) for k, v in entry.items()} } ms per pass", flush=True)
        call("profile", args.profile_passes)
        call("fetch")
        chat(prompts[:1], max(8, 2 * args.profile_passes // args.k + 2))
        got = call("fetch")
        per_pass = max(got["profiled_passes"], 1)
        record["profile"] = {"passes": got["profiled_passes"], "ms_per_pass": 1e3 * got["profiled_s"] / per_pass,
                             "ops_us_per_pass": {k: v[0] / per_pass for k, v in got["ops"].items()},
                             "calls_per_pass": {k: v[1] / per_pass for k, v in got["ops"].items()}}
    finally:
        shutdown_llm(llm)
    tag = args.tag or Path(draft).name
    base = RESULTS / f"draft_pass_{tag}_{started.strftime('%Y%m%d-%H%M')}"
    save_results(base, record, report(record))
    return 0


def report(record: dict[str, Any]) -> list[str]:
    hw, bw, nb = record["hardware"], record["bandwidth"], record["pass_bytes"]
    lines = [f"# A draft pass against its roof: {Path(record['spec']['model']).name}", "",
             f"`{record['command']}`", "",
             f"{hw.get('cpu')} ({hw.get('cpu_class')}), {hw.get('cores')} cores; commit {record['versions'].get('git')}; "
             f"{record['started']}", "",
             f"Worker: {bw['threads']} torch threads, copy bandwidth {bw['copy_GBps']:.1f} GB/s (read + written, "
             f"{bw['megabytes']} MB buffers). A pass reads {nb['projection_bytes'] / 1e6:.0f} MB of projections, "
             f"{nb['head_bytes'] / 1e6:.0f} MB of LM head ({nb['head_rows']} rows) and "
             f"{nb['kv_bytes_per_token'] / 1e3:.1f} KB of K/V per context token and row "
             f"(window {nb['attention_window']}).", "",
             "ms per pass, medians; roof = the pass's bytes at the copy bandwidth; other = Python around the parts.", "",
             "| batch | pass | passes | tokens | context | total | metadata | layers | head | bookkeeping | other "
             "| roof | roof / total |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b, entry in record["batch_sizes"].items():
        for kind, s in entry["summary"].items():
            lines.append(f"| {b} | {kind} | {s['passes']} | {s['tokens']:.0f} | {s['context']:.0f} | {s['total_ms']:.1f} | "
                         f"{s['metadata_ms']:.1f} | {s['layers_ms']:.1f} | {s['head_ms']:.1f} | {s['bookkeeping_ms']:.1f} "
                         f"| {s['other_ms']:.1f} | {s['roof_ms']:.1f} | {s['roof_fraction']:.2f} |")
    split_rows = [(b, kind, s) for b, entry in record["batch_sizes"].items() for kind, s in entry["summary"].items()
                  if "layer_python_ms" in s]
    if split_rows:
        lines += ["", "The layers' time by module kind (--split-layers), ms per pass; Python: the layers' time "
                  "outside those modules (their forwards' own code).", "",
                  "| batch | pass | layers | linears | attention | rotary | norms | activation | Python |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for b, kind, s in split_rows:
            lines.append(f"| {b} | {kind} | {s['layers_ms']:.1f} | " + " | ".join(
                f"{s.get(k + '_ms', 0.0):.2f}" for k in LAYER_PARTS) + f" | {s['layer_python_ms']:.2f} |")
    prof = record.get("profile")
    if prof:
        ops = sorted(prof["ops_us_per_pass"].items(), key=lambda kv: -kv[1])
        lines += ["", f"Profiled passes ({prof['passes']}, not timed above): the ops' own CPU time per pass, "
                  f"{sum(v for _, v in ops) / 1e3:.1f} ms in all, of {prof['ms_per_pass']:.1f} ms per profiled pass.", "", "| op | ms per pass | calls per pass |", "|---|---|---|"]
        lines += [f"| {k} | {v / 1e3:.2f} | {prof['calls_per_pass'][k]:.0f} |" for k, v in ops[:15]]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
