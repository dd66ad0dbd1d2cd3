"""Quality of MoEfied SmolLM2-135M against the dense model, for several (E, top-k).

    python -m vllm_sparsever.models.moefication_eval --out bench/results/moefication_<date>.json

Measures (fp32, PyTorch reference MoE with Mixtral routing semantics):
- held-out perplexity (Lee test news + second half of the Wikipedia dump; calibration never sees them);
- teacher-forced top-1 agreement with the dense model on the same held-out tokens;
- greedy generation agreement on MT-Bench first turns (chat template): exact-match rate and the
  mean fraction of tokens generated before the first divergence;
- the router's held-out top-k recall (how often it picks the experts with the largest output norm).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

from vllm_sparsever.models import moefication as moe


def _agreement(dense_logits_argmax: torch.Tensor, model, ids: torch.Tensor, batch: int = 4) -> float:
    same, total = 0, 0
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch):
            pred = model(input_ids=ids[start : start + batch]).logits.argmax(-1)
            same += (pred == dense_logits_argmax[start : start + batch]).sum().item()
            total += pred.numel()
    return same / total


def _argmax_all(model, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[s : s + batch]).logits.argmax(-1) for s in range(0, ids.shape[0], batch)])


def _generate(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            gen = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def _generation_agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict:
    exact, prefix_fracs = 0, []
    for ref, cand in zip(reference, candidate):
        n = 0
        while n < min(len(ref), len(cand)) and ref[n] == cand[n]:
            n += 1
        exact += int(ref == cand)
        prefix_fracs.append(n / max(len(ref), 1))
    return {"exact_match": exact / len(reference), "mean_prefix_fraction": sum(prefix_fracs) / len(prefix_fracs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="dense model folder (default: the built smollm2-135m)")
    parser.add_argument("--configs", default="8:8:0,8:2:0,8:2:128,8:4:128,8:4:256,16:4:128", help="E:k:shared triples")
    parser.add_argument("--heldout-sequences", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from vllm_sparsever.data import builders
    from vllm_sparsever.models import model_path

    base = Path(args.base) if args.base else model_path("smollm2-135m")
    cfg0 = moe.MoEficationConfig()
    model, tokenizer = moe.load_dense(base)
    calib = moe.pack_sequences(tokenizer, moe.calibration_texts(), cfg0.calib_seq_len, cfg0.calib_sequences, cfg0.seed)
    heldout = moe.pack_sequences(tokenizer, moe.heldout_texts(), 512, args.heldout_sequences, seed=1)
    prompts = [r["prompt"] for r in builders.build_mt_bench()][: args.prompts]

    t0 = time.perf_counter()
    dense_ppl = moe.perplexity(model, heldout)
    dense_argmax = _argmax_all(model, heldout)
    dense_gen = _generate(model, tokenizer, prompts, args.max_new_tokens)
    inputs = moe.capture_ffn_inputs(model, calib)
    results = {
        "dense": {"perplexity": dense_ppl},
        "configs": [],
    }
    print(f"dense ppl {dense_ppl:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    for pair in args.configs.split(","):
        num_experts, top_k, shared = (int(v) for v in (pair.split(":") + ["0"])[:3])
        cfg = moe.MoEficationConfig(num_experts=num_experts, top_k=top_k, shared_neurons=shared)
        start = time.perf_counter()
        layers = [
            moe.moefy_layer(layer.mlp, inputs[i], cfg, cfg.seed * 1000 + i) for i, layer in enumerate(model.model.layers)
        ]
        build_s = time.perf_counter() - start
        moe_model = copy.deepcopy(model)
        moe.patch_model_with_moe(moe_model, layers, top_k)
        row = {
            "num_experts": num_experts,
            "top_k": top_k,
            "shared_neurons": shared,
            # neurons computed per token (shared ones once; vLLM computes them in each of the k experts)
            "active_ffn_fraction": (shared + top_k * (model.config.intermediate_size - shared) / num_experts)
            / model.config.intermediate_size,
            "perplexity": moe.perplexity(moe_model, heldout),
            "top1_agreement_teacher_forced": _agreement(dense_argmax, moe_model, heldout),
            "greedy_generation": _generation_agreement(dense_gen, _generate(moe_model, tokenizer, prompts, args.max_new_tokens))
            if prompts
            else None,
            "router_topk_recall_heldout_mean": sum(m.router_recall for m in layers) / len(layers),
            "moefy_seconds": round(build_s, 1),
        }
        row["perplexity_ratio"] = row["perplexity"] / dense_ppl
        results["configs"].append(row)
        print(json.dumps(row), flush=True)
        del moe_model

    report = {
        "benchmark": "moefication_quality",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "vllm_sparsever.models.moefication_eval", *(argv or sys.argv[1:])]),
        "hardware": {"machine": platform.machine(), "processor": platform.processor(), "threads": args.threads},
        "base_model": str(base),
        "heldout_tokens": int(heldout.numel()),
        "calibration_tokens": int(calib.numel()),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": "float32",
        "moefication_defaults": {k: v for k, v in vars(cfg0).items() if k not in ("num_experts", "top_k")},
        **results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n| E | top-k | shared | active FFN | ppl (dense %.2f) | ppl ratio | top-1 agree | greedy exact | greedy prefix | router recall |" % dense_ppl)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["configs"]:
        g = r["greedy_generation"] or {"exact_match": float("nan"), "mean_prefix_fraction": float("nan")}
        print(
            f"| {r['num_experts']} | {r['top_k']} | {r['shared_neurons']} | {r['active_ffn_fraction']:.0%} | {r['perplexity']:.2f} | "
            f"{r['perplexity_ratio']:.3f} | {r['top1_agreement_teacher_forced']:.3f} | {g['exact_match']:.2f} | "
            f"{g['mean_prefix_fraction']:.2f} | {r['router_topk_recall_heldout_mean']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
