"""Rebuild a summary file (bench/results/summary/<name>.json) from named harness runs.

    python bench/summaries.py evict qwen.batch_1=bench/results/harness_X.json qwen.batch_8=... moe.batch_1=...

Each SLOT=RUN puts one harness run (bench/harness.py's JSON) at SLOT: plain vLLM, sparsever's kernels
alone (drafting off), vLLM's best fixed chain, and the best lossless candidate, each as its median
over the run's rounds with min-max, plus the ratios, the identity flags and the run's name and
command. The runs of one CPU class make the main entry; runs on another class go under
`other_machines.<class>` with the same slots. `aims` states each aim of the issues that name the file
as "met", "not met" or "not measured". Nothing is copied by hand: the file says which run each figure
comes from. long_context.json's step and kernel figures come from `--steps` (bench/verify_step.py) and
`--kernels` (bench/kernels/run.py --parts attention) runs on the main machine's class; without them the
previous file's are kept under the machine that measured them. drafters.json's head figures come from
`--head` (the EAGLE-3 head folder its runs drafted with: its training manifest). `SLOT.approximate=RUN` sets SLOT's
`best_approximate` from another run on the same CPU class (its approximate candidate against that run's
plain decoding, kernels alone and best lossless candidate), where SLOT's own run had none.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "bench" / "results" / "summary"

# Slots per summary file, and the key its fixed-chain baseline goes under there.
SLOTS = {
    "evict": {"qwen.batch_1": "draft_model_best", "qwen.batch_8": "draft_model_best",
              "moe.batch_1": "fixed_chain_best"},
    "long_context": {"contexts.8192": "draft_model_best", "contexts.32768": "draft_model_best"},
    "drafters": {"batch_1": "best_fixed", "batch_8": "best_fixed"},  # top-level slots (bench/drafters.py runs)
}
# Slots filled from a bench/serve_load.py run (servers under `vllm bench serve`), not a harness run.
SERVING_SLOTS = {"evict": {"serving": ("1", "8", "32")}}
# Figures a summary holds that no harness run gives (step and kernel timings, from their own scripts):
# kept from the previous file, under the machine they were measured on.
KEPT = {"long_context": ("verify_step_ms", "roof_fraction", "roof_kernel", "attainable_fraction", "sources")}


def spread(entry: dict) -> dict[str, float]:
    return {"median": entry["tok_s_median"], "min": entry["tok_s_min"], "max": entry["tok_s_max"],
            "pooled": entry["tok_s_pooled"]}


def run_class(run: dict) -> str:
    """The CPU class a harness run (its machine) or a serve_load run (its hardware) was taken on."""
    where = run.get("machine") or run["hardware"]
    return where.get("cpu_class") or f"{where.get('cpu')} (class not recorded)"


def fastest(methods: dict, lossless: bool) -> str | None:
    """A run's fastest candidate by median, lossless (its texts not flagged non-identical) or
    approximate; None where it has none. Sparsever's kernels alone, given as a candidate by a run
    without the baselines' roles, is no mode."""
    chosen = {n: e for n, e in methods.items() if e["role"] == "candidate" and e["lossless"] == lossless
              and not (lossless and "not_identical" in e["flags"]) and n != "sparsever-kernels-only"}
    return max(chosen, key=lambda n: chosen[n]["tok_s_median"]) if chosen else None


