"""node/supervisor.py: restarts with a budget, then fatal; failures counted; cancel_all."""

from __future__ import annotations

import asyncio

import pytest

from node import supervisor as supmod
from node.compute import Compute
from node.metrics import REGISTRY
from node.supervisor import Supervisor

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    """Restart backoff is 0.5 s * 2**n in production; shrink it so the test stays fast."""
    real_sleep = asyncio.sleep

    async def quick(delay, *a, **kw):
        return await real_sleep(min(delay, 0.01), *a, **kw)
    monkeypatch.setattr(supmod.asyncio, "sleep", quick)


def failures(task: str) -> float:
    return REGISTRY.get_sample_value("swarmnode_task_failures_total", {"task": task}) or 0.0


async def test_failing_task_restarted_then_fatal():
    fatal = []
    sup = Supervisor(max_restarts=3, on_fatal=lambda name, exc: fatal.append((name, exc)))
    runs = []

    async def boom():
        runs.append(1)
        raise ValueError("kaputt")

    before = failures("t_boom")
    task = sup.spawn("t_boom", boom)
    await asyncio.wait_for(task, 10)
    assert len(runs) == 4                     # first run + 3 restarts
    assert failures("t_boom") - before == 4   # each failure counted
    assert not sup.healthy and sup.failed == "t_boom"
    assert len(fatal) == 1 and fatal[0][0] == "t_boom" and isinstance(fatal[0][1], ValueError)


async def test_task_recovers_within_budget():
    fatal = []
    sup = Supervisor(max_restarts=3, on_fatal=lambda n, e: fatal.append(n))
    runs = []

    async def flaky():
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("transient")

    before = failures("t_flaky")
    await asyncio.wait_for(sup.spawn("t_flaky", flaky), 10)
    assert len(runs) == 3 and failures("t_flaky") - before == 2
    assert sup.healthy and fatal == []


async def test_no_restart_task_fatal_on_first_failure():
    fatal = []
    sup = Supervisor(max_restarts=5, on_fatal=lambda n, e: fatal.append(n))
    runs = []

    async def once():
        runs.append(1)
        raise OSError("x")

    await asyncio.wait_for(sup.spawn("t_once", once, restart=False), 10)
    assert runs == [1] and fatal == ["t_once"] and not sup.healthy


async def test_a_task_whose_compute_thread_was_closed_by_a_drain_ends_without_failing():
    """A role's main task still setting up when the drain closes its compute thread: the node exits
    0, not 1 (a CI run caught `cannot schedule new futures after shutdown` as a fatal failure)."""
    fatal = []
    sup = Supervisor(max_restarts=5, on_fatal=lambda n, e: fatal.append(n))
    c = Compute("t")
    c.close()   # the drain ran first

    async def setup_then_train():
        await c.run(lambda: "setup")

    before = failures("t_closed")
    await asyncio.wait_for(sup.spawn("t_closed", setup_then_train, restart=False), 5)
    assert fatal == [] and sup.healthy and failures("t_closed") == before


async def test_normal_return_is_done_and_healthy():
    sup = Supervisor()
    out = []

    async def ok():
        out.append(1)

    await asyncio.wait_for(sup.spawn("t_ok", ok), 5)
    assert out == [1] and sup.healthy
    # a finished name can be spawned again; a running one cannot
    ev = asyncio.Event()
    sup.spawn("t_ok", ev.wait)
    with pytest.raises(RuntimeError, match="already running"):
        sup.spawn("t_ok", ev.wait)
    await sup.cancel_all()


async def test_cancel_all_cancels_running_tasks_without_counting_failures():
    sup = Supervisor()
    started = asyncio.Event()
    cancelled = []

    async def forever():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(1)
            raise

    before = failures("t_forever")
    t1 = sup.spawn("t_forever", forever)
    t2 = sup.spawn("t_forever2", forever)
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0)
    await sup.cancel_all(timeout=2)
    assert t1.cancelled() and t2.cancelled()
    assert len(cancelled) == 2
    assert failures("t_forever") == before
    assert sup.healthy


async def test_cancel_all_with_nothing_running():
    sup = Supervisor()
    await sup.cancel_all()
    assert sup.healthy
