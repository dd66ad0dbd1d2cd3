"""Sparse verification trade-off: verify-step time and bytes read against acceptance and quality.

One sparsever engine per model pair is started with every applicable sparsity set up; the policies
(dense, each sparsity alone, combined) are switched at run time (`set_sparsity`) and run on the
same prompts in the same run, so ratios are not skewed by machine drift. Prefix caching keeps
the long prompts' KV between policies, so each context is prefilled once. A second engine with no
sparsity set up measures stock vLLM dense verification (its AMX attention / oneDNN MLP paths).

Per policy and context (1K/8K/32K of long documents, summarized): verify-step time (ms, from the worker's
timers), bytes of weights and KV read per verify step (from the model's shapes and what the
sparse layers report), mean acceptance length, greedy agreement with dense (share of tokens
before the first divergence). Quality: GSM8K accuracy on a subset and ROUGE-L of long-document
summaries against the dense policy's summaries (the data set has no reference summaries).

    python bench/sparse_verify.py --pair qwen            # Qwen2.5-Coder 1.5B + 0.5B draft
    python bench/sparse_verify.py --pair moe             # MoEfied SmolLM2 + SmolLM2 draft
    python bench/sparse_verify.py --pair qwen --quick    # 1K + 8K, 1 prompt, small quality sets
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, binding_env, hardware, versions  # noqa: E402

PAIRS = {
    "qwen": {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b", "sparsities": ("attention", "ffn")},
    "moe": {"target": "smollm2-135m-moe", "draft": "smollm2-135m", "sparsities": ("attention", "moe")},
}


def policies(args, sparsities: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Policy name -> sections for set_sparsity: dense, each sparsity alone (with its variants),
    and attention combined with each variant of the other sparsity. None values = profile."""
    attention = {"enabled": True, "top_k_blocks": args.top_k_blocks, "min_context_len": args.min_context_len,
                 "kernel": args.attention_kernel}
    variants: dict[str, list[tuple[str, dict]]] = {"attention": [("attention", attention)]}
    if "ffn" in sparsities:
        gate = {"gate": args.ffn_gate}
        if args.ffn_gate == "input_sparse":  # the gate's input keep ratio switches at run time too
            variants["ffn"] = [((f"ffn@{r}" if r else "ffn(profile)") + f"/in@{i}",
                                {"enabled": True, "keep_ratio": r, **gate, "gate_input_keep_ratio": i})
                               for r in args.ffn_keep_ratios for i in args.ffn_gate_input_keeps]
        else:
            variants["ffn"] = [(f"ffn@{r}" if r else "ffn(profile)", {"enabled": True, "keep_ratio": r, **gate})
                               for r in args.ffn_keep_ratios]
    if "moe" in sparsities:
        variants["moe"] = [(f"moe(budget {b})" if b else "moe(profile)",
                            {"enabled": True, "ratio_threshold": args.moe_ratio_threshold, "expert_budget": b})
                           for b in args.moe_expert_budgets]
    off = {s: {"enabled": False} for s in sparsities}
    result = {"dense": dict(off)}
    for section, items in variants.items():
        for name, sections in items:
            result[name] = {**off, section: sections}
    for section, items in variants.items():
        if section != "attention":
            for name, sections in items:
                result[f"attention+{name}"] = {**off, "attention": attention, section: sections}
    return result


def start_up_sections(args, sparsities: tuple[str, ...]) -> dict[str, Any]:
    """Every sparsity set up at start (the policies then switch them at run time)."""
    pols = policies(args, sparsities)
    return {s: next(p[s] for p in pols.values() if p[s]["enabled"]) for s in sparsities}


# ---- bytes read per verify step -----------------------------------------------------------------


def model_shapes(target: str) -> dict[str, Any]:
    cfg = json.loads((Path(target) / "config.json").read_text())
    h = cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    return {
        "layers": cfg["num_hidden_layers"], "hidden": h, "inter": cfg["intermediate_size"],
        "heads": heads, "kv_heads": kv_heads, "head_dim": d, "vocab": cfg["vocab_size"],
        "experts": cfg.get("num_local_experts"), "experts_per_tok": cfg.get("num_experts_per_tok"),
        "bytes": 2 if cfg.get("torch_dtype", cfg.get("dtype", "bfloat16")) != "float32" else 4,
    }