def slot_entry(run: dict, run_name: str, fixed_key: str) -> dict[str, Any]:
    """One harness run as a summary slot."""
    methods = run["summary"]["methods"]
    missing = [m for m in ("plain", "sparsever-kernels-only") if m not in methods]
    if missing or not run["summary"].get("best_fixed"):
        raise SystemExit(f"{run_name}: a summary needs the three baselines; this run lacks "
                         f"{missing or ['vLLM fixed chains']} (a --quick run?)")
    short = [n for n, e in methods.items() if "short_outputs" in e.get("flags", ())]
    if short:
        raise SystemExit(f"{run_name}: {short} produced under half the tokens asked for (answers ended early; "
                         f"rerun with --ignore-eos): their tokens/s time a few tokens")
    best = fastest(methods, lossless=True)
    if best is None:
        raise SystemExit(f"{run_name}: no lossless candidate to summarise")
    fixed_name = run["summary"]["best_fixed"]
    plain, kernels, fixed, cand = (methods[n] for n in ("plain", "sparsever-kernels-only", fixed_name, best))
    fixed_entry = {"k": run["summary"]["best_fixed_k"], "mode": fixed_name, "tok_s": fixed["tok_s_median"]}
    best_approx = fastest(methods, lossless=False)
    return {
        "results_file": run_name, "command": run["command"], "commit": run["commit"], "rounds": run["rounds"],
        "batch_size": run["batch_size"], "prompts": run["num_prompts"], "max_tokens": run["max_tokens"],
        "dtype": run["dtype"], "metric": run["metric"],
        "autoregressive_tok_s": plain["tok_s_median"],
        "sparsever_kernels_only_tok_s": kernels["tok_s_median"],
        fixed_key: fixed_entry,
        "evict_best": {"mode": best, "tok_s": cand["tok_s_median"], "config": cand["speculative_config"],
                       "mean_acceptance_length": cand["mean_acceptance_length"]},
        "spread": {"plain": spread(plain), "kernels_only": spread(kernels), "best_fixed": spread(fixed),
                   "evict": spread(cand)},
        "evict_vs_plain": cand["tok_s_median"] / plain["tok_s_median"],
        "evict_vs_kernels_only": cand["tok_s_median"] / kernels["tok_s_median"],
        "evict_vs_best_fixed": cand["tok_s_median"] / fixed["tok_s_median"],
        "kernels_only_vs_plain": kernels["tok_s_median"] / plain["tok_s_median"],
        **({"best_approximate": {"mode": best_approx, "tok_s": methods[best_approx]["tok_s_median"],
                                 "vs_plain": methods[best_approx]["vs_plain"]}} if best_approx else {}),
        "flags": {n: e["flags"] for n, e in methods.items() if e["flags"]},
        "divergent_prompts": {"evict": len(cand["divergent_prompts"]),
                              "vllm_max": run["summary"]["vllm_divergent_prompts_max"]},
    }


def approximate_entry(run: dict, run_name: str) -> dict[str, Any]:
    """A run's best approximate candidate (sparse verification: its text may change), against the same
    run's plain decoding, kernels alone and best lossless candidate: what `SLOT.approximate=RUN` puts
    at SLOT's `best_approximate` when the slot's own run had none."""
    methods = run["summary"]["methods"]
    best = fastest(methods, lossless=False)
    if best is None or "plain" not in methods or "sparsever-kernels-only" not in methods:
        raise SystemExit(f"{run_name}: an approximate slot needs an approximate candidate, plain decoding and "
                         "sparsever's kernels alone in the same run")
    entry, plain = methods[best], methods["plain"]
    best_lossless = fastest(methods, lossless=True)
    return {
        "mode": best, "tok_s": entry["tok_s_median"], "vs_plain": entry["tok_s_median"] / plain["tok_s_median"],
        "vs_kernels_only": entry["tok_s_median"] / methods["sparsever-kernels-only"]["tok_s_median"],
        **({"vs_best_lossless_same_run": entry["tok_s_median"] / methods[best_lossless]["tok_s_median"],
            "best_lossless_same_run": best_lossless} if best_lossless else {}),
        "mean_acceptance_length": entry.get("mean_acceptance_length"), "config": entry["speculative_config"],
        "spread": spread(entry), "divergent_prompts": len(entry["divergent_prompts"]), "flags": entry["flags"],
        "results_file": run_name, "command": run["command"], "commit": run["commit"], "rounds": run["rounds"],
    }


def serving_entry(run: dict, run_name: str, concurrency: tuple[str, ...]) -> dict[str, Any]:
    """A serve_load run's per-concurrency medians (no speculation, kernels alone, vLLM's best chain,
    the best EVICT server), at the concurrencies the summary names."""
    missing = [c for c in concurrency if c not in run.get("serving", {})]
    if missing:
        raise SystemExit(f"{run_name}: a serving slot needs concurrency {list(concurrency)}; this run lacks {missing}")
    out = {}
    for c in concurrency:
        s = run["serving"][c]
        absent = [k for k in ("no_spec_tok_s", "sparsever_kernels_only_tok_s", "best_fixed_tok_s", "evict_tok_s")
                  if s.get(k) is None]
        if absent:
            raise SystemExit(f"{run_name}: concurrency {c} lacks {absent} (a --methods subset?)")
        out[c] = {**s, "evict_vs_best_other": s["evict_tok_s"] / max(
            s["no_spec_tok_s"], s["sparsever_kernels_only_tok_s"], s["best_fixed_tok_s"])}
    return out


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "met" if ok else "not met"


