"""A swarm of real node processes on 127.0.0.1: used by ``swarmnode demo``, the integration
tests and the benchmarks.

Each node is a separate ``python -m node.cli`` OS process with its own key, ports and log
file; it is stopped by PID (never by name). The bootstrap's key is written first so its
multiaddr is known before it starts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a node started later, taken from *below* the kernel's
    ephemeral range: a port the kernel picked for us (bind to 0) is free only until it hands the
    same number to the next outgoing connection or `tcp/0` listener of any process, and a node
    that then fails to bind it exits ("Address already in use"). Outside the range only an
    explicit bind can take it. Never the same port twice in this process."""
    lo, _ = _ephemeral_range()
    low = 10000 if lo > 12000 else 1024
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, lo)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:           # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (good enough for tests and the demo)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


@dataclass
class NodeProc:
    name: str
    role: str
    proc: subprocess.Popen
    ops_port: int
    grpc_port: int
    dht_port: int
    identity: Path
    log_path: Path
    peer_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def readyz(self) -> dict[str, Any] | None:
        try:
            code, body = http_get(f"http://127.0.0.1:{self.ops_port}/readyz", timeout=3.0)
            return json.loads(body)
        except (OSError, ValueError):
            return None

    def metrics(self) -> dict[str, float]:
        try:
            _, body = http_get(f"http://127.0.0.1:{self.ops_port}/metrics", timeout=2.0)
            return parse_metrics(body.decode())
        except OSError:
            return {}

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class LocalSwarm:
    """Start/stop real nodes on 127.0.0.1. Use as a context manager: exit kills what is left."""

    def __init__(self, run_id: str = "local", workdir: str | os.PathLike | None = None,
                 common_set: list[str] | None = None, env: dict[str, str] | None = None):
        self.run_id = run_id
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="swarmnode-")
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.common_set = list(common_set or [])
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.nodes: list[NodeProc] = []
        self.bootstrap_maddr: str | None = None          # the first bootstrap's multiaddr
        self.bootstrap_maddrs: dict[str, str] = {}       # every bootstrap's (node name -> multiaddr)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _identity(self, name: str) -> tuple[Path, str]:
        from security.keys import generate_key, load_key_file, peer_id_str, write_key_file

        path = self.workdir / f"{name}.key"
        if path.exists():  # a restarted node keeps its peer ID
            return path, peer_id_str(load_key_file(path))
        key = generate_key()
        write_key_file(path, key)
        return path, peer_id_str(key.public_key())

    def start(self, role: str, name: str | None = None, extra_set: list[str] | None = None,
              initial_peers: list[str] | None = None, resume: bool = False,
              ports: tuple[int, int, int] | None = None) -> NodeProc:
        """Start a node; ``ports`` (DHT, gRPC, ops) to reuse a stopped node's, else free ones."""
        name = name or f"{role}-{len(self.nodes)}"
        identity, peer_id = self._identity(name)
        dht_port, grpc_port, ops_port = ports or (free_port(), free_port(), free_port())
        cmd = [sys.executable, "-m", "node.cli", "run", "--role", role, "--host", "127.0.0.1",
               "--dht-port", str(dht_port), "--grpc-port", str(grpc_port), "--metrics-port", str(ops_port),
               "--identity", str(identity), "--run-id", self.run_id,
               "--set", f"state_dir={self.workdir / name}"]
        # by default every bootstrap started so far (a standby is a second entry point), never itself
        peers = initial_peers if initial_peers is not None else \
            [m for n, m in self.bootstrap_maddrs.items() if n != name]
        if peers:
            cmd += ["--initial-peers", *peers]
        if resume:
            cmd.append("--resume")
        for item in [*self.common_set, *(extra_set or [])]:
            cmd += ["--set", item]
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
        node = NodeProc(name=name, role=role, proc=proc, ops_port=ops_port, grpc_port=grpc_port, dht_port=dht_port,
                        identity=identity, log_path=log_path, peer_id=peer_id)
        self.nodes.append(node)
        if role == "bootstrap":
            self.bootstrap_maddrs[name] = f"/ip4/127.0.0.1/tcp/{dht_port}/p2p/{peer_id}"
            self.bootstrap_maddr = self.bootstrap_maddr or self.bootstrap_maddrs[name]
        return node

    def restart(self, node: NodeProc, extra_set: list[str] | None = None) -> NodeProc:
        """Start a stopped node again as itself: the same name (key file, state_dir, log file,
        appended to) and the same ports, so peers that knew it find it where it was. A bootstrap
        gets the other bootstraps as initial peers (none if it is the only one: the swarm's other
        nodes dial it), every other node every bootstrap."""
        if node.alive():
            raise RuntimeError(f"{node.name} is still running (pid {node.pid}): stop or kill it first")
        return self.start(node.role, name=node.name, extra_set=extra_set,
                          initial_peers=None,
                          ports=(node.dht_port, node.grpc_port, node.ops_port))

    def wait_ready(self, nodes: list[NodeProc] | None = None, timeout: float = 60.0) -> float:
        """Block until every node's /readyz says ready; return the seconds waited."""
        nodes = self.nodes if nodes is None else nodes
        t0 = time.monotonic()
        pending = list(nodes)
        while pending:
            for n in list(pending):
                if not n.alive():
                    raise RuntimeError(f"{n.name} exited with {n.proc.returncode} before READY:\n{n.log_text()[-3000:]}")
                r = n.readyz()
                if r and r.get("ready"):
                    pending.remove(n)
            if pending and time.monotonic() - t0 > timeout:
                info = {n.name: n.readyz() for n in pending}
                raise TimeoutError(f"not READY after {timeout:.0f} s: {info}")
            if pending:
                time.sleep(0.2)
        return time.monotonic() - t0

    def signal(self, node: NodeProc, sig: int) -> None:
        if node.alive():
            os.kill(node.pid, sig)

    def wait_exit(self, node: NodeProc, timeout: float) -> int | None:
        try:
            return node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, node: NodeProc, timeout: float = 25.0) -> int:
        """SIGTERM, wait for the drain, then SIGKILL the process group if it is still there."""
        self.signal(node, signal.SIGTERM)
        code = self.wait_exit(node, timeout)
        if code is None:
            self.kill(node)
            code = node.proc.wait(timeout=10)
        return code

    def kill(self, node: NodeProc) -> None:
        """SIGKILL the node and everything it started (its own process group: DHT, p2pd)."""
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self, timeout: float = 25.0) -> None:
        for n in self.nodes:
            self.signal(n, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            self.wait_exit(n, max(0.1, deadline - time.monotonic()))
        for n in self.nodes:
            self.kill(n)  # reap leftovers of the group too (p2pd of a SIGKILLed parent)
