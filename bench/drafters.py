"""sparsever over an EAGLE-3 head against plain decoding, vLLM's `draft_model` and vLLM's own `eagle3`,
on chat and code prompts, side by side in one run.

    vllm-sparsever train-eagle qwen2.5-coder-1.5b                 # the head (<model>/eagle3_head)
    vllm-sparsever profile-verify qwen2.5-coder-1.5b --quick      # EVICT's cost profile
    python bench/drafters.py                                      # batch 1 and 8
    python bench/drafters.py --batch-sizes 1 --rounds 2 --eagle-ks 3

Methods (one engine each, the order rotated every round so drift hits all alike; tok/s summed over
the categories, chat: mt_bench, code: humaneval): autoregressive; vLLM `draft_model` (the 0.5B
draft) at k=3; vLLM `eagle3` with the head at each --eagle-ks; sparsever over the same head, a fixed
chain at each --eagle-ks, EVICT chains and EVICT-cut trees (EAGLE-2 style, grown by sparsever; cap
--evict-k nodes). --methods runs a subset. Reports tok/s, mean acceptance length,
and for sparsever's engines the share of step time spent drafting and verifying. Writes
bench/results/drafters_<tag>_<stamp>.json/.md and bench/results/summary/drafters.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict import best, markdown, run_section  # noqa: E402
from spec_decode import RESULTS, Method, binding_env, hardware, load_workload, versions  # noqa: E402


def methods(args, head: str) -> list[Method]:
    out = [Method("autoregressive", True, False, lambda a, d: None),
           Method(f"draft_model-k{args.draft_k}", True, True,
                  lambda a, d: {"method": "draft_model", "model": d, "num_speculative_tokens": a.draft_k})]
    for k in args.eagle_ks:
        out.append(Method(f"vllm-eagle3-k{k}", True, False,
                          lambda a, d, k=k: {"method": "eagle3", "model": head, "num_speculative_tokens": k}))
    for k in args.eagle_ks:
        out.append(Method(f"sparsever-eagle3-k{k}", True, False,
                          lambda a, d, k=k: {"method": "sparsever", "draft_source": "eagle3", "model": head,
                                             "num_speculative_tokens": k}))
    out.append(Method("sparsever-eagle3-evict", True, False,
                      lambda a, d: {"method": "sparsever", "draft_source": "eagle3", "model": head,
                                    "num_speculative_tokens": a.evict_k, "adaptive": {"enabled": True}}))
    # EAGLE-2 style trees from the head, grown by sparsever and cut by EVICT.
    out.append(Method("sparsever-eagle3-evict-tree", True, False,
                      lambda a, d: {"method": "sparsever", "draft_source": "eagle3", "model": head,
                                    "num_speculative_tokens": a.evict_k, "tree": {"enabled": True},
                                    "adaptive": {"enabled": True}}))
    if args.methods:
        unknown = sorted(set(args.methods) - {m.name for m in out})
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown} (allowed: {', '.join(m.name for m in out)})")
        out = [m for m in out if m.name in args.methods]
    return out


def step_shares(entry: dict) -> dict:
    """sparsever's engines: drafting and verification as shares of the measured step time."""
    cats = entry["rounds"][-1]["categories"].values()
    draft = sum(c.get("draft_time_s") or 0.0 for c in cats)
    verify = sum(c.get("verify_time_s") or 0.0 for c in cats)
    seconds = sum(c["seconds"] for c in cats)
    if not draft and not verify:
        return {}
    return {"drafting_share": draft / seconds, "verification_share": verify / seconds}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--head", default=None, help="EAGLE-3 head folder (default: <target>/eagle3_head)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--categories", nargs="+", default=["mt_bench", "humaneval"], help="chat and code prompts")
    p.add_argument("--num-prompts", type=int, default=3,
                   help="prompts per category (batched runs: at least the batch size)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-k", type=int, default=3)
    p.add_argument("--eagle-ks", type=int, nargs="+", default=[3, 5])
    p.add_argument("--evict-k", type=int, default=6, help="EVICT chains: the cap")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=None,
                   help="run only these methods (names as in the results; default: all)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--tag", default="qwen")
    p.add_argument("--no-summary", action="store_true",
                   help="leave bench/results/summary/drafters.json as it is (a run off the issue's set-up, e.g. "
                   "another dtype or machine)")
    args = p.parse_args(argv)
    args.contexts, args.num_long_prompts = [], 0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.methods and not args.no_summary:
        raise SystemExit("--methods: a run of some methods writes no summary (add --no-summary)")
    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.offline.train_eagle import MANIFEST_NAME, head_dir

    started = dt.datetime.now(dt.timezone.utc)
    hw_start = hardware()
    target, draft = resolve_model(args.target), resolve_model(args.draft)
    head = args.head or str(head_dir(target))
    manifest = json.loads((Path(head) / MANIFEST_NAME).read_text()) if (Path(head) / MANIFEST_NAME).is_file() else {}
    chosen = methods(args, head)
    rows, total = {}, 0
    for batch in args.batch_sizes:
        n = args.num_prompts if batch == 1 else max(batch, args.num_prompts)
        if n not in rows:
            rows[n] = load_workload(argparse.Namespace(**{**vars(args), "num_prompts": n}), target)
        total += len(rows[n]) * len(chosen) * args.rounds
    results: dict[str, dict] = {}
    with tqdm(total=total, desc="requests", unit="req") as bar:
        for batch in args.batch_sizes:
            n = args.num_prompts if batch == 1 else max(batch, args.num_prompts)
            entries = run_section("drafters", chosen, args, target, draft, rows[n], batch, bar)
            for entry in entries.values():
                entry.update(step_shares(entry))
            results[f"batch_{batch}"] = entries

    stamp = started.strftime("%Y%m%d-%H%M")
    base = RESULTS / f"drafters_{args.tag}_{stamp}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "started_utc": started.isoformat(),
              "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(), "args": vars(args),
              "target": target, "draft": draft, "head": head, "head_manifest": manifest,
              "hardware_at_start": hw_start, "hardware": hardware(), "versions": versions(), "env": binding_env(),
              "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    md = [f"# sparsever over an EAGLE-3 head ({args.tag})", "", f"`{record['command']}`", "",
          f"hardware: {record['hardware']}", "", f"binding: {record['env']}", "", f"head: {head}", ""]
    for key, entries in results.items():
        md += [markdown(Path(target).name, int(key[6:]), entries), ""]
        shares = {n: e for n, e in entries.items() if "drafting_share" in e}
        if shares:
            md += ["| sparsever engine | drafting share of step time | verification share |", "|---|---|---|"]
            md += [f"| {n} | {e['drafting_share']:.2f} | {e['verification_share']:.2f} |" for n, e in shares.items()]
            md.append("")
    base.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    if args.no_summary:
        print(f"results: {base}.json / .md (summary left as it is)")
        return 0
    summary = write_summary(record, results, base, manifest)
    print(json.dumps(summary, indent=1))
    print(f"results: {base}.json / .md; summary: {RESULTS / 'summary' / 'drafters.json'}")
    return 0


