"""Ray on vLLM-CPU across two hosts: the documented recipe (docs/serving.md), run as written on two
"hosts" made of network, mount and IPC namespaces (tests/netns_hosts.py): the Ray head and the
server on one, a Ray worker node on the other, `vllm serve` with tensor parallelism 2 (one rank per
host), sparsever drafting with a draft model under the early-exit hierarchy. Then the worker host
is lost mid-stream (its link goes down, then its processes die: a power cut, no socket closed)
and a restarted worker node serves again.

The block is parsed and run as written; the test adds only what one machine posing as two needs:
one CPU per node (`--num-cpus=1`, `VLLM_CPU_OMP_THREADS_BIND`), no usage stats or dashboard, and
for the server `--dtype float32 --enforce-eager --seed 0 --max-model-len 512`, a model name and
`VLLM_SERVER_DEV_MODE=1` (its `/collective_rpc` asks both ranks for their state). The models are
copied to the same path on both hosts, as the recipe asks. One cluster for the whole module.

Needs root and `ip netns`; skips naming what is missing otherwise.
"""

import json
import os
import re
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPTS
from netns_hosts import missing_requirement, two_hosts
from tiny_models import prompts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

README = Path(__file__).resolve().parents[2] / "docs" / "serving.md"  # the recipe's page
RECIPE_MARK = "<!-- recipe: ray-on-cpu"
RAY = Path(sys.executable).with_name("ray")
VLLM = Path(sys.executable).with_name("vllm")
MODELS = "/tmp/models"  # the same path on both hosts, each host's own copy (its /tmp is private)
PORT = 8000  # vllm serve's default
START_TIMEOUT_S = float(os.environ.get("SPARSEVER_TEST_RAY_START_S", 420))
LOST_BOUND_S = 120  # every in-flight request ends with an error within this after the host is lost (Ray: ~60 s)
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-model-len", "512",
               "--served-model-name", "tiny"]
VERIFY_LAYER = 1  # of the tiny target's 2 layers: the hierarchy's early-exit verifier


def recipe_steps() -> list[tuple[dict[str, str], list[str]]]:
    """The recipe as [(exported env, argv)], one per `# step` (head, other node, serve)."""
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


def _substitute(words: list[str], values: dict[str, str]) -> list[str]:
    pattern = re.compile("|".join(sorted(map(re.escape, values), key=len, reverse=True)))
    return [pattern.sub(lambda m: values[m.group(0)], w) for w in words]


def _substitute_env(env: dict[str, str], values: dict[str, str]) -> dict[str, str]:
    return {k: _substitute([v], values)[0] for k, v in env.items()}


def _http() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # straight to the head over the client link, never a proxy
    return session


