"""The stage watchdog on a stuck pipeline (pipeline/stage_role.py; issue 33, finding 3): a
suspended schedule waits; otherwise the node waits once for a new plan, and gives up with exit 1
(a failed supervised task) when none came; a coordinator that does not answer is waited for up to
`stage.coordinator_outage_s` (issue 29: a restarted bootstrap or a standby re-plans), then the node
exits 1 too; `pipeline_stuck` says which. Never a clean exit 0 on a stuck pipeline."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from pipeline.stage_progress import StageProgress
from pipeline.stage_role import StageRole
from pipeline.stage_watchdog import PipelineStuck


def fake_role(statuses, outage_s: float = 0.0):
    """`statuses`: what each `link.status()` call answers (an exception = no answer)."""
    answers = iter(statuses)

    async def status():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a
    role = SimpleNamespace(stopping=False, cfg=SimpleNamespace(iteration_timeout_s=0.2,
                                                                           coordinator_outage_s=outage_s), stats=StageProgress(),
                           link=SimpleNamespace(status=status), log=logging.getLogger("swarmnode.stage"),
                           ex=SimpleNamespace(iteration=4, latest_epoch=2, waiting_for=lambda: "eoi from [0]"))
    role.stop = lambda: setattr(role, "stopping", True)
    return role


def stuck_events(caplog) -> list[dict]:
    return [r._fields for r in caplog.records if getattr(r, "event", None) == "pipeline_stuck"]


async def test_a_stuck_node_waits_once_for_a_new_plan_then_exits_1(caplog):
    running = SimpleNamespace(suspended=False)
    role = fake_role([running, running])
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="swarmnode.stage"), pytest.raises(PipelineStuck):
        await StageRole._watchdog(role)
    assert [(e["action"], e["exit_code"]) for e in stuck_events(caplog)] == [("wait_for_plan", None), ("exit", 1)]
    assert role.stopping and time.monotonic() - t0 >= 0.4     # two full timeouts


async def test_a_new_plan_resets_the_wait_and_no_coordinator_means_exit(caplog):
    running = SimpleNamespace(suspended=False)
    role = fake_role([running, running, OSError("coordinator unreachable")])
    bump = role.stats.touch

    def touch():                 # a new epoch arrives while the node waits
        role.ex.latest_epoch += 1
        bump()
    role.stats.touch = touch
    with caplog.at_level(logging.INFO, logger="swarmnode.stage"), pytest.raises(PipelineStuck):
        await StageRole._watchdog(role)
    events = stuck_events(caplog)
    assert [e["action"] for e in events] == ["wait_for_plan", "wait_for_plan", "exit"], events
    assert "did not answer" in caplog.records[-1].getMessage()


async def test_a_coordinator_that_does_not_answer_is_waited_for_and_its_new_plan_is_awaited(caplog):
    running = SimpleNamespace(suspended=False)
    gone = OSError("coordinator unreachable")
    role = fake_role([gone, gone, running, running], outage_s=60.0)
    with caplog.at_level(logging.INFO, logger="swarmnode.stage"), pytest.raises(PipelineStuck):
        await StageRole._watchdog(role)
    events = stuck_events(caplog)
    assert [e["action"] for e in events] == ["wait_for_coordinator", "wait_for_coordinator", "wait_for_plan",
                                             "exit"], events
    assert events[0]["exit_code"] is None and events[1]["outage_s"] >= events[0]["outage_s"]


async def test_a_coordinator_away_longer_than_the_outage_bound_means_exit_1(caplog):
    gone = OSError("coordinator unreachable")
    role = fake_role([gone] * 50, outage_s=0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="swarmnode.stage"), pytest.raises(PipelineStuck):
        await StageRole._watchdog(role)
    events = stuck_events(caplog)
    assert events[-1]["action"] == "exit" and events[-1]["exit_code"] == 1, events
    assert {e["action"] for e in events[:-1]} == {"wait_for_coordinator"} and len(events) >= 2, events
    assert "did not answer for stage.coordinator_outage_s=0" in caplog.records[-1].getMessage()
    assert time.monotonic() - t0 >= 0.5
