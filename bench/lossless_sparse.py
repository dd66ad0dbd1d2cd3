"""Lossless sparse verification at long context: dense verification vs the sparse-target hierarchy.

One engine (target + a drafter: n-gram prompt lookup or the draft model, bf16, prefix caching so
each long prompt is prefilled once) runs every mode on the same prompts, interleaved per prompt
(the order alternates), switched at run time:
- `dense`: the drafter proposing `round_tokens` drafts per step, dense verification (the baseline);
- `sparse-hier`: hierarchical verification, intermediate level = the sparse target (block-sparse
  attention), full level dense: the lossless sparse hierarchy;
- `sparse-approx`: the same sparse attention verifying the drafter's drafts at the full level
  (approximate; changes the text), to show what losslessness costs;
- `dense-vllm-kernel`: `dense` with `attention.dense_kernel` "vllm" (vLLM's attention kernel on the
  verify steps instead of sparsever's), for the kernel's end-to-end share.
A second engine without speculative decoding then runs the same prompts (`autoregressive`), with
`--vllm-draft-model K` a third, vLLM's own `draft_model` method with K drafts (`vllm-draft_model`),
and with `--evict [DRAFTER ...]` one more per drafter: sparsever's EVICT chains (up to `--cap`
drafts, dense verification; needs `vllm-sparsever profile-verify TARGET` first) over the draft model
(`evict-chain`), the draft model over `--draft-vocab` token ids (`evict-chain-vocab`), that and
attending to `--draft-window` recent positions (`evict-chain-vocab-window`), or n-gram lookup
(`evict-ngram`); a drafter ending in `-hybrid` runs that engine's linears on `linear_kernel:
"hybrid"` (`evict-chain-hybrid`, `evict-chain-vocab-window-hybrid`), one ending in `-w8a8` drafts with
`--draft-w8a8` (the draft model with int8 linears: `evict-chain-w8a8`, `evict-chain-vocab-window-w8a8`), one
ending in `-w4a16` with `--draft-w4a16` (int4 linears: `evict-chain-w4a16`, `evict-chain-vocab-w4a16`,
`evict-chain-vocab-window-w4a16`; `draft_model-vocab-window4096-w4a16` attends to 4096 positions instead of
`--draft-window`); one ending in `-tree` drafts EVICT trees (`tree.enabled`, its default
shape, at most `--cap` nodes) instead of chains (`evict-tree-vocab-window-w4a16`, `-w8a8`).
Engines run one after another, each shut down
before the next starts; every engine runs each prompt after an untimed warm-up on it (prefilled
into the prefix cache, and `--warm-up-tokens` steps, 8 by default: as in a running server, EVICT has
then measured steps; its acceptance per depth needs a few dozen).
With `--follow-ups N` (summarize task) N more questions on each document follow its prompt, timed
the same way: their document blocks come from vLLM's prefix cache (and a draft model's K/V in
them, for sparsever's drafter), as when a server is asked about a document again.

Per mode and context: decode tokens/s (first to last output token, from vLLM's request stats, so
prefill is out of it), ratio to dense, tokens per full verification, intermediate acceptance,
full-level acceptance of pending tokens, and whether the output equals the dense mode's (bf16: the
hierarchy's batch shapes differ from dense verification's, so near-ties can flip; PLATFORM.md).

    python bench/lossless_sparse.py --contexts 8192 32000 --num-prompts 3 --tag qwen
    python bench/lossless_sparse.py --drafter draft_model --tag qwen-draft
    python bench/lossless_sparse.py --drafter draft_model --modes dense --evict draft_model ngram
    python bench/lossless_sparse.py --drafter draft_model --modes --contexts 8192 --num-prompts 2 \
        --evict draft_model draft_model-vocab draft_model-vocab-window
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import RESULTS, binding_env, hardware, versions  # noqa: E402
from vllm_sparsever.data.builders import LONG_SUMMARY  # noqa: E402

MODES = ("dense", "sparse-hier", "sparse-approx", "dense-vllm-kernel")
EVICT_MODES = {"draft_model": "evict-chain", "draft_model-vocab": "evict-chain-vocab",  # --evict drafter -> mode
               "draft_model-vocab-window": "evict-chain-vocab-window", "ngram": "evict-ngram",
               # the same, every linear of target and draft on linear_kernel "hybrid"
               "draft_model-hybrid": "evict-chain-hybrid",
               "draft_model-vocab-window-hybrid": "evict-chain-vocab-window-hybrid",
               # the same over --draft-w8a8 (int8 decoder linears: half the draft's bytes)
               "draft_model-w8a8": "evict-chain-w8a8",
               "draft_model-vocab-window-w8a8": "evict-chain-vocab-window-w8a8",
               # the same over --draft-w4a16 (int4 decoder linears: a quarter of the draft's bytes)
               "draft_model-w4a16": "evict-chain-w4a16",
               "draft_model-vocab-window-w4a16": "evict-chain-vocab-window-w4a16",
               "draft_model-vocab-w4a16": "evict-chain-vocab-w4a16",
               # the same attending to 4096 recent positions instead of --draft-window
               "draft_model-vocab-window4096-w4a16": "evict-chain-vocab-window4096-w4a16",
               # EVICT trees (tree.enabled, its default shape; --cap nodes) instead of chains
               "draft_model-vocab-window-tree": "evict-tree-vocab-window",
               "draft_model-vocab-window-w4a16-tree": "evict-tree-vocab-window-w4a16",
               "draft_model-vocab-window-w8a8-tree": "evict-tree-vocab-window-w8a8"}
LOSSLESS_MODES = ("dense", "sparse-hier", "dense-vllm-kernel", *EVICT_MODES.values())
WARM_UP_TOKENS = 8  # --warm-up-tokens' default
SUMMARY_ASK = LONG_SUMMARY.split("{title}. ", 1)[1]  # the summarize task's question, after the document
FOLLOW_UPS = (  # --follow-ups: more questions on the same document
    "Describe the main characters in it and what each of them wants.",
    "Describe where it takes place and its mood in one paragraph.",
    "Explain the main conflict in it in one paragraph.",
    "Write what could happen right after it in one paragraph.",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="--drafter draft_model: the draft model")
    p.add_argument("--draft-w8a8", default="qwen2.5-coder-0.5b-w8a8",
                   help="the draft model of the *-w8a8 EVICT drafters (models build qwen2.5-coder-0.5b-w8a8)")
    p.add_argument("--draft-w4a16", default="qwen2.5-coder-0.5b-w4a16",
                   help="the draft model of the *-w4a16 EVICT drafters (models build qwen2.5-coder-0.5b-w4a16)")
    p.add_argument("--no-autoregressive", action="store_true", help="skip the engine without speculative decoding")
    p.add_argument("--vllm-draft-model", type=int, default=0, metavar="K",
                   help="also run vLLM's own draft_model method with K drafts (needs --draft)")
    p.add_argument("--evict", nargs="*", choices=sorted(EVICT_MODES), default=None, metavar="DRAFTER",
                   help="also run EVICT chains over these drafters (draft_model, ngram; bare: --drafter's), "
                        "an engine each")
    p.add_argument("--draft-vocab", type=int, default=32768, help="draft_vocab of the *-vocab EVICT drafters")
    p.add_argument("--draft-window", type=int, default=1024,
                   help="draft_attention_window of the draft_model-vocab-window EVICT drafter")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32000])
    p.add_argument("--num-prompts", type=int, default=3, help="long documents per context")
    p.add_argument("--documents", nargs="+", default=None, metavar="TITLE",
                   help="the documents whose title contains one of these (case-insensitive), in the data "
                        "set's order, instead of its first --num-prompts")
    p.add_argument("--task", choices=["summarize", "qa"], default="summarize")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warm-up-tokens", type=int, default=WARM_UP_TOKENS,
                   help="tokens of each prompt's untimed warm-up (EVICT learns its acceptance per depth there, "
                        "as in a server that has run for a while)")
    p.add_argument("--follow-ups", type=int, default=0, choices=range(len(FOLLOW_UPS) + 1), metavar="N",
                   help=f"more questions on each document after its prompt (summarize task; at most {len(FOLLOW_UPS)})")
    p.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                   help="the sparsever engine's modes (none: no such engine)")
    p.add_argument("--cap", type=int, default=8, help="num_speculative_tokens: n-gram k, and the hierarchy's cap")
    p.add_argument("--round-tokens", type=int, default=3)
    p.add_argument("--full-verify-every", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--top-k-blocks", type=int, default=8)
    p.add_argument("--min-context-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--linear-kernel", choices=["auto", "sparsever", "hybrid", "vllm", "vllm-padded"], default=None,
                   help="linear_kernel of sparsever's engines (default: the config's, auto; an --evict "
                        "drafter ending in -hybrid: 'hybrid')")
    p.add_argument("--tag", default=None)
    return p.parse_args(argv)


def start_engine(args, target: str, max_len: int, speculative: bool = True, vllm_draft_model: int = 0,
                 evict: str | None = None):
    """The engine of one section: sparsever with the run's drafter (`speculative`), none, vLLM's
    `draft_model` with K drafts (`vllm_draft_model`), or sparsever EVICT chains over `evict`."""
    from vllm import LLM

    from vllm_sparsever.cli import resolve_model

    spec = None
    if evict:
        spec = {"method": "sparsever", "num_speculative_tokens": args.cap, "adaptive": {"enabled": True}}
        if evict == "ngram":
            spec.update(draft_source="ngram", prompt_lookup_min=args.prompt_lookup_min,
                        prompt_lookup_max=args.prompt_lookup_max)
        else:
            quant = evict.removesuffix("-tree").rsplit("-", 1)[-1]
            draft = {"w8a8": args.draft_w8a8, "w4a16": args.draft_w4a16}.get(quant, args.draft)
            spec.update(model=resolve_model(draft))
            if "vocab" in evict:
                spec["draft_vocab"] = args.draft_vocab
            if "window" in evict:
                width = re.search(r"window(\d+)", evict)
                spec["draft_attention_window"] = int(width.group(1)) if width else args.draft_window
            if evict.endswith("-tree"):
                spec["tree"] = {"enabled": True}
    elif vllm_draft_model:
        spec = {"method": "draft_model", "model": resolve_model(args.draft),
                "num_speculative_tokens": vllm_draft_model}
    elif speculative:
        spec = {
            "method": "sparsever", "num_speculative_tokens": args.cap,
            "attention": {"enabled": True, "top_k_blocks": args.top_k_blocks, "min_context_len": args.min_context_len},
            "early_exit": {"enabled": True, "intermediate": "sparse", "round_tokens": args.round_tokens,
                           "full_verify_every": args.full_verify_every},
        }
        if args.drafter == "ngram":
            spec.update(draft_source="ngram", prompt_lookup_min=args.prompt_lookup_min,
                        prompt_lookup_max=args.prompt_lookup_max)
        else:
            spec.update(draft_source="draft_model", model=resolve_model(args.draft))
    if spec is not None and spec["method"] == "sparsever" and args.linear_kernel:
        spec["linear_kernel"] = args.linear_kernel
    if evict and evict.endswith("-hybrid"):
        spec["linear_kernel"] = "hybrid"
    return LLM(model=target, dtype=args.dtype, enforce_eager=True, max_model_len=max_len, max_num_seqs=1,
               seed=0, speculative_config=spec, enable_prefix_caching=True, disable_log_stats=False), spec


def set_mode(llm, args, mode: str) -> None:
    from vllm_sparsever.metrics import set_hierarchy, set_sparsity

    attention = {"enabled": mode not in ("dense", "dense-vllm-kernel"), "top_k_blocks": args.top_k_blocks,
                 "min_context_len": args.min_context_len,
                 "dense_kernel": "vllm" if mode == "dense-vllm-kernel" else "auto"}
    set_sparsity(llm, attention=attention)
    set_hierarchy(llm, mode == "sparse-hier")


def run_one(llm, args, mode: str, prompt: list[dict]) -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics

    speculative = mode not in ("autoregressive", "vllm-draft_model")
    if speculative:
        if mode in MODES:  # (EVICT: its own engine, nothing to switch)
            set_mode(llm, args, mode)
        reset_metrics(llm)  # (EVICT's counters too; its clock and acceptance estimates stay)
    vllm_before = _vllm_spec_metrics(llm) if mode == "vllm-draft_model" else {}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    out = llm.chat([prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)[0]
    wall = time.perf_counter() - start
    tokens = list(out.outputs[0].token_ids)
    stats = out.metrics
    decode_s = (stats.last_token_ts - stats.first_token_ts) if stats is not None else None
    run = {
        "mode": mode, "wall_s": wall, "decode_s": decode_s, "num_tokens": len(tokens),
        # Output tokens after the first (which the prefill step samples) over the time between them.
        "tokens_per_s": (len(tokens) - 1) / decode_s,
        "loadavg_1m_before": load, "cached_prompt_tokens": out.num_cached_tokens,
        "tokens": tokens, "text": out.outputs[0].text,
    }
    m = get_metrics(llm) if speculative else {}
    if mode == "vllm-draft_model":  # cumulative counters: differenced per run
        spec = counter_diff(_vllm_spec_metrics(llm), vllm_before)
        m = {"num_verify_steps": spec["num_drafts"], "num_draft_tokens": spec["num_draft_tokens"],
             "num_accepted_tokens": spec["num_accepted_tokens"]}
    return run | {
        "verify_steps": m.get("num_verify_steps", 0), "verify_time_s": m.get("verify_time_s", 0.0),
        "draft_time_s": m.get("draft_time_s", 0.0), "num_draft_tokens": m.get("num_draft_tokens", 0),
        "num_accepted_tokens": m.get("num_accepted_tokens", 0),
        "mean_acceptance_length": m.get("mean_acceptance_length"),
        "hierarchical": m.get("hierarchical") or {}, "drafter": m.get("prompt_lookup") or m.get("draft_model") or {},
        "sparsity": m.get("sparsity") or {},
        "evict": m.get("evict") or {}, "tree_drafting": m.get("tree_drafting") or {},
    }


def _vllm_spec_metrics(llm) -> dict[str, Any]:
    """Drafts and accepted tokens from vLLM's own spec-decode counters (cumulative; the caller
    differences them per run)."""
    out = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_drafts": 0}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        value = getattr(metric, "value", None)
        if name == "vllm:spec_decode_num_draft_tokens" and value is not None:
            out["num_draft_tokens"] = int(value)
        elif name == "vllm:spec_decode_num_accepted_tokens" and value is not None:
            out["num_accepted_tokens"] = int(value)
        elif name == "vllm:spec_decode_num_drafts" and value is not None:
            out["num_drafts"] = int(value)
    return out


def summarize(runs: list[dict], modes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for ctx in sorted({r["context"] for r in runs}):
        at = [r for r in runs if r["context"] == ctx]
        dense = {r["prompt"]: r for r in at if r["mode"] == "dense"}
        rate = lambda rs: sum(r["num_tokens"] - 1 for r in rs) / max(sum(r["decode_s"] for r in rs), 1e-9)  # noqa: E731
        dense_tps = rate(dense.values())
        for mode in modes:
            rs = [r for r in at if r["mode"] == mode]
            if not rs:
                continue
            tps = rate(rs)
            ratios = [r["tokens_per_s"] / dense[r["prompt"]]["tokens_per_s"] for r in rs if r["prompt"] in dense]
            same = [r["tokens"] == dense[r["prompt"]]["tokens"] for r in rs if r["prompt"] in dense]
            agree = [_agreement(r["tokens"], dense[r["prompt"]]["tokens"]) for r in rs if r["prompt"] in dense]
            steps = sum(r["verify_steps"] for r in rs)
            drafts = sum(r["num_draft_tokens"] for r in rs)
            inter = [r["hierarchical"] for r in rs if r["hierarchical"]]
            rows.append({
                "context": ctx, "mode": mode, "prompts": len(rs), "tokens": sum(r["num_tokens"] for r in rs),
                "tokens_per_s": tps, "vs_dense": tps / dense_tps if dense_tps else None,
                "per_prompt_ratio_median": statistics.median(ratios) if ratios else None,
                "tokens_per_full_verification": sum(r["num_tokens"] for r in rs) / steps if steps else None,
                "verify_ms_per_step": 1e3 * sum(r["verify_time_s"] for r in rs) / steps if steps else None,
                "full_level_acceptance": sum(r["num_accepted_tokens"] for r in rs) / drafts if drafts else None,
                "intermediate_acceptance": (sum(h["hier_intermediate_accepted"] for h in inter)
                                            / max(sum(h["hier_intermediate_drafts"] for h in inter), 1)) if inter else None,
                "intermediate_ms_per_pass": (1e3 * sum(h["hier_intermediate_time_s"] for h in inter)
                                             / max(sum(h["hier_intermediate_passes"] for h in inter), 1)) if inter else None,
                "same_as_dense": f"{sum(same)}/{len(same)}",
                "agreement_with_dense": statistics.mean(agree) if agree else None,
            })
    return rows


def _agreement(tokens: list[int], dense: list[int]) -> float:
    """Share of the dense output reproduced before the first differing token."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, dense)) if a != b), min(len(tokens), len(dense)))
    return same / max(len(dense), 1)


