"""EVICT step by step in a served engine: each decode step's measured time and shape, and each depth
decision with what EVICT's clock believed then (one long-context request, batch 1).

    python bench/evict_trace.py --context 8192 [--drafter draft_model|ngram] [--max-tokens 48]

The trace is recorded inside the worker (`sparsever_call` of `evict_trace_worker`, put on the
worker's import path through PYTHONPATH) and written to bench/results/evict_trace_<tag>_<time>.json
with the command line, hardware and versions. It shows how much one engine's step time moves while
nothing changes but the machine (the same plain step, minutes apart), which single-run comparisons
between engines cannot separate from the methods.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from record import RESULTS, binding_env, hardware, versions  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--drafter", choices=["draft_model", "ngram"], default="draft_model")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cap", type=int, default=8)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "tools"), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    from vllm_sparsever.cli import resolve_model
    from vllm_sparsever.compat.engine import shutdown_llm
    from vllm_sparsever.data.long_context import long_context_prompts

    target = resolve_model(args.target)
    spec = {"method": "sparsever", "num_speculative_tokens": args.cap, "adaptive": {"enabled": True}}
    if args.drafter == "ngram":
        spec.update(draft_source="ngram", prompt_lookup_min=2, prompt_lookup_max=4)
    else:
        spec["model"] = resolve_model(args.draft)
    started = dt.datetime.now(dt.timezone.utc)
    record = {"command": " ".join([sys.executable, *sys.argv]), "target": target, "spec": spec, "args": vars(args),
              "started": started.isoformat(), "hardware": hardware(), "env": binding_env(), "versions": versions()}
    llm = LLM(model=target, dtype="bfloat16", enforce_eager=True, max_model_len=args.context + args.max_tokens + 128,
              max_num_seqs=1, seed=0, speculative_config=spec, enable_prefix_caching=True, disable_log_stats=False)
    try:
        llm.collective_rpc("sparsever_call", args=("evict_trace_worker:install",))
        row = long_context_prompts(target, args.context, task="summarize", n=1)[0]
        prompt = [{"role": "user", "content": row["prompt"]}]
        llm.chat([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # prefill, warm-up
        llm.collective_rpc("sparsever_call", args=("evict_trace_worker:fetch",))
        start = time.perf_counter()
        out = llm.chat([prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)[0]
        record["wall_s"] = time.perf_counter() - start
        record["decode_s"] = out.metrics.last_token_ts - out.metrics.first_token_ts
        record["num_tokens"] = len(out.outputs[0].token_ids)
        record["trace"] = llm.collective_rpc("sparsever_call", args=("evict_trace_worker:fetch",))[0]
    finally:
        shutdown_llm(llm)
    for key, tokens in (("plain_step_ms", 1), ("verify_2_step_ms", 2)):  # one row: 1 token, 1 token + 1 draft
        ms = [1e3 * e["seconds"] for e in record["trace"] if e["kind"] == "step" and e["query_tokens"] == [tokens]]
        record[key] = {"n": len(ms), "min": min(ms, default=0.0), "max": max(ms, default=0.0)}
    tag = args.tag or f"{args.drafter}-{args.context}"
    path = RESULTS / f"evict_trace_{tag}_{started.strftime('%Y%m%d-%H%M')}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    for e in record["trace"]:
        if e["kind"] == "step":
            print(f"step  tokens {e['query_tokens']} context {e['contexts']}: {1e3 * e['seconds']:.1f} ms")
        else:
            print(f"plan  depth {e['depth']} (catch-up {e['catch_up_tokens']} tokens); clock "
                  f"{ {k: round(v, 3) for k, v in e['clock'].items()} }")
    print(f"plain steps: {record['plain_step_ms']}; 2-token verify steps: {record['verify_2_step_ms']}\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
