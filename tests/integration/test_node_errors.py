"""Real node processes in error situations: what the probes, metrics, logs and exit codes say.

- an unreachable bootstrap keeps the node JOINING (``dht_bootstrap_failed``, detail naming
  "0 of 1 initial_peers answered"), liveness stays green, attempts are counted, SIGTERM -> 0;
- with ``dht.bootstrap_deadline_s`` it gives up by itself with exit 4;
- a taken ops or gRPC port -> exit 2 naming ``ops.port`` / ``grpc.port``;
- an AWS spot notice from a fake IMDSv2 server drains the node, which exits 0 by itself;
- a second SIGINT during the drain aborts with 130.

Every process is started in its own session and stopped by PID / process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from node.localswarm import LocalSwarm, NodeProc, free_port, http_get, parse_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

START_S = 90.0  # a node imports torch + hivemind and forks p2pd: slow on a loaded 2-core box
FAKE_PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def events(node: NodeProc) -> list[dict]:
    out = []
    for line in node.log_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_for(pred, timeout: float, interval: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(interval)


def failed_attempts(node: NodeProc) -> float:
    return node.metrics().get('swarmnode_dht_bootstrap_attempts_total{outcome="failed"}', 0.0)


class HeldDrain:
    """An open gRPC health Watch stream on ``node``. It never ends by itself, so the drain's
    grpc_stop step waits the node's whole ``grpc.grace_s``: the drain provably lasts that long."""

    def __init__(self, node: NodeProc):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}")
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        self.updates: list[int] = []
        self.reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            for r in self.call:
                self.updates.append(r.status)
        except Exception:  # noqa: BLE001 - the stream ends with CANCELLED/UNAVAILABLE at shutdown
            pass

    def __enter__(self) -> "HeldDrain":
        self.reader.start()
        wait_for(lambda: self.updates, 15, what="the first health Watch update")
        return self

    def __exit__(self, *exc) -> None:
        self.call.cancel()
        self.channel.close()


# ---- unreachable bootstrap ----

