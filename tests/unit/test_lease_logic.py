"""The coordinator lease's pure rules (node/lease_logic.py): who wins, expiry, step-down, no hand-back."""

from __future__ import annotations

import pytest

from node.lease_logic import ACTIVE, CLAIMING, STANDBY, LeaseLogic, Seen, active_holder

A, B, C = "12D3KooWAAAA", "12D3KooWBBBB", "12D3KooWCCCC"   # A < B < C


def logic(me: str, now: float = 0.0, at_once: bool = False) -> LeaseLogic:
    return LeaseLogic(me, lease_s=10.0, settle_s=2.0, now=now, claim_at_once=at_once)


def test_a_primary_on_its_first_start_claims_at_once_and_wins_after_settle():
    p = logic(A, at_once=True)
    assert p.tick(0.0, {}).new == CLAIMING
    assert p.tick(1.0, {}) is None                     # still settling
    ch = p.tick(2.0, {})
    assert ch.new == ACTIVE and p.active_since == 2.0


def test_a_standby_waits_while_an_active_entry_is_fresh_and_takes_over_lease_s_after_it_lapsed():
    s = logic(B)
    for t in range(0, 30):
        assert s.tick(float(t), {A: Seen(ACTIVE, epoch=7)}) is None
    assert s.state == STANDBY and s.holder == A and s.max_epoch == 7
    assert s.tick(30.0, {}) is None                     # the lease just lapsed: wait lease_s
    assert s.tick(39.0, {}) is None
    assert s.tick(40.0, {}).new == CLAIMING
    ch = s.tick(42.0, {})
    assert ch.new == ACTIVE and ch.missing_s == pytest.approx(12.0)
    assert s.max_epoch == 7                             # it plans above the epoch it saw


def test_two_claimants_the_lower_peer_id_wins_and_the_other_goes_back_to_standby():
    a, b = logic(A, at_once=True), logic(B, at_once=True)
    assert a.tick(0.0, {}).new == CLAIMING and b.tick(0.0, {}).new == CLAIMING
    assert b.tick(2.0, {A: Seen(CLAIMING)}).new == STANDBY
    assert a.tick(2.0, {B: Seen(CLAIMING)}).new == ACTIVE


def test_a_standby_does_not_claim_while_a_lower_peer_id_claims():
    c = logic(C, now=0.0)
    assert c.tick(20.0, {A: Seen(CLAIMING)}) is None and c.state == STANDBY


def test_a_claim_is_abandoned_when_an_active_entry_appears():
    b = logic(B, at_once=True)
    b.tick(0.0, {})
    ch = b.tick(1.0, {C: Seen(ACTIVE, epoch=3)})       # even a higher peer ID that is already active
    assert ch.new == STANDBY and b.max_epoch == 3


def test_an_active_coordinator_steps_down_only_for_a_lower_active_peer_id():
    b = logic(B, at_once=True)
    b.tick(0.0, {})
    b.tick(2.0, {})
    assert b.state == ACTIVE
    assert b.tick(3.0, {C: Seen(ACTIVE)}) is None and b.state == ACTIVE     # C steps down, not B
    assert b.tick(4.0, {C: Seen(STANDBY)}) is None
    ch = b.tick(5.0, {A: Seen(ACTIVE)})
    assert ch.old == ACTIVE and ch.new == STANDBY and b.holder == A


def test_no_hand_back_a_returning_bootstrap_stays_standby_while_the_new_one_is_active():
    # A was active, died; B took over. A restarts (not claim_at_once: it was active before)
    a = logic(A, now=100.0)
    for t in range(100, 200):
        assert a.tick(float(t), {B: Seen(ACTIVE, epoch=9)}) is None
    assert a.state == STANDBY and a.max_epoch == 9


def test_own_entry_is_ignored_and_highest_epoch_is_kept():
    a = logic(A)
    a.tick(0.0, {A: Seen(ACTIVE, epoch=99), B: Seen(STANDBY, epoch=4)})
    assert a.holder is None and a.max_epoch == 4
    a.note_epoch(2)
    assert a.max_epoch == 4


def test_active_holder_is_the_lowest_active_peer():
    assert active_holder({C: Seen(ACTIVE), B: Seen(ACTIVE), A: Seen(STANDBY)}) == B
    assert active_holder({A: Seen(CLAIMING)}) is None


def test_bad_timings_are_refused():
    with pytest.raises(ValueError):
        LeaseLogic(A, lease_s=0, settle_s=1, now=0)


def test_a_bootstrap_that_sees_no_peer_never_claims_unless_it_is_a_first_started_primary():
    restarted = logic(A, now=0.0)                       # a restarted primary or a standby: needs peers
    for t in range(0, 60, 5):
        assert restarted.tick(float(t), {}, connected=False) is None and restarted.state == STANDBY
    assert restarted.tick(60.0, {B: Seen(ACTIVE, epoch=4)}, connected=True) is None   # the swarm found it
    assert restarted.state == STANDBY and restarted.max_epoch == 4
    first = logic(A, at_once=True)
    assert first.tick(0.0, {}, connected=False).new == CLAIMING
    assert first.tick(2.0, {}, connected=False).new == ACTIVE


def test_a_claimant_that_loses_every_peer_while_it_settles_stands_back():
    s = logic(B, now=0.0)
    assert s.tick(10.0, {}, connected=True).new == CLAIMING
    ch = s.tick(11.0, {}, connected=False)
    assert ch.new == STANDBY and "no peer" in ch.why