def bytes_per_verify_step(shapes: dict, sparsity: dict, verify_steps: int, context: int, block_size: int,
                          moe_dense_experts: float | None, dtype_bytes: int) -> dict[str, float]:
    """Weights and KV bytes one verify step reads (batch 1), from shapes and the layers' counters."""
    L, H, inter, d = shapes["layers"], shapes["hidden"], shapes["inter"], shapes["head_dim"]
    b = dtype_bytes
    attn_proj = (shapes["heads"] * d * H * 2 + shapes["kv_heads"] * d * H * 2) * b
    steps = max(verify_steps, 1)
    out = {"attn_proj": L * attn_proj, "lm_head": shapes["vocab"] * H * b}
    if shapes["experts"]:
        per_expert = 3 * inter * H * b
        used = sparsity.get("moe_experts_read")
        per_layer = (used / steps / L) if used else (moe_dense_experts or shapes["experts"])
        out["ffn_or_experts"] = L * per_layer * per_expert
    else:
        rows = sparsity.get("ffn_neurons_read")
        kept = (rows / steps / L) if rows else inter
        # The gate: every row, or (ffn.gate "input_sparse") the kept hidden channels' rows of [H, I].
        channels = sparsity.get("ffn_gate_channels_read")
        gate = (channels / steps / L) * inter if channels else inter * H
        out["ffn_or_experts"] = L * (gate + 2 * kept * H) * b  # up/down: the kept neurons' rows
    blocks = sparsity.get("attn_kv_blocks_read")
    if blocks:
        out["kv"] = blocks / steps * block_size * d * 2 * b
    else:
        out["kv"] = L * shapes["kv_heads"] * context * d * 2 * b
    out["total"] = sum(out.values())
    return out


# ---- quality ------------------------------------------------------------------------------------