def test_unreachable_bootstrap_stays_joining_then_sigterm(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{FAKE_PEER}"
    with LocalSwarm(run_id="errs", workdir=tmp_path, common_set=["dht.retry_max_s=2", "drain.budget_s=10"]) as swarm:
        node = swarm.start("bootstrap", name="lonely", initial_peers=[dead])

        def stuck():
            assert node.alive(), node.log_text()[-3000:]
            r = node.readyz()
            return r if r and r.get("reason") == "dht_bootstrap_failed" else None
        r = wait_for(stuck, START_S, what="/readyz reason dht_bootstrap_failed")
        code, body = http_get(f"http://127.0.0.1:{node.ops_port}/readyz")
        assert code == 503
        r = json.loads(body)
        assert r["ready"] is False and r["state"] == "joining" and r["reason"] == "dht_bootstrap_failed"
        assert "0 of 1 initial_peers answered" in r["detail"], r
        assert "retry" in r["detail"]

        code, body = http_get(f"http://127.0.0.1:{node.ops_port}/healthz")
        assert code == 200 and json.loads(body)["ok"] is True

        first = failed_attempts(node)
        assert first > 0
        wait_for(lambda: failed_attempts(node) > first, 30, what="more failed bootstrap attempts")
        assert node.readyz()["ready"] is False
        assert node.metrics().get('swarmnode_state{swarmnode_state="joining"}') == 1.0

        swarm.signal(node, signal.SIGTERM)
        code = swarm.wait_exit(node, 30)
        assert code == 0, node.log_text()[-3000:]
        assert any(e.get("event") == "drained" for e in events(node))


def test_bootstrap_deadline_exits_4(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{FAKE_PEER}"
    with LocalSwarm(run_id="errs", workdir=tmp_path,
                    common_set=["dht.bootstrap_deadline_s=3", "dht.retry_max_s=1", "drain.budget_s=5"]) as swarm:
        node = swarm.start("bootstrap", name="giveup", initial_peers=[dead])
        code = swarm.wait_exit(node, START_S + 30)
        assert code == 4, f"exit {code}:\n{node.log_text()[-3000:]}"
        assert any(e.get("event") == "bootstrap_gave_up" for e in events(node))


# ---- ports in use ----

def _run_with(tmp_path: Path, name: str, flag: str, port: int) -> subprocess.CompletedProcess:
    from security.keys import generate_key, write_key_file

    key = tmp_path / f"{name}.key"
    write_key_file(key, generate_key())
    ports = {"--dht-port": str(free_port()), "--grpc-port": str(free_port()), "--metrics-port": str(free_port())}
    ports[flag] = str(port)
    cmd = [sys.executable, "-m", "node.cli", "run", "--role", "bootstrap", "--host", "127.0.0.1",
           "--identity", str(key), "--run-id", "errs", *[x for kv in ports.items() for x in kv]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, err = proc.communicate(timeout=START_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
    finally:
        try:  # p2pd and the DHT process live in the node's session: never leave them behind
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("flag,key", [("--metrics-port", "ops.port"), ("--grpc-port", "grpc.port")])
def test_port_in_use_exit_2(tmp_path, flag, key):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _run_with(tmp_path, "busy", flag, port)
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stderr[-3000:]}\n{res.stdout[-2000:]}"
    assert key in res.stderr and flag in res.stderr, res.stderr[-2000:]


# ---- spot preemption (fake AWS IMDSv2) ----

class FakeImds:
    """PUT /latest/api/token -> token; GET spot/instance-action -> 404 ``quiet`` times, then a notice."""

    def __init__(self, quiet: int = 2):
        self.quiet, self.polls, self.tokens = quiet, 0, 0
        self.armed = threading.Event()  # no notice before the test says the node is READY
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):  # noqa: N802
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.tokens += 1
                    self._send(200, b"tok-123")
                else:
                    self._send(400)

            def do_GET(self):  # noqa: N802
                if self.path != "/latest/meta-data/spot/instance-action":
                    return self._send(404)
                if self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                    return self._send(401)
                if fake.armed.is_set():
                    fake.polls += 1
                if not fake.armed.is_set() or fake.polls <= fake.quiet:
                    return self._send(404)
                self._send(200, json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeImds":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_aws_spot_notice_drains_and_exits_0(tmp_path):
    with FakeImds(quiet=2) as imds, LocalSwarm(run_id="errs", workdir=tmp_path) as swarm:
        base = f"http://127.0.0.1:{imds.port}"
        node = swarm.start("bootstrap", name="spot", extra_set=[
            "preemption.provider=aws",
            f"preemption.aws_url={base}/latest/meta-data/spot/instance-action",
            f"preemption.aws_token_url={base}/latest/api/token",
            "preemption.poll_interval_s=0.5", "drain.budget_s=10", "grpc.grace_s=6"])
        swarm.wait_ready([node], timeout=START_S)
        # the watcher polls with an IMDSv2 token (it may start a moment after READY)
        wait_for(lambda: imds.tokens >= 1 or not node.alive(), 30, what="an IMDSv2 token request")
        assert imds.tokens >= 1, node.log_text()[-3000:]
        # an open Watch stream holds the drain >= grpc.grace_s, so /metrics is provably still up
        # after the notice: the counter is read every time, never "if it was seen in time"
        with HeldDrain(node):
            imds.armed.set()
            counted = None
            deadline = time.monotonic() + 40
            while counted is None and node.alive() and time.monotonic() < deadline:
                try:
                    _, body = http_get(f"http://127.0.0.1:{node.ops_port}/metrics", timeout=1.0)
                    counted = parse_metrics(body.decode()).get('swarmnode_preemption_notices_total{source="aws"}')
                except OSError:
                    pass
                time.sleep(0.1)
            assert counted == 1.0, f"preemption counter {counted} (node alive: {node.alive()})\n" \
                                   f"{node.log_text()[-3000:]}"
            code = swarm.wait_exit(node, 30)
        assert code == 0, f"exit {code}:\n{node.log_text()[-3000:]}"
        ev = events(node)
        notices = [e for e in ev if e.get("event") == "preemption_notice"]
        assert notices and all(e.get("source") == "aws" for e in notices), node.log_text()[-3000:]
        drained = [e for e in ev if e.get("event") == "drained"]
        assert drained and drained[-1].get("trigger") == "aws"
        assert imds.polls > imds.quiet


# ---- second SIGINT ----

def test_second_sigint_aborts_130(tmp_path):
    # HeldDrain keeps the drain in grpc_stop for the whole grpc.grace_s (30 s), so the drain is
    # provably still running when the second Ctrl-C comes: an ignored second SIGINT ends in exit 0
    # after the grace, not 130 (no skip for "the drain finished first").
    with LocalSwarm(run_id="errs", workdir=tmp_path, common_set=["grpc.grace_s=30", "drain.budget_s=60"]) as swarm:
        node = swarm.start("bootstrap", name="ctrlc")
        swarm.wait_ready([node], timeout=START_S)
        with HeldDrain(node):
            swarm.signal(node, signal.SIGINT)
            wait_for(lambda: (node.readyz() or {}).get("state") in ("draining", "offline") or not node.alive(), 20,
                     interval=0.05, what="draining after the first SIGINT")
            assert node.alive(), f"drain ended (exit {node.proc.returncode}) with a Watch stream open:\n" \
                                 f"{node.log_text()[-3000:]}"
            t0 = time.monotonic()
            swarm.signal(node, signal.SIGINT)
            code = swarm.wait_exit(node, 45)
            took = time.monotonic() - t0
        assert code == 130, f"exit {code} {took:.1f} s after the second SIGINT:\n{node.log_text()[-3000:]}"
        assert took < 15, f"abort took {took:.1f} s: it waited for the drain instead of aborting"
        assert any(e.get("event") == "abort" for e in events(node)), node.log_text()[-3000:]
