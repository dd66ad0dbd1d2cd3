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
    (["train-eagle", "/nonexistent/m"], "MODEL: '/nonexistent/m' is neither a folder nor a known model"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0][:2]) + "-" + c[0][-1] for c in CASES])
def test_hostile_arguments_exit_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "vllm_sparsever.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


LIMIT = 512  # the tiny model's maximum length

# (argv after the model, message): lengths past the model's limit, and sizes that are not positive.
MODEL_CASES = [
    (["generate", "--model", "{m}", "--max-model-len", "100000"],
     f"--max-model-len 100000: the model's maximum length is {LIMIT}; the largest --max-model-len allowed is {LIMIT}"),
    (["calibrate", "{m}", "--max-tokens", "100000"],
     f"--max-tokens 100000: the model's maximum length is {LIMIT}; the largest --max-tokens allowed is {LIMIT}"),
    (["calibrate", "{m}", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1"),
    (["train-exits", "{m}", "--max-new-tokens", "100000"],
     f"--max-new-tokens 100000: the model's maximum length is {LIMIT}, less 328 tokens the command adds; "
     f"the largest --max-new-tokens allowed is {LIMIT - 328}"),
    (["train-exits", "{m}", "--time-budget", "0"], "--time-budget: must be > 0 minutes, got 0.0"),
    (["train-eagle", "{m}", "--max-new-tokens", "100000"],
     f"--max-new-tokens 100000: the model's maximum length is {LIMIT}, less 328 tokens the command adds; "
     f"the largest --max-new-tokens allowed is {LIMIT - 328}"),
    (["train-eagle", "{m}", "--time-budget", "0"], "--time-budget: must be > 0 minutes, got 0.0"),
    (["train-eagle", "{m}", "--ttt-steps", "0"], "argument --ttt-steps: must be an integer >= 1"),
    (["train-eagle", "{m}", "--num-prompts", "100000", "--generator", "hf"], "--num-prompts: 100000 > "),
    (["train-eagle", "{m}", "--aux-layers", "0", "9"], "--aux-layers: increasing distinct layer ids in 0..2"),
    (["profile-verify", "{m}", "--max-context", "100000"],
     f"--max-context 100000: the model's maximum length is {LIMIT}, less 80 tokens the command adds; "
     f"the largest --max-context allowed is {LIMIT - 80}"),
    (["profile-verify", "{m}", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
]


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    from tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("short") / "m", max_position_embeddings=LIMIT)


@pytest.mark.parametrize("argv,message", MODEL_CASES, ids=[" ".join(c[0][:1] + c[0][2:3]) + "=" + c[0][-1]
                                                           for c in MODEL_CASES])
def test_lengths_past_the_model_and_sizes_below_one_exit_2_with_one_line(short_model, argv, message):
    argv = [a.format(m=short_model) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "vllm_sparsever.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
