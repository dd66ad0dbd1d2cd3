"""EVICT against the best fixed chain: plain decoding, vLLM's fixed chains at every k, and sparsever's
EVICT (chains and trees that choose their own depth), on chat and code prompts, in one run.

    python bench/evict.py                                  # Qwen pair at batch 1 and 8, the MoE target
    python bench/evict.py --batch-sizes 1 --no-moe --rounds 2
    python bench/evict.py --no-moe --batch-sizes 1 --draft-vocab 32768 --no-summary \
        --methods autoregressive draft_model-k3 sparsever-evict-chain sparsever-evict-chain-vocab32768

Qwen pair (target + same-family draft model): autoregressive, vLLM `draft_model` at k = --ks,
sparsever EVICT chain (up to --evict-chain-k drafts) and EVICT tree (draft model). MoE target (no
same-family draft model): autoregressive, vLLM `ngram` at k = --ks, sparsever EVICT n-gram chain.
Methods run one engine each, the order rotated every round (drift hits every method alike); tok/s
is summed over the categories (chat: mt_bench; code: humaneval). Reports tok/s, mean acceptance
length, and for EVICT the depth it planned (histogram: 0 = drafting skipped), the levels it drafted,
drafted vs verified tokens and the share of steps where drafting was skipped. Needs
`vllm-sparsever profile-verify` on each target first (`--quick` is enough: EVICT scales the profile
to the steps it measures). Writes bench/results/evict_<tag>_<stamp>.json/.md and
bench/results/summary/evict.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import RESULTS, Method, binding_env, hardware, load_workload, run_method, versions  # noqa: E402


def qwen_methods(args) -> list[Method]:
    tree = {"enabled": True, "branching": args.tree_branching, "expand": args.tree_expand, "depth": args.tree_depth}
    out = [Method("autoregressive", True, False, lambda a, d: None)]
    for k in args.ks:
        out.append(Method(f"draft_model-k{k}", True, True,
                          lambda a, d, k=k: {"method": "draft_model", "model": d, "num_speculative_tokens": k}))
    out.append(Method("sparsever-evict-chain", True, True,
                      lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.evict_chain_k,
                                    "adaptive": {"enabled": True}}))
    out.append(Method("sparsever-evict-tree", True, True,
                      lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.tree_nodes,
                                    "tree": tree, "adaptive": {"enabled": True}}))
    for n in args.draft_vocab:  # the same, the draft model drafting over part of the vocabulary
        out.append(Method(f"sparsever-evict-chain-vocab{n}", True, True,
                          lambda a, d, n=n: {"method": "sparsever", "model": d, "draft_vocab": n,
                                             "num_speculative_tokens": a.evict_chain_k, "adaptive": {"enabled": True}}))
        out.append(Method(f"sparsever-evict-tree-vocab{n}", True, True,
                          lambda a, d, n=n: {"method": "sparsever", "model": d, "draft_vocab": n,
                                             "num_speculative_tokens": a.tree_nodes, "tree": tree,
                                             "adaptive": {"enabled": True}}))
    if args.methods:
        unknown = set(args.methods) - {m.name for m in out}
        if unknown:
            raise SystemExit(f"--methods: unknown {sorted(unknown)}; allowed: {[m.name for m in out]}")
        out = [m for m in out if m.name in args.methods]
    return out


def moe_methods(args) -> list[Method]:
    ngram = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    out = [Method("autoregressive", True, False, lambda a, d: None)]
    for k in args.ks:
        out.append(Method(f"ngram-k{k}", True, False,
                          lambda a, d, k=k: {"method": "ngram", "num_speculative_tokens": k, **ngram}))
    out.append(Method("sparsever-ngram-evict", True, False,
                      lambda a, d: {"method": "sparsever", "draft_source": "ngram", "num_speculative_tokens":
                                    a.evict_chain_k, **ngram, "adaptive": {"enabled": True}}))
    return out


def drafting_path_methods(args) -> list[Method]:
    """The same k drafts per step from vLLM's draft_model proposer (sparsever's runner times it) and
    from sparsever's draft-model drafter (EVICT to the cap, no truncation that pays, no guard)."""
    k = args.drafting_path_k
    return [Method("vllm-proposer", True, True,
                   lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": k}),
            Method("sparsever-drafter", True, True,
                   lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": k,
                                 "adaptive": {"enabled": True, "depth": "cap", "guard": False,
                                              "min_draft_tokens": k}})]


