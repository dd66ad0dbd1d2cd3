"""bench/results/summary/long_context.json from a long-context end-to-end run and a kernel run.

    python bench/long_context_summary.py \
        --e2e bench/results/lossless_sparse_<tag>_<time>.json \
        --kernels bench/results/kernels_<date>_attention_bf16_t2_<tag>.json

- `contexts`: decode tokens/s per mode from `bench/lossless_sparse.py` (one engine per method family,
  the speculative modes interleaved per prompt); contexts are keyed by the nominal length asked for
  (the run clamps 32768 to what leaves room for the output);
- `verify_step_ms["32768"]`: `decode_1` = the autoregressive engine's time per output token; the
  verify columns = the sparsever runner's verification time per dense verify step (target forward
  with logits + rejection sampling) with vLLM's and with sparsever's attention kernel;
- `roof_fraction["32768"]`: dense attention FLOP/s of the kernel dense verify steps run (sparsever's,
  in the KV layout vLLM picks on the machine) over the GEMM roof measured in the kernel run;
- `other_machines` (`--other-machine KERNELS VERIFY_STEP [PLAIN_VERIFY_STEP]`): the same two measures on
  a machine without an end-to-end run, from a kernel run and `bench/verify_step.py` (one engine, no
  prefill). Where sparsever's engine also runs decode steps on its own kernels (`linear_kernel`), the
  third run is the same benchmark with vLLM's (`--spec-json '{"linear_kernel": "vllm"}'`): `decode_1`
  then comes from it (a plain vLLM decode step), and `decode_1_sparsever_engine` is sparsever's;
  `--other-e2e` adds that machine's end-to-end runs (`contexts`, as above; a family the run left out
  is null). Without `--e2e` / `--kernels`, the `--other-machine` runs are added to the existing
  `--out` file, whose main machine stays as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lossless_sparse import LOSSLESS_MODES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOMINAL = (8192, 32768)
LOSSLESS = LOSSLESS_MODES  # every lossless mode lossless_sparse.py runs
APPROXIMATE = ("sparse-approx",)


def nominal(ctx: int) -> str:
    return str(min((n for n in NOMINAL if n >= ctx), default=ctx))


def kernel_roof_fraction(kernels: dict) -> tuple[str, dict[str, float]]:
    """(variant, {q: fraction}) at 32K of the dense kernel verify steps run in the KV layout vLLM picks."""
    variant = "dense_ours_amx" if kernels["roof"].get("amx", False) else "dense_ours"
    return variant, {str(r["q_len"]): r[f"roof_fraction_{variant}"] for r in kernels["attention"]
                     if r["ctx"] == 32768 and r["q_len"] in (4, 8, 16) and f"roof_fraction_{variant}" in r}


def kernel_and_step_aims(roof: dict[str, float], verify_32k: dict) -> dict[str, bool]:
    """The issue's kernel aim (>= 60% of the roof at 4-16 tokens) and step aim (a 4-token verify step
    <= 1.5x a decode step), at 32K."""
    return {"roof_fraction_ge_0.6": bool(roof) and all(v >= 0.6 for v in roof.values()),
            "verify_4_le_1.5x_decode": bool(verify_32k)
            and verify_32k["verify_4_sparsever_kernel"] <= 1.5 * verify_32k["decode_1"]}


def other_machine(kernels_path: Path, verify_path: Path, plain_path: Path | None = None) -> dict:
    """verify_step_ms and roof_fraction of a machine measured without an end-to-end run (decode_1 from
    `plain_path`'s engine, vLLM's own linears, when given)."""
    kernels, verify = json.loads(kernels_path.read_text()), json.loads(verify_path.read_text())
    variant, roof = kernel_roof_fraction(kernels)
    at32 = lambda run: next((row for ctx, row in run["summary"].items() if nominal(int(ctx)) == "32768"), {})  # noqa: E731
    at = dict(at32(verify))
    by_context = verify["summary"]
    command = f"{kernels['command']}  +  {verify['command']}"
    sources = {"kernels": str(kernels_path.relative_to(ROOT)), "verify_step": str(verify_path.relative_to(ROOT))}
    if plain_path is not None:
        plain = json.loads(plain_path.read_text())
        at["decode_1_sparsever_engine"] = at["decode_1"]
        at["decode_1"] = at32(plain)["decode_1"]
        by_context = {"sparsever_engine": verify["summary"], "vllm_linears_engine": plain["summary"]}
        command += f"  +  {plain['command']}"
        sources["verify_step_vllm_linears"] = str(plain_path.relative_to(ROOT))
    hw = verify["hardware"]
    return {
        "machine": f"{hw.get('Model name', '?')}, {hw.get('nproc', '?')} cores ({kernels['hardware'].get('torch_cpu_capability')})",
        "date": verify["started"][:10],
        "command": command,
        "verify_step_ms": {"32768": {k: at.get(k) for k in ("decode_1", "verify_4_vllm_kernel", "verify_4_sparsever_kernel",
                                                            "decode_1_sparsever_engine", "decode_1_sparsever_kernel")
                                             if k in at}},
        "verify_step_ms_by_context": by_context,
        "roof_fraction": {"32768": roof},
        "roof_kernel": f"{variant}; roof {kernels['roof']['gemm_GFLOPs']:.0f} GFLOP/s ({kernels['roof']['method']}; "
                       f"fastest: {kernels['roof'].get('roof_dtype', kernels['roof']['dtype'])})",
        "aims_met": kernel_and_step_aims(roof, at),
        "sources": sources,
    }


def merged_rows(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """The runs of lossless_sparse.py JSON files and their summary rows per (context, mode): a
    later file's row replaces an earlier file's over the same documents (a rerun), and is pooled
    with it over other documents (tokens over decode time of both: one run per document, when a
    32K prefill per engine makes a run of several too long)."""
    runs = [json.loads(p.read_text()) for p in paths]
    merged: dict[tuple[int, str], dict] = {}
    for path, run in zip(paths, runs):
        for row in run["summary"]:
            key = (row["context"], row["mode"])
            docs = sorted({r["prompt"] for r in run["runs"] if (r["context"], r["mode"]) == key})
            new = row | {"source": str(path.relative_to(ROOT)), "documents": docs}
            old = merged.get(key)
            if old is not None and not set(old["documents"]) & set(docs):
                tokens = old["tokens"] + row["tokens"]
                seconds = old["tokens"] / old["tokens_per_s"] + row["tokens"] / row["tokens_per_s"]
                new = {"context": row["context"], "mode": row["mode"], "prompts": old["prompts"] + row["prompts"],
                       "tokens": tokens, "tokens_per_s": tokens / seconds,
                       "verify_ms_per_step": None, "documents": old["documents"] + docs,
                       "source": f"{old['source']} + {new['source']}"}
            merged[key] = new
    return runs, list(merged.values())


def e2e_contexts(rows: list[dict]) -> tuple[dict, dict]:
    """(contexts, verify_step_ms) keyed by nominal context; a method family the run left out
    (vLLM's draft_model, the approximate or vLLM-kernel modes) is None."""
    contexts, ms = {}, {}
    for ctx in sorted({r["context"] for r in rows}):
        at = {r["mode"]: r for r in rows if r["context"] == ctx}
        lossless = max((at[m] for m in LOSSLESS if m in at), key=lambda r: r["tokens_per_s"])
        approx = max((at[m] for m in APPROXIMATE if m in at), key=lambda r: r["tokens_per_s"], default=None)
        plain, draft_model = at["autoregressive"]["tokens_per_s"], at.get("vllm-draft_model", {}).get("tokens_per_s")
        key = nominal(ctx)
        contexts[key] = {
            "autoregressive_tok_s": plain,
            "draft_model_tok_s": draft_model,
            "best_lossless": {"mode": lossless["mode"], "tok_s": lossless["tokens_per_s"]},
            "best_approximate": approx and {"mode": approx["mode"], "tok_s": approx["tokens_per_s"]},
            "prompt_context_tokens": ctx,
            "tok_s_by_mode": {m: r["tokens_per_s"] for m, r in at.items()},
            "source_by_mode": {m: r["source"] for m, r in at.items()},
            "documents_by_mode": {m: r["documents"] for m, r in at.items()},
            "best_lossless_vs_autoregressive": lossless["tokens_per_s"] / plain,
            "best_lossless_vs_draft_model": draft_model and lossless["tokens_per_s"] / draft_model,
        }
        ms[key] = {
            "decode_1": 1e3 / plain,
            "verify_4_vllm_kernel": at.get("dense-vllm-kernel", {}).get("verify_ms_per_step"),
            "verify_4_sparsever_kernel": at.get("dense", {}).get("verify_ms_per_step"),
        }
    return contexts, ms


def other_machines(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict]:
    """The --other-machine entries, the last one with the --other-e2e runs' tokens/s."""
    for paths in args.other_machine:
        if len(paths) not in (2, 3):
            ap.error("--other-machine: KERNELS VERIFY_STEP [PLAIN_VERIFY_STEP]")
    entries = [other_machine(*(p.resolve() for p in paths)) for paths in args.other_machine]
    if args.other_e2e:
        if not entries:
            ap.error("--other-e2e: give the machine's --other-machine runs too")
        other_runs, other_rows = merged_rows([p.resolve() for p in args.other_e2e])
        other = entries[-1]
        other["contexts"], _ = e2e_contexts(other_rows)
        other["aims_met"]["best_lossless_ge_1.3x_autoregressive"] = {
            k: v["best_lossless_vs_autoregressive"] >= 1.3 for k, v in other["contexts"].items()}
        other["command"] += "".join(f"  +  {r['command']}" for r in other_runs)
        other["sources"]["e2e"] = [str(p.resolve().relative_to(ROOT)) for p in args.other_e2e]
    return entries


def add_other_machines(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--out's main machine as it is; the new other machines first, then (--keep-other-machines) its
    earlier ones."""
    summary = json.loads(args.out.read_text())
    earlier = summary.get("other_machines", []) if args.keep_other_machines else []
    added = other_machines(ap, args)
    if args.note:
        added[-1]["e2e_note"] = args.note
    summary["other_machines"] = added + earlier
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["other_machines"][0], indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", type=Path, action="append", default=[],
                    help="lossless_sparse.py JSON; repeat it to merge runs: a later file's (context, mode) "
                         "rows replace an earlier file's (e.g. a rerun of modes measured on a busy machine)")
    ap.add_argument("--kernels", type=Path, default=None,
                    help="with --e2e (both required unless only --other-machine runs are added: the --out "
                         "file's main machine then stays as it is)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="an evict_trace.py JSON: how much one engine's plain step moved during the run's day")
    ap.add_argument("--other-machine", nargs="+", type=Path, action="append", default=[],
                    metavar=("KERNELS_JSON", "VERIFY_STEP_JSON"),
                    help="a kernel run and a bench/verify_step.py run of another machine, and optionally the "
                         "same verify_step run with vLLM's linears (decode_1 then comes from it): its "
                         "verify_step_ms and roof_fraction go under other_machines (the main keys stay the "
                         "--e2e machine's)")
    ap.add_argument("--other-e2e", type=Path, action="append", default=[],
                    help="a lossless_sparse.py JSON of the last --other-machine (repeat to merge): its "
                         "end-to-end tokens/s go under that machine's `contexts`")
    ap.add_argument("--note", default=None, help="what the runs show that the numbers do not (e2e_note; of the "
                                                 "added machine when only --other-machine runs are added)")
    ap.add_argument("--keep-other-machines", action="store_true",
                    help="carry the other_machines entries of the --out file over (after those given here), "
                         "notes added to them included: a new run on the main machine keeps them")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "summary" / "long_context.json")
    args = ap.parse_args()
    if not args.e2e and args.kernels is None:
        if not args.other_machine or not args.out.is_file():
            ap.error("--e2e and --kernels, or --other-machine runs to add to an existing --out")
        return add_other_machines(ap, args)
    if not args.e2e or args.kernels is None:
        ap.error("--e2e and --kernels go together")
    args.e2e = [p.resolve() for p in args.e2e]
    args.kernels = args.kernels.resolve()
    kernels = json.loads(args.kernels.read_text())
    runs, rows = merged_rows(args.e2e)
    e2e = runs[0]
    contexts, ms = e2e_contexts(rows)
    amx = kernels["roof"].get("amx", False)
    variant, roof = kernel_roof_fraction(kernels)
    verify_32k = ms.get("32768", {})
    summary = {
        "machine": e2e["hardware"].get("Model name", "?") + f", {e2e['hardware'].get('nproc', '?')} cores",
        "date": e2e["started"][:10],
        "command": "  +  ".join([*(r["command"] for r in runs), kernels["command"], " ".join(["python", *sys.argv])]),
        "contexts": contexts,
        "verify_step_ms": {"32768": verify_32k},
        "roof_fraction": {"32768": roof},
        "roof_kernel": f"{variant} ({'vLLM AMX layout, AMX tiles' if amx else 'vec layout'}); roof "
                       f"{kernels['roof']['gemm_GFLOPs']:.0f} GFLOP/s ({kernels['roof']['method']})",
        "attainable_fraction": {"32768": {str(r["q_len"]): r.get(f"attainable_fraction_{variant}")
                                          for r in kernels["attention"]
                                          if r["ctx"] == 32768 and r["q_len"] in (4, 8, 16)}},
        "sources": {"e2e": [str(p.relative_to(ROOT)) for p in args.e2e], "kernels": str(args.kernels.relative_to(ROOT))},
    }
    summary["other_machines"] = other_machines(ap, args)
    if args.keep_other_machines and args.out.is_file():
        summary["other_machines"] += json.loads(args.out.read_text()).get("other_machines", [])
    aims = {
        **kernel_and_step_aims(roof, verify_32k),
        "best_lossless_ge_1.3x_autoregressive": {k: v["best_lossless_vs_autoregressive"] >= 1.3 for k, v in contexts.items()},
    }
    summary["aims_met"] = aims
    if args.note:
        summary["e2e_note"] = args.note
    if args.trace is not None:
        trace = json.loads(args.trace.read_text())
        summary["step_time_spread"] = {"plain_step_ms": trace["plain_step_ms"],
                                       "verify_2_step_ms": trace.get("verify_2_step_ms"),
                                       "source": str(args.trace.resolve().relative_to(ROOT))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
