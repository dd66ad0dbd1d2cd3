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


def _server_args(model: Path, spec: dict | None, *extra_args: str) -> list[str]:
    return [
        str(model), "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--served-model-name", "tiny", *(["--speculative-config", json.dumps(spec)] if spec else []),
        *extra_args,
    ]


@contextlib.contextmanager
def running_server(model: Path, spec: dict, log: Path, *extra_args: str, env: dict | None = None):
    """Yield the server's base URL once /health answers; fail the test with the log otherwise."""
    with running_vllm_serve(_server_args(model, spec, *extra_args), log, env=env) as (base, _):
        yield base


@contextlib.contextmanager
def running_servers(model: Path, specs: dict[str, dict | None], logs: Path, *extra_args: str,
                    env: dict | None = None):
    """`running_server` for each of `specs` ({name: speculative config or None}), started together
    so their start-ups overlap: yield {name: base URL} once every /health answers (logs/<name>.log)."""
    servers: list[_Server] = []
    try:
        for name, spec in specs.items():  # appended one by one: a failed start still stops the earlier ones
            servers.append(_Server(_server_args(model, spec, *extra_args), logs / f"{name}.log", env))
        deadline = time.time() + START_TIMEOUT_S * len(servers)  # their start-ups share the cores
        for server in servers:
            server.wait_healthy(deadline)
        yield {name: server.base for name, server in zip(specs, servers, strict=True)}
    finally:
        for server in servers:
            server.stop()


class _Server:
    """One `vllm serve <args> --host 127.0.0.1 --port <free>` process (its own process group)."""

    def __init__(self, args: list[str], log: Path, env: dict | None) -> None:
        port = _free_port()
        vllm_bin = Path(sys.executable).with_name("vllm")
        cmd = [str(vllm_bin), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
        proc_env = {k: v for k, v in os.environ.items() if k != "VLLM_SPARSEVER_METRICS_DIR"}
        proc_env.update(env or {})
        self.log = log
        with open(log, "w") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=proc_env,
                                         start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"

    def wait_healthy(self, deadline: float) -> None:
        """Return once /health answers; fail the test with the log if the server exits or the deadline passes."""
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if requests.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not start in time:\n{self.log.read_text()[-4000:]}")
            time.sleep(1)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_vllm_serve(args: list[str], log: Path, env: dict | None = None, start_timeout_s: float = START_TIMEOUT_S):
    """`vllm serve <args> --host 127.0.0.1 --port <free>`: yield (base URL, process) once /health
    answers; fail the test with the log otherwise. The process group is stopped afterwards."""
    server = _Server(args, log, env)
    try:
        server.wait_healthy(time.time() + start_timeout_s)
        yield server.base, server.proc
    finally:
        server.stop()


def sparsever_metrics(base: str) -> dict[str, float]:
    """The `sparsever:*` samples of /metrics, by full sample name (labels included)."""
    body = requests.get(f"{base}/metrics", timeout=10).text
    values = {}
    for line in body.splitlines():
        if line.startswith("sparsever:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def settled_sparsever_metrics(base: str, ready=lambda values: True, timeout_s: float = 15.0,
                              interval_s: float = 0.3) -> dict[str, float]:
    """The `sparsever:*` samples once they have settled: /metrics polled until `ready(values)` holds and
    two reads `interval_s` apart agree (workers write snapshots at most every 0.25 s), at most
    `timeout_s`; then the last read (the caller's assertions say what is missing)."""
    deadline = time.time() + timeout_s
    last = None
    while True:
        values = sparsever_metrics(base)
        if (values == last and ready(values)) or time.time() > deadline:
            return values
        last = values
        time.sleep(interval_s)
