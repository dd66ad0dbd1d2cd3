"""Soak: `vllm serve` with sparsever under continuous mixed load (streaming, a quarter of the requests
cancelled mid-stream), resident memory of the server's processes sampled throughout.

    python bench/serve_soak.py --minutes 20                 # tiny random models, EVICT draft trees
    python bench/serve_soak.py --minutes 2 --tag quick

The models are the test suite's tiny random Llamas (built on the fly): small steps mean many
requests per minute, i.e. the most allocations and frees per minute a leak could hide in. Writes
JSON (command, hardware, versions, every sample, per-batch counts), a markdown summary and a plot
of RSS over time under bench/results/. Flat means: the mean RSS of the last fifth of the run is
within a few MB of the mean of the second fifth (after warm-up) and the fitted slope over the
second half is near zero.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from record import RESULTS, binding_env, hardware, versions  # noqa: E402


def tree_rss_mb(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def soak(base: str, pid: int, minutes: float, *, concurrency: int = 32, sample_s: float = 5.0) -> dict:
    """Run mixed load against `base` for `minutes`; sample the RSS of process `pid` and its children."""
    from load_utils import ServerCounters, mixed_requests, run_load, wait_until_idle

    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    start = time.monotonic()

    def sampler():
        while not stop.is_set():
            samples.append((time.monotonic() - start, tree_rss_mb(pid)))
            stop.wait(sample_s)

    thread = threading.Thread(target=sampler, daemon=True)
    counters_before = ServerCounters.read(base)
    thread.start()
    batches = []
    i = 0
    try:
        while time.monotonic() - start < minutes * 60:
            reqs = mixed_requests(64, seed=1000 + i, cancel_fraction=0.25, max_prompt_words=200, max_tokens=48)
            t = time.monotonic()
            results = run_load(base, reqs, concurrency=concurrency)
            batch = {"batch": i, "seconds": time.monotonic() - t,
                     "served": sum(1 for r in results if not r.cancelled and r.error is None),
                     "cancelled": sum(1 for r in results if r.cancelled),
                     "failed": sum(1 for r in results if r.error is not None),
                     "tokens": sum(r.completion_tokens or 0 for r in results if not r.cancelled),
                     "errors": [r.error for r in results if r.error][:3]}
            batches.append(batch)
            rss = samples[-1][1] if samples else float("nan")
            print(f"  [{(time.monotonic() - start) / 60:5.1f}/{minutes} min] batch {i}: served {batch['served']}, "
                  f"cancelled {batch['cancelled']}, failed {batch['failed']}, RSS {rss:.0f} MB", flush=True)
            i += 1
    finally:
        idle = wait_until_idle(base)
        time.sleep(sample_s)
        stop.set()
        thread.join()
    return {"samples": samples, "batches": batches, "summary": summarize(samples, batches),
            "counters_before": counters_before.values, "counters_after": idle.values}


def summarize(samples: list[tuple[float, float]], batches: list[dict]) -> dict:
    ts = [t for t, _ in samples]
    ms = [m for _, m in samples]
    n = len(ms)
    fifth = max(1, n // 5)
    second = ms[fifth:2 * fifth] or ms[:1]
    last = ms[-fifth:]
    half = list(zip(ts[n // 2:], ms[n // 2:]))
    slope = 0.0
    if len(half) >= 2:
        mt = sum(t for t, _ in half) / len(half)
        mm = sum(m for _, m in half) / len(half)
        var = sum((t - mt) ** 2 for t, _ in half)
        slope = sum((t - mt) * (m - mm) for t, m in half) / var * 60 if var else 0.0
    return {
        "rss_mb_first": ms[0] if ms else None, "rss_mb_last": ms[-1] if ms else None, "rss_mb_max": max(ms) if ms else None,
        "rss_mb_mean_second_fifth": sum(second) / len(second), "rss_mb_mean_last_fifth": sum(last) / len(last),
        "rss_growth_mb": sum(last) / len(last) - sum(second) / len(second),
        "rss_slope_mb_per_min_second_half": slope,
        "requests_served": sum(b["served"] for b in batches), "requests_cancelled": sum(b["cancelled"] for b in batches),
        "requests_failed": sum(b["failed"] for b in batches), "tokens_served": sum(b["tokens"] for b in batches),
        "minutes": ts[-1] / 60 if ts else 0.0,
    }


def tiny_server_args(work: Path) -> tuple[Path, list[str], dict]:
    """The tiny target, `vllm serve` arguments with EVICT draft trees over the tiny draft, env."""
    from e2e.test_trees import _cost_profile
    from tiny_models import make_tiny_llama

    target = make_tiny_llama(work / "target", seed=0)
    draft = make_tiny_llama(work / "draft", seed=1, perturb_from=target, perturb_scale=0.04)
    spec = {"method": "sparsever", "model": str(draft), "num_speculative_tokens": 8,
            "tree": {"enabled": True, "branching": 2, "expand": 2, "depth": 4},
            "adaptive": {"enabled": True, "guard": False, "cost_profile": _cost_profile(work / "cost.json", 1e-5)}}
    args = [str(target), "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "1024",
            "--max-num-seqs", "64", "--seed", "0", "--no-async-scheduling", "--enforce-eager",
            "--speculative-config", json.dumps(spec)]
    return target, args, {"VLLM_CPU_KVCACHE_SPACE": "1"}


def plot(samples, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([t / 60 for t, _ in samples], [m for _, m in samples])
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS of server processes (MB)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tag", default="tiny-evict-trees")
    args = p.parse_args(argv)

    from serve_utils import running_vllm_serve

    work = Path(tempfile.mkdtemp(prefix="serve_soak_"))
    _, serve_args, env = tiny_server_args(work)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M")
    print(f"soak {args.minutes} min, concurrency {args.concurrency}; server log {work / 'server.log'}", flush=True)
    with running_vllm_serve(serve_args, work / "server.log", env=env) as (base, proc):
        result = soak(base, proc.pid, args.minutes, concurrency=args.concurrency)
    out = {"command": " ".join([sys.executable, *sys.argv]), "date": stamp, "hardware": hardware(),
           "versions": versions(), "binding": binding_env(), "server_args": serve_args, **result}
    name = f"serve_soak_{args.tag}_{stamp}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))
    s = result["summary"]
    md = "\n".join(f"- {k}: {v:.2f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in s.items())
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n`{out['command']}`\n\n{md}\n")
    plot(result["samples"], RESULTS / f"{name}.png", f"soak: {args.minutes} min of mixed load")
    print(md)


if __name__ == "__main__":
    main()