def markdown(rows: list[dict]) -> str:
    cols = ["context", "mode", "prompts", "tokens", "tokens_per_s", "vs_dense", "per_prompt_ratio_median",
            "tokens_per_full_verification", "verify_ms_per_step", "intermediate_ms_per_pass",
            "intermediate_acceptance", "full_level_acceptance", "same_as_dense", "agreement_with_dense"]
    fmt = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_report(record: dict, base: Path) -> str:
    record["summary"] = summarize(record["runs"], [*record["args"]["modes"], *EVICT_MODES.values(), "autoregressive",
                                                   "vllm-draft_model"])
    base.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    table = markdown(record["summary"])
    base.with_suffix(".md").write_text(
        f"# lossless sparse verification: {Path(record['target']).name}, drafter {record['args']['drafter']}\n\n"
        f"`{record['command']}`\n\nhardware: {record['hardware']}\n\nbinding: {record['env']}\n\n"
        f"versions: {record['versions']}\n\nengine speculative_configs: `{json.dumps(record.get('specs') or record.get('spec'))}`\n\n"
        "Decode tokens/s per request (output tokens after the first over the time from the first to "
        "the last, from vLLM's request stats: prefill excluded); the speculative modes in one engine, "
        "interleaved per prompt; each other method in an engine of its own after it. 'vs dense' = the mode's "
        "decode tokens over its decode seconds / the same for dense; 'per prompt ratio' = median over "
        "prompts. 'tokens per full verification' = output "
        "tokens / full (vLLM) verify steps. 'same as dense' = prompts whose output equals the dense "
        "mode's token for token; 'agreement' = share of the dense output reproduced before the first "
        "differing token (bf16: near-ties flip between batch shapes even for vLLM's own paths, so "
        f"compare with the autoregressive engine's agreement; losslessness is tested in fp32).\n\n{table}\n")
    return table


