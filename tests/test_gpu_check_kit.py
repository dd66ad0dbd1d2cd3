"""bench/gpu/check.py, the GPU check kit, in its `--device cpu --quick` form: every phase runs (the sanitizer
is skipped on CPU), so the kit cannot rot between the sessions that have a GPU."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = {"update_block_key_summaries", "select_kv_blocks", "block_sparse_tree_attention", "topk_swiglu_ffn",
       "topk_swiglu_ffn_gated", "input_sparse_gate", "dense_linear", "int8_linear", "int4_linear",
       "moe_route_and_prune", "moe_grouped_dispatch"}


def test_gpu_check_kit_cpu_quick(tmp_path):
    out = tmp_path / "kit"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu/check.py"), str(out), "--device", "cpu", "--quick",
                           "--build-dir", str(tmp_path / "build")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "check.json").read_text())
    phases = report["phases"]
    assert [phases[p]["status"] for p in ("probe", "build", "correctness", "sanitizer", "speed")] == \
        ["ok", "ok", "ok", "skipped", "ok"]
    assert set(phases["build"]["kernels"]) == OPS and all("CPU" in v for v in phases["build"]["kernels"].values())
    corr = phases["correctness"]
    assert corr["simt_suite"]["status"] == "ok" and " passed" in corr["simt_suite"]["summary"]
    assert corr["failed"] == 0 and corr["cases"] >= 30 and set(corr["ops_checked"]) == OPS
    speed = phases["speed"]
    assert speed["copy_bandwidth"]["gbps"] > 0
    assert speed["attention"] and speed["ffn"] and speed["moe"]
    for r in speed["attention"]:
        assert r["ours_dense_s"] > 0 and r["sdpa_s"] > 0 and r["dense_vs_sdpa"] > 0
    assert "| build | ok |" in (out / "check.md").read_text()


def test_gpu_check_kit_rejects_unknown_phase(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu/check.py"), str(tmp_path), "--phases", "probe,bogus"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--phases: unknown ['bogus']" in proc.stderr


def test_ext_info_reports_each_ops_kernels(capsys, monkeypatch):
    import torch

    from vllm_sparsever.cli import main

    assert main(["ext-info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["kernels"]) == OPS and all("CPU" in keys for keys in info["kernels"].values())
    # A GPU machine with this CPU-only build: every op lacks its CUDA kernel, and the command says so.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["ext-info"]) == 1
    assert "no CUDA kernel for: update_block_key_summaries" in capsys.readouterr().err


def _synthetic_speed(ours_factor: float) -> dict:
    """A speed phase's result at every shape gpu.json names; ours = ours_factor x the floor."""
    bw = 4000.0
    attention = []
    for ctx in (8192, 32768, 131072):
        for q in (1, 4, 8, 16):
            floor = 2 * (ctx + q) * 8 * 128 * 2 / (bw * 1e9)
            attention.append({"ctx": ctx, "q_len": q, "floor_s": floor, "ours_dense_s": ours_factor * floor,
                              "ours_dense_cuda_cores_s": 10 * floor, "flex_s": 2 * floor, "sdpa_s": 3 * floor,
                              "ours_sparse_1_8_s": ours_factor * floor / 8, "select_1_8_s": floor / 50})
    batched = [{"requests": r, "ctx": 32768, "q_len": 4, "floor_s": 1e-4, "ours_dense_s": 1e-4, "flex_s": 2e-4,
                "ours_dense_cuda_cores_s": 1e-3} for r in (8, 32)]
    ffn = [{"tokens": t, "dense_s": 1e-4, "topk_0.25_s": 1e-4 / (2 / ours_factor), "topk_0.5_s": 8e-5}
           for t in (1, 4, 16)]
    moe = [{"tokens": t, "ours_s": 1e-5 * ours_factor, "grouped_gemm_s": 2e-5, "ours_gbps": 3000 / ours_factor}
           for t in (1, 4, 16)]
    return {"copy_bandwidth": {"gbps": bw}, "attention": attention, "batched": batched, "ffn": ffn, "moe": moe}


def test_gpu_summary_keys_and_aims():
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import check

    fast = check.gpu_summary(_synthetic_speed(1.1), "abc1234")
    assert set(fast["aims"].values()) == {"met"}, fast["aims"]
    cell = fast["attention"]["131072"]["16"]
    assert set(cell) >= {"floor_us", "ours_dense_us", "ours_sparse_1_8_us", "select_us", "flex_us", "sdpa_us",
                         "flashinfer_us"} and cell["flashinfer_us"] is None
    assert set(fast["batched"]) == {"8", "32"} and set(fast["ffn"]) == {"1", "4", "16"} == set(fast["moe"])
    slow = check.gpu_summary(_synthetic_speed(2.5), "abc1234")  # slower than FlexAttention, under 70% of the floor
    assert slow["aims"]["dense_vs_best"] == slow["aims"]["dense_roof"] == "not met"
    assert slow["aims"]["ffn"] == slow["aims"]["moe"] == "not met"
