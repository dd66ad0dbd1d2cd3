"""bench/harness.py, the end-to-end benchmark harness: its summary rules on made-up rounds, one --quick
run on the tiny models (2 rounds, plain and one approximate candidate), and one over a KV snapshot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402


def _run(tok_s, outputs, drafts=0.0, accepted=0.0):
    tokens = sum(len(o) for o in outputs)
    return {"seconds": tokens / tok_s, "output_tokens": tokens, "all_output_tokens": tokens, "tok_s": tok_s,
            "outputs": outputs,
            "num_drafts": drafts, "num_draft_tokens": 2 * drafts, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def test_round_order_rotates_every_method_through_every_slot():
    methods = harness.baseline_methods("d", [1, 2], quick=False)
    names = [m.name for m in methods]
    assert names == ["plain", "vllm-draft_model-k1", "vllm-draft_model-k2", "sparsever-kernels-only"]
    orders = [[m.name for m in harness.round_order(methods, r)] for r in range(4)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == names  # each method leads one round
    assert harness.baseline_methods(None, [3], quick=False)[1].spec["method"] == "ngram"
    assert [m.name for m in harness.baseline_methods("d", [3], quick=True)] == ["plain"]


def test_cpu_class_names_the_generation_a_vm_hides():
    assert harness.cpu_class("AMD EPYC", "26", {"avx512f", "avx512_bf16", "avx2"}) == "AMD Zen 5 (AVX512-BF16)"
    assert harness.cpu_class("AMD EPYC", "25", {"avx512f", "avx512_bf16", "avx2"}) == "AMD Zen 4 (AVX512-BF16)"
    assert harness.cpu_class("AMD EPYC", "25", {"avx2"}) == "AMD Zen 3 (AVX2)"
    assert harness.cpu_class("Intel(R) Xeon(R) Processor", "6", {"amx_tile", "avx512f"}) == "Intel Xeon (AMX)"


def test_fixed_chains_given_explicitly_replace_the_draft_models():
    fixed = [harness.parse_fixed(f'vllm-eagle3-k{k}={{"method": "eagle3", "model": "/head", '
                                 f'"num_speculative_tokens": {k}}}', "/d") for k in (1, 3)]
    names = [m.name for m in harness.baseline_methods("/d", [1, 2, 3], quick=False, fixed=fixed)]
    assert names == ["plain", "vllm-eagle3-k1", "vllm-eagle3-k3", "sparsever-kernels-only"]
    assert all(m.role == "vllm_fixed" for m in fixed)
    for bad in ('eagle={"method": "eagle3"}', 'x-k2={"method": "sparsever"}'):
        with pytest.raises(SystemExit):
            harness.parse_fixed(bad, None)


def test_candidates_parse_with_the_draft_and_their_kind():
    m = harness.parse_candidate('c={"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": 3}', "/d")
    assert m.spec["model"] == "/d" and m.lossless and m.role == "candidate"
    assert not harness.parse_candidate('s={"method": "sparsever", "ffn": {"enabled": true}}', None).lossless
    # sparse sections that only drive the hierarchy's intermediate level: the full level is dense
    hier = ('h={"method": "sparsever", "attention": {"enabled": true}, '
            '"early_exit": {"enabled": true, "intermediate": "sparse"}}')
    assert harness.parse_candidate(hier, None).lossless
    for bad in ("noequals", 'x={"model": "DRAFT"}', "x=[1]", "x={"):
        with pytest.raises(SystemExit):
            harness.parse_candidate(bad, None)


def test_summary_spreads_ratios_best_k_and_flags():
    plain_out = [[1, 2, 3], [4, 5, 6]]
    other = [[1, 2, 3], [4, 5, 9]]
    methods = [harness.Method("plain", None, "plain"),
               harness.Method("vllm-draft_model-k1", {}, "vllm_fixed"),
               harness.Method("vllm-draft_model-k3", {}, "vllm_fixed"),
               harness.Method("sparsever-kernels-only", {}, "kernels_only"),
               harness.Method("cand", {}, "candidate"),
               harness.Method("sparse", {}, "candidate", lossless=False)]
    rounds = [{"plain": _run(10, plain_out), "vllm-draft_model-k1": _run(11, plain_out, 4, 2),
               "vllm-draft_model-k3": _run(13, plain_out, 4, 6), "sparsever-kernels-only": _run(12, plain_out),
               "cand": _run(18, other if r == 1 else plain_out, 4, 8), "sparse": _run(20, other)}
              for r in range(3)]
    rounds[2]["plain"] = _run(8, plain_out)
    s = harness.summarize(methods, rounds, "float32")
    p = s["methods"]["plain"]
    assert p["tok_s_per_round"] == [10, 10, 8] and p["tok_s_median"] == 10 and (p["tok_s_min"], p["tok_s_max"]) == (8, 10)
    assert p["tok_s_pooled"] == pytest.approx(18 / (0.6 + 0.6 + 6 / 8))  # all tokens over all seconds
    assert s["best_fixed"] == "vllm-draft_model-k3" and s["best_fixed_k"] == 3
    c = s["methods"]["cand"]
    assert c["vs_plain"] == pytest.approx(1.8) and c["vs_kernels_only"] == pytest.approx(1.5)
    assert c["vs_best_fixed"] == pytest.approx(18 / 13) and c["mean_acceptance_length"] == 3.0
    # fp32: a lossless method whose output differs in any round is flagged; an approximate one only
    # as compared over different texts
    assert c["divergent_prompts"] == [1] and c["flags"] == ["different_texts", "not_identical"]
    assert s["methods"]["sparse"]["flags"] == ["different_texts"]
    assert s["flagged"] == {"cand": ["different_texts", "not_identical"], "sparse": ["different_texts"]}
    # bf16: near-ties flip; reported beside vLLM's own divergence, not called a broken lossless claim
    assert harness.summarize(methods, rounds, "bfloat16")["methods"]["cand"]["flags"] == ["different_texts"]
    # 6 tokens a round where 2 prompts x 3 were asked for: complete; where 2 x 8 were: answers ended early
    assert "short_outputs" not in harness.summarize(methods, rounds, "bfloat16", expected_tokens=6)["flagged"].get("plain", [])
    short = harness.summarize(methods, rounds, "bfloat16", expected_tokens=16)
    assert short["methods"]["plain"]["flags"] == ["short_outputs"]


def test_summary_refuses_a_run_whose_answers_ended_early(tmp_path):
    import summaries

    record = _record("Intel Xeon (AMX)", 4, 4, 5, 6)
    record["summary"]["methods"]["plain"]["flags"].append("short_outputs")
    (tmp_path / "harness_short.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="ignore-eos"):
        summaries.main(["long_context", f"contexts.8192={tmp_path / 'harness_short.json'}", "--out-dir", str(tmp_path)])


@pytest.mark.slow
@pytest.mark.e2e
def test_quick_run_on_the_tiny_models(tmp_path, tiny_target, tiny_draft):
    from tiny_models import prompts

    (tmp_path / "prompts.json").write_text(json.dumps(prompts(3)))
    # Approximate on purpose: FFN verification over 5% of the neurons changes the greedy text.
    lossy = {"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": 3,
             "ffn": {"enabled": True, "keep_ratio": 0.05}}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "harness.py"), "--quick", "--target", str(tiny_target), "--draft",
         str(tiny_draft), "--candidate", f"sparse-ffn={json.dumps(lossy)}", "--prompts-file",
         str(tmp_path / "prompts.json"), "--prompt-format", "text", "--dtype", "float32", "--max-tokens", "24",
         "--max-model-len", "512", "--metric", "decode", "--out-dir", str(tmp_path), "--tag", "quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result] = tmp_path.glob("harness_quick_*.json")
    record = json.loads(result.read_text())
    assert {"command", "commit", "machine", "rounds", "orders", "raw", "summary", "metric"} <= set(record)
    assert record["machine"]["cpu"] and set(record["machine"]["isa"]) == set(harness.ISA_FLAGS)
    assert record["orders"] == [["plain", "sparse-ffn"], ["sparse-ffn", "plain"]]  # interleaved, rotated
    assert len(record["raw"]) == 2 and all(set(r) == {"plain", "sparse-ffn"} for r in record["raw"])
    s = record["summary"]["methods"]
    assert s["plain"]["flags"] == [] and len(s["plain"]["tok_s_per_round"]) == 2
    assert s["sparse-ffn"]["divergent_prompts"] and s["sparse-ffn"]["flags"] == ["different_texts"]
    # The sparsever engine's worker counters cover the timed requests only (reset after the warm-up).
    for r in record["raw"]:
        assert r["plain"]["sparsever"] is None
        worker = r["sparse-ffn"]["sparsever"]
        assert worker["num_steps"] >= 3 * 24 // 4 and worker["num_verify_steps"] >= 1 and worker["step_time_s"] > 0
    # --metric decode: tokens/s over each request's first to last token, the wall time kept beside it
    assert record["metric"] == "decode"
    for r in record["raw"]:
        for run in r.values():
            assert 0 < run["decode_s"] < run["wall_s"] and run["seconds"] == run["decode_s"]
            assert run["output_tokens"] == run["decode_tokens"] == run["all_output_tokens"] - 3
    assert (tmp_path / result.name.replace(".json", ".md")).exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_kv_snapshot_run_prefills_once_and_decodes_the_same_tokens(tmp_path, tiny_target, tiny_draft, monkeypatch):
    """--kv-snapshot: a first engine (vLLM's draft_model chain) prefills and saves each prompt's KV blocks,
    the draft's layers included; the timed engines load them instead of prefilling. In fp32 their greedy
    texts equal plain decoding's over a real prefill only if every loaded layer holds the right K/V."""
    from tiny_models import prompts

    long_prompts = [" ".join(prompts(12, length=20, seed=s)) for s in range(2)]  # ~360 tokens: 2 whole blocks
    (tmp_path / "prompts.json").write_text(json.dumps(long_prompts))
    chain = {"method": "sparsever", "model": "DRAFT", "num_speculative_tokens": 3}
    snapshot = tmp_path / "kv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "harness.py"), "--quick", "--target", str(tiny_target), "--draft",
         str(tiny_draft), "--candidate", f"chain={json.dumps(chain)}", "--prompts-file",
         str(tmp_path / "prompts.json"), "--prompt-format", "text", "--dtype", "float32", "--max-tokens", "24",
         "--ignore-eos", "--max-model-len", "512", "--metric", "decode", "--kv-snapshot", str(snapshot),
         "--out-dir", str(tmp_path), "--tag", "snapshot"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result] = tmp_path.glob("harness_snapshot_*.json")
    record = json.loads(result.read_text())
    snap = record["kv_snapshot"]
    assert snap["reused"] == [False, False] and all(s > 0 for s in snap["prefill_s"])
    assert snap["speculative_config"]["method"] == "draft_model"
    assert len(list(snapshot.glob("*/kv.safetensors"))) == 2
    for manifest in snapshot.glob("*/manifest.json"):
        layers = json.loads(manifest.read_text())["layers"]
        assert sum(n.startswith("draft_model.") for n in layers) == 2 and len(layers) == 4  # target's and draft's
    for r in record["raw"]:
        for run in r.values():
            assert run["kv_snapshot_tokens"] >= 2 * 256  # both prompts' whole blocks, loaded not prefilled
    s = record["summary"]["methods"]
    assert s["plain"]["flags"] == [] and s["chain"]["flags"] == []  # texts identical to plain's
    assert s["chain"]["mean_acceptance_length"] > 1
    # ... and plain's over loaded K/V equal a plain engine's over its own prefill
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # as conftest's multiprocess_engine: other engines may live
    llm = LLM(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    try:
        reference = [list(o.outputs[0].token_ids) for o in llm.generate(
            long_prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    finally:
        del llm
    assert record["raw"][0]["plain"]["outputs"] == reference


def _record(cls: str, plain: float, kernels: float, fixed: float, cand: float, batch: int = 1) -> dict:
    out = [[1, 2, 3]]
    methods = [harness.Method("plain", None, "plain"), harness.Method("vllm-draft_model-k2", {}, "vllm_fixed"),
               harness.Method("sparsever-kernels-only", {}, "kernels_only"),
               harness.Method("evict", {"method": "sparsever"}, "candidate"),
               harness.Method("sparse", {}, "candidate", lossless=False)]
    rounds = [{"plain": _run(plain, out), "vllm-draft_model-k2": _run(fixed, out, 4, 4),
               "sparsever-kernels-only": _run(kernels, out), "evict": _run(cand, out, 4, 6),
               "sparse": _run(cand * 2, out)} for _ in range(3)]
    return {"command": "python bench/harness.py ...", "commit": "abc", "rounds": 3, "batch_size": batch,
            "num_prompts": 1, "max_tokens": 3, "dtype": "bfloat16", "metric": "whole request",
            "date": "2026-12-05T00:00:00+00:00", "machine": {"cpu": "AMD EPYC", "cpu_class": cls},
            "summary": harness.summarize(methods, rounds, "bfloat16")}


def test_summary_file_built_from_named_runs_with_baselines_and_aims(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import summaries

    runs = {"b1": _record("AMD Zen 5 (AVX512-BF16)", 10, 10, 12, 16),
            "b8": _record("AMD Zen 5 (AVX512-BF16)", 20, 19, 15, 19.3, batch=8),
            "moe": _record("AMD Zen 5 (AVX512-BF16)", 30, 31, 40, 41),
            "xeon": _record("Intel Xeon (AMX)", 5, 6, 7, 10)}
    for name, record in runs.items():
        (tmp_path / f"harness_{name}.json").write_text(json.dumps(record))
    summaries.main(["evict", f"qwen.batch_1={tmp_path / 'harness_b1.json'}",
                    f"qwen.batch_8={tmp_path / 'harness_b8.json'}", f"moe.batch_1={tmp_path / 'harness_moe.json'}",
                    f"qwen.batch_1={tmp_path / 'harness_xeon.json'}", "--out-dir", str(tmp_path)])
    s = json.loads((tmp_path / "evict.json").read_text())
    assert s["machine"] == "AMD Zen 5 (AVX512-BF16)" and s["rounds"] == 3
    b1 = s["qwen"]["batch_1"]
    assert (b1["autoregressive_tok_s"], b1["sparsever_kernels_only_tok_s"]) == (10, 10)
    assert b1["draft_model_best"] == {"k": 2, "mode": "vllm-draft_model-k2", "tok_s": 12}
    # the approximate candidate is faster but never the lossless summary's best
    assert b1["evict_best"]["mode"] == "evict" and b1["evict_best"]["tok_s"] == 16
    assert b1["results_file"] == "harness_b1" and s["sources"]["qwen.batch_8"] == "harness_b8"
    assert s["moe"]["batch_1"]["fixed_chain_best"]["tok_s"] == 40
    aims = s["aims"]
    assert aims["batch_1: best lossless >= 1.5x kernels only and >= 1.25x vLLM's best fixed chain"] == "met"
    # 19.3 < 0.97 x 20 (plain): below the best of the three
    assert aims["batch_8: EVICT >= 0.97x the best of plain, kernels only and vLLM's best fixed chain"] == "not met"
    assert aims["serving 8: the same"] == "not measured"
    # another CPU class goes under other_machines, with its own slots
    assert s["other_machines"]["Intel Xeon (AMX)"]["qwen"]["batch_1"]["autoregressive_tok_s"] == 5
    # serving slots come from a serve_load run: at 8, EVICT 0.98x the best other (met); at 32, 0.9x (not met)
    serve = {"args": {"rounds": 3}, "hardware": {"cpu": "Intel Xeon", "cpu_class": "Intel Xeon (AMX)"},
             "serving": {c: {"no_spec_tok_s": 10.0, "sparsever_kernels_only_tok_s": 9.0, "best_fixed_tok_s": 8.0,
                             "best_fixed": "vllm-draft_model-k1", "evict_tok_s": e, "evict_mode": "sparsever-evict-chain"}
                         for c, e in (("1", 15.0), ("8", 9.8), ("32", 9.0))}}
    (tmp_path / "serve_load_x.json").write_text(json.dumps(serve))
    summaries.main(["evict", f"qwen.batch_1={tmp_path / 'harness_xeon.json'}",
                    f"serving={tmp_path / 'serve_load_x.json'}", "--out-dir", str(tmp_path)])
    s = json.loads((tmp_path / "evict.json").read_text())
    assert s["machine"] == "Intel Xeon (AMX)" and s["sources"]["serving"] == "serve_load_x"
    assert s["serving"]["8"]["evict_vs_best_other"] == pytest.approx(0.98)
    assert (s["aims"]["serving 8: the same"], s["aims"]["serving 32: the same"]) == ("met", "not met")
    # a serving run without the kernels-only server is refused, naming what it lacks
    del serve["serving"]["8"]["sparsever_kernels_only_tok_s"]
    (tmp_path / "serve_load_y.json").write_text(json.dumps(serve))
    with pytest.raises(SystemExit, match="sparsever_kernels_only_tok_s"):
        summaries.main(["evict", f"serving={tmp_path / 'serve_load_y.json'}", "--out-dir", str(tmp_path)])
    # a --quick run lacks the baselines and is refused
    quick = _record("AMD Zen 5 (AVX512-BF16)", 10, 10, 12, 16)
    del quick["summary"]["methods"]["sparsever-kernels-only"]
    (tmp_path / "harness_quick.json").write_text(json.dumps(quick))
    with pytest.raises(SystemExit, match="three baselines"):
        summaries.main(["evict", f"qwen.batch_1={tmp_path / 'harness_quick.json'}", "--out-dir", str(tmp_path)])


def test_drafters_summary_names_eagle3_at_its_best_k_draft_model_and_the_head(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import summaries

    out = [[1, 2, 3]]
    methods = [harness.Method("plain", None, "plain"), harness.Method("sparsever-kernels-only", {}, "kernels_only"),
               *(harness.Method(f"vllm-eagle3-k{k}", {}, "vllm_fixed") for k in (1, 2)),
               harness.Method("vllm-draft_model-k3", {}, "vllm_fixed"),
               harness.Method("sparsever-eagle3-evict", {"method": "sparsever"}, "candidate")]
    speeds = {"plain": 10, "sparsever-kernels-only": 11, "vllm-eagle3-k1": 9, "vllm-eagle3-k2": 8,
              "vllm-draft_model-k3": 12, "sparsever-eagle3-evict": 10.5}
    rounds = [{n: _run(v, out, 4, 2) for n, v in speeds.items()} for _ in range(3)]
    for batch in (1, 8):
        record = _record("AMD Zen 4 (AVX512-BF16)", 1, 1, 1, 1, batch=batch)
        record["summary"] = harness.summarize(methods, rounds, "bfloat16")
        (tmp_path / f"harness_d{batch}.json").write_text(json.dumps(record))
    head = tmp_path / "head"
    head.mkdir()
    (head / "sparsever_eagle.json").write_text(json.dumps({
        "seconds": {"total": 600.0}, "heldout": {"trained": {"agreement_per_step": [0.4, 0.2]}},
        "train_tokens": 1000, "heldout_tokens": 100, "settings": {"text": "chat"}, "stopped_by_time_budget": True}))
    runs = [f"batch_1={tmp_path / 'harness_d1.json'}", f"batch_8={tmp_path / 'harness_d8.json'}"]
    summaries.main(["drafters", *runs, "--head", str(head), "--out-dir", str(tmp_path)])
    s = json.loads((tmp_path / "drafters.json").read_text())
    b1 = s["batch_1"]
    assert s["rounds"] == 3 and b1["sparsever_kernels_only_tok_s"] == 11
    assert (b1["vllm_eagle3_best_k"], b1["vllm_eagle3_best_tok_s"]) == (1, 9)
    assert (b1["draft_model_k"], b1["draft_model_tok_s"]) == (3, 12)
    assert b1["best_fixed"]["mode"] == "vllm-draft_model-k3"  # the strongest fixed chain over either drafter
    assert b1["sparsever_best"] == {"mode": "sparsever-eagle3-evict", "tok_s": 10.5, "mean_acceptance_length": 1.5}
    assert s["head"]["train_minutes"] == 10 and s["head"]["heldout_top1_agreement"] == 0.4
    assert s["aims"]["batch_1: sparsever's best mode over the head >= 1.0x vLLM eagle3 at its best k"] == "met"
    assert s["aims"]["batch_1: sparsever's best mode over the head >= 1.3x vLLM draft_model"] == "not met"
    # the head's training figures are required; a run without vLLM's draft_model chain is refused
    with pytest.raises(SystemExit):
        summaries.main(["drafters", *runs, "--out-dir", str(tmp_path)])
    record["summary"] = harness.summarize(methods[:-2] + methods[-1:], [
        {n: r[n] for n in r if n != "vllm-draft_model-k3"} for r in rounds], "bfloat16")
    (tmp_path / "harness_nodm.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="draft_model"):
        summaries.main(["drafters", f"batch_1={tmp_path / 'harness_nodm.json'}", "--head", str(head),
                        "--out-dir", str(tmp_path)])


def test_long_context_summary_keeps_step_timings_under_their_own_machine(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import summaries

    record = _record("AMD Zen 5 (AVX512-BF16)", 4, 4.4, 6, 7.2)
    record["metric"] = "decode"
    (tmp_path / "harness_8k.json").write_text(json.dumps(record))
    previous = {"machine": "Intel(R) Xeon(R) Processor, 2 cores", "date": "2026-12-02",
                "verify_step_ms": {"32768": {"decode_1": 357.9}}, "roof_fraction": {"32768": {"4": 0.15}},
                "contexts": {"8192": {"autoregressive_tok_s": 3.5}}}
    (tmp_path / "long_context.json").write_text(json.dumps(previous))
    summaries.main(["long_context", f"contexts.8192={tmp_path / 'harness_8k.json'}", "--out-dir", str(tmp_path)])
    s = json.loads((tmp_path / "long_context.json").read_text())
    c = s["contexts"]["8192"]
    assert s["metric"] == "decode" and s["rounds"] == 3 and "32768" not in s["contexts"]
    assert (c["autoregressive_tok_s"], c["sparsever_kernels_only_tok_s"]) == (4, 4.4)
    assert (c["draft_model_tok_s"], c["draft_model_k"]) == (6, 2) and c["best_lossless"] == {"mode": "evict", "tok_s": 7.2}
    assert c["best_approximate"]["mode"] == "sparse"
    # 7.2 / 4.4 = 1.64x kernels only and 1.2x the chain: met at 8K; 32K not measured
    aims = list(s["aims"].values())
    assert aims == ["met", "not measured"]
    # the old machine's step timings stay, under that machine, not mixed into this one's entry
    kept = s["other_machines"]["Intel(R) Xeon(R) Processor, 2 cores (kept from the previous summary)"]
    assert kept["verify_step_ms"] == previous["verify_step_ms"] and "verify_step_ms" not in s

    # step and kernel figures measured on the main machine's class go into its entry, and the old
    # machine's kept ones are dropped rather than mixed in
    steps = {"summary": {"8192": {"decode_1": 230.0}, "32736": {"decode_1": 330.0, "verify_4_vllm_kernel": 852.0,
                                                              "verify_4_sparsever_kernel": 305.0}}}
    kernels = {"roof": {"gemm_GFLOPs": 421.0, "roof_dtype": "bfloat16"},
               "attention": [{"ctx": 32768, "q_len": q, "roof_fraction_dense_ours": f} for q, f in
                             ((1, 0.3), (4, 0.66), (8, 0.78), (16, 0.83))]}
    (tmp_path / "verify_step_z.json").write_text(json.dumps(steps))
    (tmp_path / "kernels_z.json").write_text(json.dumps(kernels))
    summaries.main(["long_context", f"contexts.8192={tmp_path / 'harness_8k.json'}", "--out-dir", str(tmp_path),
                    "--steps", str(tmp_path / "verify_step_z.json"), "--kernels", str(tmp_path / "kernels_z.json")])
    s = json.loads((tmp_path / "long_context.json").read_text())
    assert s["verify_step_ms"]["32768"] == {"decode_1": 330.0, "verify_4_vllm_kernel": 852.0,
                                            "verify_4_sparsever_kernel": 305.0}
    assert s["roof_fraction"]["32768"] == {"4": 0.66, "8": 0.78, "16": 0.83}
    assert s["step_sources"] == {"verify_step_ms": "verify_step_z", "roof_fraction": "kernels_z"}
    assert "other_machines" not in s
    # SLOT.approximate=RUN: best_approximate from another run of the same class, against that run's own
    # plain decoding and best lossless candidate; the slot's other figures stay its own run's
    no_approx = _record("AMD Zen 5 (AVX512-BF16)", 4, 4.4, 6, 7.2)
    no_approx["metric"] = "decode"
    del no_approx["summary"]["methods"]["sparse"]
    approx = _record("AMD Zen 5 (AVX512-BF16)", 5, 5.5, 7, 8)  # its sparse candidate: 16 tok/s
    (tmp_path / "harness_8k_lossless.json").write_text(json.dumps(no_approx))
    (tmp_path / "harness_8k_approx.json").write_text(json.dumps(approx))
    summaries.main(["long_context", f"contexts.8192.approximate={tmp_path / 'harness_8k_approx.json'}",
                    f"contexts.8192={tmp_path / 'harness_8k_lossless.json'}", "--out-dir", str(tmp_path)])
    s = json.loads((tmp_path / "long_context.json").read_text())
    c = s["contexts"]["8192"]
    assert c["autoregressive_tok_s"] == 4 and c["results_file"] == "harness_8k_lossless"
    a = c["best_approximate"]
    assert (a["mode"], a["tok_s"], a["results_file"]) == ("sparse", 16, "harness_8k_approx")
    assert (a["vs_plain"], a["vs_best_lossless_same_run"]) == (pytest.approx(16 / 5), pytest.approx(16 / 8))
    assert s["sources"]["contexts.8192.approximate"] == "harness_8k_approx"
    # ... and refused where no run fills the slot it completes
    with pytest.raises(SystemExit, match="no SLOT=RUN fills"):
        summaries.main(["long_context", f"contexts.32768.approximate={tmp_path / 'harness_8k_approx.json'}",
                        f"contexts.8192={tmp_path / 'harness_8k_lossless.json'}", "--out-dir", str(tmp_path)])
    # a kernels run without the 32K rows is refused, naming the query lengths it lacks
    kernels["attention"] = [r for r in kernels["attention"] if r["q_len"] != 16]
    (tmp_path / "kernels_z.json").write_text(json.dumps(kernels))
    with pytest.raises(SystemExit, match=r"\[16\]"):
        summaries.main(["long_context", f"contexts.8192={tmp_path / 'harness_8k.json'}", "--out-dir", str(tmp_path),
                        "--steps", str(tmp_path / "verify_step_z.json"), "--kernels", str(tmp_path / "kernels_z.json")])


def test_serve_load_serving_section_has_the_summary_keys_and_spreads():
    sys.path.insert(0, str(ROOT / "bench"))
    import serve_load

    def rounds(*tputs):
        return [{"runs": [{"concurrency": 8, "output_throughput": t}], "acceptance": {}} for t in tputs]

    results = {"no-spec": rounds(10, 12, 11), serve_load.KERNELS_ONLY: rounds(9, 9, 9),
               "vllm-draft_model-k1": rounds(8, 7, 9), "vllm-draft_model-k2": rounds(6, 6, 6),
               "sparsever-evict-chain": rounds(13, 11, 12)}
    s = serve_load.serving(results, [8])["8"]
    assert (s["no_spec_tok_s"], s["sparsever_kernels_only_tok_s"]) == (11, 9)
    assert (s["best_fixed"], s["best_fixed_tok_s"]) == ("vllm-draft_model-k1", 8)
    assert (s["evict_mode"], s["evict_tok_s"]) == ("sparsever-evict-chain", 12)
    assert s["spread"]["no-spec"] == {"median": 11, "min": 10, "max": 12, "rounds": 3}


def test_serve_load_drafting_table_sums_evict_decisions_over_rounds():
    sys.path.insert(0, str(ROOT / "bench"))
    import serve_load

    def run(c, **counters):
        return {"concurrency": c, "output_throughput": 1.0, "sparsever_drafting": counters}

    evict = [{"runs": [run(1, evict_planned_depth_3=10), run(8, evict_planned_depth_0=30, evict_planned_depth_2=10,
                                                                  evict_probe_steps=2)]},
             {"runs": [run(1, evict_planned_depth_3=12), run(8, evict_planned_depth_0=20, evict_realized_skipped_steps=5)]}]
    results = {"no-spec": [{"runs": [run(1), run(8)]}] * 2, "sparsever-evict-chain": evict}
    lines = serve_load.drafting_table(results, [1, 8]).splitlines()
    assert lines[2:] == ["| sparsever-evict-chain | 1 | 22 | 0 | 0 | 0 |",
                         "| sparsever-evict-chain | 8 | 60 | 50 | 2 | 5 |"]
    assert serve_load.drafting_table({"no-spec": [{"runs": [run(1)]}]}, [1]) == ""