def counter_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Numeric counters of `after` less `before` (cumulative engine counters, per run)."""
    return {k: (v - before.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in after.items()}


def engine_sections(args) -> list[tuple[str, dict[str, Any]]]:
    """(name, start_engine keywords) of each engine the run starts, in order; each engine runs its
    modes (`section_modes`) on every prompt."""
    out = []
    if args.modes:
        out.append(("sparsever", {}))
    if not args.no_autoregressive:
        out.append(("autoregressive", {"speculative": False}))
    if args.vllm_draft_model:
        out.append(("vllm-draft_model", {"vllm_draft_model": args.vllm_draft_model}))
    for drafter in args.evict or ():
        out.append((EVICT_MODES[drafter], {"evict": drafter}))
    return out


def section_modes(args, section: str) -> list[str]:
    return list(args.modes) if section == "sparsever" else [section]


def _wanted(title: str, wanted: list[str]) -> bool:
    return any(w.lower() in title.lower() for w in wanted)


def check_documents(args: argparse.Namespace) -> None:
    """--documents: each names a document of the data set (before any engine starts)."""
    from vllm_sparsever.data import load_prompts

    titles = [row["title"] for row in load_prompts("long_context")]
    missing = [w for w in args.documents or [] if not any(_wanted(t, [w]) for t in titles)]
    if missing:
        raise SystemExit(f"--documents: no document's title contains {missing}; titles: {titles}")
    if args.documents:
        args.num_prompts = sum(_wanted(t, args.documents) for t in titles)


def documents(args: argparse.Namespace, target: str, ctx: int) -> list[dict[str, Any]]:
    """The context's prompts: the data set's first --num-prompts documents, or --documents."""
    from vllm_sparsever.data.long_context import long_context_prompts

    if not args.documents:
        return long_context_prompts(target, ctx, task=args.task, n=args.num_prompts)
    return [row for row in long_context_prompts(target, ctx, task=args.task) if _wanted(row["title"], args.documents)]


def questions(row: dict[str, Any], follow_ups: int, tokenizer: Any) -> list[tuple[str, str, int]]:
    """(id, prompt, prompt tokens) of a long-context row's prompt and `follow_ups` more questions on
    its document."""
    from vllm_sparsever.data.long_context import count_tokens

    out = [(row["id"], row["prompt"], row["num_tokens"])]
    if follow_ups:
        if not row["prompt"].endswith(SUMMARY_ASK):
            raise SystemExit(f"--follow-ups: {row['id']} is not a summarize prompt (use --task summarize)")
        document = row["prompt"][: -len(SUMMARY_ASK)]
        for k in range(follow_ups):
            text = document + FOLLOW_UPS[k]
            out.append((f"{row['id']}/follow-up-{k + 1}", text, count_tokens(text, tokenizer)))
    return out


def run_engine(args, target: str, max_len: int, section: str, engine_kwargs: dict[str, Any], record: dict,
               partial: Path) -> None:
    """Start one engine, run its modes on every prompt of every context (interleaved per prompt, the
    order alternating), each prompt after an untimed warm-up on it (the prompt prefilled into the
    prefix cache; a few steps, so EVICT has measured steps as in a running server), then shut it
    down before the next engine starts."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_sparsever.compat.engine import shutdown_llm

    tokenizer = AutoTokenizer.from_pretrained(target)  # the follow-up questions' token counts
    llm, spec = start_engine(args, target, max_len, **engine_kwargs)
    record["specs"][section] = spec
    modes = section_modes(args, section)
    try:
        total = len(args.contexts) * args.num_prompts * (1 + args.follow_ups) * len(modes)
        with tqdm(total=total, desc=section, unit="run") as bar:
            for ctx in args.contexts:
                for p, row in enumerate(documents(args, target, ctx)):
                    asked = questions(row, args.follow_ups, tokenizer)
                    bar.set_postfix_str(f"{ctx} prompt {p} warm-up")
                    if section == "sparsever":
                        set_mode(llm, args, modes[0])
                    llm.chat([[{"role": "user", "content": asked[0][1]}]],
                             SamplingParams(temperature=0.0, max_tokens=args.warm_up_tokens), use_tqdm=False)
                    for q, (prompt_id, text, prompt_tokens) in enumerate(asked):
                        for mode in (modes if (p + q) % 2 == 0 else list(reversed(modes))):
                            bar.set_postfix_str(f"{ctx} prompt {p}.{q} {mode}")
                            run = run_one(llm, args, mode, [{"role": "user", "content": text}])
                            run.update(context=ctx, prompt=prompt_id, prompt_tokens=prompt_tokens)
                            record["runs"].append(run)
                            partial.write_text(json.dumps(record, default=str))
                            bar.update()
    finally:
        shutdown_llm(llm)  # no engine left running (or spinning) beside the next one
        del llm
        import gc

        gc.collect()


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--from-json":
        path = Path(sys.argv[2])
        print(write_report(json.loads(path.read_text()), path.with_suffix("")))
        return 0
    args = parse_args(argv)
    if args.evict == []:  # bare --evict: over the run's drafter
        args.evict = [args.drafter]
    check_documents(args)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # A long prompt's prefill chunk can outlast vLLM's 300-s step timeout on a CPU without AVX-512
    # (bench/results/long_context_avx2_bf16_attempt_20261128.md).
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.models.limits import model_max_len

    target = resolve_model(args.target)
    max_pos = model_max_len(target) or 32768
    fit = max_pos - args.max_tokens - 64
    args.contexts = list(dict.fromkeys(min(c, fit) for c in args.contexts))
    max_len = min(max_pos, max(args.contexts) + args.max_tokens + 64)
    started = dt.datetime.now(dt.timezone.utc)
    tag = args.tag or Path(target).name
    base = RESULTS / f"lossless_sparse_{tag}_{started.strftime('%Y%m%d-%H%M')}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]), "target": target, "args": vars(args),
        "started": started.isoformat(), "hardware": hardware(), "env": binding_env(), "versions": versions(),
        "runs": [], "specs": {},
    }
    partial = base.with_suffix(".partial.json")
    for section, engine_kwargs in engine_sections(args):
        run_engine(args, target, max_len, section, engine_kwargs, record, partial)
    record["hardware_end"] = hardware()
    print(write_report(record, base))
    partial.unlink(missing_ok=True)
    print(f"results: {base}.md / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
