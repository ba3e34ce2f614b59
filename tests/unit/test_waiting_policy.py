"""optimizers/waiting.py: the NoLoCo waiting bound and the "nobody can meet us" rule (issue 8).

The rules read plain ``PeerPlan`` values; ``view`` builds each from a node card the way the role
reads it (``optimizers.noloco_role.peer_plan``), so junk card values are covered too."""

from __future__ import annotations

import pytest

from node.card import CardView, NodeCard
from optimizers.config import NoLoCoConfig
from optimizers.noloco_role import peer_plan
from optimizers.waiting import (FINISHING, NEXT_EXCHANGE_AT, PeerPlan, lead_steps, someone_can_meet, steps_to_wait,
                               wait_bound)


def view(peer, **details) -> PeerPlan:
    card = NodeCard(role="noloco", state="ready", version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                    published_at=0.0, details=details)
    return peer_plan(CardView(peer_id=peer, card=card, expiration=0.0))


def test_bound_is_a_fraction_of_the_own_inner_phase():
    cfg = NoLoCoConfig(inner_steps=20, wait_fraction=0.25, min_wait_s=0.5, round_timeout=10.0)
    assert wait_bound(0.4, cfg) == pytest.approx(0.25 * 0.4 * 20)   # 8 s phase -> 2 s
    assert wait_bound(1.2, cfg) == pytest.approx(6.0)               # a 3x slower worker waits 3x longer


def test_bound_floor_and_hard_cap():
    cfg = NoLoCoConfig(inner_steps=20, wait_fraction=0.25, min_wait_s=0.5, round_timeout=10.0)
    assert wait_bound(None, cfg) == 0.5            # nothing measured yet: the floor
    assert wait_bound(0.01, cfg) == 0.5            # 0.05 s by the fraction: the floor wins
    assert wait_bound(100.0, cfg) == 10.0          # round_timeout is the hard cap
    assert wait_bound(100.0, cfg.model_copy(update={"round_timeout": 3.0})) == 3.0


def test_defaults_are_documented_values():
    cfg = NoLoCoConfig()
    assert (cfg.wait_fraction, cfg.min_wait_s) == (0.25, 0.5)
    assert NoLoCoConfig(wait_fraction=0.9).cfg_hash() == cfg.cfg_hash()


def test_nobody_left_when_all_peers_are_past_or_finishing():
    assert not someone_can_meet([], 5)
    assert not someone_can_meet([view("a", round=6), view("b", round=9)], 5)        # all past label 5
    assert not someone_can_meet([view("a", round=5, **{FINISHING: True})], 5)       # took its last round
    assert not someone_can_meet([view("a", round=6), view("b", round=3, **{FINISHING: True})], 5)


def test_someone_left_when_a_peer_is_at_or_behind_the_label():
    assert someone_can_meet([view("a", round=5)], 5)                  # in its inner phase for round 5
    assert someone_can_meet([view("a", round=7), view("b", round=2)], 5)  # behind: it catches up
    assert someone_can_meet([view("a")], 5)                           # no round yet: about to start
    assert someone_can_meet([view("a", round=4, **{FINISHING: False})], 5)
    assert someone_can_meet([view("a", round=True)], 5)               # junk round reads as unknown


def test_a_peer_expected_after_the_wait_cannot_meet_us():
    now = 1000.0
    late = view("a", round=5, **{NEXT_EXCHANGE_AT: now + 3.0})
    soon = view("b", round=5, **{NEXT_EXCHANGE_AT: now + 0.3})
    waiting = view("c", round=5, **{NEXT_EXCHANGE_AT: now - 2.0})    # already waiting at the exchange
    assert not someone_can_meet([late], 5, by=now + 1.0)
    assert someone_can_meet([late, soon], 5, by=now + 1.0)
    assert someone_can_meet([waiting], 5, by=now + 1.0)
    assert someone_can_meet([late], 5)                                 # no deadline: only the label counts
    assert someone_can_meet([view("d", round=5, **{NEXT_EXCHANGE_AT: float("nan")})], 5, by=now)  # junk: unknown
    assert not someone_can_meet([view("e", round=7, **{NEXT_EXCHANGE_AT: now})], 5, by=now + 1.0)  # past the label


