"""sparsever over an EAGLE-3 head against vLLM's own `eagle3` over the same head: do sparsever's chains,
EVICT chains and EVICT trees from the head beat vLLM's best k? Runs through bench/harness.py, once per
batch size, on chat and code prompts (mt_bench, humaneval): plain vLLM, sparsever's kernels alone, vLLM
`eagle3` at --eagle-ks and vLLM's `draft_model` over --draft at --draft-k (the fixed chains, given to the
harness with --fixed) and the candidates below.

    vllm-sparsever train-eagle qwen2.5-coder-1.5b                 # the head (<target>/eagle3_head)
    vllm-sparsever profile-verify qwen2.5-coder-1.5b --quick      # EVICT's cost profile
    python bench/drafters.py                                      # batch 1 and 8
    python bench/drafters.py --batch-sizes 1 --rounds 2 --methods sparsever-eagle3-evict
    python bench/drafters.py --dry-run                            # the harness command lines only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import preset  # noqa: E402


def vllm_chains(head: str, ks: list[int], draft_k: int) -> dict[str, dict]:
    """vLLM's eagle3 over the head at each k, and its draft_model chain over the harness's --draft (DRAFT)."""
    out = {f"vllm-eagle3-k{k}": {"method": "eagle3", "model": head, "num_speculative_tokens": k} for k in ks}
    if draft_k:
        out[f"vllm-draft_model-k{draft_k}"] = {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": draft_k}
    return out


def candidates(a: argparse.Namespace, head: str) -> dict[str, dict]:
    over_head = {"method": "sparsever", "draft_source": "eagle3", "model": head}
    out = {f"sparsever-eagle3-k{k}": {**over_head, "num_speculative_tokens": k} for k in a.sparsever_ks}
    evict = {**over_head, "num_speculative_tokens": a.evict_k, "adaptive": {"enabled": True}}
    out["sparsever-eagle3-evict"] = evict
    out["sparsever-eagle3-evict-tree"] = {**evict, "tree": {"enabled": True}}  # EAGLE-2 style, cut by EVICT
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--head", help="EAGLE-3 head folder (default: <target>/eagle3_head)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="one harness run each")
    p.add_argument("--categories", nargs="+", default=["mt_bench", "humaneval"], help="chat and code prompts")
    p.add_argument("--eagle-ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="vLLM eagle3's chain lengths")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of vLLM's draft_model chain")
    p.add_argument("--draft-k", type=int, default=3, help="vLLM draft_model's chain length (0: no such chain)")
    p.add_argument("--sparsever-ks", type=int, nargs="+", default=[3, 5], help="sparsever's fixed chains over the head")
    p.add_argument("--evict-k", type=int, default=6, help="EVICT chains and trees: the cap")
    p.add_argument("--tag", default="qwen")
    preset.add_run_flags(p, num_prompts=3, max_tokens=64, max_model_len=4096)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    head = args.head
    if head is None:
        from vllm_sparsever.cli import resolve_model
        from vllm_sparsever.offline.train_eagle import head_dir

        head = str(head_dir(resolve_model(args.target, "--target")))
    if not args.dry_run and not Path(head).is_dir():  # else vLLM fails minutes in, at the first head engine
        raise SystemExit(f"no EAGLE-3 head at {head}: `vllm-sparsever train-eagle {args.target}`, or --head")
    chosen = preset.pick(candidates(args, head), args.methods)
    argvs = []
    for batch in args.batch_sizes:
        prompts = max(batch, args.num_prompts)  # per category: enough to fill a batch
        draft = ["--draft", args.draft] if args.draft_k else []
        argvs.append(["--target", args.target, *draft, "--batch-size", str(batch), "--num-prompts", str(prompts),
                      "--categories", *args.categories, "--tag", f"drafters-{args.tag}-b{batch}",
                      *preset.run_flags(args), *preset.method_flags("--fixed", vllm_chains(head, args.eagle_ks, args.draft_k)),
                      *preset.method_flags("--candidate", chosen)])
    return preset.run(argvs, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
