"""node/ops_http.py: probes follow the lifecycle and the health callable; port errors name the key."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from node import metrics
from node.lifecycle import Lifecycle, State
from node.ops_http import OpsServer, PortInUse

pytestmark = pytest.mark.timeout(30)


def get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


@pytest.fixture
def ops():
    lc = Lifecycle()
    health = {"value": (True, "ok")}
    info = {"peer_id": "12D3KooWtest", "maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWtest"],
            "grpc_addr": "127.0.0.1:2", "run_id": "r", "role": "bootstrap"}
    server = OpsServer("127.0.0.1", 0, lc, lambda: health["value"], lambda: info)
    lc.subscribe(metrics.follow_lifecycle)
    metrics.follow_lifecycle(*lc.snapshot())
    server.start()
    try:
        yield server, lc, health, info
    finally:
        server.stop()


async def test_readyz_follows_lifecycle(ops):
    server, lc, _, _ = ops
    assert server.port > 0
    detail = "0 of 1 initial_peers answered (ip4/10.0.0.7/tcp/31337: refused); retry 2 in 2 s"
    await lc.move(State.JOINING, "dht_bootstrap_failed", detail)
    code, ctype, body = get(server.port, "/readyz")
    assert code == 503 and ctype == "application/json"
    assert json.loads(body) == {"ready": False, "state": "joining", "reason": "dht_bootstrap_failed",
                                "detail": detail}
    await lc.move(State.READY, "ready", "")
    code, _, body = get(server.port, "/readyz")
    assert code == 200 and json.loads(body)["ready"] is True and json.loads(body)["state"] == "ready"
    await lc.move(State.DRAINING, "draining", "trigger: sigterm")
    code, _, body = get(server.port, "/readyz")
    assert code == 503 and json.loads(body)["reason"] == "draining"
    # query strings are ignored
    assert get(server.port, "/readyz?verbose=1")[0] == 503


def test_healthz_follows_health_callable(ops):
    server, _, health, _ = ops
    code, _, body = get(server.port, "/healthz")
    assert code == 200 and json.loads(body) == {"ok": True, "reason": "ok"}
    health["value"] = (False, "task_failed:card")
    code, _, body = get(server.port, "/healthz")
    assert code == 500 and json.loads(body) == {"ok": False, "reason": "task_failed:card"}
    health["value"] = (False, "dht_process_exited")
    assert json.loads(get(server.port, "/healthz")[2])["reason"] == "dht_process_exited"


def test_peerinfo(ops):
    server, _, _, info = ops
    code, ctype, body = get(server.port, "/peerinfo")
    assert code == 200 and ctype == "application/json"
    assert json.loads(body) == info


async def test_metrics_has_state(ops):
    server, lc, _, _ = ops
    code, ctype, body = get(server.port, "/metrics")
    text = body.decode()
    assert code == 200 and ctype.startswith("text/plain")
    assert 'swarmnode_state{swarmnode_state="joining"} 1.0' in text
    await lc.move(State.READY, "ready", "")
    text = get(server.port, "/metrics")[2].decode()
    assert 'swarmnode_state{swarmnode_state="ready"} 1.0' in text
    assert 'swarmnode_state{swarmnode_state="joining"} 0.0' in text
    assert 'swarmnode_readiness_reason{swarmnode_readiness_reason="ready"} 1.0' in text


def test_unknown_path_404_with_hint(ops):
    server, _, _, _ = ops
    code, _, body = get(server.port, "/nope")
    assert code == 404
    err = json.loads(body)["error"]
    assert "/nope" in err and "/readyz" in err and "/metrics" in err


def test_port_in_use_names_ops_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse) as ei:
            OpsServer("127.0.0.1", port, Lifecycle(), lambda: (True, "ok"), lambda: {})
    msg = str(ei.value)
    assert "ops.port" in msg and "--metrics-port" in msg and str(port) in msg
    assert PortInUse.exit_code == 2


def test_stop_releases_port():
    srv = OpsServer("127.0.0.1", 0, Lifecycle(), lambda: (True, "ok"), lambda: {})
    srv.start()
    port = srv.port
    assert get(port, "/healthz")[0] == 200
    srv.stop()
    again = OpsServer("127.0.0.1", port, Lifecycle(), lambda: (True, "ok"), lambda: {})
    again.start()
    again.stop()


def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_idle_connections_are_capped_and_probes_still_answer():
    import threading
    srv = OpsServer("127.0.0.1", 0, Lifecycle(), lambda: (True, "ok"), lambda: {}, max_connections=8,
                    idle_timeout_s=30)
    srv.start()
    threads0 = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(100)]
    try:
        assert get(srv.port, "/healthz")[0] == 200  # evicts the longest-waiting idle one
        assert srv.open_connections <= 8
        assert threading.active_count() == threads0
        closed = 0
        for s in idle:  # the node closed all but the newest few: their reads end at once
            s.settimeout(0.05)
            try:
                closed += s.recv(1) == b""
            except ConnectionError:
                closed += 1
            except TimeoutError:
                pass  # still open: one of the newest
        assert closed >= 100 - 8
    finally:
        for s in idle:
            s.close()
        srv.stop()


def test_idle_timeout_closes_a_silent_connection():
    srv = OpsServer("127.0.0.1", 0, Lifecycle(), lambda: (True, "ok"), lambda: {}, idle_timeout_s=0.3)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\n")  # never finishes its head
            t0 = time.monotonic()
            assert s.recv(1) == b""
            assert time.monotonic() - t0 < 3
        assert srv.open_connections == 0
    finally:
        srv.stop()


def test_only_get_and_bounded_heads():
    srv = OpsServer("127.0.0.1", 0, Lifecycle(), lambda: (True, "ok"), lambda: {})
    srv.start()
    try:
        out = _raw(srv.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 405") and b"read-only" in out
        out = _raw(srv.port, b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400") and b"8192" in out
        assert _raw(srv.port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert get(srv.port, "/healthz")[0] == 200
    finally:
        srv.stop()


def test_two_addresses_one_port():
    srv = OpsServer(["127.0.0.1", "127.0.0.2"], 0, Lifecycle(), lambda: (True, "ok"), lambda: {})
    srv.start()
    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            with urllib.request.urlopen(f"http://{host}:{srv.port}/healthz", timeout=5) as resp:
                assert resp.status == 200
    finally:
        srv.stop()


def test_ops_host_config(monkeypatch):
    import node.config as config
    from node.config import OpsConfig

    assert OpsConfig().host == "127.0.0.1" and OpsConfig().bind_hosts("0.0.0.0") == ["127.0.0.1"]
    assert OpsConfig(host="host").bind_hosts("0.0.0.0") == ["0.0.0.0"]
    with pytest.raises(ValueError, match="ops.host"):
        OpsConfig(host="metrics.example")
    monkeypatch.setattr(config, "own_address", lambda: "172.18.0.5")
    assert OpsConfig(host="private").bind_hosts("0.0.0.0") == ["172.18.0.5", "127.0.0.1"]
    monkeypatch.setattr(config, "own_address", lambda: "34.120.1.2")
    with pytest.raises(ValueError, match="public address 34.120.1.2"):
        OpsConfig(host="private").bind_hosts("0.0.0.0")