def aims(summary: dict) -> dict:
    """Issue 27's aims, each as the measured ratio and whether it is met."""
    out = {}
    b1, b8 = summary.get("batch_1"), summary.get("batch_8")
    if b1:
        out["batch_1_sparsever_best_over_draft_model"] = _aim(b1["sparsever_best"]["tok_s"],
                                                              b1["draft_model_tok_s"], 1.3)
    if b8:
        out["batch_8_sparsever_best_over_autoregressive"] = _aim(b8["sparsever_best"]["tok_s"],
                                                                b8["autoregressive_tok_s"], 1.0)
    for key, entry in (("batch_1", b1), ("batch_8", b8)):
        if entry and entry.get("sparsever_evict_tok_s"):
            out[f"{key}_evict_over_vllm_eagle3_best"] = _aim(entry["sparsever_evict_tok_s"],
                                                            entry["vllm_eagle3_best_tok_s"], 1.0)
    return out


def _aim(tok_s: float, baseline: float, at_least: float) -> dict:
    ratio = tok_s / baseline
    return {"ratio": round(ratio, 3), "at_least": at_least, "met": ratio >= at_least}


def write_summary(record: dict, results: dict, base: Path, manifest: dict) -> dict:
    """bench/results/summary/drafters.json with the keys issue 27 names."""
    path = RESULTS / "summary" / "drafters.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    summary = {"machine": record["hardware"].get("Model name", "?") + f" ({record['hardware'].get('nproc')} cores)",
               "date": record["started_utc"][:10], "command": record["command"], "results_file": base.name}
    for key in ("batch_1", "batch_8"):  # a batch size this run did not measure stays as its last run wrote it
        if key in previous and key not in results:
            summary[key] = previous[key]
    where = {"command": record["command"], "results_file": base.name}
    for key, entries in results.items():
        dm = next(n for n in entries if n.startswith("draft_model-k"))
        _, eagle_tok_s = best(entries, "vllm-eagle3-k")
        sv, sv_tok_s = best(entries, "sparsever-eagle3")
        evict = [n for n in entries if n.startswith("sparsever-eagle3-evict")]  # chains, trees
        evict_mode, evict_tok_s = best(entries, "sparsever-eagle3-evict") if evict else (None, None)
        summary[key] = {**where, "autoregressive_tok_s": entries["autoregressive"]["tok_s"],
                        "draft_model_tok_s": entries[dm]["tok_s"], "vllm_eagle3_best_tok_s": eagle_tok_s,
                        "sparsever_best": {"mode": sv, "tok_s": sv_tok_s,
                                           "mean_acceptance_length": entries[sv]["mean_acceptance_length"] or 1.0},
                        "sparsever_evict_tok_s": evict_tok_s, "sparsever_evict_mode": evict_mode}
    summary["dtype"] = record["args"]["dtype"]
    summary["aims"] = aims(summary)
    seconds = (manifest.get("seconds") or {}).get("total")
    trained = ((manifest.get("heldout") or {}).get("trained") or {}).get("agreement_per_step") or [None]
    summary["head"] = {"train_minutes": seconds / 60 if seconds else None, "heldout_top1_agreement": trained[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