def evict_aims(entry: dict) -> dict[str, str]:
    """Issue 63's aims on this file's slots (harness medians)."""
    def get(path: str) -> dict | None:
        node: Any = entry
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    b1, b8 = get("qwen.batch_1"), get("qwen.batch_8")
    serving = entry.get("serving") or {}

    def never_below(slot: dict | None, fixed_key: str = "draft_model_best") -> bool | None:
        if not slot:
            return None
        best_other = max(slot["autoregressive_tok_s"], slot["sparsever_kernels_only_tok_s"], slot[fixed_key]["tok_s"])
        return slot["evict_best"]["tok_s"] >= 0.97 * best_other

    def serving_ok(c: str) -> bool | None:
        s = serving.get(c)
        return None if not s else s["evict_vs_best_other"] >= 0.97

    return {
        "batch_1: best lossless >= 1.5x kernels only and >= 1.25x vLLM's best fixed chain": verdict(
            None if not b1 else b1["evict_vs_kernels_only"] >= 1.5 and b1["evict_vs_best_fixed"] >= 1.25),
        "batch_8: EVICT >= 0.97x the best of plain, kernels only and vLLM's best fixed chain": verdict(never_below(b8)),
        "serving 8: the same": verdict(serving_ok("8")),
        "serving 32: the same": verdict(serving_ok("32")),
    }


def long_context_aims(entry: dict) -> dict[str, str]:
    """Issue 63's long-context aims (decode tokens/s, harness medians)."""
    out = {}
    for ctx in ("8192", "32768"):
        slot = (entry.get("contexts") or {}).get(ctx)
        ok = None if not slot else slot["evict_vs_kernels_only"] >= 1.5 and slot["evict_vs_best_fixed"] >= 1.2
        out[f"{ctx}: best lossless >= 1.5x kernels only and >= 1.2x vLLM's best fixed chain over the same draft"] = \
            verdict(ok)
    return out


def long_context_slot(slot: dict, run: dict) -> dict:
    """The keys long_context.json names, beside the harness slot's own."""
    return {**slot, "draft_model_tok_s": slot["draft_model_best"]["tok_s"], "draft_model_k": slot["draft_model_best"]["k"],
            "best_lossless": {"mode": slot["evict_best"]["mode"], "tok_s": slot["evict_best"]["tok_s"]}}


def drafters_slot(slot: dict, run: dict) -> dict:
    """The keys drafters.json names, beside the harness slot's own: vLLM's eagle3 at its best k and its
    draft_model chain, both from the run's fixed chains, and sparsever's best lossless mode over the head."""
    methods = run["summary"]["methods"]

    def best_of(prefix: str) -> tuple[str, dict]:
        named = {n: e for n, e in methods.items() if e["role"] == "vllm_fixed" and n.startswith(prefix)}
        if not named:
            raise SystemExit(f"{slot['results_file']}: drafters.json needs vLLM's {prefix}k<N> chains in the run "
                             "(bench/drafters.py with --draft-k above 0)")
        name = max(named, key=lambda n: named[n]["tok_s_median"])
        return name, named[name]

    eagle_name, eagle = best_of("vllm-eagle3-")
    dm_name, dm = best_of("vllm-draft_model-")
    best = slot["evict_best"]
    return {**slot, "draft_model_tok_s": dm["tok_s_median"], "draft_model_k": int(dm_name.rsplit("-k", 1)[1]),
            "vllm_eagle3_best_tok_s": eagle["tok_s_median"], "vllm_eagle3_best_k": int(eagle_name.rsplit("-k", 1)[1]),
            "vllm_eagle3_mean_acceptance_length": eagle["mean_acceptance_length"],
            "sparsever_best": {"mode": best["mode"], "tok_s": best["tok_s"],
                               "mean_acceptance_length": best["mean_acceptance_length"]},
            "sparsever_best_vs_eagle3_best": best["tok_s"] / eagle["tok_s_median"],
            "sparsever_best_vs_draft_model": best["tok_s"] / dm["tok_s_median"]}


