"""EVICT (chains and trees that choose their own depth per step) against the best fixed chain: is it at
least as fast as plain decoding, vLLM's best k and sparsever's kernels alone? Runs through
bench/harness.py, once per batch size, on chat and code prompts (mt_bench, humaneval).

    python bench/evict.py                                  # Qwen pair at batch 1 and 8
    python bench/evict.py --batch-sizes 1 --draft-vocab 32768 --methods sparsever-evict-chain-vocab32768
    python bench/evict.py --moe                            # the MoE target, batch 1
    python bench/evict.py --drafting-path                  # vLLM's proposer vs sparsever's drafter
    python bench/evict.py --dry-run                        # the harness command lines only

Qwen pair (target + same-family draft): vLLM's `draft_model` chains at --ks are the fixed baseline;
candidates EVICT chains and trees over the draft (with --draft-vocab N, also over N token ids). --moe
(no same-family draft): vLLM's `ngram` chains; candidate EVICT n-gram chains. --drafting-path: the same k
drafts per step through vLLM's draft_model proposer and through sparsever's drafter (the harness's worker
counters hold each one's draft time). Needs `vllm-sparsever profile-verify TARGET` first (`--quick` is
enough). The summary: `python bench/summaries.py evict qwen.batch_1=RUN qwen.batch_8=RUN moe.batch_1=RUN`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import preset  # noqa: E402

MOE_TARGET = "smollm2-135m-moe"


def qwen_candidates(a: argparse.Namespace) -> dict[str, dict]:
    tree = {"enabled": True, "branching": a.tree_branching, "expand": a.tree_expand, "depth": a.tree_depth}
    chain = {"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": a.evict_chain_k,
             "adaptive": {"enabled": True}}
    trees = {"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": a.tree_nodes, "tree": tree,
             "adaptive": {"enabled": True}}
    out = {"sparsever-evict-chain": chain, "sparsever-evict-tree": trees}
    for n in a.draft_vocab:  # the draft model drafting over its N most frequent token ids
        out[f"sparsever-evict-chain-vocab{n}"] = {**chain, "draft_vocab": n}
        out[f"sparsever-evict-tree-vocab{n}"] = {**trees, "draft_vocab": n}
    return out


def moe_candidates(a: argparse.Namespace) -> dict[str, dict]:
    return {"sparsever-ngram-evict": {"method": "sparsever", "draft_source": "ngram", "prompt_lookup_max": 4,
                                      "prompt_lookup_min": 2, "num_speculative_tokens": a.evict_chain_k,
                                      "adaptive": {"enabled": True}}}


def drafting_path_candidates(a: argparse.Namespace) -> dict[str, dict]:
    """k drafts per step from vLLM's draft_model proposer (sparsever's runner times it) and from
    sparsever's drafter (EVICT drafting to the cap: no truncation, no guard)."""
    k = a.drafting_path_k
    fixed = {"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": k}
    return {"vllm-proposer": fixed,
            "sparsever-drafter": {**fixed, "adaptive": {"enabled": True, "depth": "cap", "guard": False,
                                                        "min_draft_tokens": k}}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--moe", nargs="?", const=MOE_TARGET, metavar="TARGET",
                   help=f"the MoE target (default {MOE_TARGET}) with n-gram drafting instead of the Qwen pair")
    p.add_argument("--drafting-path", action="store_true",
                   help="the drafting-path comparison (Qwen pair) instead of the EVICT candidates")
    p.add_argument("--drafting-path-k", type=int, default=3)
    p.add_argument("--batch-sizes", type=int, nargs="+", help="one harness run each (default: Qwen 1 8, else 1)")
    p.add_argument("--categories", nargs="+", default=["mt_bench", "humaneval"], help="chat and code prompts")
    p.add_argument("--ks", type=int, nargs="+", help="vLLM's chain lengths (default: the harness's, 1..5)")
    p.add_argument("--evict-chain-k", type=int, default=6, help="EVICT chains: the cap")
    p.add_argument("--tree-nodes", type=int, default=12)
    p.add_argument("--tree-branching", type=int, default=3)
    p.add_argument("--tree-expand", type=int, default=3)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--draft-vocab", type=int, nargs="*", default=[], metavar="N",
                   help="also the EVICT chain and tree with the draft model's draft_vocab N")
    p.add_argument("--tag", help="name part of the result files (default: qwen, moe)")
    preset.add_run_flags(p, num_prompts=3, max_tokens=64, max_model_len=4096)
    args = p.parse_args(argv)
    if args.moe and (args.drafting_path or args.draft_vocab):
        p.error("--moe has no draft model: no --drafting-path or --draft-vocab")
    if args.batch_sizes is None:
        args.batch_sizes = [1] if args.moe or args.drafting_path else [1, 8]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.moe:
        target, draft, found = args.moe, [], moe_candidates(args)
    else:
        target, draft = args.target, ["--draft", args.draft]
        found = drafting_path_candidates(args) if args.drafting_path else qwen_candidates(args)
    chosen = preset.pick(found, args.methods)
    tag = "evict-" + (args.tag or ("moe" if args.moe else "qwen")) + ("-drafting-path" if args.drafting_path else "")
    argvs = []
    for batch in args.batch_sizes:
        prompts = max(batch, args.num_prompts)  # per category: enough to fill a batch
        argvs.append(["--target", target, *draft, "--batch-size", str(batch), "--num-prompts", str(prompts),
                      "--categories", *args.categories, "--tag", f"{tag}-b{batch}", *preset.run_flags(args),
                      *preset.method_flags("--candidate", chosen)])
    return preset.run(argvs, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