def gsm8k_answer(text: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def gsm8k_reference(reference: str) -> str:
    return reference.split("####")[-1].strip().replace(",", "")


def rouge_l(candidates: list[str], references: list[str]) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    scores = [scorer.score(r, c)["rougeL"].fmeasure for c, r in zip(candidates, references)]
    return sum(scores) / len(scores) if scores else float("nan")


def agreement(tokens: list[int], dense: list[int]) -> float:
    """Share of the dense output reproduced before the first differing token."""
    same = 0
    for a, b in zip(tokens, dense):
        if a != b:
            break
        same += 1
    return same / max(len(dense), 1)


# ---- running ------------------------------------------------------------------------------------


def start_engine(args, target: str, draft: str, sparsities: tuple[str, ...], max_len: int, sparse: bool):
    from vllm import LLM

    spec: dict[str, Any] = {"method": "sparsever", "num_speculative_tokens": args.k, "model": draft}
    if sparse:
        spec.update(start_up_sections(args, sparsities))
        if args.profile:
            spec["profile"] = args.profile
    return LLM(model=target, dtype=args.dtype, enforce_eager=True, max_model_len=max_len, max_num_seqs=args.max_batch,
               seed=0, speculative_config=spec, enable_prefix_caching=True)


def run_policy(llm, sections: dict | None, prompts: list[list[dict]], max_tokens: int,
               min_tokens: int = 0) -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics, set_sparsity

    if sections is not None:
        set_sparsity(llm, **sections)
    reset_metrics(llm)
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens)
    outs = llm.chat(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    m = get_metrics(llm)
    steps = m["num_verify_steps"]
    return {
        "wall_s": wall,
        "verify_steps": steps,
        "verify_ms_per_step": 1e3 * m["verify_time_s"] / steps if steps else None,
        "step_ms": 1e3 * m["step_time_s"] / m["num_steps"] if m["num_steps"] else None,
        "mean_acceptance_length": m["mean_acceptance_length"],
        "sparsity": m.get("sparsity", {}),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
    }


def bench_engine(args, llm, names: list[str], pols: dict, shapes: dict, bar, label: str,
                 checkpoint=lambda result: None) -> dict[str, Any]:
    from vllm_sparsever.data import load_prompts
    from vllm_sparsever.data.long_context import long_context_prompts

    result: dict[str, Any] = {"contexts": {}, "quality": {}}
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    dtype_bytes = 4 if args.dtype == "float32" else 2
    for ctx in args.contexts:
        # Summaries: long answers, so every policy runs many verify steps (min_tokens = max_tokens
        # keeps the lengths equal across policies).
        rows = long_context_prompts(args.target_path, ctx, task="summarize", n=args.num_prompts)
        per_policy: dict[str, Any] = {name: [] for name in names}
        for row in rows:
            chat = [[{"role": "user", "content": row["prompt"]}]]
            run_policy(llm, pols.get("dense"), chat, 1)  # prefill once; later runs hit the prefix cache
            for repeat in range(args.repeats):  # policies interleaved: drift hits all alike
                for name in names:
                    bar.set_postfix_str(f"{label} {ctx // 1024}K {name} #{repeat}")
                    r = run_policy(llm, pols.get(name), chat, args.max_tokens, min_tokens=args.max_tokens)
                    r.update(prompt_id=row["id"], context_tokens=row["num_tokens"], repeat=repeat)
                    per_policy[name].append(r)
                    bar.update(1)
        # Distinct experts per layer of dense routing: sampled by the MoE layers of any policy
        # with MoE sparsity (the same tokens' unpruned top-k).
        sampled = [r["sparsity"] for runs in per_policy.values() for r in runs
                   if r["sparsity"].get("moe_layers_sampled")]
        moe_dense = (sum(s["moe_experts_dense_sampled"] for s in sampled)
                     / sum(s["moe_layers_sampled"] for s in sampled)) if sampled else None
        for name, runs in per_policy.items():
            for r in runs:
                r["bytes_per_verify_step"] = bytes_per_verify_step(
                    shapes, r["sparsity"], r["verify_steps"], r["context_tokens"], block_size, moe_dense, dtype_bytes)
                if "dense" in per_policy:
                    dense = per_policy["dense"][runs.index(r)]
                    r["agreement_with_dense"] = agreement(r["tokens"][0], dense["tokens"][0])
        result["contexts"][str(ctx)] = per_policy
        checkpoint(result)

    # Short prompts never reach min_context_len: attention policies equal their non-attention twin.
    short_names = [n for n in names if not n.startswith("attention")]
    if args.gsm8k:
        rows = load_prompts("gsm8k", n=args.gsm8k)
        chats = [[{"role": "user", "content": r["prompt"] + "\nSolve step by step; end with 'The answer is N.'"}]
                 for r in rows]
        for name in short_names:
            bar.set_postfix_str(f"{label} gsm8k {name}")
            r = run_policy(llm, pols.get(name), chats, args.quality_tokens)
            correct = [gsm8k_answer(t) == gsm8k_reference(row["reference"]) for t, row in zip(r["texts"], rows)]
            r["accuracy"] = sum(correct) / len(correct)
            r["correct"] = correct
            result["quality"].setdefault("gsm8k", {})[name] = r
            bar.update(1)
        checkpoint(result)
    if args.summaries:
        rows = long_context_prompts(args.target_path, args.summary_context, task="summarize", n=args.summaries)
        chats = [[{"role": "user", "content": r["prompt"]}] for r in rows]
        runs = {}
        for name in names:
            bar.set_postfix_str(f"{label} summaries {name}")
            runs[name] = run_policy(llm, pols.get(name), chats, args.quality_tokens)
            bar.update(1)
        if "dense" in runs:
            for name, r in runs.items():
                r["rouge_l_vs_dense"] = rouge_l(r["texts"], runs["dense"]["texts"])
        result["quality"]["summaries"] = runs
    return result


# ---- report -------------------------------------------------------------------------------------


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(sparse: dict, stock: dict | None, names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for ctx, per_policy in sparse["contexts"].items():
        dense_ms = _mean(r["verify_ms_per_step"] for r in per_policy["dense"])
        dense_mal = _mean(r["mean_acceptance_length"] for r in per_policy["dense"])
        dense_bytes = _mean(r["bytes_per_verify_step"]["total"] for r in per_policy["dense"])
        stock_ms = None
        if stock:
            stock_ms = _mean(r["verify_ms_per_step"] for r in stock["contexts"][ctx]["dense"])
        for name in names:
            runs = per_policy[name]
            ms = _mean(r["verify_ms_per_step"] for r in runs)
            mal = _mean(r["mean_acceptance_length"] for r in runs)
            total = _mean(r["bytes_per_verify_step"]["total"] for r in runs)
            kv = _mean(r["bytes_per_verify_step"]["kv"] for r in runs)
            rows.append({
                "context": int(ctx), "policy": name, "verify_ms": ms,
                "speedup_vs_dense": dense_ms / ms if ms and dense_ms else None,
                "speedup_vs_stock_dense": stock_ms / ms if ms and stock_ms else None,
                "stock_dense_verify_ms": stock_ms,
                "bytes_GB": total / 1e9 if total else None, "kv_GB": kv / 1e9 if kv else None,
                "bytes_ratio_vs_dense": total / dense_bytes if total and dense_bytes else None,
                "mean_acceptance_length": mal,
                "mal_ratio_vs_dense": mal / dense_mal if mal and dense_mal else None,
                "agreement_with_dense": _mean(r.get("agreement_with_dense") for r in runs),
                "rouge_l_vs_dense": rouge_l([r["texts"][0] for r in runs],
                                            [d["texts"][0] for d in per_policy["dense"]]),
                "fallbacks": sum(v for r in runs for k, v in r["sparsity"].items() if k.endswith("fallbacks")),
            })
    for row in rows:
        row["aim_met"] = (row["context"] >= 8192 and row["speedup_vs_dense"] is not None
                          and row["speedup_vs_dense"] >= 2.0 and row["mal_ratio_vs_dense"] is not None
                          and row["mal_ratio_vs_dense"] >= 0.95)
    return rows


def quality_rows(sparse: dict, names: list[str]) -> list[dict[str, Any]]:
    rows = []
    q = sparse["quality"]
    for name in names:
        row = {"policy": name}
        g = q.get("gsm8k", {}).get(name)
        if g is not None:
            row.update(gsm8k_accuracy=g["accuracy"], gsm8k_n=len(g["correct"]),
                       gsm8k_verify_ms=g["verify_ms_per_step"], gsm8k_mal=g["mean_acceptance_length"])
        if "summaries" in q:
            s = q["summaries"][name]
            row.update(rouge_l_vs_dense=s.get("rouge_l_vs_dense"), summaries_verify_ms=s["verify_ms_per_step"])
        rows.append(row)
    return rows


def _fmt(v, spec=".2f"):
    return "-" if v is None else (format(v, spec) if isinstance(v, float) else str(v))


def markdown(summary: list[dict], quality: list[dict]) -> str:
    lines = ["| context | policy | verify ms | vs dense | vs stock dense | GB read | KV GB | bytes ratio | MAL | MAL ratio | agreement | ROUGE-L vs dense | aim |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(
            f"| {r['context']} | {r['policy']} | {_fmt(r['verify_ms'], '.1f')} | {_fmt(r['speedup_vs_dense'])}x | "
            f"{_fmt(r['speedup_vs_stock_dense'])}x | {_fmt(r['bytes_GB'], '.3f')} | {_fmt(r['kv_GB'], '.3f')} | "
            f"{_fmt(r['bytes_ratio_vs_dense'])} | {_fmt(r['mean_acceptance_length'])} | "
            f"{_fmt(r['mal_ratio_vs_dense'])} | {_fmt(r['agreement_with_dense'])} | {_fmt(r['rouge_l_vs_dense'])} | "
            f"{'met' if r['aim_met'] else '-'} |")
    keys = [k for k in (quality[0] if quality else {}) if k != "policy"]
    if keys:
        lines += ["", "| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in quality:
            lines.append(f"| {r['policy']} | " + " | ".join(_fmt(r.get(k), ".3f") for k in keys) + " |")
    return "\n".join(lines)


def plot(summary: list[dict], quality: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ax = axes[0]
    for ctx in sorted({r["context"] for r in summary}):
        pts = [r for r in summary if r["context"] == ctx and r["speedup_vs_dense"]]
        ax.scatter([r["speedup_vs_dense"] for r in pts], [r["rouge_l_vs_dense"] for r in pts],
                   label=f"{ctx // 1024}K context")
        for r in pts:
            ax.annotate(r["policy"], (r["speedup_vs_dense"], r["rouge_l_vs_dense"]), fontsize=7)
    ax.axvline(2.0, ls=":", c="grey")
    ax.set_xlabel("verify-step speed-up vs dense verification (same engine)")
    ax.set_ylabel("ROUGE-L of the output against dense verification's")
    ax.legend()
    ax = axes[1]
    pts = [r for r in summary if r["mal_ratio_vs_dense"] and r["speedup_vs_dense"]]
    ax.scatter([r["speedup_vs_dense"] for r in pts], [r["mal_ratio_vs_dense"] for r in pts])
    for r in pts:
        ax.annotate(f"{r['policy']}@{r['context'] // 1024}K", (r["speedup_vs_dense"], r["mal_ratio_vs_dense"]), fontsize=7)
    ax.axhline(0.95, ls=":", c="grey")
    ax.axvline(2.0, ls=":", c="grey")
    ax.set_xlabel("verify-step speed-up vs dense")
    ax.set_ylabel("mean acceptance length / dense")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=sorted(PAIRS), default="qwen")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 8192, 32000],
                   help="context lengths in tokens (32000: Qwen2.5's 32K window minus the answer)")
    p.add_argument("--num-prompts", type=int, default=1, help="long documents per context")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="runs per policy and prompt (interleaved)")
    p.add_argument("--gsm8k", type=int, default=10, help="GSM8K questions (0: skip)")
    p.add_argument("--summaries", type=int, default=2, help="long-document summaries for ROUGE-L (0: skip)")
    p.add_argument("--summary-context", type=int, default=4096)
    p.add_argument("--quality-tokens", type=int, default=192)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top-k-blocks", type=int, default=8)
    p.add_argument("--min-context-len", type=int, default=2048)
    p.add_argument("--attention-kernel", choices=["auto", "sparsever", "vllm"], default="auto",
                   help="attention.kernel of the sparse engine (fixed at its start)")
    p.add_argument("--ffn-keep-ratios", type=lambda v: None if v == "profile" else float(v), nargs="+",
                   default=[None, 0.5], help="FFN variants ('profile' = the calibration profile's ratios)")
    p.add_argument("--ffn-gate", choices=["auto", "stock", "kernel", "input_sparse"], default="auto",
                   help="ffn.gate of the sparse engine (a start-up knob)")
    p.add_argument("--ffn-gate-input-keeps", type=float, nargs="+", default=[0.7],
                   help="ffn.gate_input_keep_ratio variants with --ffn-gate input_sparse")
    p.add_argument("--moe-ratio-threshold", type=float, default=None, help="default: calibration profile")
    p.add_argument("--moe-expert-budgets", type=lambda v: None if v == "none" else int(v), nargs="+",
                   default=[None, 4], help="MoE variants: per-request expert budget ('none' = no cap)")
    p.add_argument("--profile", default=None, help="calibration profile (default: the model's, if calibrated)")
    p.add_argument("--no-stock", action="store_true", help="skip the stock-dense engine")
    p.add_argument("--quick", action="store_true", help="1K + 8K, 1 prompt, 8 GSM8K, 2 summaries, 48 tokens")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.num_prompts, args.max_tokens = [1024, 8192], 1, 48
        args.gsm8k, args.summaries, args.quality_tokens = 8, 2, 160
    return args


