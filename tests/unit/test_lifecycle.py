"""node/lifecycle.py: legal and illegal transitions, listeners, snapshots."""

from __future__ import annotations

import logging

import pytest

from node.lifecycle import ALLOWED, READINESS_REASONS, Lifecycle, LifecycleError, State


def test_initial_state():
    lc = Lifecycle()
    assert lc.snapshot() == (State.JOINING, "dht_starting", "starting the DHT")
    assert not lc.ready
    assert lc.state.value == "joining"


async def test_happy_path_and_snapshot():
    lc = Lifecycle()
    await lc.move(State.JOINING, "dht_bootstrap_failed", "0 of 1 initial_peers answered")
    assert lc.snapshot() == (State.JOINING, "dht_bootstrap_failed", "0 of 1 initial_peers answered")
    await lc.move(State.READY, "ready")
    assert lc.ready and lc.snapshot() == (State.READY, "ready", "")
    await lc.move(State.DRAINING, "draining", "trigger: sigterm")
    assert not lc.ready
    await lc.move(State.OFFLINE, "offline", "trigger: sigterm")
    assert lc.snapshot()[0] is State.OFFLINE


async def test_backward_edge_ready_to_joining_logs_warning(caplog):
    lc = Lifecycle()
    await lc.move(State.READY, "ready")
    with caplog.at_level(logging.INFO, logger="swarmnode.lifecycle"):
        await lc.move(State.JOINING, "dht_no_peers", "routing table empty")
    rec = [r for r in caplog.records if getattr(r, "event", None) == "state_changed"]
    assert rec and rec[-1].levelno == logging.WARNING
    fields = rec[-1]._fields
    assert fields["reason"] == "dht_no_peers" and fields["from"] == "ready" and fields["to"] == "joining"


@pytest.mark.parametrize("path,bad", [
    ([], State.OFFLINE),                                        # JOINING -> OFFLINE
    ([State.READY], State.OFFLINE),                             # READY -> OFFLINE
    ([State.DRAINING], State.READY),                            # DRAINING -> READY
    ([State.DRAINING], State.JOINING),                          # DRAINING -> JOINING
    ([State.DRAINING, State.OFFLINE], State.READY),             # OFFLINE -> anything
    ([State.DRAINING, State.OFFLINE], State.DRAINING),
    ([State.DRAINING, State.OFFLINE], State.JOINING),
])
async def test_illegal_transitions(path, bad):
    lc = Lifecycle()
    for s in path:
        await lc.move(s, s.value)
    before = lc.snapshot()
    with pytest.raises(LifecycleError) as ei:
        await lc.move(bad, "x")
    assert str(before[0]) in str(ei.value) and str(bad) in str(ei.value)
    assert lc.snapshot() == before  # unchanged


def test_allowed_table_matches_design():
    assert ALLOWED[State.JOINING] == {State.JOINING, State.READY, State.DRAINING}
    assert ALLOWED[State.READY] == {State.JOINING, State.DRAINING}
    assert ALLOWED[State.DRAINING] == {State.OFFLINE}
    assert ALLOWED[State.OFFLINE] == set()
    for r in ("dht_starting", "dht_bootstrap_failed", "dht_no_peers", "role_init", "state_sync", "draining"):
        assert r in READINESS_REASONS


async def test_listeners_sync_and_async():
    lc = Lifecycle()
    sync_calls, async_calls = [], []
    lc.subscribe(lambda s, r, d: sync_calls.append((s, r, d)))

    async def alisten(s, r, d):
        async_calls.append((s, r, d))
    lc.subscribe(alisten)

    await lc.move(State.JOINING, "dht_bootstrap_failed", "0 of 1")
    await lc.move(State.JOINING, "dht_bootstrap_failed", "0 of 1")   # identical: no notification
    await lc.move(State.JOINING, "dht_bootstrap_failed", "0 of 1, retry 2")  # detail change: notified
    await lc.move(State.READY, "ready", "")
    expected = [(State.JOINING, "dht_bootstrap_failed", "0 of 1"),
                (State.JOINING, "dht_bootstrap_failed", "0 of 1, retry 2"),
                (State.READY, "ready", "")]
    assert sync_calls == expected
    assert async_calls == expected


async def test_listener_sees_new_state_in_snapshot():
    lc = Lifecycle()
    seen = []
    lc.subscribe(lambda s, r, d: seen.append(lc.snapshot()))
    await lc.move(State.READY, "ready", "")
    assert seen == [(State.READY, "ready", "")]


async def test_since_changes_only_on_state_change():
    lc = Lifecycle()
    t0 = lc.since
    lc.since = t0 - 100
    await lc.move(State.JOINING, "dht_bootstrap_failed", "x")
    assert lc.since == t0 - 100
    await lc.move(State.READY, "ready")
    assert lc.since > t0 - 100


async def test_illegal_move_notifies_nobody():
    lc = Lifecycle()
    calls = []
    lc.subscribe(lambda *a: calls.append(a))
    with pytest.raises(LifecycleError):
        await lc.move(State.OFFLINE, "offline")
    assert calls == []


async def test_repeated_identical_move_is_a_noop_even_where_self_edge_is_not_listed():
    # the daemon refreshes readiness from several places (join loop, role): READY -> READY with the same
    # reason must not raise, or a node crashes on a harmless race
    lc = Lifecycle()
    calls = []
    lc.subscribe(lambda *a: calls.append(a))
    await lc.move(State.READY, "ready", "")
    await lc.move(State.READY, "ready", "")
    assert calls == [(State.READY, "ready", "")]
    await lc.move(State.DRAINING, "draining", "trigger: sigterm")
    await lc.move(State.DRAINING, "draining", "trigger: sigterm")
    with pytest.raises(LifecycleError):
        await lc.move(State.READY, "ready", "x")  # a real change (DRAINING -> READY) still fails