def aggregate(result: dict) -> dict:
    """One method's run over every category: tok/s (sum of tokens / sum of seconds), acceptance, and
    EVICT's decisions."""
    cats = result["categories"].values()
    tokens = sum(c["output_tokens"] for c in cats)
    seconds = sum(c["seconds"] for c in cats)
    drafts = sum(c["num_drafts"] for c in cats)
    accepted = sum(c["num_accepted_tokens"] for c in cats)
    steps = sum(c.get("num_steps", 0) for c in cats)
    out = {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else None,
           "draft_time_s": sum(c.get("draft_time_s") or 0.0 for c in cats), "steps": steps,
           "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
           "draft_tokens_verified": sum(c["num_draft_tokens"] for c in cats), "accepted_tokens": accepted}
    evict, clock = {}, {}
    for c in cats:
        for key, value in (c.get("drafting") or {}).items():
            if key.startswith("evict_clock_"):
                clock[key] = value  # measurements, not counters: the latest
            elif key.startswith("evict_") or key.startswith("draft_model_") or key.startswith("prompt_lookup_"):
                evict[key] = evict.get(key, 0) + value
    if evict:
        planned = {int(k.rsplit("_", 1)[1]): v for k, v in evict.items() if k.startswith("evict_planned_depth_")}
        drafted = {int(k.rsplit("_", 1)[1]): v for k, v in evict.items() if k.startswith("evict_drafted_depth_")}
        decisions = sum(planned.values())
        out["evict"] = {
            "planned_depth_histogram": dict(sorted(planned.items())),
            "drafted_depth_histogram": dict(sorted(drafted.items())),
            "skipped_drafting_share": evict.get("evict_skipped_drafting_steps", 0) / decisions if decisions else None,
            "probe_steps": evict.get("evict_probe_steps", 0),
            "plain_check_steps": evict.get("evict_plain_check_steps", 0),
            "catch_up_deferred_steps": evict.get("evict_catch_up_deferred_steps", 0),
            "stopped_early_steps": evict.get("evict_stopped_early_steps", 0),
            "nodes_drafted": evict.get("evict_nodes_drafted", 0),
            "nodes_verified": evict.get("evict_nodes_kept", 0),
            "counters": evict,
            "clock": clock,
        }
    return out


def run_section(name: str, methods: list[Method], args, target: str, draft: str | None, rows: list[dict],
                batch: int, bar) -> dict:
    """Every method at this batch size, --rounds times, the order rotated each round."""
    run_args = argparse.Namespace(**{**vars(args), "batch_size": batch})
    per_round: list[dict[str, dict]] = []
    for r in range(args.rounds):
        shift = (r + (batch > 1)) % len(methods)
        order = methods[shift:] + methods[:shift]
        this_round = {}
        for method in order:
            bar.set_postfix_str(f"{name} batch {batch} round {r + 1}: {method.name}")
            res = run_method(method, run_args, target, draft, rows, bar)
            this_round[method.name] = {"speculative_config": res["speculative_config"], **aggregate(res),
                                       "categories": res["categories"], "outputs": res["outputs"]}
        per_round.append(this_round)
    merged = {}
    base = None
    for method in methods:
        runs = [rd[method.name] for rd in per_round]
        tokens = sum(x["output_tokens"] for x in runs)
        seconds = sum(x["seconds"] for x in runs)
        entry = {"tok_s": tokens / seconds, "per_round_tok_s": [x["tok_s"] for x in runs],
                 "mean_acceptance_length": runs[-1]["mean_acceptance_length"], "rounds": runs}
        if "evict" in runs[-1]:
            entry["evict"] = runs[-1]["evict"]
        merged[method.name] = entry
        if method.name == "autoregressive":
            base = runs
    first = merged[methods[0].name]
    for name_, entry in merged.items():  # greedy agreement with autoregressive (bf16: near-ties flip)
        outs = entry["rounds"][-1]["outputs"]
        ref = base[-1]["outputs"] if base else first["rounds"][-1]["outputs"]
        entry["greedy_match"] = f"{sum(outs[k] == ref.get(k) for k in outs)}/{len(outs)}"
        entry["speedup_vs_autoregressive"] = entry["tok_s"] / (merged["autoregressive"] if base else first)["tok_s"]
    return merged


