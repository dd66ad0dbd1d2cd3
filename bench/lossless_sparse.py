"""Lossless speed-up at long context: do EVICT over a lean draft and the lossless sparse hierarchy beat
plain decoding, vLLM's fixed chains and sparsever's kernels alone at 8K and 32K, and what does the
approximate mode (sparse attention verifying at the full level) add? Runs through bench/harness.py,
once per context: long documents cut to the context with a question on each, batch 1, decode tokens/s
(each request's first to last output token: prefill left out), every candidate its own engine. Each
prompt is prefilled once and its KV blocks loaded by every engine (the harness's --kv-snapshot).

    python bench/lossless_sparse.py                                   # 8K and 32K, the default candidates
    python bench/lossless_sparse.py --contexts 8192 --methods evict-tree-vocab-window-w8a8 sparse-hier
    python bench/lossless_sparse.py --drafter ngram --methods dense sparse-hier sparse-approx evict-ngram
    python bench/lossless_sparse.py --dry-run                         # the harness command lines only

The drafter of the hierarchy modes (--drafter) is also the harness's fixed chains: vLLM's `draft_model`
over --draft, or `ngram`. Candidates:
- `dense`: that drafter proposing --round-tokens drafts per step, dense verification; `dense-vllm-kernel`
  the same on vLLM's attention kernel (the kernel's end-to-end share);
- `sparse-hier`: hierarchical verification, the sparse target (block-sparse attention) as the
  intermediate level, the full level dense: the lossless sparse hierarchy;
- `sparse-approx`: the same sparse attention verifying at the full level (approximate: the text changes);
- EVICT chains (`evict-chain*`; up to --cap drafts, dense verification) or trees (`evict-tree*`: tree.enabled,
  its default shape, at most --cap nodes) over the draft model, `-vocab`: over --draft-vocab token ids,
  `-window`: attending to --draft-window recent positions (`-window4096`: 4096), `-w8a8` / `-w4a16`: over
  --draft-w8a8 / --draft-w4a16 (int8 / int4 linears), `-hybrid`: every linear on linear_kernel "hybrid";
  `evict-ngram` over n-gram lookup. EVICT needs `vllm-sparsever profile-verify TARGET` first.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import preset  # noqa: E402

HIERARCHY_MODES = ("dense", "sparse-hier", "sparse-approx", "dense-vllm-kernel")
EVICT_MODES = ("evict-chain", "evict-chain-vocab", "evict-chain-vocab-window", "evict-ngram",
               "evict-chain-hybrid", "evict-chain-vocab-window-hybrid",
               "evict-chain-w8a8", "evict-chain-vocab-window-w8a8",
               "evict-chain-w4a16", "evict-chain-vocab-window-w4a16", "evict-chain-vocab-w4a16",
               "evict-chain-vocab-window4096-w4a16",
               "evict-tree-vocab-window", "evict-tree-vocab-window-w4a16", "evict-tree-vocab-window-w8a8")
DEFAULT_METHODS = ("dense", "sparse-hier", "sparse-approx", "evict-chain-vocab-window", "evict-tree-vocab-window")
OUTPUT_MARGIN = 64  # max_model_len beyond context + max_tokens


def candidates(a: argparse.Namespace) -> dict[str, dict]:
    """Every mode by the name it has had in the results (draft models by their --draft* names)."""
    if a.drafter == "ngram":
        drafter = {"draft_source": "ngram", "prompt_lookup_min": a.prompt_lookup_min,
                   "prompt_lookup_max": a.prompt_lookup_max}
    else:
        drafter = {"draft_source": "draft_model", "model": a.draft}
    sparse = {"enabled": True, "top_k_blocks": a.top_k_blocks, "min_context_len": a.min_context_len}
    dense = {"method": "sparsever", **drafter, "num_speculative_tokens": a.round_tokens}
    out = {
        "dense": dense,
        "sparse-hier": {"method": "sparsever", **drafter, "num_speculative_tokens": a.cap, "attention": sparse,
                        "early_exit": {"enabled": True, "intermediate": "sparse", "round_tokens": a.round_tokens,
                                       "full_verify_every": a.full_verify_every}},
        "sparse-approx": {**dense, "attention": sparse},
        "dense-vllm-kernel": {**dense, "attention": {"enabled": False, "dense_kernel": "vllm"}},
    }
    for name in EVICT_MODES:
        out[name] = evict_spec(a, name)
    for spec in out.values():
        if a.linear_kernel and "linear_kernel" not in spec:
            spec["linear_kernel"] = a.linear_kernel
    return out


def evict_spec(a: argparse.Namespace, name: str) -> dict:
    """An EVICT mode's config, read off its name."""
    spec: dict = {"method": "sparsever", "num_speculative_tokens": a.cap, "adaptive": {"enabled": True}}
    if name == "evict-ngram":
        return {**spec, "draft_source": "ngram", "prompt_lookup_min": a.prompt_lookup_min,
                "prompt_lookup_max": a.prompt_lookup_max}
    spec["model"] = a.draft_w8a8 if name.endswith("-w8a8") else a.draft_w4a16 if name.endswith("-w4a16") else a.draft
    if "-vocab" in name:
        spec["draft_vocab"] = a.draft_vocab
    if "-window" in name:
        width = re.search(r"window(\d+)", name)
        spec["draft_attention_window"] = int(width.group(1)) if width else a.draft_window
    if name.startswith("evict-tree"):
        spec["tree"] = {"enabled": True}
    if name.endswith("-hybrid"):
        spec["linear_kernel"] = "hybrid"
    return spec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", choices=["draft_model", "ngram"], default="draft_model",
                   help="the hierarchy modes' drafter and the harness's fixed chains")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft-w8a8", default="qwen2.5-coder-0.5b-w8a8", help="the draft of the *-w8a8 modes")
    p.add_argument("--draft-w4a16", default="qwen2.5-coder-0.5b-w4a16", help="the draft of the *-w4a16 modes")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768],
                   help="prompt tokens, one harness run each (cut to what leaves room for the output)")
    p.add_argument("--ks", type=int, nargs="+", help="vLLM's chain lengths (default: the harness's, 1..5)")
    p.add_argument("--cap", type=int, default=8, help="EVICT's cap, and the hierarchy's pending tokens")
    p.add_argument("--round-tokens", type=int, default=3)
    p.add_argument("--full-verify-every", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--top-k-blocks", type=int, default=8)
    p.add_argument("--min-context-len", type=int, default=2048)
    p.add_argument("--draft-vocab", type=int, default=32768, help="draft_vocab of the *-vocab modes")
    p.add_argument("--draft-window", type=int, default=1024, help="draft_attention_window of the *-window modes")
    p.add_argument("--linear-kernel", choices=["auto", "sparsever", "hybrid", "vllm", "vllm-padded"],
                   help="linear_kernel of every sparsever candidate (default: the config's; -hybrid modes: hybrid)")
    p.add_argument("--kv-snapshot", type=Path, metavar="DIR",
                   help="where the harness keeps each prompt's KV blocks, prefilled once and loaded by every "
                        "engine (default: kv-snapshots/ under $VLLM_SPARSEVER_HOME)")
    p.add_argument("--prefill-per-engine", action="store_true",
                   help="no snapshot: every engine prefills each prompt itself (its time is not timed either way)")
    p.add_argument("--tag", help="name part of the result files (default: the target's name)")
    preset.add_run_flags(p, num_prompts=3, max_tokens=64, max_model_len=None,
                         default_methods=" ".join(DEFAULT_METHODS))
    args = p.parse_args(argv)
    args.methods = args.methods or list(DEFAULT_METHODS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.models.limits import model_max_len

    chosen = preset.pick(candidates(args), args.methods)
    flag_of = {args.draft_w8a8: "--draft-w8a8", args.draft_w4a16: "--draft-w4a16"}
    for spec in chosen.values():  # a folder for every draft the chosen modes run (the harness's --draft: its own)
        if "model" in spec:
            spec["model"] = resolve_model(spec["model"], flag_of.get(spec["model"], "--draft"))
    max_position = model_max_len(resolve_model(args.target, "--target")) or 32768
    fit = max_position - args.max_tokens - OUTPUT_MARGIN
    tag = f"lossless_sparse-{args.tag or Path(args.target).name}"
    draft = ["--draft", args.draft] if args.drafter == "draft_model" else []
    if args.prefill_per_engine:
        snapshot = []
    else:
        from vllm_sparsever.store.paths import sparsever_home

        snapshot = ["--kv-snapshot", str(args.kv_snapshot or sparsever_home() / "kv-snapshots")]
    argvs = []
    for ctx in dict.fromkeys(min(c, fit) for c in args.contexts):
        argvs.append(["--target", args.target, *draft, "--long-context", str(ctx), "--metric", "decode", "--ignore-eos",
                      "--max-model-len", str(min(max_position, ctx + args.max_tokens + OUTPUT_MARGIN)),
                      "--num-prompts", str(args.num_prompts), "--tag", f"{tag}-{round(ctx / 1024)}k", *snapshot,
                      *preset.run_flags(args), *preset.method_flags("--candidate", chosen)])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of K/V cache: a 32K prompt's, target and draft
    # A long prompt's prefill chunk can outlast vLLM's 300-s step timeout on a CPU without AVX-512
    # (bench/results/long_context_avx2_bf16_attempt_20261128.md).
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
    return preset.run(argvs, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
