"""Every sparsever mode on short prompts: which is fastest here, against plain decoding, vLLM's fixed
chains and sparsever's kernels alone? Runs through bench/harness.py, once per batch size: the harness's
three baselines (plain vLLM; vLLM's `draft_model` chains at --ks over --draft; sparsever with drafting
off) and the modes below as candidates, interleaved in rounds.

    python bench/spec_decode.py                              # Qwen pair, batch 1, every mode
    python bench/spec_decode.py --quick --methods sparsever-evict-chain sparsever-ngram-evict
    python bench/spec_decode.py --target smollm2-135m-moe --draft smollm2-135m --tag moe
    python bench/spec_decode.py --dry-run                    # the harness command lines only

Self-drafting and hierarchical modes need the target's exit heads (`vllm-sparsever train-exits`), EVICT
modes its cost profile (`vllm-sparsever profile-verify TARGET`). Long prompts: bench/lossless_sparse.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import preset  # noqa: E402

SHORT_CATEGORIES = ("mt_bench", "humaneval", "gsm8k", "truthfulqa", "summarization", "qa")
NGRAM = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}


def candidates(a: argparse.Namespace) -> dict[str, dict]:
    """Every sparsever mode, by the name it has had in the results (DRAFT: --draft)."""
    tree = {"enabled": True, "branching": a.tree_branching, "expand": a.tree_expand, "depth": a.tree_depth}
    layer = {"draft_layer": a.draft_layer} if a.draft_layer else {}  # None: the shallowest trained head
    self_draft = {"draft_confidence": a.draft_confidence, **layer}
    verify = {"verify_layer": a.verify_layer} if a.verify_layer else {}  # None: the deepest trained head
    hierarchy = {"enabled": True, "round_tokens": a.k, "full_verify_every": a.full_verify_every, **verify}
    sv, ngram, early = {"method": "sparsever"}, {"draft_source": "ngram", **NGRAM}, {"draft_source": "early_exit"}
    return {
        # Dense verification in sparsever's worker: the overhead it adds.
        "sparsever-dense": {**sv, "model": "DRAFT", "num_speculative_tokens": a.k},
        "sparsever-ngram": {**sv, **ngram, "num_speculative_tokens": a.k},
        "sparsever-ngram-k5": {**sv, **ngram, "num_speculative_tokens": 5},
        # Self-drafting: the target's first layers + a trained exit head; -trim: over --draft-vocab tokens.
        "sparsever-self-draft": {**sv, **early, "num_speculative_tokens": a.k, "early_exit": self_draft},
        "sparsever-self-draft-k5": {**sv, **early, "num_speculative_tokens": 5, "early_exit": self_draft},
        "sparsever-self-draft-trim": {**sv, **early, "num_speculative_tokens": a.k,
                                      "early_exit": {**self_draft, "draft_vocab": a.draft_vocab}},
        # Hierarchical: rounds of k drafts checked by the target's first layers, the full target verifying
        # up to --hier-cap pending tokens; -reuse starts the full pass from the intermediate states.
        "sparsever-hierarchical": {**sv, **early, "num_speculative_tokens": a.hier_cap,
                                   "early_exit": {**self_draft, **hierarchy}},
        "sparsever-hierarchical-reuse": {**sv, **early, "num_speculative_tokens": a.hier_cap,
                                         "early_exit": {**self_draft, **hierarchy, "reuse_hidden_states": True}},
        # The draft model drafting under the early-exit verifier (HiSpec's draft -> early layers -> target).
        "sparsever-draft-hierarchical": {**sv, "model": "DRAFT", "num_speculative_tokens": a.hier_cap,
                                         "early_exit": hierarchy},
        # Trees (EAGLE-2 growth, --tree-nodes nodes) and EVICT, which cuts trees and chains per step.
        "sparsever-tree": {**sv, "model": "DRAFT", "num_speculative_tokens": a.tree_nodes, "tree": tree},
        "sparsever-evict-tree": {**sv, "model": "DRAFT", "num_speculative_tokens": a.tree_nodes, "tree": tree,
                                 "adaptive": True},
        "sparsever-evict-chain": {**sv, "model": "DRAFT", "num_speculative_tokens": a.evict_chain_k,
                                  "adaptive": True},
        "sparsever-ngram-evict": {**sv, **ngram, "num_speculative_tokens": a.evict_chain_k, "adaptive": True},
        "sparsever-self-tree": {**sv, **early, "num_speculative_tokens": a.tree_nodes, "tree": tree,
                                "early_exit": layer},
        "sparsever-self-evict-chain": {**sv, **early, "num_speculative_tokens": a.evict_chain_k, "adaptive": True,
                                       "early_exit": layer},
        "sparsever-self-evict-tree": {**sv, **early, "num_speculative_tokens": a.tree_nodes, "tree": tree,
                                      "adaptive": True, "early_exit": layer},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="built model name or folder")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model: DRAFT and vLLM's chains")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="one harness run each")
    p.add_argument("--categories", nargs="+", default=list(SHORT_CATEGORIES))
    p.add_argument("--ks", type=int, nargs="+", help="vLLM's chain lengths (default: the harness's, 1..5)")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens (hierarchical: drafts per round)")
    p.add_argument("--draft-layer", type=int, help="self-drafting exit layer (default: the shallowest trained head)")
    p.add_argument("--draft-confidence", type=float, default=0.0,
                   help="self-drafting: stop a request's draft below this head probability")
    p.add_argument("--draft-vocab", type=int, default=4096, help="sparsever-self-draft-trim: draft vocabulary")
    p.add_argument("--verify-layer", type=int,
                   help="hierarchical: intermediate verifier exit layer (default: the deepest trained head)")
    p.add_argument("--hier-cap", type=int, default=8, help="hierarchical: pending tokens per full verification")
    p.add_argument("--full-verify-every", type=int, default=3, help="hierarchical: rounds per full verification")
    p.add_argument("--tree-nodes", type=int, default=12, help="trees: node budget (num_speculative_tokens)")
    p.add_argument("--tree-branching", type=int, default=3)
    p.add_argument("--tree-expand", type=int, default=3)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--evict-chain-k", type=int, default=6, help="EVICT chains: the longest chain")
    p.add_argument("--tag", help="name part of the result files (default: the target's name)")
    preset.add_run_flags(p, num_prompts=4, max_tokens=96, max_model_len=4096)
    args = p.parse_args(argv)
    if args.quick:  # a few minutes: 1 prompt x 3 categories, 48 tokens
        args.num_prompts, args.categories, args.max_tokens = 1, ["mt_bench", "humaneval", "gsm8k"], 48
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = preset.pick(candidates(args), args.methods)
    tag = f"spec_decode-{args.tag or Path(args.target).name}"
    argvs = []
    for batch in args.batch_sizes:
        prompts = max(batch, args.num_prompts)  # per category: enough to fill a batch
        argvs.append(["--target", args.target, "--draft", args.draft, "--batch-size", str(batch),
                      "--num-prompts", str(prompts), "--categories", *args.categories, "--tag", f"{tag}-b{batch}",
                      *preset.run_flags(args), *preset.method_flags("--candidate", chosen)])
    return preset.run(argvs, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