def test_compute_while_waiting_runs_until_the_next_peer_is_due():
    now, step = 1000.0, 0.1
    due_in_1s = view("a", round=5, **{NEXT_EXCHANGE_AT: now + 1.0})
    assert steps_to_wait([due_in_1s], 5, now, bound=0.5, step_s=step, max_steps=20) == 10
    assert steps_to_wait([due_in_1s], 5, now, bound=1.5, step_s=step, max_steps=20) == 0   # within the bound: wait
    assert steps_to_wait([due_in_1s], 5, now, bound=0.5, step_s=step, max_steps=5) == 0    # too far: solo now
    assert steps_to_wait([], 5, now, bound=0.5, step_s=step, max_steps=20) == 0            # nobody at all
    assert steps_to_wait([due_in_1s], 5, now, bound=0.5, step_s=None, max_steps=20) == 0   # pace unknown
    finishing = view("b", round=5, **{NEXT_EXCHANGE_AT: now + 1.0, FINISHING: True})
    assert steps_to_wait([finishing], 5, now, bound=0.5, step_s=step, max_steps=20) == 0
    assert steps_to_wait([view("c", round=5, **{NEXT_EXCHANGE_AT: now + 0.01})], 5, now, 0.0, step, 20) == 1


def test_idle_only_for_a_partner_due_within_the_idle_window():
    now, step = 1000.0, 0.1
    due_in_05 = view("a", round=5, **{NEXT_EXCHANGE_AT: now + 0.5})
    # within the wait bound (1 s) but 5 steps away: keep training for 5 steps instead of idling
    assert steps_to_wait([due_in_05], 5, now, bound=1.0, step_s=step, max_steps=20, idle_s=step) == 5
    assert steps_to_wait([due_in_05], 5, now, bound=1.0, step_s=step, max_steps=20) == 0     # no window: wait
    assert steps_to_wait([due_in_05], 5, now, bound=1.0, step_s=step, max_steps=20, idle_s=0.6) == 0
    # the window never exceeds the bound: a peer due after the bound still means compute first
    assert steps_to_wait([due_in_05], 5, now, bound=0.2, step_s=step, max_steps=20, idle_s=5.0) == 5
    # a peer already waiting (time in the past) or without a time: pair now
    waiting = view("b", round=5, **{NEXT_EXCHANGE_AT: now - 1.0})
    assert steps_to_wait([due_in_05, waiting], 5, now, 1.0, step, 20, idle_s=step) == 0
    assert steps_to_wait([due_in_05, view("c", round=5)], 5, now, 1.0, step, 20, idle_s=step) == 0
    # the earliest due peer sets the extra steps
    due_in_03 = view("d", round=5, **{NEXT_EXCHANGE_AT: now + 0.3})
    assert steps_to_wait([due_in_05, due_in_03], 5, now, 1.0, step, 20, idle_s=step) == 3


def test_idle_steps_default_and_not_hashed():
    cfg = NoLoCoConfig()
    assert cfg.idle_steps == 1.0
    assert NoLoCoConfig(idle_steps=4.0).cfg_hash() == cfg.cfg_hash()


def test_peer_plan_reads_only_well_formed_details():
    assert PeerPlan.from_details({FINISHING: True, NEXT_EXCHANGE_AT: 12.5}, 3) == PeerPlan(3, True, 12.5)
    for junk in ("12", True, float("inf"), None):
        assert PeerPlan.from_details({FINISHING: "yes", NEXT_EXCHANGE_AT: junk}, None) == PeerPlan(None, False, None)
    assert view("a", round=2 ** 80).round is None   # out of the card range: read as no round
    assert view("a", round=4, **{NEXT_EXCHANGE_AT: 7}).next_exchange_at == 7.0


def test_a_worker_left_out_arrives_one_step_before_the_peers_of_its_next_label():
    """The joiner of tests/integration/test_robust_gossip.py, 0.17 s (1.7 steps of 0.1 s) after a
    lock-stepped pair, found them matched 200 rounds in a row; it now drops 3 steps and is
    there 0.13 s before them."""
    pair = [PeerPlan(223, next_exchange_at=100.0), PeerPlan(223, next_exchange_at=100.02)]
    assert lead_steps(pair, 223, own_at=100.17, step_s=0.1, max_steps=4) == 3
    assert lead_steps(pair, 223, own_at=100.0, step_s=0.1, max_steps=4) == 1      # a tie is a race: go first
    assert lead_steps(pair, 223, own_at=99.9, step_s=0.1, max_steps=4) == 0       # early already: it waits
    # the peers paired at its label while it waited: it came late whatever the cards said
    assert lead_steps(pair, 223, own_at=99.9, step_s=0.1, max_steps=4, missed=True) == 1
    assert lead_steps(pair, 224, own_at=99.9, step_s=0.1, max_steps=4, missed=True) == 0
    assert lead_steps(pair, 224, own_at=100.17, step_s=0.1, max_steps=4) == 0     # nobody due at its label
    assert lead_steps(pair, 223, own_at=100.5, step_s=0.1, max_steps=4) == 0      # a phase off: not by dropping
    assert lead_steps([PeerPlan(223, finishing=True, next_exchange_at=100.0)], 223, 100.17, 0.1, 4) == 0
    assert lead_steps(pair, 223, own_at=100.17, step_s=None, max_steps=4) == 0
    assert lead_steps(pair, 223, own_at=100.17, step_s=0.1, max_steps=0) == 0
