"""Hostile command-line arguments: exit code 2 and one line naming the flag, before any engine starts
(no traceback). Each case fails in argument parsing or model/config resolution, so none loads a model."""

import subprocess
import sys

import pytest

CASES = [
    (["generate", "--model", "/nonexistent/m"], "--model: '/nonexistent/m' is neither a folder nor a known model"),
    (["generate", "--model", "/tmp", "--draft-model", "nosuch"], "--draft-model: 'nosuch' is neither a folder"),
    (["generate", "--num-speculative-tokens", "0"], "argument --num-speculative-tokens: must be an integer >= 1"),
    (["generate", "--max-tokens", "-1"], "argument --max-tokens: must be an integer >= 1"),
    (["profile-verify", "/nonexistent/m"], "MODEL: '/nonexistent/m' is neither a folder nor a known model"),
    (["calibrate", "/nonexistent/m"], "MODEL: '/nonexistent/m' is neither a folder nor a known model"),
    (["train-exits", "/nonexistent/m"], "MODEL: '/nonexistent/m' is neither a folder nor a known model"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0][:2]) + "-" + c[0][-1] for c in CASES])
def test_hostile_arguments_exit_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "vllm_sparsever.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
