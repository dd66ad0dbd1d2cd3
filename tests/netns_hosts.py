"""Two "hosts" on one machine for tests of multi-node deployments (tests/e2e/test_ray_cpu.py).

Each host is a network namespace with its own address on a private veth link between the two
(HOST_LINK), and its own mount and IPC namespaces with private tmpfs mounts on `/tmp` and
`/dev/shm`; its HOME is `/tmp/home`, inside that private `/tmp`. Nothing passes between the hosts
but that link: no loopback, no files under /tmp, no shared memory. The rest of the filesystem
(the Python environment, the repository) is the same on both, as on two machines installed alike.

A third link joins the machine's own network namespace (the test process: the client, a third
machine) to the head only, and is the head's default route (its "uplink"): an address a process
on the head finds through the default route is on the client link, which the worker cannot reach.
IP forwarding stays off in every namespace, so the worker reaches nothing but the head's
HOST_LINK address.

Each host is held by a `sleep` process started as
`ip netns exec NS unshare --mount --ipc -- sh -c 'mount tmpfs /tmp, /dev/shm; exec sleep infinity'`;
commands run in it through `nsenter --target <holder> --net --mount --ipc`. Processes of a host
are found by their network namespace (/proc/PID/ns/net), so a process that double-forks (Ray's
daemons) is still found, and everything is killed at the end.

Needs root, `ip` with `netns`, `unshare` and `nsenter` (util-linux); `missing_requirement()` names
what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "svhost"  # network namespaces and veths of these fixtures: svhost<pid>{h,w}
HOME = "/tmp/home"


def missing_requirement() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "two-host fixture needs root (network, mount and IPC namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"two-host fixture needs `{tool}`"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"two-host fixture needs `ip netns`: {probe.stderr.strip()}"
    return None


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _netns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


@dataclass
class Host:
    name: str  # "head" or "worker"
    netns: str
    ip: str  # on HOST_LINK
    link: str  # this host's end of HOST_LINK
    holder: subprocess.Popen | None = None
    net_inode: int = 0
    log_dir: Path | None = None
    extra_ips: list[str] = field(default_factory=list)

    def nsenter(self) -> list[str]:
        assert self.holder is not None
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--ipc", "--", "env", "-C", HOME]

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` as this host's environment: HOME and TMPDIR are the host's own."""
        return {**env, "HOME": HOME, "TMPDIR": "/tmp"}

    def run(self, argv: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(self.nsenter() + argv, env=self.env(env), capture_output=True, text=True,
                              timeout=timeout)

    def popen(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """A process on this host in its own session (process group), output to `log`."""
        with open(log, "w") as out:
            return subprocess.Popen(self.nsenter() + argv, env=self.env(env), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def path(self, path: str) -> Path:
        """`path` as this host sees it (its private /tmp included), from outside."""
        assert self.holder is not None
        return Path(f"/proc/{self.holder.pid}/root") / path.lstrip("/")

    def copy_in(self, src: Path, dest: str) -> None:
        """Copy a file tree of this machine to `dest` on this host (for its private /tmp)."""
        target = self.path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, target, symlinks=False)

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process in this host but its holder."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or (self.holder is not None and int(entry) == self.holder.pid):
                continue
            if _netns_inode(f"/proc/{entry}/ns/net") != self.net_inode:
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            out.append((int(entry), cmdline))
        return out

    def kill_all(self, sig: int = signal.SIGKILL) -> list[tuple[int, str]]:
        """Send `sig` to every process of this host but its holder; return them."""
        procs = self.processes()
        for pid, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return procs

    def link_down(self) -> None:
        _sh("ip", "-n", self.netns, "link", "set", self.link, "down")

    def link_up(self) -> None:
        _sh("ip", "-n", self.netns, "link", "set", self.link, "up")


def _clean_stale() -> None:
    """Namespaces left by a run of these fixtures whose process is gone (a killed test run)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or not name[len(PREFIX):-1].isdigit():
            continue
        owner = int(name[len(PREFIX):-1])
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            inode = _netns_inode(f"/run/netns/{name}")
            for entry in os.listdir("/proc"):
                if entry.isdigit() and _netns_inode(f"/proc/{entry}/ns/net") == inode:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host, str]]:
    """Yield (head, worker, client_ip): the client_ip is this process's end of the client link,
    `head.extra_ips[0]` the head's. Everything made is removed afterwards, also after a failure."""
    _clean_stale()
    tag = f"{PREFIX}{os.getpid()}"
    net = 10 + os.getpid() % 240  # 10.213.<net>.0/29
    base = f"10.213.{net}"
    head = Host("head", f"{tag}h", f"{base}.1", f"{tag}h0")
    worker = Host("worker", f"{tag}w", f"{base}.2", f"{tag}w0")
    client_link, head_client_link = f"{tag}c", f"{tag}h1"
    client_ip, head_client_ip = f"{base}.5", f"{base}.6"
    head.extra_ips.append(head_client_ip)
    made_ns: list[str] = []
    made_client_link = False
    try:
        for host in (head, worker):
            _sh("ip", "netns", "add", host.netns)
            made_ns.append(host.netns)
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        # HOST_LINK: head <-> worker.
        _sh("ip", "link", "add", head.link, "netns", head.netns, "type", "veth", "peer", "name", worker.link,
            "netns", worker.netns)
        for host in (head, worker):
            _sh("ip", "-n", host.netns, "addr", "add", f"{host.ip}/30", "dev", host.link)
            _sh("ip", "-n", host.netns, "link", "set", host.link, "up")
        # The client link: this namespace <-> head, the head's default route.
        _sh("ip", "link", "add", client_link, "type", "veth", "peer", "name", head_client_link, "netns", head.netns)
        made_client_link = True
        _sh("ip", "addr", "add", f"{client_ip}/30", "dev", client_link)
        _sh("ip", "link", "set", client_link, "up")
        _sh("ip", "-n", head.netns, "addr", "add", f"{head_client_ip}/30", "dev", head_client_link)
        _sh("ip", "-n", head.netns, "link", "set", head_client_link, "up")
        _sh("ip", "-n", head.netns, "route", "add", "default", "via", client_ip)
        script = ("set -e; mount -t tmpfs -o mode=1777 svhost-tmp /tmp; mount -t tmpfs -o mode=1777 svhost-shm /dev/shm; "
                  f"mkdir -p {HOME}; echo ready; exec sleep infinity")
        for host in (head, worker):
            host.holder = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--ipc", "--propagation", "private",
                 "--", "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            ready = host.holder.stdout.readline().strip()
            if ready != "ready":
                raise RuntimeError(f"{host.name} host did not start: {host.holder.stderr.read()}")
            host.net_inode = _netns_inode(f"/run/netns/{host.netns}")
        yield head, worker, client_ip
    finally:
        for host in (head, worker):
            if host.net_inode:
                for _ in range(3):
                    if not host.kill_all():
                        break
                    time.sleep(0.5)
            if host.holder is not None:
                host.holder.kill()
                host.holder.wait(timeout=10)
        if made_client_link:
            subprocess.run(["ip", "link", "del", client_link], capture_output=True)
        for ns in made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