def drafters_aims(entry: dict) -> dict[str, str]:
    """The aims drafters.json has carried since its first runs (issue 27), on harness medians."""
    b1, b8 = entry.get("batch_1"), entry.get("batch_8")
    return {
        "batch_1: sparsever's best mode over the head >= 1.3x vLLM draft_model": verdict(
            None if not b1 else b1["sparsever_best_vs_draft_model"] >= 1.3),
        "batch_8: sparsever's best mode over the head >= 1.0x plain": verdict(
            None if not b8 else b8["evict_vs_plain"] >= 1.0),
        "batch_1: sparsever's best mode over the head >= 1.0x vLLM eagle3 at its best k": verdict(
            None if not b1 else b1["sparsever_best_vs_eagle3_best"] >= 1.0),
        "batch_8: the same": verdict(None if not b8 else b8["sparsever_best_vs_eagle3_best"] >= 1.0),
    }


def head_figures(head: Path) -> dict[str, Any]:
    """drafters.json's `head`: the training behind the EAGLE-3 head the runs drafted with (its manifest)."""
    manifest_path = head / "sparsever_eagle.json"
    if not manifest_path.is_file():
        raise SystemExit(f"--head {head}: no sparsever_eagle.json (a head `vllm-sparsever train-eagle` wrote)")
    manifest = json.loads(manifest_path.read_text())
    trained = manifest["heldout"]["trained"]
    return {"path": str(head), "train_minutes": manifest["seconds"]["total"] / 60,
            "heldout_top1_agreement": trained["agreement_per_step"][0],
            "heldout_agreement_per_step": trained["agreement_per_step"],
            "train_tokens": manifest["train_tokens"], "heldout_tokens": manifest["heldout_tokens"],
            "text": manifest["settings"]["text"], "stopped_by_time_budget": manifest["stopped_by_time_budget"]}


AIMS = {"evict": evict_aims, "long_context": long_context_aims, "drafters": drafters_aims}
SLOT_KEYS = {"long_context": long_context_slot, "drafters": drafters_slot}


def step_figures(steps_path: Path, kernels_path: Path) -> dict[str, Any]:
    """long_context.json's step and kernel figures at 32K from their own scripts (bench/verify_step.py,
    bench/kernels/run.py --parts attention), run on the main machine's CPU class."""
    steps = json.loads(steps_path.read_text())["summary"]
    ctx = max(steps, key=int)  # 32736: the longest context the 32K engine holds
    kernels = json.loads(kernels_path.read_text())
    rows = {r["q_len"]: r for r in kernels["attention"] if r["ctx"] >= 32000}
    missing = [q for q in (4, 8, 16) if "roof_fraction_dense_ours" not in rows.get(q, {})]
    if int(ctx) < 32000:
        raise SystemExit(f"{steps_path.name}: no 32K step summary (its longest context is {ctx})")
    if missing:
        raise SystemExit(f"{kernels_path.name}: no 32K roof fraction at query tokens {missing}")
    return {
        "verify_step_ms": {"32768": {k: steps[ctx][k] for k in
                                     ("decode_1", "verify_4_vllm_kernel", "verify_4_sparsever_kernel")}},
        "roof_fraction": {"32768": {str(q): rows[q]["roof_fraction_dense_ours"] for q in (4, 8, 16)}},
        "roof_kernel": f"dense_ours; roof {kernels['roof']['gemm_GFLOPs']:.0f} GFLOP/s ({kernels['roof']['roof_dtype']} "
                       "torch.matmul in the same run)",
        "step_sources": {"verify_step_ms": steps_path.stem, "roof_fraction": kernels_path.stem},
    }


