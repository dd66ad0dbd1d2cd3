"""What counting sparse-verification work costs, next to the work it counts (issue 10, item 4).

Per layer and verify step, the sparse layers record how much they read. This measures, at real
verify shapes and in one run (interleaved, median of many repeats):
- the sparse work of one layer (the kernels a verify step runs in that layer);
- the counting the layer does now (sizes from the plan and the kernels; the MoE dense-expert count,
  a second routing, on one verify step in `STATS_SAMPLE_EVERY`);
- the counting it did before (FFN: `torch.unique` over the selection; MoE: a second routing and an
  `.item()` on every step; attention: a sum over the selection counts).
The share of a verify step that counting costs is at most counting / (the layer's sparse work),
since a verify step also runs everything else of every layer (projections, norms, the LM head).

    python bench/counter_overhead.py [--repeats 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, hardware, versions  # noqa: E402

from vllm_sparsever import _custom_ops as ops  # noqa: E402
from vllm_sparsever.config import SparseverConfig  # noqa: E402
from vllm_sparsever.verification.sparse.runtime import STATS_SAMPLE_EVERY, SparseVerificationRuntime  # noqa: E402

# Qwen2.5-Coder-1.5B (FFN, attention) and a Mixtral-style MoE with SmolLM2-135M's width
# (smollm2-135m-moe: H 576, 8 experts of 192 neurons, top-6).
QWEN = {"hidden": 1536, "inter": 8960, "heads": 12, "kv_heads": 2, "head_dim": 128}
MOE = {"hidden": 576, "experts": 8, "expert_inter": 192, "top_k": 6, "heads": 9, "kv_heads": 3, "head_dim": 64}
# The sparse layers of each model pair's verify step: (model, [components of one decoder layer]).
MODELS = {
    "Qwen2.5-Coder-1.5B (attention + FFN)": ["ffn", "attention-qwen"],
    "smollm2-135m-moe (attention + MoE)": ["moe", "attention-moe"],
}


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(tokens: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rt = SparseVerificationRuntime(SparseverConfig.from_dict({"num_speculative_tokens": tokens - 1}))
    gsl = torch.tensor([0, tokens], dtype=torch.int32)
    rows = []

    # FFN: top-k SwiGLU at keep 0.5.
    h, inter = QWEN["hidden"], QWEN["inter"]
    keep = inter // 2
    x = torch.randn(tokens, h, generator=gen).to(dtype)
    w_gate_up = (torch.randn(2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w_down_t = (torch.randn(inter, h, generator=gen) / inter**0.5).to(dtype)
    _, selected = ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, keep)
    rows.append({
        "key": "ffn", "component": "ffn (Qwen-1.5B, keep 0.5)",
        "work": lambda: ops.topk_swiglu_ffn(x, w_gate_up, w_down_t, gsl, keep),
        "now": lambda: rt.record(ffn_layers_sparse=1, ffn_neurons_read=keep * 1, ffn_neurons_dense=inter),
        "before": lambda: rt.record(ffn_layers_sparse=1, ffn_neurons_dense=inter,
                                    ffn_neurons_read=int(torch.unique(selected[selected >= 0]).numel())),
    })

    # MoE: route + prune, grouped dispatch.
    e, ie, hm, top_k = MOE["experts"], MOE["expert_inter"], MOE["hidden"], MOE["top_k"]
    xm = torch.randn(tokens, hm, generator=gen).to(dtype)
    logits = torch.randn(tokens, e, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * ie, hm, generator=gen) / hm**0.5).to(dtype)
    w2 = (torch.randn(e, hm, ie, generator=gen) / ie**0.5).to(dtype)
    weights, ids = ops.moe_route_and_prune(logits, top_k, 0.3, gsl, 4, True)
    _, used = ops.moe_grouped_dispatch(xm, weights, ids, w13, w2)

    def moe_work():
        w, i = ops.moe_route_and_prune(logits, top_k, 0.3, gsl, 4, True)
        ops.moe_grouped_dispatch(xm, w, i, w13, w2)

    def dense_count():
        _, dense_ids = ops.moe_route_and_prune(logits, top_k, 0.0, None, 0, True)
        return int(dense_ids.unique().numel())

    step = iter(range(1, 10**9))

    def moe_now():
        n = int(used)
        rt.record(moe_layers=1, moe_experts_read=n)
        if rt.should_sample(next(step)):
            rt.record(moe_layers_sampled=1, moe_experts_read_sampled=n, moe_experts_dense_sampled=dense_count())

    rows.append({
        "key": "moe", "component": f"moe (E{e} top-{top_k}, H {hm}, budget 4)",
        "work": moe_work,
        "now": moe_now,
        "before": lambda: rt.record(moe_experts_read=int(used.item()), moe_experts_dense=dense_count(), moe_layers=1),
    })

    # Attention: block-sparse over 8K context, 10 kept blocks of 128 per KV head.
    for key, shape in (("attention-qwen", QWEN), ("attention-moe", MOE)):
        rows.append(_attention_row(key, shape, tokens, gsl, dtype, gen, rt))

    results = []
    for row in rows:
        for fn in (row["work"], row["now"], row["before"]):  # warm-up
            fn()
        samples = {"work": [], "now": [], "before": []}
        for _ in range(5):  # interleaved rounds: drift hits all three alike
            for key in samples:
                samples[key].append(_median_us(row[key], max(repeats // 5, 1)))
        work, now, before = (statistics.median(samples[k]) for k in ("work", "now", "before"))
        results.append({
            "key": row["key"], "component": row["component"], "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
            "work_us": work, "count_now_us": now, "count_before_us": before,
            "share_now": now / work, "share_before": before / work, "raw_us": samples,
        })
    return results


def _attention_row(key, shape, tokens, gsl, dtype, gen, rt) -> dict:
    hkv, hq, d, bs, ctx = shape["kv_heads"], shape["heads"], shape["head_dim"], 128, 8192
    nb = (ctx + tokens + bs - 1) // bs
    key_cache = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    value_cache = torch.randn(nb, hkv, bs, d, generator=gen).to(dtype)
    block_table = torch.arange(nb, dtype=torch.int32).view(1, -1)
    seq_lens = torch.tensor([ctx + tokens], dtype=torch.int32)
    query = torch.randn(tokens, hq, d, generator=gen).to(dtype)
    n_ctx = ctx // bs
    sel = torch.full((1, hkv, nb), -1, dtype=torch.int32)
    sel[:, :, :10] = torch.tensor([0, *range(n_ctx - 9, n_ctx)], dtype=torch.int32)
    num_sel = torch.full((1, hkv), 10, dtype=torch.int32)
    return {
        "key": key, "component": f"attention (Hq {hq}, Hkv {hkv}, D {d}, 8K, 10 blocks)",
        "work": lambda: ops.block_sparse_tree_attention(query, key_cache, value_cache, block_table, seq_lens,
                                                        gsl, d**-0.5, selected=sel, num_selected=num_sel),
        "now": lambda: rt.record(attn_layers_sparse=1, attn_kv_blocks_read=10 * hkv, attn_kv_blocks_dense=n_ctx * hkv),
        "before": lambda: rt.record(attn_layers_sparse=1, attn_kv_blocks_read=int(num_sel.sum()),
                                    attn_kv_blocks_dense=n_ctx * hkv),
    }


def per_model(results: list[dict]) -> list[dict]:
    """Counting of a decoder layer's sparse components over the kernels they run (an upper bound on
    the share of a verify step, which also runs projections, norms and the LM head)."""
    out = []
    for tokens in sorted({r["tokens"] for r in results}):
        by_key = {r["key"]: r for r in results if r["tokens"] == tokens}
        for model, keys in MODELS.items():
            work = sum(by_key[k]["work_us"] for k in keys)
            now = sum(by_key[k]["count_now_us"] for k in keys)
            before = sum(by_key[k]["count_before_us"] for k in keys)
            out.append({"model": model, "tokens": tokens, "work_us": work, "count_now_us": now,
                        "count_before_us": before, "share_now": now / work, "share_before": before / work})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[4, 8])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = dt.datetime.now(dt.timezone.utc)
    hw_start = hardware()
    results = [r for t in args.tokens for r in measure(t, args.repeats, torch.bfloat16)]
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started_utc": started.isoformat(), "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
        "args": vars(args), "stats_sample_every": STATS_SAMPLE_EVERY,
        "hardware_at_start": hw_start, "hardware": hardware(), "versions": versions(), "results": results,
    }
    models = per_model(results)
    out["per_model"] = models
    stamp = started.strftime("%Y%m%d-%H%M")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"counter_overhead_{stamp}.json").write_text(json.dumps(out, indent=1))
    lines = [
        "# Counting cost of sparse verification, per layer and verify step",
        "", f"`{out['command']}`", "", f"hardware: {out['hardware']}", "",
        "bf16, one request. Medians of interleaved rounds (work, counting now, counting before).",
        "'share' = counting / the sparse kernels it counts, an upper bound on the share of a verify",
        "step (which also runs every projection, norm and the LM head).", "",
        "| component | tokens | sparse work us | counting now us | share now | counting before us | share before |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['component']} | {r['tokens']} | {r['work_us']:.1f} | {r['count_now_us']:.2f} | "
                     f"{100 * r['share_now']:.2f}% | {r['count_before_us']:.2f} | {100 * r['share_before']:.2f}% |")
    lines += ["", "Per decoder layer of each model pair (its sparse components together):", "",
              "| model | tokens | sparse work us | counting now us | share now | counting before us | share before |",
              "|---|---|---|---|---|---|---|"]
    for m in models:
        lines.append(f"| {m['model']} | {m['tokens']} | {m['work_us']:.1f} | {m['count_now_us']:.2f} | "
                     f"{100 * m['share_now']:.2f}% | {m['count_before_us']:.2f} | {100 * m['share_before']:.2f}% |")
    worst = max(m["share_now"] for m in models)
    lines += ["", f"Largest share of a verify step now (upper bound): {100 * worst:.2f}% "
              f"({'under' if worst < 0.01 else 'NOT under'} 1%)."]
    (RESULTS / f"counter_overhead_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
