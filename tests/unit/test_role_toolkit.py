"""Pure parts of the role toolkit: the compute thread (node/compute.py), donor ordering
(node/state_sync.order_donors) and the shared training metrics helpers (node/metrics.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from node import metrics as NM
from node.card import CardView, NodeCard
from node.compute import Compute, ComputeClosed
from node.state_sync import order_donors


async def test_compute_runs_one_job_at_a_time_on_one_thread_under_the_lock():
    c = Compute("t")
    seen, active, peak = set(), [0], [0]

    def job(i):
        assert c.lock.locked()
        seen.add(threading.get_ident())
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        active[0] -= 1
        return i * 2

    try:
        out = await asyncio.gather(*(c.run(job, i) for i in range(8)))
        assert out == [i * 2 for i in range(8)]
        assert len(seen) == 1 and threading.get_ident() not in seen and peak[0] == 1
        with pytest.raises(ZeroDivisionError):
            await c.run(lambda: 1 / 0)
    finally:
        c.close()


async def test_compute_drain_waits_for_in_flight_work_with_a_timeout():
    c = Compute("t")
    release = threading.Event()

    def long_job():
        while not c.stopping and not release.is_set():
            time.sleep(0.005)
        return "stopped" if c.stopping else "released"

    try:
        fut = asyncio.ensure_future(c.run(long_job))
        await asyncio.sleep(0.05)
        assert c.busy
        assert await c.drain(0.1) is False  # still running: drain gives up in time
        c.stop()
        assert await c.drain(5.0) is True and not c.busy
        assert await fut == "stopped"
        assert await c.run(lambda: "after stop") == "after stop"  # a final job is still accepted
        c.close()
        with pytest.raises(ComputeClosed, match="closed by the role's drain"):
            await c.run(lambda: "after close")
    finally:
        c.close()


def _view(pid, rnd, role="toy", cfg="c1", state="ready"):
    now = time.time()
    card = NodeCard(role=role, state=state, version="t", grpc_addr="127.0.0.1:1", started_at=now,
                    published_at=now, details={"round": rnd, "cfg_hash": cfg})
    return CardView(pid, card, now + 60)


def test_order_donors_most_advanced_first_random_among_ties():
    views = [_view("a", 3), _view("b", 7), _view("c", 7), _view("d", 9, cfg="other"), _view("e", 9, role="x"),
             _view("f", 9, state="joining"), _view("me", 10), _view("g", 1)]
    firsts = set()
    for seed in range(30):
        got = [v.peer_id for v in order_donors(views, role="toy", cfg_hash="c1", exclude="me",
                                               rng=random.Random(seed))]
        assert sorted(got[:2]) == ["b", "c"] and got[2:] == ["a", "g"]
        firsts.add(got[0])
    assert firsts == {"b", "c"}  # ties are broken at random: joiners spread over donors
    got = order_donors(views, role="toy", cfg_hash="c1", exclude="me", min_progress=3)
    assert sorted(v.peer_id for v in got) == ["a", "b", "c"]


def test_count_rejection_and_record_train_step():
    nonfinite = NM.TENSORS_REJECTED.labels(reason="nonfinite")._value.get()
    stale = NM.RPC_REJECTED.labels(reason="stale")._value.get()
    schema = NM.RPC_REJECTED.labels(reason="schema")._value.get()
    NM.count_rejection("nonfinite")
    NM.count_rejection("future")
    NM.count_rejection("specs")
    assert NM.TENSORS_REJECTED.labels(reason="nonfinite")._value.get() == nonfinite + 1
    assert NM.RPC_REJECTED.labels(reason="stale")._value.get() == stale + 1
    assert NM.RPC_REJECTED.labels(reason="schema")._value.get() == schema + 1
    steps, tokens = NM.TRAIN_STEPS._value.get(), NM.TRAIN_TOKENS._value.get()
    NM.record_train_step(2.5, 64, 0.01)
    assert NM.TRAIN_STEPS._value.get() == steps + 1 and NM.TRAIN_TOKENS._value.get() == tokens + 64
    assert NM.TRAIN_LOSS._value.get() == 2.5 and NM.LAST_STEP._value.get() > 0
