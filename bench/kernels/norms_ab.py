"""A decoder layer's RMSNorms and SwiGLU activation: vLLM's modules as they run eagerly on an x86 CPU (a
few torch ops each), the norms and the SwiGLU on vLLM-CPU's C kernels, and what sparsever's draft-model
drafter sets (`compat.model.use_c_kernels_where_faster`: the norms on the C kernels, the SwiGLU on its C
kernel at one token and as vLLM runs it past one), side by side.

Per layer a Qwen2/Llama decoder runs one fused-add RMSNorm before attention, one before the MLP and
one SiluAndMul (the model's first layer and final norm run a plain RMSNorm). Best of rounds, variants
in turn per round (rotated).

    python bench/kernels/norms_ab.py --hidden 896 --intermediate 4864 --tokens 1 4 8 16 600 --threads 1 --tag xeon-0.5b
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


VARIANTS = ("vllm", "c_all", "c_norms")
LABELS = {"vllm": "vLLM modules", "c_all": "C norms + C SwiGLU", "c_norms": "C norms + the SwiGLU as the draft runs it"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=24, help="decoder layers per pass (the per-pass column)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 600])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=500, help="calls per round at up to 8 tokens (fewer past it)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from record import RESULTS, hardware, save_results, versions
    from vllm_sparsever.compat.model import c_silu_and_mul, use_c_kernels_where_faster

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with set_current_vllm_config(VllmConfig()):
        def layer():
            m = torch.nn.Module()
            m.norm, m.act = RMSNorm(args.hidden, eps=1e-6).to(dtype), SiluAndMul()
            return m

        variants = {name: layer() for name in VARIANTS}
    use_c_kernels_where_faster(variants["c_norms"])
    use_c_kernels_where_faster(variants["c_all"])
    variants["c_all"].act._forward_method = c_silu_and_mul  # the earlier choice: the SwiGLU on its C kernel at every size
    gen = torch.Generator().manual_seed(0)

    def per_layer_us(m, t: int, reps: int) -> float:
        x = torch.randn(t, args.hidden, generator=gen).to(dtype)
        r = torch.randn(t, args.hidden, generator=gen).to(dtype)
        g = torch.randn(t, 2 * args.intermediate, generator=gen).to(dtype)

        def one():  # two fused-add norms and the activation (inputs reused: values do not matter)
            m.norm(x, r)
            m.norm(x, r)
            m.act(g)

        for _ in range(20):
            one()
        start = time.perf_counter()
        for _ in range(reps):
            one()
        return 1e6 * (time.perf_counter() - start) / reps

    started = dt.datetime.now(dt.timezone.utc)
    base = RESULTS / f"norms_ab_{args.tag or args.hidden}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "started": started.isoformat(),
              "hardware": hardware(), "versions": versions(), "threads": torch.get_num_threads(), "rows": []}
    with torch.inference_mode():
        for t in args.tokens:
            reps = max(5, args.reps // max(1, t // 8))
            raw = {k: [] for k in VARIANTS}
            for rnd in range(args.rounds):
                order = VARIANTS[rnd % 3:] + VARIANTS[:rnd % 3]
                for name in order:
                    raw[name].append(per_layer_us(variants[name], t, reps))
            best = {k: min(v) for k, v in raw.items()}
            record["rows"].append({"tokens": t, **{f"{k}_us_per_layer": v for k, v in best.items()},
                                   "saved_ms_per_pass_c_norms_vs_c_all": (best["c_all"] - best["c_norms"]) * args.layers / 1e3,
                                   "raw_us": raw})
    lines = ["# RMSNorm + SiluAndMul per decoder layer: vLLM's eager modules, vLLM-CPU's C kernels for both, "
             "the draft's choice", "",
             f"`{record['command']}`", "", f"hardware: {record['hardware']}", "",
             f"hidden {args.hidden}, intermediate {args.intermediate}, {args.dtype}, {record['threads']} threads; per "
             f"layer two fused-add RMSNorms and one SiluAndMul, microseconds, best of {args.rounds} rounds; saved "
             f"per pass = {args.layers} layers.", "",
             "| tokens | " + " | ".join(f"{LABELS[k]} us/layer" for k in VARIANTS)
             + " | draft's choice vs both on C | saved ms per pass |", "|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['tokens']} | " + " | ".join(f"{r[k + '_us_per_layer']:.1f}" for k in VARIANTS)
                     + f" | {r['c_all_us_per_layer'] / r['c_norms_us_per_layer']:.2f}x | "
                     f"{r['saved_ms_per_pass_c_norms_vs_c_all']:.2f} |")
    save_results(base, record, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
