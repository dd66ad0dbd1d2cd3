"""End-to-end speculative-decoding benchmark: baselines and every sparsever mode, in one run.

    python bench/spec_decode.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
    python bench/spec_decode.py --quick                      # a few minutes
    python bench/spec_decode.py --target smollm2-135m-moe --draft smollm2-135m --tag moe

Runs, on the same prompts and in one process (one engine per method, the same CPU binding for all):
autoregressive decoding, vLLM's built-in `draft_model` and `ngram`, and sparsever in each mode that
exists. Reports per category: output tokens/s, speed-up over autoregressive, mean acceptance length,
acceptance rate, the verification share of step time (sparsever), and for lossless modes whether
greedy outputs match autoregressive token for token. A context-length sweep (1K/8K/32K by default)
covers the long-context category. Writes JSON (command, models, hardware, versions, raw numbers),
a markdown table and a plot under bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SHORT_CATEGORIES = ("mt_bench", "humaneval", "gsm8k", "truthfulqa", "summarization", "qa")


@dataclass(frozen=True)
class Method:
    name: str
    lossless: bool
    needs_draft: bool
    spec: Callable[[argparse.Namespace, str | None], dict | None]


def _ngram(args) -> dict:
    return {"num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


METHODS: dict[str, Method] = {
    "autoregressive": Method("autoregressive", True, False, lambda a, d: None),
    "draft_model": Method(
        "draft_model", True, True,
        lambda a, d: {"method": "draft_model", "model": d, "num_speculative_tokens": a.k}),
    "ngram": Method("ngram", True, False, lambda a, d: {"method": "ngram", **_ngram(a)}),
    # sparsever with dense verification: the plugin's own worker, the overhead it adds, the
    # baseline every sparse mode is compared against.
    "sparsever-dense": Method(
        "sparsever-dense", True, True,
        lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.k}),
    "sparsever-ngram": Method(
        "sparsever-ngram", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "ngram", **_ngram(a)}),
    # Self-drafting: the target's first --draft-layer layers + the trained exit head (no draft model).
    "sparsever-self-draft": Method(
        "sparsever-self-draft", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.k,
                      "early_exit": _early_exit(a)}),
    # The same with VocabTrim: drafts over the --draft-vocab most frequent generated tokens.
    "sparsever-self-draft-trim": Method(
        "sparsever-self-draft-trim", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.k,
                      "early_exit": {**_early_exit(a), "draft_vocab": a.draft_vocab}}),
    # Self-drafting + hierarchical verification: --verify-layer layers + head verify each round of
    # k drafts; the full target verifies up to --hier-cap pending tokens per pass.
    "sparsever-hierarchical": Method(
        "sparsever-hierarchical", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.hier_cap,
                      "early_exit": {**_early_exit(a), "enabled": True, "round_tokens": a.k,
                                     "full_verify_every": a.full_verify_every,
                                     **({"verify_layer": a.verify_layer} if a.verify_layer else {})}}),
    # The same, with the full pass starting at the verify layer from the intermediate passes'
    # hidden states (reuse across levels; the verifier's last correction is dropped for it).
    "sparsever-hierarchical-reuse": Method(
        "sparsever-hierarchical-reuse", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.hier_cap,
                      "early_exit": {**_early_exit(a), "enabled": True, "round_tokens": a.k,
                                     "full_verify_every": a.full_verify_every, "reuse_hidden_states": True,
                                     **({"verify_layer": a.verify_layer} if a.verify_layer else {})}}),
    # The draft model drafting in rounds of k under the early-exit intermediate verifier (HiSpec's
    # set-up: draft model -> early layers -> full target).
    "sparsever-draft-hierarchical": Method(
        "sparsever-draft-hierarchical", True, True,
        lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.hier_cap,
                      "early_exit": {"enabled": True, "round_tokens": a.k, "full_verify_every": a.full_verify_every,
                                     **({"verify_layer": a.verify_layer} if a.verify_layer else {})}}),
    # Fixed chain of 5 (vLLM's draft_model; "draft_model" above is the chain of k).
    "draft_model-k5": Method(
        "draft_model-k5", True, True,
        lambda a, d: {"method": "draft_model", "model": d, "num_speculative_tokens": 5}),
    # Draft trees from the draft model (--tree-nodes nodes, EAGLE-2 growth), verified in one pass.
    "sparsever-tree": Method(
        "sparsever-tree", True, True,
        lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.tree_nodes, "tree": _tree(a)}),
    # The same trees cut per step by EVICT (needs `vllm-sparsever profile-verify TARGET` first).
    "sparsever-evict-tree": Method(
        "sparsever-evict-tree", True, True,
        lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.tree_nodes, "tree": _tree(a),
                      "adaptive": True}),
    # EVICT on chains: an adaptive draft length (up to --evict-chain-k) per request and step.
    "sparsever-evict-chain": Method(
        "sparsever-evict-chain", True, True,
        lambda a, d: {"method": "sparsever", "model": d, "num_speculative_tokens": a.evict_chain_k, "adaptive": True}),
    # n-gram chains of 5 and EVICT-cut n-gram chains (up to --evict-chain-k; scored per depth,
    # calibrated online): the drafter that costs nothing, for targets whose verification does.
    "sparsever-ngram-k5": Method(
        "sparsever-ngram-k5", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "ngram", **_ngram(a), "num_speculative_tokens": 5}),
    "sparsever-ngram-evict": Method(
        "sparsever-ngram-evict", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "ngram", **_ngram(a),
                      "num_speculative_tokens": a.evict_chain_k, "adaptive": True}),
    # Self-drafted trees (the target's first layers + exit head), plain and EVICT-cut.
    "sparsever-self-tree": Method(
        "sparsever-self-tree", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.tree_nodes,
                      "tree": _tree(a), "early_exit": _early_exit_tree(a)}),
    # Self-drafted fixed chains of 5 ("sparsever-self-draft" is the chain of --k) and EVICT chains (up
    # to --evict-chain-k), for targets without a separate draft model (the MoE target).
    "sparsever-self-draft-k5": Method(
        "sparsever-self-draft-k5", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": 5,
                      "early_exit": _early_exit(a)}),
    "sparsever-self-evict-chain": Method(
        "sparsever-self-evict-chain", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.evict_chain_k,
                      "adaptive": True, "early_exit": _early_exit_tree(a)}),
    "sparsever-self-evict-tree": Method(
        "sparsever-self-evict-tree", True, False,
        lambda a, d: {"method": "sparsever", "draft_source": "early_exit", "num_speculative_tokens": a.tree_nodes,
                      "tree": _tree(a), "adaptive": True, "early_exit": _early_exit_tree(a)}),
}


def _tree(args) -> dict:
    return {"enabled": True, "branching": args.tree_branching, "expand": args.tree_expand, "depth": args.tree_depth}


def _early_exit_tree(args) -> dict:
    return {"draft_layer": args.draft_layer} if args.draft_layer else {}


def _early_exit(args) -> dict:
    section: dict = {"draft_confidence": args.draft_confidence}
    if args.draft_layer:
        section["draft_layer"] = args.draft_layer
    return section


# ---- environment ------------------------------------------------------------------------------


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "nproc": os.cpu_count(),
                            "loadavg_1_5_15": os.getloadavg()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["Model name"] = value.strip()
            elif key.strip() == "Flags":
                info["avx512f"] = "avx512f" in value.split()
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def versions() -> dict[str, Any]:
    from harness import package_versions

    out: dict[str, Any] = package_versions()
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, check=False).stdout.strip()
    except OSError:
        pass
    return out


def save_results(base: Path, record: dict[str, Any], lines: list[str]) -> None:
    """Write `record` to BASE.json and the report `lines` to BASE.md (the whole name kept: a tag may
    hold dots), and print the report."""
    Path(f"{base}.json").write_text(json.dumps(record, indent=1, default=str))
    Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {base}.md / .json")


from harness import binding_env  # noqa: E402  (re-exported: the other benchmarks import it from here)


# ---- prompts ---------------------------------------------------------------------------------


def load_workload(args, tokenizer_path: str) -> list[dict[str, Any]]:
    """Rows {category, id, prompt, context} for the chosen categories and context sweep."""
    from vllm_sparsever.data import load_prompts

    rows = []
    for category in args.categories:
        for row in load_prompts(category, n=args.num_prompts):
            rows.append({"category": category, "id": row["id"], "prompt": row["prompt"], "context": None})
    if args.contexts:
        from vllm_sparsever.data.long_context import long_context_prompts

        for n_tokens in args.contexts:
            for row in long_context_prompts(tokenizer_path, n_tokens, task="qa", n=args.num_long_prompts):
                rows.append({"category": f"long_context@{n_tokens // 1024}K", "id": row["id"],
                             "prompt": row["prompt"], "context": row["num_tokens"]})
    return rows


# ---- running ---------------------------------------------------------------------------------


def _counter(metrics, name: str) -> float:
    return float(sum(getattr(m, "value", 0) for m in metrics if m.name == name))


def run_method(method: Method, args, target: str, draft: str | None, rows: list[dict], bar) -> dict:
    from vllm import LLM, SamplingParams

    spec = method.spec(args, draft)
    max_context = max([r["context"] or 0 for r in rows] + [0])
    llm = LLM(
        model=target,
        dtype=args.dtype,
        enforce_eager=not args.compile,
        max_model_len=max(args.max_model_len, max_context + args.max_tokens + 64),
        max_num_seqs=max(args.batch_size, 1),
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
        async_scheduling=False,  # sparsever's draft-model drafters propose after the step's bookkeeping
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    is_sparsever = spec is not None and spec.get("method") == "sparsever"
    per_category: dict[str, dict] = {}
    outputs: dict[str, list[int]] = {}
    try:
        # Untimed warm-up: one-time costs (e.g. vLLM's n-gram matcher is JIT-compiled on its first
        # real proposal, ~2 s) stay out of the first category's time.
        llm.chat([[{"role": "user", "content": rows[0]["prompt"]}]], SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)
        for category in dict.fromkeys(r["category"] for r in rows):
            cat_rows = [r for r in rows if r["category"] == category]
            before = llm.get_metrics()
            if is_sparsever:
                from vllm_sparsever.metrics import get_metrics, reset_metrics

                reset_metrics(llm)
            messages = [[{"role": "user", "content": r["prompt"]}] for r in cat_rows]
            start = time.perf_counter()
            results = []
            for i in range(0, len(messages), args.batch_size):
                results += llm.chat(messages[i:i + args.batch_size], params, use_tqdm=False)
                bar.update(len(messages[i:i + args.batch_size]))
            elapsed = time.perf_counter() - start
            after = llm.get_metrics()
            n_tokens = sum(len(r.outputs[0].token_ids) for r in results)
            drafts = _counter(after, "vllm:spec_decode_num_drafts") - _counter(before, "vllm:spec_decode_num_drafts")
            draft_tokens = (_counter(after, "vllm:spec_decode_num_draft_tokens")
                            - _counter(before, "vllm:spec_decode_num_draft_tokens"))
            accepted = (_counter(after, "vllm:spec_decode_num_accepted_tokens")
                        - _counter(before, "vllm:spec_decode_num_accepted_tokens"))
            entry = {
                "num_prompts": len(cat_rows),
                "output_tokens": n_tokens,
                "seconds": elapsed,
                "tokens_per_s": n_tokens / elapsed if elapsed > 0 else None,
                "num_drafts": drafts,
                "num_draft_tokens": draft_tokens,
                "num_accepted_tokens": accepted,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "context_tokens": [r["context"] for r in cat_rows if r["context"]] or None,
            }
            if is_sparsever:
                m = get_metrics(llm)
                entry["verification_time_share"] = m["verification_time_share"]
                entry["sparsever_mean_acceptance_length"] = m["mean_acceptance_length"]
                entry["verify_time_s"] = m["verify_time_s"]
                entry["draft_time_s"] = m["draft_time_s"]
                entry["num_steps"] = m.get("num_steps", 0)
                entry["num_verify_steps"] = m.get("num_verify_steps", 0)
                if m.get("drafting"):
                    entry["drafting"] = m["drafting"]
                entry.update(_experts_per_step(m.get("sparsity") or {}))
            per_category[category] = entry
            for r, out in zip(cat_rows, results):
                outputs[f"{category}/{r['id']}"] = list(out.outputs[0].token_ids)
    finally:
        del llm
        gc.collect()
    return {"speculative_config": spec, "categories": per_category, "outputs": outputs}


def _experts_per_step(sparsity: dict) -> dict:
    """MoE targets (sparsever's expert counter): distinct routed experts per layer, per verify step
    (what the step reads) and per verifying request, with the tokens they route."""
    steps, requests = sparsity.get("moe_verify_step_layers"), sparsity.get("moe_verify_request_layers")
    if not steps:
        return {}
    return {"experts_per_verify_step": sparsity["moe_verify_step_distinct_experts"] / steps,
            "tokens_per_verify_step": sparsity["moe_verify_step_tokens"] / steps,
            "experts_per_verifying_request": sparsity["moe_verify_distinct_experts"] / requests,
            "tokens_per_verifying_request": sparsity["moe_verify_tokens"] / requests}


def summarize(results: dict[str, dict], methods: list[Method]) -> dict[str, dict]:
    """Speed-up over autoregressive and greedy agreement, per method and category."""
    base = results.get("autoregressive")
    for method in methods:
        res = results[method.name]
        for category, entry in res["categories"].items():
            if base and category in base["categories"]:
                b = base["categories"][category]
                entry["speedup_vs_autoregressive"] = (
                    entry["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None)
                keys = [k for k in res["outputs"] if k.startswith(category + "/")]
                same = sum(res["outputs"][k] == base["outputs"].get(k) for k in keys)
                entry["greedy_match"] = f"{same}/{len(keys)}"
    return results


def merge_rounds(rounds: list[dict[str, dict]], methods: list[Method]) -> dict[str, dict]:
    """One result per method: the first round's entries, tokens/s and speed-up replaced by their
    mean over rounds (each round's own values kept under `per_round`)."""
    if len(rounds) == 1:
        return rounds[0]
    merged = rounds[0]
    for method in methods:
        for category, entry in merged[method.name]["categories"].items():
            entries = [rd[method.name]["categories"][category] for rd in rounds]
            for key in ("tokens_per_s", "speedup_vs_autoregressive"):
                values = [e.get(key) for e in entries]
                entry[f"{key}_per_round"] = values
                if all(v is not None for v in values):
                    entry[key] = sum(values) / len(values)
            same = [e.get("greedy_match") for e in entries]
            entry["greedy_match_per_round"] = same
            entry["seconds_per_round"] = [e["seconds"] for e in entries]
            entry["output_tokens_per_round"] = [e["output_tokens"] for e in entries]
    return merged


def markdown_table(results: dict[str, dict]) -> str:
    moe = any("experts_per_verify_step" in e for res in results.values() for e in res["categories"].values())
    lines = ["| method | category | tok/s | speed-up | mean acc. len | acc. rate | verify share | greedy = AR |"
             + (" experts/step (tokens) | experts/request (tokens) |" if moe else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if moe else "")]

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    for name, res in results.items():
        for category, e in res["categories"].items():
            lines.append(
                f"| {name} | {category} | {f(e['tokens_per_s'])} | {f(e.get('speedup_vs_autoregressive'), '{:.2f}x')} "
                f"| {f(e['mean_acceptance_length'])} | {f(e['acceptance_rate'])} "
                f"| {f(e.get('verification_time_share'))} | {e.get('greedy_match', '-')} |"
                + (f" {f(e.get('experts_per_verify_step'), '{:.1f}')} ({f(e.get('tokens_per_verify_step'), '{:.1f}')}) "
                   f"| {f(e.get('experts_per_verifying_request'), '{:.1f}')} "
                   f"({f(e.get('tokens_per_verifying_request'), '{:.1f}')}) |" if moe else ""))
    lines += ["", "Short categories together (sum of tokens / sum of seconds over all rounds; per round in brackets):",
              "", "| method | tok/s | vs autoregressive | vs draft_model | mean acc. len |", "|---|---|---|---|---|"]
    overall = {name: _overall(res) for name, res in results.items()}
    for name, o in overall.items():
        ar, dm = overall.get("autoregressive"), overall.get("draft_model")
        per_round = ", ".join(f(t) for t in o["tokens_per_s_per_round"])
        lines.append(
            f"| {name} | {f(o['tokens_per_s'])} [{per_round}] | {_ratios(o, ar)} | {_ratios(o, dm)} "
            f"| {f(o['mean_acceptance_length'])} |")
    return "\n".join(lines)


def _overall(res: dict) -> dict:
    entries = [e for c, e in res["categories"].items() if not c.startswith("long_context")]
    tokens = [e.get("output_tokens_per_round", [e["output_tokens"]]) for e in entries]
    seconds = [e.get("seconds_per_round", [e["seconds"]]) for e in entries]
    per_round = [sum(t[r] for t in tokens) / sum(s[r] for s in seconds) for r in range(len(seconds[0]))]
    drafts = sum(e["num_drafts"] for e in entries)
    accepted = sum(e["num_accepted_tokens"] for e in entries)
    return {"tokens_per_s": sum(map(sum, tokens)) / sum(map(sum, seconds)),
            "tokens_per_s_per_round": per_round,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def _ratios(a: dict, b: dict | None) -> str:
    """a / b over all rounds, and per round in brackets (machines drift: compare within a round)."""
    if not b:
        return "-"
    per = ", ".join(f"{x / y:.2f}" for x, y in zip(a["tokens_per_s_per_round"], b["tokens_per_s_per_round"]))
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x [{per}]"


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n in results if n != "autoregressive"]
    categories = list(next(iter(results.values()))["categories"])
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(categories) + 2), 4))
    width = 0.8 / max(len(names), 1)
    x = np.arange(len(categories))
    for i, name in enumerate(names):
        ys = [results[name]["categories"].get(c, {}).get("speedup_vs_autoregressive") or 0 for c in categories]
        ax.bar(x + i * width - 0.4 + width / 2, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, categories, rotation=30, ha="right")
    ax.set_ylabel("speed-up over autoregressive (tok/s ratio)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="built model name or folder")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model name or folder")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--categories", nargs="+", default=list(SHORT_CATEGORIES))
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per category")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 8192, 32768],
                   help="long-context sweep lengths in tokens (empty: none)")
    p.add_argument("--num-long-prompts", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=1, help="requests submitted together")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens (hierarchical: drafts per round)")
    p.add_argument("--draft-layer", type=int, default=None,
                   help="self-drafting exit layer (default: the shallowest trained head)")
    p.add_argument("--draft-confidence", type=float, default=0.0,
                   help="self-drafting: stop a request's draft below this head probability")
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="sparsever-self-draft-trim: draft vocabulary size (VocabTrim)")
    p.add_argument("--verify-layer", type=int, default=None,
                   help="hierarchical: intermediate verifier exit layer (default: the deepest trained head)")
    p.add_argument("--hier-cap", type=int, default=8, help="hierarchical: pending tokens per full verification")
    p.add_argument("--full-verify-every", type=int, default=3, help="hierarchical: rounds per full verification")
    p.add_argument("--tree-nodes", type=int, default=12, help="trees: node budget (num_speculative_tokens)")
    p.add_argument("--tree-branching", type=int, default=3)
    p.add_argument("--tree-expand", type=int, default=3)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--evict-chain-k", type=int, default=6, help="sparsever-evict-chain: longest chain")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every method this many times, alternating the method order (noise check)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="1 prompt x 3 categories, 1K context only, 48 tokens")
    p.add_argument("--tag", default=None, help="name part of the result files")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts = 1
        args.categories = ["mt_bench", "humaneval", "gsm8k"]
        args.contexts = [1024]
        args.max_tokens = 48
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_sparsever.cli import resolve_model

    target = resolve_model(args.target)
    methods = [METHODS[m] for m in args.methods]
    draft = resolve_model(args.draft) if any(m.needs_draft for m in methods) else None
    rows = load_workload(args, target)
    print(f"target={target}\ndraft={draft}\n{len(rows)} prompts x {len(methods)} methods", flush=True)

    started = dt.datetime.now(dt.timezone.utc)
    hw_start = hardware()  # load average before the run: other work on the machine shows here
    results: dict[str, dict] = {}
    rounds: list[dict[str, dict]] = []
    with tqdm(total=len(rows) * len(methods) * args.rounds, desc="requests", unit="req") as bar:
        for r in range(args.rounds):
            order = methods if r % 2 == 0 else methods[::-1]  # alternate: drift hits every method alike
            this_round: dict[str, dict] = {}
            for method in order:
                bar.set_postfix_str(f"round {r + 1}: {method.name}")
                this_round[method.name] = run_method(method, args, target, draft, rows, bar)
            rounds.append(summarize(this_round, methods))
    results = merge_rounds(rounds, methods)

    tag = args.tag or Path(target).name
    stamp = started.strftime("%Y%m%d-%H%M")
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / f"spec_decode_{tag}_{stamp}"
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started_utc": started.isoformat(),
        "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
        "target": target, "draft": draft, "args": vars(args),
        "hardware_at_start": hw_start, "hardware": hardware(), "versions": versions(), "env": binding_env(),
        "results": results,
    }
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    table = markdown_table(results)
    base.with_suffix(".md").write_text(
        f"# {tag}: {Path(target).name} (draft {Path(draft).name if draft else '-'})\n\n"
        f"`{record['command']}`\n\nhardware: {record['hardware']}\n\nbinding: {record['env']}\n\n{table}\n")
    plot(results, base.with_suffix(".png"), f"{Path(target).name} / draft {Path(draft).name if draft else '-'}, "
         f"k={args.k}, batch {args.batch_size}, {args.dtype}")
    print(table)
    print(f"results: {base}.json / .md / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
