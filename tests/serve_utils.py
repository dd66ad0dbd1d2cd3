"""Start `vllm serve` (the real console script) for a test module and stop it afterwards."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: Path, spec: dict, log: Path, *extra_args: str, env: dict | None = None):
    """Yield the server's base URL once /health answers; fail the test with the log otherwise."""
    args = [
        str(model), "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--served-model-name", "tiny", *(["--speculative-config", json.dumps(spec)] if spec else []),
        *extra_args,
    ]
    with running_vllm_serve(args, log, env=env) as (base, _):
        yield base


@contextlib.contextmanager
def running_vllm_serve(args: list[str], log: Path, env: dict | None = None, start_timeout_s: float = START_TIMEOUT_S):
    """`vllm serve <args> --host 127.0.0.1 --port <free>`: yield (base URL, process) once /health
    answers; fail the test with the log otherwise. The process group is stopped afterwards."""
    port = _free_port()
    vllm_bin = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm_bin), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc_env = {k: v for k, v in os.environ.items() if k != "VLLM_SPARSEVER_METRICS_DIR"}
    proc_env.update(env or {})
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=proc_env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + start_timeout_s
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not start in {start_timeout_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def sparsever_metrics(base: str) -> dict[str, float]:
    """The `sparsever:*` samples of /metrics, by full sample name (labels included)."""
    body = requests.get(f"{base}/metrics", timeout=10).text
    values = {}
    for line in body.splitlines():
        if line.startswith("sparsever:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