def write_report(record: dict, base: Path) -> str:
    names = list(record["policies"])
    summary = summarize(record["sparse_engine"], record["stock_engine"], names)
    quality = quality_rows(record["sparse_engine"], names)
    record["summary"], record["quality"] = summary, quality
    base.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    table = markdown(summary, quality)
    target, draft = Path(record["target"]).name, Path(record["draft"]).name
    base.with_suffix(".md").write_text(
        f"# sparse verification trade-off: {target} (draft {draft})\n\n"
        f"`{record['command']}`\n\nhardware: {record['hardware']}\n\nbinding: {record['env']}\n\n"
        f"sparsity set-up (profile, anchors): {json.dumps(record['sparsity_setup'])}\n\n"
        f"'vs dense' = dense verification in the same engine (vec attention ISA, plain-weight MLP / "
        f"sparsever expert kernel); 'vs stock dense' = an engine without sparsity set up (vLLM's own "
        f"AMX attention, oneDNN MLP, cpu_fused_moe). 'agreement' = share of the dense output reproduced "
        f"before the first differing token; 'aim' = >= 8K context, >= 2x verify-step speed-up vs dense "
        f"with mean acceptance length within 5%.\n\n{table}\n")
    plot(summary, quality, base.with_suffix(".png"),
         f"{target} + {draft}, k={record['args']['k']}, {record['args']['dtype']}; {record['hardware'].get('Model name')}")
    return table


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--from-json":
        path = Path(sys.argv[2])  # re-render a finished run (tables, plot) from its raw numbers
        print(write_report(json.loads(path.read_text()), path.with_suffix("")))
        return 0
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")
    from vllm_sparsever.cli import resolve_model

    pair = PAIRS[args.pair]
    args.target_path = target = resolve_model(pair["target"])
    draft = resolve_model(pair["draft"])
    shapes = model_shapes(target)
    max_pos = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings", 32768)
    # Contexts beyond the model's window are cut to fit it (e.g. 8192 -> 8064 for an 8K model).
    fit = max_pos - args.max_tokens - 64
    clamped = {c: min(c, fit) for c in args.contexts if c > fit}
    args.contexts = list(dict.fromkeys(min(c, fit) for c in args.contexts))
    max_len = min(max_pos, max(args.contexts + [args.summary_context]) + max(args.max_tokens, args.quality_tokens) + 64)
    sparsities = pair["sparsities"]
    pols = policies(args, sparsities)
    names = list(pols)
    started = dt.datetime.now(dt.timezone.utc)
    hw_start = hardware()
    tag = args.tag or args.pair + ("-quick" if args.quick else "")
    base = RESULTS / f"sparse_verify_{tag}_{started.strftime('%Y%m%d-%H%M')}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    partial = base.with_suffix(".partial.json")

    def checkpoint(result: dict) -> None:  # a crash or a killed run keeps what was measured
        partial.write_text(json.dumps({"command": " ".join(sys.argv), "raw": result}, default=str))
    per_engine = len(args.contexts) * args.num_prompts * args.repeats * len(names) + (
        sum(not n.startswith("attention") for n in names) if args.gsm8k else 0) + (len(names) if args.summaries else 0)
    stock_units = 0 if args.no_stock else len(args.contexts) * args.num_prompts * args.repeats
    print(f"target={target}\ndraft={draft}\npolicies={names}\ncontexts={args.contexts} (cut to the "
          f"model's window: {clamped})", flush=True)
    with tqdm(total=per_engine + stock_units, desc="runs", unit="run") as bar:
        llm = start_engine(args, target, draft, sparsities, max_len, sparse=True)
        try:
            info = llm.collective_rpc("sparsever_sparsity_info")[0]
            sparse = bench_engine(args, llm, names, pols, shapes, bar, "sparse", checkpoint)
        finally:
            del llm
            gc.collect()
        stock = None
        if not args.no_stock:
            quality_args = argparse.Namespace(**{**vars(args), "gsm8k": 0, "summaries": 0})
            llm = start_engine(args, target, draft, sparsities, max_len, sparse=False)
            try:
                stock = bench_engine(quality_args, llm, ["dense"], {"dense": None}, shapes, bar, "stock")
            finally:
                del llm
                gc.collect()
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started_utc": started.isoformat(), "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
        "target": target, "draft": draft, "args": {k: v for k, v in vars(args).items()},
        "sparsity_setup": info, "shapes": shapes, "policies": pols,
        "hardware_at_start": hw_start, "hardware": hardware(), "versions": versions(), "env": binding_env(),
        "sparse_engine": sparse, "stock_engine": stock,
    }
    table = write_report(record, base)
    partial.unlink(missing_ok=True)
    print(table)
    print(f"\nwritten: {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
