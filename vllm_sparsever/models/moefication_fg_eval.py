"""Fine-grained MoEfied SmolLM2-135M (Qwen2-MoE with a shared expert) against the dense model.

    python -m vllm_sparsever.models.moefication_fg_eval --out bench/results/moefication_fg_<date>.json

Per configuration E:k:S:dense-layers (e.g. `32:8:512:0`, dense layers joined by `+`, `-` for none), fp32,
PyTorch reference block with Qwen2-MoE routing (softmax top-k renormalised, shared expert always on):
- held-out perplexity and teacher-forced top-1 agreement with the dense model (Lee test news + second half
  of the Wikipedia dump, never seen in calibration);
- distinct routed experts touched by N = 1..16 consecutive held-out tokens (mean over MoE layers and every
  window position) next to independent routing E(1-(1-k/E)^N), and their ratio;
- the router's held-out top-k recall.
`--sensitivity E:k:S` first MoEfies one layer at a time (all others dense) and reports each layer's
perplexity increase on calibration-side text (not the held-out set): how the dense layers were chosen.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from vllm_sparsever.models import moefication as moe
from vllm_sparsever.models import moefication_fg as fg
from vllm_sparsever.models.moefication_eval import _agreement, _argmax_all

MAX_N = 16


def parse_config(text: str, default_smoothing: float) -> fg.FineGrainedConfig:
    """E:k:S[:dense[:smoothing]], dense layers joined by '+' ('-' = none)."""
    parts = text.split(":")
    e, k, s = (int(v) for v in parts[:3])
    dense = () if len(parts) < 4 or parts[3] in ("", "-") else tuple(int(v) for v in parts[3].split("+"))
    smoothing = float(parts[4]) if len(parts) > 4 else default_smoothing
    return fg.FineGrainedConfig(num_experts=e, top_k=k, shared_neurons=s, dense_layers=dense, router_smoothing=smoothing)


def run_config(model, inputs, cfg: fg.FineGrainedConfig, heldout, dense_ppl, dense_argmax) -> dict:
    start = time.perf_counter()
    layers = fg.moefy_layers(model, list(inputs), cfg)
    build_s = time.perf_counter() - start
    moe_model = copy.deepcopy(model)
    blocks = fg.patch_model(moe_model, layers, cfg.top_k)
    for b in blocks:
        b.record = []
    ppl = moe.perplexity(moe_model, heldout)
    curves = []
    for b in blocks:
        ids = torch.cat(b.record, 0)  # [B, L, k], batches in order
        curves.append(fg.distinct_experts_curve(ids, cfg.num_experts, MAX_N))
        b.record = None
    agree = _agreement(dense_argmax, moe_model, heldout)
    del moe_model
    real = [sum(c[n] for c in curves) / len(curves) for n in range(MAX_N)]
    indep = fg.independent_curve(cfg.num_experts, cfg.top_k, MAX_N)
    intermediate = model.config.intermediate_size
    n_layers = model.config.num_hidden_layers
    active = (cfg.shared_neurons + cfg.top_k * cfg.moe_intermediate_size(intermediate)) / intermediate
    return {
        "config": f"{cfg.num_experts}:{cfg.top_k}:{cfg.shared_neurons}:{'+'.join(map(str, cfg.dense_layers)) or '-'}"
                  f":{cfg.router_smoothing:g}",
        "router_smoothing": cfg.router_smoothing,
        "num_experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "shared_neurons": cfg.shared_neurons,
        "expert_width": cfg.moe_intermediate_size(intermediate),
        "dense_layers": list(cfg.dense_layers),
        "active_ffn_fraction_moe_layers": round(active, 4),
        "active_ffn_fraction_model": round((active * len(layers) + (n_layers - len(layers))) / n_layers, 4),
        "perplexity": ppl,
        "perplexity_ratio": ppl / dense_ppl,
        "top1_agreement_teacher_forced": agree,
        "router_topk_recall_heldout_mean": sum(m.router_recall for m in layers.values()) / len(layers),
        "distinct_experts": [round(v, 3) for v in real],
        "independent_experts": [round(v, 3) for v in indep],
        "ratio_to_independent": [round(r / i, 4) for r, i in zip(real, indep)],
        "moefy_seconds": round(build_s, 1),
    }


def sensitivity(model, inputs, cfg: fg.FineGrainedConfig, ids: torch.Tensor) -> list[dict]:
    """Perplexity on `ids` with only layer i MoEfied, for every layer."""
    base = moe.perplexity(model, ids)
    rows = []
    for i, layer in enumerate(model.model.layers):
        lm = fg.moefy_layer(layer.mlp, inputs[i], cfg, cfg.seed * 1000 + i)
        dense_mlp = layer.mlp
        layer.mlp = fg.FineGrainedMoEFFN(dense_mlp, lm, cfg.top_k)
        try:
            ppl = moe.perplexity(model, ids)
        finally:
            layer.mlp = dense_mlp
        rows.append({"layer": i, "perplexity": ppl, "increase": ppl - base, "router_recall": lm.router_recall})
        print(f"layer {i}: ppl {ppl:.3f} (+{ppl - base:.3f}) recall {lm.router_recall:.3f}", flush=True)
    return [{"dense_perplexity": base}, *rows]


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except Exception:
        return None


def markdown(report: dict) -> str:
    lines = [
        f"# Fine-grained MoEfied SmolLM2-135M vs dense ({report['date_utc'][:10]})",
        "",
        f"Command: `{report['command_short']}`. fp32, PyTorch reference Qwen2-MoE block; held-out = "
        f"{report['heldout_tokens']} tokens (Lee test news + 2nd half of the Wikipedia dump), dense perplexity "
        f"{report['dense']['perplexity']:.2f}. CPU: {report['hardware']['cpu']}, {report['hardware']['threads']} threads.",
        "",
        "| E:k:S:dense:smoothing | expert width | active FFN (MoE layers / model) | perplexity | ratio | top-1 agreement | router recall | distinct/indep. N=4 | N=8 | N=16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["configs"]:
        rt = r["ratio_to_independent"]
        de, ie = r["distinct_experts"], r["independent_experts"]
        lines.append(
            f"| {r['config']} | {r['expert_width']} | {r['active_ffn_fraction_moe_layers']:.0%} / "
            f"{r['active_ffn_fraction_model']:.0%} | {r['perplexity']:.2f} | {r['perplexity_ratio']:.3f} | "
            f"{r['top1_agreement_teacher_forced']:.3f} | {r['router_topk_recall_heldout_mean']:.3f} | "
            f"{de[3]:.1f}/{ie[3]:.1f} = {rt[3]:.2f} | {de[7]:.1f}/{ie[7]:.1f} = {rt[7]:.2f} | "
            f"{de[15]:.1f}/{ie[15]:.1f} = {rt[15]:.2f} |"
        )
    if report.get("sensitivity"):
        s = report["sensitivity"]
        lines += ["", f"Per-layer sensitivity ({report['sensitivity_config']}, one layer MoEfied at a time, "
                  f"calibration-side text, dense {s[0]['dense_perplexity']:.2f}):", "",
                  "| layer | " + " | ".join(str(r["layer"]) for r in s[1:]) + " |",
                  "|---" * (len(s)) + "|",
                  "| ppl increase | " + " | ".join(f"{r['increase']:.2f}" for r in s[1:]) + " |"]
    lines += ["", "Distinct routed experts vs N consecutive tokens (mean over MoE layers and positions):", ""]
    for r in report["configs"]:
        lines.append(f"- {r['config']}: real " + ", ".join(f"{v:.1f}" for v in r["distinct_experts"])
                     + "; independent " + ", ".join(f"{v:.1f}" for v in r["independent_experts"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="dense model folder (default: the built smollm2-135m)")
    parser.add_argument("--configs", default="32:8:512:0", help="E:k:S[:dense-layers[:router-smoothing]], comma separated")
    parser.add_argument("--router-smoothing", type=float, default=fg.FineGrainedConfig.router_smoothing,
                        help="default neighbour smoothing of the router targets (see moefication_fg)")
    parser.add_argument("--sensitivity", default=None, help="E:k:S for the per-layer sensitivity scan")
    parser.add_argument("--sensitivity-sequences", type=int, default=4)
    parser.add_argument("--heldout-sequences", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True, help="json; a .md with the same stem is written next to it")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from vllm_sparsever.models import model_path

    base = Path(args.base) if args.base else model_path("smollm2-135m")
    cfg0 = fg.FineGrainedConfig()
    model, tokenizer = moe.load_dense(base)
    calib = moe.pack_sequences(tokenizer, moe.calibration_texts(), cfg0.calib_seq_len, cfg0.calib_sequences, cfg0.seed)
    heldout = moe.pack_sequences(tokenizer, moe.heldout_texts(), 512, args.heldout_sequences, seed=1)
    t0 = time.perf_counter()
    dense_ppl = moe.perplexity(model, heldout)
    dense_argmax = _argmax_all(model, heldout)
    inputs = moe.capture_ffn_inputs(model, calib)
    print(f"dense ppl {dense_ppl:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    report_extra = {}
    if args.sensitivity:
        # Calibration-side text (train split, another shuffle): the choice never looks at the held-out set.
        sens_ids = moe.pack_sequences(tokenizer, moe.calibration_texts(), 512, args.sensitivity_sequences, seed=2)
        report_extra = {"sensitivity_config": args.sensitivity,
                        "sensitivity": sensitivity(model, inputs, parse_config(args.sensitivity, args.router_smoothing), sens_ids)}
    rows = []
    for text in args.configs.split(","):
        row = run_config(model, inputs, parse_config(text, args.router_smoothing), heldout, dense_ppl, dense_argmax)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("distinct_experts", "independent_experts")}), flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cmd = ["python", "-m", "vllm_sparsever.models.moefication_fg_eval", *(argv if argv is not None else sys.argv[1:])]
    report = {
        "benchmark": "moefication_fg_quality",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command_short": " ".join(cmd),
        "git_commit": _git_commit(),
        "hardware": {"cpu": cpu, "threads": args.threads},
        "base_model": str(base),
        "heldout_tokens": int(heldout.numel()),
        "calibration_tokens": int(calib.numel()),
        "dtype": "float32",
        "max_n": MAX_N,
        "defaults": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg0).items()},
        "dense": {"perplexity": dense_ppl},
        **report_extra,
        "configs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
