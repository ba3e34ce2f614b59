"""node/ops_http.py: probes follow the lifecycle and the health callable; port errors name the key."""

from __future__ import annotations

import json
import socket
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