class Cluster:
    """The two hosts, the recipe and how to run its steps on them."""

    def __init__(self, head, worker, log_dir: Path) -> None:
        self.head, self.worker, self.log_dir = head, worker, log_dir
        self.steps = recipe_steps()
        self.values = {"HEAD_IP": head.ip, "MODEL": f"{MODELS}/target", "DRAFT": f"{MODELS}/draft",
                       "HEADS": f"{MODELS}/exit_heads"}
        self.base_env = {k: v for k, v in os.environ.items()
                         if not k.startswith("RAY_") and k != "VLLM_SPARSEVER_METRICS_DIR"}
        self.base = f"http://{head.extra_ips[0]}:{PORT}"  # the client's way to the head
        self.http = _http()
        self.servers = 0

    def start_node(self, host, step: int, cpu: str) -> None:
        env, argv = self.steps[step]
        values = {**self.values, "NODE_IP": host.ip}
        node_env = {**self.base_env, **_substitute_env(env, values), "VLLM_CPU_OMP_THREADS_BIND": cpu}
        extra = ["--num-cpus=1", "--disable-usage-stats"] + (["--include-dashboard=false"] if step == 0 else [])
        cmd = [str(RAY), *_substitute(argv, values)[1:], *extra]
        done = host.run(cmd, node_env, timeout=300)
        assert done.returncode == 0, f"{host.name}: {shlex.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"

    def alive_nodes(self) -> list[str]:
        """Addresses of the live Ray nodes holding the recipe's resource, asked on the head."""
        code = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
                "print(sorted(n['NodeManagerAddress'] for n in ray.nodes() "
                "if n['Alive'] and n['Resources'].get('sparsever_cpu')))" % f"{self.head.ip}:6379")
        out = self.head.run([sys.executable, "-c", code], self.base_env, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print of a list

    def wait_for_nodes(self, timeout_s: float = 90) -> None:
        deadline = time.time() + timeout_s
        while (nodes := self.alive_nodes()) != sorted([self.head.ip, self.worker.ip]):
            assert time.time() < deadline, f"Ray nodes did not come up: {nodes}"
            time.sleep(2)

    def start_server(self):
        """The recipe's `vllm serve` on the head (its own process group); returns (process, log)."""
        env, argv = self.steps[2]
        self.servers += 1
        log = self.log_dir / f"server{self.servers}.log"
        server_env = {**self.base_env, **_substitute_env(env, self.values), "VLLM_SERVER_DEV_MODE": "1"}
        proc = self.head.popen([str(VLLM), *_substitute(argv, self.values)[1:], *SERVER_ARGS], server_env, log)
        deadline = time.time() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                if self.http.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return proc, log
            except requests.RequestException:
                pass
            if time.time() > deadline:
                stacks = self.diagnose()
                proc.kill()
                pytest.fail(f"vllm serve did not start in time:\n{log.read_text()[-3000:]}\n{stacks}")
            time.sleep(1)

    def diagnose(self) -> str:
        """Where the vLLM processes of both hosts are (py-spy, if installed) and Ray's worker logs."""
        out = []
        spy = Path(sys.executable).with_name("py-spy")
        for host in (self.head, self.worker):
            for pid, cmd in vllm_processes(host):
                if spy.exists():
                    done = host.run([str(spy), "dump", "--pid", str(pid)], self.base_env, timeout=60)
                    out.append(f"--- {host.name} {pid} {cmd[:80]}\n{done.stdout[-3000:]}{done.stderr[-500:]}")
            logs = host.path("/tmp/ray/session_latest/logs")
            for path in sorted(logs.glob("worker-*")) if logs.exists() else []:
                text = path.read_text(errors="replace")
                if "RayWorkerProc" in text or "Error" in text:
                    out.append(f"--- {host.name} {path.name}\n{text[-2000:]}")
        return "\n".join(out)

    def stop_server(self, proc) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)

    def rpc(self, method: str) -> list:
        r = self.http.post(f"{self.base}/collective_rpc", json={"method": method}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["results"]

    def complete(self, i: int) -> dict:
        r = self.http.post(f"{self.base}/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": prompts(GREEDY_PROMPTS)[i], "max_tokens": GREEDY_MAX_TOKENS,
            "temperature": 0.0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]


def vllm_processes(host) -> list[tuple[int, str]]:
    """The host's processes of a vLLM server: the front end, its engine core, Ray's vLLM workers."""
    return [(pid, cmd) for pid, cmd in host.processes()
            if "RayWorkerProc" in cmd or "EngineCore" in cmd or " serve " in f" {cmd} "]


@pytest.fixture(scope="module")
def hosts():
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    with two_hosts() as made:
        yield made


@pytest.fixture(scope="module")
def exit_heads(tiny_target, tmp_path_factory) -> Path:
    from e2e.test_self_draft import make_heads

    return make_heads(tiny_target, tmp_path_factory.mktemp("ray_heads") / "exit_heads", layers=(VERIFY_LAYER,))


@pytest.fixture(scope="module")
def cluster(hosts, tiny_target, tiny_draft, exit_heads, tmp_path_factory):
    """The recipe's two Ray nodes, one per host (CPU 0 on the head, 1 on the worker)."""
    head, worker, _ = hosts
    for host in (head, worker):
        for src, name in ((tiny_target, "target"), (tiny_draft, "draft"), (exit_heads, "exit_heads")):
            host.copy_in(src, f"{MODELS}/{name}")
    c = Cluster(head, worker, tmp_path_factory.mktemp("ray_hosts"))
    c.start_node(head, 0, "0")
    c.start_node(worker, 1, "1")
    c.wait_for_nodes()
    return c


@pytest.fixture(scope="module")
def server(cluster):
    proc, log = cluster.start_server()
    yield proc, log
    cluster.stop_server(proc)


def test_recipe_block_is_the_documented_one():
    steps = recipe_steps()
    for env, _ in steps:
        assert env.get("VLLM_SPARSEVER_RAY_CPU") == "1"
    assert any(w.startswith("--node-ip-address=") for w in steps[0][1])
    assert any(w.startswith("--node-ip-address=") for w in steps[1][1])
    serve = steps[2][1]
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    assert serve[serve.index("--tensor-parallel-size") + 1] == "2"
    spec = json.loads(serve[serve.index("--speculative-config") + 1])
    assert spec["method"] == "sparsever" and spec["early_exit"]["enabled"] is True


def test_two_hosts_share_nothing_but_their_link(hosts):
    """The fixture's premise: separate /tmp, /dev/shm and addresses; the worker reaches only the
    head's link address."""
    head, worker, _ = hosts
    marker = f"/tmp/only-on-head-{os.getpid()}"
    done = head.run(["sh", "-c", f"touch {marker} /dev/shm/only-on-head"], {})
    assert done.returncode == 0, done.stderr
    assert head.path(marker).exists() and not worker.path(marker).exists() and not Path(marker).exists()
    assert not worker.path("/dev/shm/only-on-head").exists()
    probe = ("import socket, sys; s = socket.socket(); s.settimeout(3)\n"
             "try:\n s.connect((sys.argv[1], 9)); print('connected')\n"
             "except OSError as e:\n print(type(e).__name__, e.errno)")
    # The head's client-link address (its default route's) is unreachable from the worker.
    out = worker.run([sys.executable, "-c", probe, head.extra_ips[0]], {})
    assert "Network is unreachable" in out.stdout or "101" in out.stdout, out.stdout + out.stderr
    # The head's link address is reachable (refused: nothing listens on port 9).
    out = worker.run([sys.executable, "-c", probe, head.ip], {})
    assert "ConnectionRefusedError" in out.stdout, out.stdout + out.stderr


def test_serve_over_two_hosts_equals_plain_greedy_with_the_hierarchy_on_both_ranks(
    cluster, server, plain_greedy
):
    from serve_utils import sparsever_metrics

    proc, log = server
    for i, (tokens, text) in enumerate(plain_greedy):
        choice = cluster.complete(i)
        assert choice["token_ids"] == tokens, f"prompt {i} differs"
        assert choice["text"] == text
    workers = sorted(cluster.rpc("sparsever_worker_info"), key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == [0, 1]
    assert all(w["model_runner"] == "SparseverCPUModelRunner" and w["plugin_registered"] for w in workers)
    # One rank per host: rank 0 runs on the head, rank 1 on the worker host.
    head_pids = {pid for pid, _ in cluster.head.processes()}
    worker_pids = {pid for pid, _ in cluster.worker.processes()}
    assert workers[0]["pid"] in head_pids and workers[1]["pid"] in worker_pids, (workers, head_pids, worker_pids)
    # Each node's binding from its own `ray start` environment.
    assert [(w["cpus"], w["num_threads"]) for w in workers] == [([0], 1), ([1], 1)]
    # Both ranks ran the hierarchy: drafts, intermediate (early-exit) verification, full verification.
    ranks = cluster.rpc("sparsever_metrics")
    assert len(ranks) == 2
    for r in ranks:
        h = r["drafting"]
        assert r["num_drafts"] > 0 and r["num_verify_steps"] > 0, r
        assert 0 < h["hier_intermediate_accepted"] < h["hier_intermediate_drafts"], h
        assert h["hier_rounds"] > 0 and h["hier_pending_tokens"] > 0, h
    # The ranks agree on what was verified (TP ranks run the same steps).
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert ranks[0][key] == ranks[1][key], key
    # /metrics: the head's snapshot (rank 0); rank 1 writes its own on the worker host, never the head's.
    values = sparsever_metrics(cluster.base)
    assert values["sparsever:num_drafts_total"] > 0
    assert 0 < values['sparsever:level_acceptance_rate{level="intermediate"}'] < 1

    def snapshots(host) -> dict[str, list[str]]:
        return {d.name: sorted(p.name for p in d.glob("rank*.json"))
                for d in host.path("/tmp").glob("vllm-sparsever-metrics-*")}

    on_head, on_worker = snapshots(cluster.head), snapshots(cluster.worker)
    # The same directory name (the front end's, passed to both ranks), one rank's file on each host.
    assert list(on_worker.values()) == [["rank1.json"]] and on_worker.keys() <= on_head.keys(), (on_head, on_worker)
    assert [files for files in on_head.values() if files] == [["rank0.json"]], on_head


class _Stream(threading.Thread):
    """One streaming completion; records how it ended and when."""

    def __init__(self, base: str, i: int) -> None:
        super().__init__(daemon=True)
        self.base, self.i = base, i
        self.chunks = 0
        self.outcome: str | None = None
        self.detail = ""
        self.ended = 0.0
        self.first_chunk = threading.Event()

    def run(self) -> None:
        try:
            with _http().post(f"{self.base}/v1/completions", stream=True, timeout=(10, 240), json={
                    "model": "tiny", "prompt": prompts(4, seed=11)[self.i], "max_tokens": 440,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}) as r:
                if r.status_code != 200:
                    self.outcome, self.detail = "http_error", f"{r.status_code} {r.text[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        self.outcome = self.outcome or "done"
                        return
                    event = json.loads(data)
                    if "error" in event:
                        self.outcome, self.detail = "error_event", json.dumps(event)[:300]
                        continue
                    self.chunks += 1
                    self.first_chunk.set()
                self.outcome = self.outcome or "closed"  # the body ended without [DONE]
        except requests.exceptions.ReadTimeout as e:
            self.outcome, self.detail = "timeout", str(e)
        except requests.RequestException as e:
            self.outcome, self.detail = "connection_error", str(e)[:300]
        finally:
            self.ended = time.time()
            self.first_chunk.set()


def test_worker_host_lost_mid_stream_fails_requests_in_bounded_time_then_a_restarted_node_serves(
    cluster, server, plain_greedy
):
    proc, log = server
    assert cluster.http.get(f"{cluster.base}/health", timeout=5).status_code == 200
    streams = [_Stream(cluster.base, i) for i in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first_chunk.wait(120) and s.outcome is None, (s.outcome, s.detail)
    # Power cut: the link first (nothing the worker sends reaches the head), then its processes.
    lost_at = time.time()
    cluster.worker.link_down()
    cluster.worker.kill_all()
    health: list[tuple[float, int | str]] = []
    while any(s.is_alive() for s in streams) and time.time() - lost_at < LOST_BOUND_S + 60:
        try:
            health.append((time.time() - lost_at, cluster.http.get(f"{cluster.base}/health", timeout=5).status_code))
        except requests.RequestException as e:
            health.append((time.time() - lost_at, type(e).__name__))
        time.sleep(1)
    ended = [(s.outcome, round(s.ended - lost_at, 1) if s.ended else None, s.chunks, s.detail) for s in streams]
    print(f"in-flight requests after the worker host was lost: {ended}")
    # Every in-flight request ended, with an error, within the bound: none finished, none hung.
    for outcome, after, _, detail in ended:
        assert outcome in ("error_event", "closed", "connection_error", "http_error"), ended
        assert after is not None and after <= LOST_BOUND_S, ended
    # Health is honest: never 200 once the requests have failed.
    failed_by = max(after for _, after, _, _ in ended)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            code = cluster.http.get(f"{cluster.base}/health", timeout=5).status_code
        except requests.RequestException as e:
            code = type(e).__name__
        health.append((time.time() - lost_at, code))
        if code != 200 and proc.poll() is not None:
            break
        time.sleep(1)
    last_ok = max((t for t, code in health if code == 200), default=None)
    first_bad = min(((round(t, 1), code) for t, code in health if code != 200), default=None)
    print(f"/health after the loss: 200 until {last_ok and round(last_ok, 1)} s, then {first_bad} (s, status)")
    assert all(code != 200 for t, code in health if t >= failed_by), health
    # A new request gets an error, not a hang.
    try:
        r = cluster.http.post(f"{cluster.base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0.0})
        assert r.status_code >= 500, r.text
    except requests.ConnectionError:
        pass  # the server has stopped
    # The server stops by itself, and leaves no vLLM process on either host.
    assert proc.poll() is not None, "the server still runs after its engine died"
    deadline = time.time() + 60
    while (left := vllm_processes(cluster.head) + vllm_processes(cluster.worker)) and time.time() < deadline:
        time.sleep(2)
    assert not left, f"orphaned vLLM processes: {left}"
    assert not cluster.worker.processes(), cluster.worker.processes()
    text = log.read_text()
    assert "died unexpectedly" in text or "Worker failed with error" in text or "EngineDeadError" in text, text[-4000:]

    # The worker host comes back: its link, then the recipe's second step; a new server serves.
    cluster.worker.link_up()
    cluster.start_node(cluster.worker, 1, "1")
    cluster.wait_for_nodes()
    proc2, _ = cluster.start_server()
    try:
        choice = cluster.complete(0)
        assert choice["token_ids"] == plain_greedy[0][0]
        assert len(cluster.rpc("sparsever_worker_info")) == 2
    finally:
        cluster.stop_server(proc2)
    deadline = time.time() + 60
    while (left := vllm_processes(cluster.head) + vllm_processes(cluster.worker)) and time.time() < deadline:
        time.sleep(2)
    assert not left, f"vLLM processes left after the restarted server stopped: {left}"
