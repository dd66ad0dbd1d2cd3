"""A target's dense linears on vLLM-CPU's own path against sparsever's `dense_linear`, side by side.

For each projection of a model (attention QKV and output, MLP gate/up and down, LM head) and token
count, in one process and in turn per round: vLLM-CPU's linear as it prepares it at load
(`run.py`'s `vllm_cpu_linear`: oneDNN, sgl-kernel or torch's linear, whichever it picks on this CPU;
the path is recorded), and `dense_linear` over the plain weight on each of its paths (weights
streamed; fp32 panels for ATen's fp32 GEMM) and on its default choice, and vLLM-CPU's linear with a
call of 1-3 tokens padded to 4 rows (`linear_kernel: "vllm-padded"`), and torch's linear over the plain
weight (what a draft's `draft_vocab` rows ran before they were prepared). Best of rounds per cell;
ratios are vLLM's time / ours (and / padded). Weights rotate over enough copies (together twice the last-level
cache, `last_level_cache_bytes`) that each call reads them from DRAM, as a served model's do: runs
before 2026-12-02 held at most 256 MB of copies, which a Xeon's 480 MB L3 kept cached.

    python bench/kernels/linear_ab.py --model qwen2.5-1.5b --tokens 1 4 8 16 32 64 256 --rounds 3 --tag zen3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

# (N, K) of each projection: Qwen2.5-Coder-1.5B / -0.5B (the LM head is the tied embedding).
MODELS = {
    "qwen2.5-1.5b": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
                     "lm_head": (151936, 1536)},
    "qwen2.5-0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
                     "lm_head": (151936, 896)},
    # the 0.5B draft's LM head over `draft_vocab: 32768` (drafting/draft_vocab.py: its lowest ids' rows)
    "qwen2.5-0.5b-draft-vocab": {"lm_head_32768": (32768, 896)},
}
STREAM_MAX = "SPARSEVER_CPU_LINEAR_STREAM_MAX"
AMX = "SPARSEVER_CPU_LINEAR_AMX"
# ours: the default path; the rest force one (environment the kernel reads per call)
PATHS = {"ours": {}, "ours_stream": {STREAM_MAX: "1000000"}, "ours_panels": {STREAM_MAX: "0"},
         "ours_no_amx": {AMX: "0"}}


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The largest CPU cache's size (sysfs), or `default` where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            pass
    return max(sizes, default=default)


def best_ms(call, reps: int) -> float:
    """The best of `reps` timed calls `call(i)` after one warm-up (i picks the weight copy)."""
    call(0)
    times = []
    for i in range(1, reps + 1):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; vLLM-CPU's engine binds one core per worker here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    from kernels.run import vllm_cpu_linear
    from record import RESULTS, hardware, versions
    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever.verification.lossless.linear_kernel import padded_cpu_linear

    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    started = dt.datetime.now(dt.timezone.utc)
    base = RESULTS / f"linear_ab_{args.tag or args.model}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "started": started.isoformat(),
              "hardware": hardware(), "versions": versions(), "threads": torch.get_num_threads(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": []}
    shapes = MODELS[args.model]
    llc = last_level_cache_bytes()
    record["last_level_cache_bytes"] = llc
    # The LM head runs only the rows that are sampled (a prefill chunk's last token), so few tokens.
    tokens_of = {name: [t for t in args.tokens if name != "lm_head" or t <= 64] for name in shapes}
    cells = [(name, t) for name in shapes for t in tokens_of[name]]
    best: dict[tuple[str, int, str], float] = {}
    paths: dict[str, str] = {}
    with tqdm(total=args.rounds * len(cells), desc="linear A/B", unit="cell") as bar:
        for rnd in range(args.rounds):
            for name, (n, k) in shapes.items():
                size = n * k * dtype.itemsize  # copies past the cache, within memory (4 GB)
                copies = max(2, min(-(-2 * llc // size), int(4e9 // size)))
                weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(copies)]
                stocks = [vllm_cpu_linear(w.clone()) for w in weights]
                padded = [padded_cpu_linear(s) for s in stocks]
                paths[name] = stocks[0].kind
                for t in tokens_of[name]:
                    x = torch.randn(t, k, generator=gen).to(dtype)
                    reps = args.reps if n * k * t < 5e8 else 2
                    order = ["vllm", "vllm_padded", "torch", *PATHS]
                    order = order if rnd % 2 == 0 else order[::-1]
                    for which in order:
                        if which == "vllm":
                            call = lambda i: stocks[i % copies](x)  # noqa: E731
                        elif which == "vllm_padded":
                            call = lambda i: padded[i % copies](x)  # noqa: E731
                        elif which == "torch":
                            call = lambda i: torch.nn.functional.linear(x, weights[i % copies])  # noqa: E731
                        else:
                            call = lambda i: ops.dense_linear(x, weights[i % copies])  # noqa: E731
                            os.environ.update(PATHS[which])
                        ms = best_ms(call, reps)
                        for var in (STREAM_MAX, AMX):
                            os.environ.pop(var, None)
                        key = (name, t, which)
                        best[key] = min(best.get(key, float("inf")), ms)
                    bar.update()
            record["loadavg_1m_after_round_%d" % rnd] = os.getloadavg()[0]
    for name, (n, k) in shapes.items():
        for t in tokens_of[name]:
            row = {"proj": name, "n": n, "k": k, "tokens": t, "vllm_path": paths[name],
                   **{f"{w}_ms": best[(name, t, w)] for w in ("vllm", "vllm_padded", "torch", *PATHS)}}
            row["speedup"] = row["vllm_ms"] / row["ours_ms"]
            row["padded_speedup"] = row["vllm_ms"] / row["vllm_padded_ms"]
            record["rows"].append(row)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    lines = [f"# Dense linears: vLLM-CPU's against sparsever's dense_linear ({args.model}, {args.dtype})", "",
             f"`{record['command']}`", "", f"hardware: {record['hardware']}", "",
             f"torch CPU capability {record['cpu_capability']}, {record['threads']} threads. ms, best of "
             f"{args.rounds} rounds (each the best of its calls); speedup = vLLM's / ours (default path).", "",
             "'no AMX': bf16 few-token rows on vdpbf16ps instead of AMX tiles (the same where the CPU has no AMX).",
             "'vLLM padded': vLLM-CPU's linear, a call of 1-3 tokens run as 4 rows (linear_kernel 'vllm-padded').",
             "'torch': torch.nn.functional.linear over the plain weight.",
             "", "| proj | N x K | tokens | vLLM ms [path] | vLLM padded ms | padded speedup | torch ms | ours ms | speedup "
             "| ours streamed ms | ours fp32 panels ms | ours no AMX ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['proj']} | {r['n']} x {r['k']} | {r['tokens']} | {r['vllm_ms']:.2f} [{r['vllm_path']}] | "
                     f"{r['vllm_padded_ms']:.2f} | {r['padded_speedup']:.2f}x | {r['torch_ms']:.2f} | {r['ours_ms']:.2f} | {r['speedup']:.2f}x | {r['ours_stream_ms']:.2f} | {r['ours_panels_ms']:.2f} "
                     f"| {r['ours_no_amx_ms']:.2f} |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {base}.md / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
