"""bench/draft_pass.py's arithmetic: a pass's parts, its bytes and its roof at the measured bandwidth."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import draft_pass  # noqa: E402

BYTES = {"projection_bytes": 300e6, "head_bytes": 60e6, "kv_bytes_per_token": 10e3, "attention_window": None}


def _pass(rows, tokens, context, total, **parts):
    return {"rows": rows, "tokens": tokens, "context": context, "total_s": total, **parts}


def test_passes_split_by_kind_with_parts_and_roof():
    passes = [_pass(1, 1, 100, 0.050, metadata=0.002, layers=0.040, head=0.005, bookkeeping=0.001),
              _pass(1, 1, 300, 0.070, metadata=0.002, layers=0.060, head=0.005, bookkeeping=0.001),
              _pass(1, 3, 200, 0.090, layers=0.080)]
    out = draft_pass.summarize(passes, BYTES, copy_GBps=10.0)
    one = out["one_token"]
    assert (one["passes"], one["context"], one["total_ms"]) == (2, 200, pytest.approx(60.0))
    assert one["layers_ms"] == pytest.approx(50.0) and one["other_ms"] == pytest.approx(60.0 - 58.0)
    # 300 + 60 MB of weights + 1 row x 200 tokens x 10 KB of K/V = 362 MB at 10 GB/s: 36.2 ms
    assert one["bytes"] == pytest.approx(362e6) and one["roof_ms"] == pytest.approx(36.2)
    assert one["roof_fraction"] == pytest.approx(36.2 / 60.0)
    assert out["catch_up"]["passes"] == 1 and out["catch_up"]["tokens"] == 3
    # a draft attention window caps the K/V read per row
    windowed = draft_pass.summarize(passes[:1], {**BYTES, "attention_window": 50}, copy_GBps=10.0)["one_token"]
    assert windowed["bytes"] == pytest.approx(360e6 + 50 * 10e3)


def test_report_has_a_row_per_batch_and_kind():
    passes = [_pass(8, 8, 100, 0.08, layers=0.07)]
    record = {"spec": {"model": "/m/qwen2.5-coder-0.5b-w8a8"}, "command": "python bench/draft_pass.py",
              "hardware": {"cpu": "AMD EPYC", "cpu_class": "AMD Zen 4 (AVX512-BF16)", "cores": 2},
              "versions": {"git": "abc"}, "started": "2026-12-06T00:00:00",
              "bandwidth": {"threads": 1, "copy_GBps": 10.0, "megabytes": 512},
              "pass_bytes": {**BYTES, "head_rows": 32768},
              "batch_sizes": {"8": {"summary": draft_pass.summarize(passes, BYTES, 10.0)}},
              "profile": {"passes": 2, "ms_per_pass": 5.0, "ops_us_per_pass": {"aten::linear": 3000.0}, "calls_per_pass": {"aten::linear": 96}}}
    lines = draft_pass.report(record)
    assert any(line.startswith("| 8 | one_token | 1 | 8 |") for line in lines)
    assert "| aten::linear | 3.00 | 96 |" in lines


def test_split_layers_parts_and_their_python():
    """--split-layers: the layers' time by module kind, medians per pass; Python is what is left."""
    passes = [_pass(1, 1, 100, 0.020, layers=0.016, layer_linear=0.010, layer_attention=0.002, layer_norm=0.001,
                    layer_activation=0.0005, layer_rotary=0.0005)] * 3
    one = draft_pass.summarize(passes, BYTES, copy_GBps=10.0)["one_token"]
    assert one["layer_linear_ms"] == pytest.approx(10.0) and one["layer_python_ms"] == pytest.approx(2.0)
    plain = draft_pass.summarize([_pass(1, 1, 100, 0.020, layers=0.016)], BYTES, copy_GBps=10.0)["one_token"]
    assert "layer_python_ms" not in plain  # not split: no such column


def test_split_layers_kinds_match_vllms_modules_not_the_models_wrappers():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
    import draft_pass_worker

    def named(name):
        return type(name, (), {})()

    kinds = {n: draft_pass_worker._layer_kind(named(n)) for n in (
        "QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear", "Attention", "Qwen2Attention",
        "LlamaAttention", "RotaryEmbedding", "RMSNorm", "SiluAndMul", "Qwen2MLP", "Qwen2DecoderLayer")}
    assert kinds == {"QKVParallelLinear": "linear", "RowParallelLinear": "linear",
                     "MergedColumnParallelLinear": "linear", "Attention": "attention", "Qwen2Attention": None,
                     "LlamaAttention": None, "RotaryEmbedding": "rotary", "RMSNorm": "norm",
                     "SiluAndMul": "activation", "Qwen2MLP": None, "Qwen2DecoderLayer": None}
