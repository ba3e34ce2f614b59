"""optimizers/waiting.py: the NoLoCo waiting bound and the "nobody can meet us" rule (issue 8)."""

from __future__ import annotations

import pytest

from node.card import CardView, NodeCard
from optimizers.config import NoLoCoConfig
from optimizers.waiting import FINISHING, someone_can_meet, wait_bound


def view(peer, **details):
    card = NodeCard(role="noloco", state="ready", version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                    published_at=0.0, details=details)
    return CardView(peer_id=peer, card=card, expiration=0.0)


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