def best(entries: dict, prefix: str) -> tuple[str, float]:
    name = max((n for n in entries if n.startswith(prefix)), key=lambda n: entries[n]["tok_s"])
    return name, entries[name]["tok_s"]


def markdown(section: str, batch: int, entries: dict) -> str:
    lines = [f"### {section}, batch {batch}", "",
             "| method | tok/s (rounds) | x autoregressive | mean acceptance length | greedy = AR | drafting ms per step "
             "(sparsever's runner) | EVICT: planned depth (0 = skipped) | drafted levels | drafted / verified nodes "
             "| skipped share |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in entries.items():
        ev = e.get("evict")
        rounds = ", ".join(f"{x:.2f}" for x in e["per_round_tok_s"])
        mal = f"{e['mean_acceptance_length']:.2f}" if e["mean_acceptance_length"] else "-"
        extra = ["-"] * 4
        if ev:
            extra = [json.dumps(ev["planned_depth_histogram"]), json.dumps(ev["drafted_depth_histogram"]),
                     f"{ev['nodes_drafted']} / {ev['nodes_verified']}",
                     f"{ev['skipped_drafting_share']:.2f}" if ev["skipped_drafting_share"] is not None else "-"]
        last = e["rounds"][-1]
        draft_ms = f"{1e3 * last['draft_time_s'] / last['steps']:.1f}" if last.get("steps") else "-"
        lines.append(f"| {name} | {e['tok_s']:.2f} ({rounds}) | {e['speedup_vs_autoregressive']:.2f} | {mal} | "
                     f"{e['greedy_match']} | {draft_ms} | " + " | ".join(extra) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--moe-target", default="smollm2-135m-moe-fg")
    p.add_argument("--no-moe", action="store_true", help="skip the MoE target")
    p.add_argument("--no-qwen", action="store_true", help="skip the Qwen pair")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="Qwen pair (MoE: batch 1)")
    p.add_argument("--categories", nargs="+", default=["mt_bench", "humaneval"], help="chat and code prompts")
    p.add_argument("--num-prompts", type=int, default=3,
                   help="prompts per category (batched runs: at least the batch size)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5], help="fixed chain lengths")
    p.add_argument("--evict-chain-k", type=int, default=6, help="EVICT chains: the cap")
    p.add_argument("--tree-nodes", type=int, default=12)
    p.add_argument("--tree-branching", type=int, default=3)
    p.add_argument("--tree-expand", type=int, default=3)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--drafting-path", action="store_true",
                   help="also time the same k drafts per step through vLLM's proposer and sparsever's drafter")
    p.add_argument("--drafting-path-k", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--draft-vocab", type=int, nargs="*", default=[], metavar="N",
                   help="also run the EVICT chain and tree with the draft model's draft_vocab N")
    p.add_argument("--methods", nargs="*", default=None,
                   help="run only these Qwen methods (autoregressive first if given; needs --no-summary)")
    p.add_argument("--no-summary", action="store_true", help="leave bench/results/summary/evict.json as it is")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if args.methods and not args.no_summary:
        p.error("--methods runs a subset: add --no-summary (the summary compares every method)")
    args.contexts, args.num_long_prompts = [], 0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_sparsever.cli import resolve_model

    started = dt.datetime.now(dt.timezone.utc)
    hw_start = hardware()
    sections = []
    if not args.no_qwen:
        target, draft = resolve_model(args.target), resolve_model(args.draft)
        sections += [("qwen", target, draft, qwen_methods(args), b) for b in args.batch_sizes]
    if not args.no_moe:
        sections.append(("moe", resolve_model(args.moe_target), None, moe_methods(args), 1))
    if args.drafting_path:
        sections.append(("drafting_path", resolve_model(args.target), resolve_model(args.draft),
                         drafting_path_methods(args), 1))
    rows = {}
    total = 0
    for name, target, _, methods, batch in sections:
        # batched runs: enough prompts per category to fill the batch
        n = args.num_prompts if batch == 1 else max(batch, args.num_prompts)
        if (target, n) not in rows:
            rows[(target, n)] = load_workload(argparse.Namespace(**{**vars(args), "num_prompts": n}), target)
        total += len(rows[(target, n)]) * len(methods) * args.rounds
    results: dict[str, dict] = {}
    with tqdm(total=total, desc="requests", unit="req") as bar:
        for name, target, draft, methods, batch in sections:
            n = args.num_prompts if batch == 1 else max(batch, args.num_prompts)
            results.setdefault(name, {"target": target, "draft": draft})[f"batch_{batch}"] = run_section(
                name, methods, args, target, draft, rows[(target, n)], batch, bar)

    tag = args.tag or "qwen-moe"
    stamp = started.strftime("%Y%m%d-%H%M")
    base = RESULTS / f"evict_{tag}_{stamp}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "started_utc": started.isoformat(),
              "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(), "args": vars(args),
              "hardware_at_start": hw_start, "hardware": hardware(), "versions": versions(), "env": binding_env(),
              "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    md = [f"# EVICT against fixed chains ({tag})", "", f"`{record['command']}`", "",
          f"hardware: {record['hardware']}", "", f"binding: {record['env']}", ""]
    for name, sec in results.items():
        for key, entries in sec.items():
            if key.startswith("batch_"):
                md += [markdown(f"{name}: {Path(sec['target']).name}", int(key[6:]), entries), ""]
    base.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    if args.no_summary:
        print(f"results: {base}.json / .md (summary left as it was)")
        return 0
    summary = write_summary(record, results, base)
    print(json.dumps(summary, indent=1))
    print(f"results: {base}.json / .md; summary: {RESULTS / 'summary' / 'evict.json'}")
    return 0


