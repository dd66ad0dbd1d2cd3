"""bench/gpu/check.py, the GPU check kit, in its `--device cpu --quick` form: every phase runs (the sanitizer
is skipped on CPU), so the kit cannot rot between the sessions that have a GPU."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = {"update_block_key_summaries", "select_kv_blocks", "block_sparse_tree_attention", "topk_swiglu_ffn",
       "topk_swiglu_ffn_gated", "input_sparse_gate", "dense_linear", "moe_route_and_prune", "moe_grouped_dispatch"}


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
