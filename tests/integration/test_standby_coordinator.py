"""A standby coordinator takes over (issue 29): two bootstraps (the second `bootstrap.standby=true`,
joined through the first) and one `stage` node per stage (0, 1, 2) as OS processes on 127.0.0.1.
The active bootstrap is SIGKILLed (by PID): the standby becomes the active coordinator within
30 s, re-plans on a new schedule epoch that every stage adopts and steps on, and at no time do
both bootstraps claim to be active (their `coordinator_active` / `coordinator_stepped_down`
events, with timestamps, never overlap)."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from node.localswarm import LocalSwarm, NodeProc
from tests.integration.test_noloco_swarm import events, wait_for
from tests.integration.test_pipeline_coordinator_loss import coordinator, settings, start_stages, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RUN = "standby-coord"
LEASE = ["bootstrap.lease_s=6", "bootstrap.settle_s=2"]


def ts(event: dict) -> float:
    """Unix seconds of a log record (its `ts` field)."""
    t = event["ts"]
    return float(t) if isinstance(t, (int, float)) else datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()


def active_spans(node: NodeProc, end: float) -> list[tuple[float, float]]:
    """The [start, end) intervals in which `node` said it was the active coordinator."""
    marks = sorted([(ts(e), 1) for e in events(node, "coordinator_active")]
                   + [(ts(e), 0) for e in events(node, "coordinator_stepped_down")])
    spans, start = [], None
    for t, up in marks:
        if up and start is None:
            start = t
        elif not up and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, end))
    return spans


def test_a_standby_bootstrap_takes_over_within_30_s_and_only_one_is_ever_active(tmp_path):
    with LocalSwarm(run_id=RUN, workdir=tmp_path, common_set=settings() + LEASE) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=90)
        wait_for(lambda: events(boot, "coordinator_active"), 30, "the first bootstrap to become active")
        standby = swarm.start("bootstrap", name="standby", extra_set=["bootstrap.standby=true"])
        swarm.wait_ready([standby], timeout=90)
        stages = start_stages(swarm)
        swarm.wait_ready(stages, timeout=240)
        wait_for(lambda: all(len(steps(n)) >= 5 for n in stages), 120, "5 steps on every stage")
        assert not events(standby, "coordinator_active"), standby.log_text()[-3000:]
        lease = (standby.readyz() or {}).get("details", {}).get("coordinator_lease", {})
        assert lease.get("state") == "standby" and lease.get("active_peer") == boot.peer_id, lease
        old_epoch = max(e["epoch"] for e in events(boot, "schedule_published"))
        assert all(coordinator(n).get("peer_id") == boot.peer_id for n in stages), [coordinator(n) for n in stages]

        swarm.kill(boot)                 # SIGKILL by PID (its process group)
        t_kill = time.time()
        took = wait_for(lambda: events(standby, "coordinator_took_over"), 60,
                        lambda: f"the standby to take over; its log tail {standby.log_text()[-3000:]}", poll=0.5)
        took_over_s = ts(events(standby, "coordinator_active")[-1]) - t_kill

        def replanned() -> int | None:
            new = [e["epoch"] for e in events(standby, "schedule_published") if e["epoch"] > old_epoch]
            if new and all(any(e["epoch"] >= min(new) for e in events(n, "schedule_adopted")) for n in stages):
                return min(new)
            return None
        new_epoch = wait_for(replanned, 90, lambda: f"a new epoch (> {old_epoch}) from the standby adopted by every "
                                                   f"stage; standby log tail {standby.log_text()[-3000:]}", poll=0.5)
        replan_s = time.time() - t_kill
        wait_for(lambda: all(any(e["epoch"] >= new_epoch for e in steps(n)) for n in stages), 90,
                 f"a step on schedule epoch {new_epoch} on every stage")
        seen = {n.name: coordinator(n) for n in stages}
        switched = {n.name: events(n, "coordinator_switched") for n in stages}
        lease_after = (standby.readyz() or {}).get("details", {}).get("coordinator_lease", {})
        alive = [n.alive() for n in stages]
        end = time.time()
        spans = {n.name: active_spans(n, end if n is standby else t_kill) for n in (boot, standby)}

    print(f"took over {took_over_s:.1f} s after the kill ({took[-1]}); re-planned epoch {old_epoch} -> {new_epoch} "
          f"{replan_s:.1f} s after it; spans {spans}")
    assert all(alive), alive
    assert took_over_s <= 30.0, f"the standby became active {took_over_s:.1f} s after the kill (bound 30 s)"
    assert took[-1]["previous"] == boot.peer_id and took[-1]["lease_missing_s"] > 0, took[-1]
    assert lease_after.get("state") == "active" and lease_after.get("active_peer") == standby.peer_id, lease_after
    assert new_epoch > old_epoch
    for name, c in seen.items():
        assert c.get("state") == "answering" and c.get("peer_id") == standby.peer_id, (name, c)
        assert switched[name] and switched[name][-1]["peer"] == standby.peer_id, (name, switched[name])
    # at no time two coordinators active: the standby's spans start after the first's end (its kill)
    assert len(spans["bootstrap"]) == 1 and len(spans["standby"]) == 1, spans
    assert spans["standby"][0][0] > spans["bootstrap"][0][1], spans
