"""The schedule coordinator's pure parts (pipeline/coordinator.py): stage membership from node
cards, the cost model from cards + a netem matrix, planning, and refusing a tampered or
malformed schedule reply before use."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from node.card import CardView, NodeCard
from node.netem import NetemConfig
from pipeline.config import ScheduleConfig
from pipeline.coordinator import build_cluster, parse_reply, plan_for, stage_members
from pipeline.schedule import Schedule, ScheduleViolation
from pipeline.simulator import simulate
from protocol import pipeline_pb2


def _view(pid, role="stage", state="ready", **details):
    now = time.time()
    card = NodeCard(role=role, state=state, version="t", grpc_addr=f"10.0.0.{int(pid[-2:])}:5000", started_at=now, published_at=now, details=details)
    return CardView(pid, card, now + 60)


def _views():
    layout = (0, 0, 0, 1, 1, 2, 2, 3, 3)
    views = [_view(f"peer{i:02d}", stage=s, memory=3) for i, s in enumerate(layout)]
    views[5].card.details["compute_ms"] = 400             # a slow stage-2 replica
    return views + [_view("peer90", role="bootstrap"), _view("peer91", state="draining", stage=1),
                    _view("peer92", stage=7), _view("peer93", stage="x")]


CFG = ScheduleConfig(stages=4, skip_ratio=1 / 3, mb_per_origin=3, memory=3, time_budget_s=2.0)


def test_members_are_the_live_stage_nodes_with_a_valid_stage():
    members = stage_members(_views(), 4)
    assert [m[0] for m in members] == [f"peer{i:02d}" for i in range(9)]
    assert [m[1] for m in members] == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert members[5][4] == 400 and members[0][4] is None


def test_cluster_uses_cards_and_the_netem_matrix():
    members = stage_members(_views(), 4)
    addrs = [m[2] for m in members]
    lat = [[0 if i == j else (80 if {i, j} == {0, 3} else 5) for j in range(9)] for i in range(9)]
    netem = NetemConfig(enabled=True, matrix={"nodes": addrs, "latency_ms": lat})
    c = build_cluster(members, CFG, netem, activation_bytes=4096)
    assert c.compute[5] == pytest.approx(0.4) and c.compute[0] == pytest.approx(CFG.compute_s)
    assert c.comm[0][3] == pytest.approx(0.08) and c.comm[1][3] == pytest.approx(0.005)
    assert c.memory == (3,) * 9
    plain = build_cluster(members, CFG, NetemConfig(), activation_bytes=4096)
    assert plain.comm[0][3] == pytest.approx(CFG.default_latency_ms / 1000)


def test_plan_avoids_the_slow_replica_and_is_valid():
    members = stage_members(_views(), 4)
    sched, cluster = plan_for(members, CFG, NetemConfig(), 4096, epoch=3)
    assert sched.epoch == 3 and sched.names == tuple(m[0] for m in members)
    assert sched.partitions == ((0, 1, 2), (3, 4), (5, 6), (7, 8))
    visits = sched.node_visits()
    assert visits[5] <= visits[6]                          # the slow node gets no more than its twin
    assert all(v <= 3 for v in visits.values())
    # the schedule is recomputable from what the coordinator logs: its body and cost model
    assert sched.cost_hash == cluster.cost_hash()
    again = Schedule.from_json(sched.to_json())
    assert simulate(cluster, again.paths).makespan == pytest.approx(sched.expected_makespan)


def _reply(sched, addrs):
    body = sched.to_json()
    return pipeline_pb2.ScheduleReply(epoch=sched.epoch, schedule_json=body,
                                      sha256=hashlib.sha256(body.encode()).hexdigest(), addrs=addrs)


def test_replies_are_checked_before_use():
    members = stage_members(_views(), 4)
    sched, _ = plan_for(members, CFG, NetemConfig(), 4096, epoch=1)
    addrs = {m[0]: m[2] for m in members}
    got, got_addrs = parse_reply(_reply(sched, addrs))
    assert got == sched and got_addrs == addrs
    tampered = _reply(sched, addrs)
    tampered.schedule_json = tampered.schedule_json.replace('"epoch":1', '"epoch":2')
    with pytest.raises(ScheduleViolation, match="sha256"):
        parse_reply(tampered)
    with pytest.raises(ScheduleViolation, match="without an address"):
        parse_reply(_reply(sched, {k: v for k, v in list(addrs.items())[1:]}))
    # a path that skips stage 0's return rule: R1 (starts at a non-originator)
    bad = sched.to_dict()
    bad["paths"]["0"] = [3, 5, 7]
    body = json.dumps(bad, sort_keys=True, separators=(",", ":"))
    reply = pipeline_pb2.ScheduleReply(epoch=1, schedule_json=body, sha256=hashlib.sha256(body.encode()).hexdigest(),
                                       addrs=addrs)
    with pytest.raises(ScheduleViolation) as exc:
        parse_reply(reply)
    assert exc.value.rule == "R1"


def test_between_iteration_costs_come_from_links_and_card_grad_bytes():
    """grad_s[y][x]: y's gradient (its card's grad_bytes) over the link to x, the latency split
    out of comm; a planner with them minimises the steady-state period."""
    views = _views()
    for v in views[:9]:
        v.card.details["grad_bytes"] = 1_000_000
    members = stage_members(views, 4)
    addrs = [m[2] for m in members]
    lat = [[0 if i == j else (40 if {i, j} == {3, 4} else 10) for j in range(9)] for i in range(9)]
    bw = [[1e9 if i == j else 80.0 for j in range(9)] for i in range(9)]       # 10 MB/s: 1 MB = 0.1 s
    netem = NetemConfig(matrix={"nodes": addrs, "latency_ms": lat, "bandwidth_mbps": bw})
    c = build_cluster(members, CFG, netem, activation_bytes=4096)
    assert c.grad_s[4][3] == pytest.approx(0.040 + 0.1) and c.grad_s[6][5] == pytest.approx(0.010 + 0.1)
    assert c.latency[3][4] == pytest.approx(0.040) and c.comm[3][4] == pytest.approx(0.040 + 4096 / 10e6)
    assert c.latency_s(0, 3) == pytest.approx(0.010)
    sched, cluster = plan_for(members, CFG, netem, 4096, epoch=1)
    assert cluster.has_sync and cluster.cost_hash() == sched.cost_hash
