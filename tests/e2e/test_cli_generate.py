"""`vllm-sparsever generate` (the set-up's main job) on a tiny model: it prints its result and ends
cleanly, with no "engine core exited unexpectedly" warning and no traceback after it."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_generate_ends_without_engine_warning(tiny_target, tiny_draft, tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_sparsever.cli", "generate", "--model", str(tiny_target), "--draft-model",
         str(tiny_draft), "--dtype", "float32", "--max-model-len", "256", "--max-tokens", "8",
         "--no-chat-template", "--prompt", "The quick brown fox", "--metrics-json", str(metrics)],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1"))  # as users run it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s:" in proc.stdout and metrics.exists()
    assert "exited unexpectedly" not in proc.stderr, proc.stderr[-3000:]
    assert "force killing" not in proc.stderr, proc.stderr[-3000:]  # the engine exited on its own
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