def build(name: str, assignments: list[str], command: str, previous: dict | None = None,
          steps: dict | None = None, head: dict | None = None) -> dict[str, Any]:
    slots, serving_slots = SLOTS[name], SERVING_SLOTS.get(name, {})
    machines: dict[str, dict] = {}
    order: list[str] = []
    approximate_runs: list[tuple[str, str, Path]] = []
    for text in assignments:
        slot, sep, path = text.partition("=")
        base = slot.removesuffix(".approximate")
        if not sep or (base not in slots and slot not in serving_slots):
            raise SystemExit(f"{name}: expected SLOT=RUN or SLOT.approximate=RUN with SLOT one of "
                             f"{sorted({*slots, *serving_slots})}, got {text!r}")
        if slot != base:
            approximate_runs.append((base, text, Path(path)))
            continue
        run_path = Path(path)
        run = json.loads(run_path.read_text())
        cls = run_class(run)
        if cls not in machines:
            machines[cls] = {"sources": {}}
            order.append(cls)
        node = machines[cls]
        if slot in serving_slots:
            node[slot] = serving_entry(run, run_path.stem, serving_slots[slot])
            node["sources"][slot] = run_path.stem
            rounds = run["args"]["rounds"]
            node["rounds"] = min(node.get("rounds", rounds), rounds)
            continue
        entry = slot_entry(run, run_path.stem, slots[slot])
        entry = SLOT_KEYS[name](entry, run) if name in SLOT_KEYS else entry
        group, _, key = slot.rpartition(".")
        (node.setdefault(group, {}) if group else node)[key] = entry
        node["metric"] = run["metric"]
        node["sources"][slot] = run_path.stem
        node["rounds"] = min(node.get("rounds", run["rounds"]), run["rounds"])
        node["date"] = max(node.get("date", ""), run["date"][:10])
    for base, text, run_path in approximate_runs:  # after the slots they complete
        run = json.loads(run_path.read_text())
        cls = run_class(run)
        group, _, key = base.rpartition(".")
        node = machines.get(cls, {})
        target = (node.get(group, {}) if group else node).get(key)
        if target is None:
            raise SystemExit(f"{name}: {text!r} completes slot {base} on {cls}, which no SLOT=RUN fills")
        target["best_approximate"] = approximate_entry(run, run_path.stem)
        machines[cls]["sources"][f"{base}.approximate"] = run_path.stem
        machines[cls]["rounds"] = min(machines[cls]["rounds"], run["rounds"])
    aims = AIMS[name]
    main = order[0]
    out = {"machine": main, "date": machines[main].get("date"), "command": command, **machines[main], **(steps or {}),
           **({"head": head} if head else {})}
    out["aims"] = aims(out)
    others = {}
    for cls in order[1:]:
        entry = machines[cls]
        entry["aims"] = aims(entry)
        others[cls] = entry
    kept = {k: previous[k] for k in KEPT.get(name, ()) if previous and k in previous and not steps}
    if kept:
        # Not from harness runs: kept beside them under the machine that measured them.
        others[f"{previous.get('machine')} (kept from the previous summary)"] = {"date": previous.get("date"), **kept}
    if others:
        out["other_machines"] = others
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(SLOTS))
    p.add_argument("runs", nargs="+", metavar="SLOT=RUN", help="the first run's CPU class is the main machine")
    p.add_argument("--out-dir", type=Path, default=SUMMARY)
    p.add_argument("--steps", type=Path, help="long_context: a bench/verify_step.py run on the main machine's class")
    p.add_argument("--kernels", type=Path, help="long_context: a bench/kernels/run.py --parts attention run, the same")
    p.add_argument("--head", type=Path, help="drafters: the EAGLE-3 head folder the runs drafted with")
    args = p.parse_args(argv)
    if (args.steps is None) != (args.kernels is None) or (args.steps and args.name != "long_context"):
        p.error("--steps and --kernels go together, and only with long_context")
    if (args.head is not None) != (args.name == "drafters"):
        p.error("--head goes with drafters, and drafters needs it (the head's training figures)")
    command = " ".join(["python", "bench/summaries.py", *(argv if argv is not None else sys.argv[1:])])
    path = args.out_dir / f"{args.name}.json"
    previous = json.loads(path.read_text()) if path.exists() else None
    steps = step_figures(args.steps, args.kernels) if args.steps else None
    head = head_figures(args.head) if args.head else None
    summary = build(args.name, args.runs, command, previous, steps, head)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["aims"], indent=1))
    print(f"wrote {path} ({dt.date.today()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
