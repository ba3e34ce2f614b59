"""node/swarm_metrics.py: the bootstrap's swarm view from node cards, and its /metrics/swarm endpoint."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node.card import CardView, NodeCard
from node.lifecycle import Lifecycle
from node.swarm_metrics import SwarmCensus, numeric_details

pytestmark = pytest.mark.timeout(30)


def view(pid: str, role: str, state: str, published: float = 100.0, **details) -> CardView:
    card = NodeCard(role=role, state=state, version="0.1.0", grpc_addr="127.0.0.1:1", started_at=1.0,
                    published_at=published, details=details)
    return CardView(peer_id=pid, card=card, expiration=published + 30)


def samples(census: SwarmCensus) -> dict[tuple, float]:
    reg = CollectorRegistry()
    reg.register(census)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(out, name, **labels):
    return out[(name, tuple(sorted(labels.items())))]


def test_counts_by_role_and_state_with_zeros_for_every_state():
    c = SwarmCensus()
    c.update("r1", [view("b", "bootstrap", "ready"), view("n1", "noloco", "ready"), view("n2", "noloco", "ready"),
                    view("n3", "noloco", "joining")], now=105.0)
    out = samples(c)
    assert get(out, "swarmnode_swarm_nodes", run="r1", role="noloco", state="ready") == 2
    assert get(out, "swarmnode_swarm_nodes", run="r1", role="noloco", state="joining") == 1
    assert get(out, "swarmnode_swarm_nodes", run="r1", role="noloco", state="draining") == 0
    assert get(out, "swarmnode_swarm_nodes", run="r1", role="bootstrap", state="ready") == 1
    assert not any(k[0] == "swarmnode_swarm_nodes" and ("role", "grpo") in k[1] for k in out)  # never seen
    assert get(out, "swarmnode_swarm_card_info", run="r1", peer_id="n3", role="noloco", state="joining",
               version="0.1.0") == 1
    assert get(out, "swarmnode_swarm_card_age_seconds", run="r1", peer_id="n1", role="noloco") == 5.0
    assert get(out, "swarmnode_swarm_census_timestamp_seconds", run="r1") == 105.0


def test_joins_and_leaves_drained_or_vanished():
    c = SwarmCensus()
    c.update("r", [view("a", "noloco", "ready"), view("b", "noloco", "draining"), view("s", "stage", "ready")])
    c.update("r", [view("a", "noloco", "ready"), view("c", "noloco", "joining")])   # b drained, s vanished
    out = samples(c)
    assert get(out, "swarmnode_swarm_joins_total", run="r", role="noloco") == 3
    assert get(out, "swarmnode_swarm_joins_total", run="r", role="stage") == 1
    assert get(out, "swarmnode_swarm_leaves_total", run="r", role="noloco", how="drained") == 1
    assert get(out, "swarmnode_swarm_leaves_total", run="r", role="noloco", how="vanished") == 0
    assert get(out, "swarmnode_swarm_leaves_total", run="r", role="stage", how="vanished") == 1
    # the role whose last node left keeps its rows, at zero: a "below N ready" alert still sees it
    assert get(out, "swarmnode_swarm_nodes", run="r", role="stage", state="ready") == 0
    c.failed()
    assert get(samples(c), "swarmnode_swarm_census_failures_total", run="r") == 1


def test_card_details_become_series_and_peer_junk_does_not():
    c = SwarmCensus()
    c.update("r", [view("g", "grpo", "ready", round=12, reward=0.4375, rejected=3, cfg_hash="ab" * 8,
                        flag=True, nan=float("nan"), **{"Bad-Key": 1, "x" * 40: 2}),
                   view("n", "noloco", "ready", bus_reach="0/3", gossip_addr="/ip4/10.0.0.1/tcp/31338")])
    out = samples(c)
    details = {dict(k[1])["detail"]: v for k, v in out.items()
               if k[0] == "swarmnode_swarm_card_detail" and dict(k[1])["peer_id"] == "g"}
    assert details == {"round": 12, "reward": 0.4375, "rejected": 3, "flag": 1}
    assert get(out, "swarmnode_swarm_unreachable_nodes", run="r", role="noloco") == 1
    assert get(out, "swarmnode_swarm_unreachable_nodes", run="r", role="grpo") == 0
    assert numeric_details({"a": float("inf"), "b": "1", "c": 2}) == {"c": 2.0}


def test_ops_serves_the_swarm_view_only_once_the_census_runs(monkeypatch):
    import node.ops_http as ops_http

    census = SwarmCensus()
    reg = CollectorRegistry()
    reg.register(census)
    monkeypatch.setattr(ops_http, "CENSUS", census)
    monkeypatch.setattr(ops_http, "SWARM_REGISTRY", reg)
    server = ops_http.OpsServer("127.0.0.1", 0, Lifecycle(), lambda: (True, "ok"), dict)
    server.start()
    url = f"http://127.0.0.1:{server.port}/metrics/swarm"
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 404 and b"bootstrap" in err.value.read()
        census.update("r", [view("a", "noloco", "ready")])
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read().decode()
        assert 'swarmnode_swarm_nodes{role="noloco",run="r",state="ready"} 1.0' in body
    finally:
        server.stop()

