"""The linears of one whole decoder pass, every layer's own weights, read from DRAM: bf16 on vLLM-CPU's
path, on it with 1-3 tokens padded to 4 rows (`linear_kernel: "vllm-padded"`) and on sparsever's `dense_linear`, int8 (W8A8) on vLLM-CPU's int8 GEMM and
on sparsever's `int8_linear` (`draft_int8_kernel`), and int4 on vLLM-CPU's int4 GEMM (W4A8 on CPUs with AMX,
W4A16 elsewhere) and on sparsever's `int4_linear` (W4A8, `draft_int4_kernel`), side by side.

A served pass reads each layer's weights once, and a model's weights exceed the CPU's caches
(Qwen2.5-Coder-0.5B: 716 MB of bf16 linears against a Xeon's 480 MB L3), so this times passes over
all layers with the caches flushed before each (a buffer larger than the last-level cache written
through), in turn per round; a pass without the flush is reported too ("hot"). The int8 weights are
quantized as `models build qwen2.5-coder-0.5b-w8a8` does (per output channel, models/quantize.py) and
run as vLLM's compressed-tensors W8A8 layer does (`int8_scaled_mm_with_quant` on CPUs with AMX,
oneDNN's int8 GEMM elsewhere; activations quantized per token inside); the int4 ones as `models build
qwen2.5-coder-0.5b-w4a16` does (groups of 128) and run as vLLM's compressed-tensors W4A16 layer does
(its CPU kernel's repacking and GEMM, compat-free: the layer is vLLM's own).

    python bench/kernels/pass_linears.py --model qwen2.5-0.5b --tokens 1 4 --threads 1 --tag xeon
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

LAYERS = {"qwen2.5-1.5b": 28, "qwen2.5-0.5b": 24}
# ratio name: (baseline kind, kind), the baseline's median time over the kind's
RATIOS = {"int8_speedup_vs_vllm_bf16": ("vllm_bf16", "vllm_int8"), "ours_vs_vllm_bf16": ("vllm_bf16", "ours_bf16"),
          "padded_vs_vllm_bf16": ("vllm_bf16", "vllm_bf16_padded"), "int4_speedup_vs_vllm_bf16": ("vllm_bf16", "vllm_int4"),
          "int4_speedup_vs_vllm_int8": ("vllm_int8", "vllm_int4"), "ours_int8_vs_vllm_int8": ("vllm_int8", "ours_int8"),
          "ours_int4_vs_vllm_int4": ("vllm_int4", "ours_int4"), "ours_int4_vs_ours_int8": ("ours_int8", "ours_int4")}
KINDS = ("vllm_bf16", "vllm_bf16_padded", "ours_bf16", "vllm_int8", "ours_int8", "vllm_int4", "ours_int4")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(LAYERS), default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM-CPU's engine: one core per worker here)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the passes to time (default: all)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)

    import torch
    import vllm._custom_ops  # noqa: F401 (registers torch.ops._C)
    from tqdm import tqdm

    from kernels.linear_ab import MODELS, last_level_cache_bytes
    from kernels.run import vllm_cpu_linear
    from record import RESULTS, hardware, save_results, versions
    from vllm_sparsever import _custom_ops as ops
    from vllm_sparsever.models.quantize import quantize_int8_per_channel
    from vllm_sparsever.verification.lossless.linear_kernel import padded_cpu_linear

    torch.set_num_threads(args.threads)
    amx = torch.cpu._is_amx_tile_supported()  # (also what lets this process use AMX tiles, as vLLM's worker does)

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(VllmConfig()):  # a one-rank group: vLLM's quantized parameters ask their rank
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)

    def int4_layer(w):
        """vLLM's compressed-tensors W4A16 layer over `w` quantized as models/quantize.py does."""
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
            CompressedTensorsWNA16)
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        from vllm_sparsever.models.quantize import INT4_GROUP_SIZE, quantize_int4_per_group

        n, k = w.shape
        scheme = CompressedTensorsWNA16(strategy="group", num_bits=4, group_size=INT4_GROUP_SIZE, symmetric=True)
        layer = torch.nn.Module()
        layer.bias = None
        scheme.create_weights(layer, output_size=n, input_size=k, output_partition_sizes=[n],
                              input_size_per_partition=k, params_dtype=w.dtype, weight_loader=default_weight_loader)
        q, scale = quantize_int4_per_group(w, INT4_GROUP_SIZE, w.dtype)
        layer.weight_packed.data.copy_(pack_to_int32(q, 4))
        layer.weight_scale.data.copy_(scale)
        scheme.process_weights_after_loading(layer)
        return lambda x: scheme.apply_weights(layer, x, None)

    shapes = [shape for name, shape in MODELS[args.model].items() if name != "lm_head"]
    gen = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in shapes]
              for _ in range(LAYERS[args.model])]
    stock = [[vllm_cpu_linear(w.clone()) for w in layer] for layer in layers]
    padded = [[padded_cpu_linear(s) for s in layer] for layer in stock]

    def int8(w):
        q, scale = quantize_int8_per_channel(w)
        if amx:
            return torch.ops._C.convert_weight_packed(q), scale.squeeze(1)
        handler = vllm._custom_ops.create_onednn_scaled_mm(q.t(), scale, torch.bfloat16, True, False, 32)
        return handler, scale

    quantized = [[int8(w) for w in layer] for layer in layers]

    def int8_rows(w):  # as draft_int8_kernel keeps a layer (compat/linear.py int8_linears_on_rows)
        q, scale = quantize_int8_per_channel(w)
        return q.contiguous(), scale.reshape(-1).float(), ops.int8_weight_sums(q)

    rows8 = [[int8_rows(w) for w in layer] for layer in layers]
    int4_layers = [[int4_layer(w) for w in layer] for layer in layers]

    def int4_rows(w):  # as draft_int4_kernel keeps a layer (compat/linear.py int4_linears_on_rows)
        from vllm_sparsever.models.quantize import INT4_GROUP_SIZE, quantize_int4_per_group

        q, scale = quantize_int4_per_group(w, INT4_GROUP_SIZE, w.dtype)
        return ops.pack_int4_rows(q), scale.float().contiguous()

    rows4 = [[int4_rows(w) for w in layer] for layer in layers]
    llc = last_level_cache_bytes()
    flush = torch.zeros(int(2 * llc) // 4, dtype=torch.float32)

    def linear_int8(x, packed):
        if amx:
            return torch.ops._C.int8_scaled_mm_with_quant(x, packed[0], packed[1], None, x.dtype, True)
        xq, xs, xzp = vllm._custom_ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty(x.shape[0], packed[0].n, dtype=x.dtype)
        vllm._custom_ops.onednn_scaled_mm(packed[0], xq, out, xs, xzp, None, None)
        return out

    def one_pass(kind: str, xs: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for li in range(len(layers)):
            for j, (_, k) in enumerate(shapes):
                if kind == "vllm_bf16":
                    stock[li][j](xs[k])
                elif kind == "vllm_bf16_padded":
                    padded[li][j](xs[k])
                elif kind == "ours_bf16":
                    ops.dense_linear(xs[k], layers[li][j])
                elif kind == "vllm_int8":
                    linear_int8(xs[k], quantized[li][j])
                elif kind == "ours_int8":
                    ops.int8_linear(xs[k], *rows8[li][j])
                elif kind == "ours_int4":
                    ops.int4_linear(xs[k], *rows4[li][j])
                else:
                    int4_layers[li][j](xs[k])
        return 1e3 * (time.perf_counter() - start)

    # The read roof: a pass's int8 bytes read once by a plain reduction (torch's fp32 sum, memory-bound),
    # best of 5, the flush before each.
    stream = torch.ones(sum(n * k for n, k in shapes) * len(layers) // 4, dtype=torch.float32)
    read_s = []
    for _ in range(5):
        flush.add_(1.0)
        start = time.perf_counter()
        stream.sum()
        read_s.append(time.perf_counter() - start)
    read_GBps = stream.numel() * 4 / min(read_s) / 1e9
    del stream
    started = dt.datetime.now(dt.timezone.utc)
    base = RESULTS / f"pass_linears_{args.tag or args.model}_{started.strftime('%Y%m%d-%H%M')}"
    record = {"command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "started": started.isoformat(),
              "hardware": hardware(), "versions": versions(), "threads": torch.get_num_threads(),
              "last_level_cache_bytes": llc, "int8_path": "sgl-kernel int8_scaled_mm_with_quant" if amx else "oneDNN",
              "int4_path": "W4A8 int4_scaled_mm_cpu" if amx else "W4A16 cpu_gemm_wna16",
              "ours_int8_path": "VNNI" if ops.int8_vnni_available() else "portable loop",
              "int8_bytes_per_pass": sum(n * k for n, k in shapes) * len(layers), "read_GBps": read_GBps,
              "bf16_bytes_per_pass": 2 * sum(n * k for n, k in shapes) * len(layers), "rows": []}
    kinds = tuple(args.kinds)
    bar = tqdm(total=len(args.tokens) * (args.rounds + 1) * len(kinds), desc="passes", unit="pass")
    for t in args.tokens:
        xs = {k: torch.randn(t, k, generator=gen).bfloat16() for _, k in shapes}
        cold: dict[str, list[float]] = {kind: [] for kind in kinds}
        for rnd in range(args.rounds + 1):
            for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
                flush.add_(1.0)
                ms = one_pass(kind, xs)
                if rnd:  # round 0 warms up
                    cold[kind].append(ms)
                bar.update()
        hot = {kind: min(one_pass(kind, xs) for _ in range(3)) for kind in kinds}
        row = {"tokens": t, **{f"{kind}_ms_min": min(v) for kind, v in cold.items()},
               **{f"{kind}_ms_median": statistics.median(v) for kind, v in cold.items()},
               **{f"{kind}_ms_hot": hot[kind] for kind in kinds}, "raw_ms": cold}
        for name, (base_kind, kind) in RATIOS.items():  # base's time / kind's: above 1, kind is faster
            if base_kind in cold and kind in cold:
                row[name] = row[f"{base_kind}_ms_median"] / row[f"{kind}_ms_median"]
        record["rows"].append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "raw_ms"}))
    lines = [f"# One pass's linears from DRAM: bf16 (vLLM-CPU, dense_linear) and int8 ({args.model})", "",
             f"`{record['command']}`", "", f"hardware: {record['hardware']}", "",
             f"{record['threads']} threads, {len(layers)} layers x {len(shapes)} projections, "
             f"{record['bf16_bytes_per_pass'] / 1e6:.0f} MB of bf16 weights per pass, caches flushed before each "
             f"pass (last-level cache {llc >> 20} MB); int8 on {record['int8_path']} and ours ({record['ours_int8_path']}), "
             f"int4 on {record['int4_path']}. ms per pass, median (min) of "
             f"{args.rounds} rounds; hot = best of 3 passes without the flush. Ratios: the first kind's time over the second's. "
             f"Read roof: the int8 bytes ({record['int8_bytes_per_pass'] / 1e6:.0f} MB) summed by torch in "
             f"{record['int8_bytes_per_pass'] / read_GBps / 1e6:.1f} ms ({read_GBps:.1f} GB/s, one thread, from DRAM).", "",
             "| tokens | " + " | ".join(kinds) + " | " + " | ".join(RATIOS) + " | hot: " + " / ".join(kinds) + " |",
             "|---|" + "---|" * (len(kinds) + len(RATIOS) + 1)]
    for r in record["rows"]:
        cells = [f"{r[f'{k}_ms_median']:.1f} ({r[f'{k}_ms_min']:.1f})" for k in kinds]
        cells += [f"{r[name]:.2f}x" if name in r else "-" for name in RATIOS]
        cells.append(" / ".join(f"{r[f'{k}_ms_hot']:.1f}" for k in kinds))
        lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    bar.close()
    save_results(base, record, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