def write_summary(record: dict, results: dict, base: Path) -> dict:
    """bench/results/summary/evict.json with the keys issue 24 names (sections not run are left out)."""
    path = RESULTS / "summary" / "evict.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    summary = {"machine": record["hardware"].get("Model name", "?") + f" ({record['hardware'].get('nproc')} cores)",
               "date": record["started_utc"][:10], "command": record["command"], "results_file": base.name}
    for section in ("qwen", "moe"):  # what this run did not measure stays as its last run wrote it
        if section in previous:
            summary[section] = dict(previous[section])
    where = {"command": record["command"], "results_file": base.name}
    if "qwen" in results:
        summary.setdefault("qwen", {})
        for key, entries in results["qwen"].items():
            if not key.startswith("batch_"):
                continue
            dm, dm_tok_s = best(entries, "draft_model-k")
            ev, ev_tok_s = best(entries, "sparsever-evict")
            summary["qwen"][key] = {**where, "autoregressive_tok_s": entries["autoregressive"]["tok_s"],
                                    "draft_model_best": {"k": int(dm.rsplit("k", 1)[1]), "tok_s": dm_tok_s},
                                    "evict_best": {"mode": ev, "tok_s": ev_tok_s},
                                    "evict_vs_draft_model_best": ev_tok_s / dm_tok_s}
    if "moe" in results:
        entries = results["moe"]["batch_1"]
        fx, fx_tok_s = best(entries, "ngram-k")
        ev, ev_tok_s = best(entries, "sparsever-ngram-evict")
        summary["moe"] = {"batch_1": {**where, "autoregressive_tok_s": entries["autoregressive"]["tok_s"],
                                      "fixed_chain_best": {"mode": fx, "tok_s": fx_tok_s},
                                      "evict_best": {"mode": ev, "tok_s": ev_tok_s},
                                      "evict_vs_fixed_chain_best": ev_tok_s / fx_tok_s}}
    if "qwen" not in results and "moe" not in results:
        return summary  # e.g. the drafting-path section alone: the summary stays as the last run wrote it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
