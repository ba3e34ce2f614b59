"""The event bus's sender rule (node/eventbus/members.py) and the daemon's gate (gate.py), in-process."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from node.eventbus.config import TOPICS, EventBusConfig
from node.eventbus.gate import SenderGate
from node.eventbus.members import BusMembers, topics_for_role
from security.limits import BanList

PUB = {"rollouts": ["grpo"]}


def view(peer, role="grpo", state="ready", expiration=1000.0):
    return SimpleNamespace(peer_id=peer, card=SimpleNamespace(role=role, state=state), expiration=expiration)


class Clock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_topics_for_role():
    assert topics_for_role("grpo", TOPICS, PUB) == {"swarm", "rollouts"}
    assert topics_for_role("noloco", TOPICS, PUB) == {"swarm"}
    assert topics_for_role("noloco", TOPICS, {}) == {"swarm", "rollouts"}


def test_refusals_before_and_after_the_first_card_read():
    m = BusMembers(clock=Clock())
    assert m.refusal("A", "swarm") == "members_unknown"
    m.update([view("A"), view("B", role="bootstrap")], TOPICS, PUB)
    assert m.refusal("A", "rollouts") is None and m.refusal("A", "swarm") is None
    assert m.refusal("B", "swarm") is None
    assert m.refusal("B", "rollouts") == "role_not_allowed"
    assert m.refusal("S", "rollouts") == "not_member"


def test_absent_peers_fade_after_the_grace_and_offline_cards_end_membership_at_once():
    clock = Clock()
    m = BusMembers(clock=clock)
    m.update([view("A", expiration=130.0), view("B", expiration=130.0)], TOPICS, PUB, grace_s=15.0)
    clock.t = 105.0
    m.update([view("B", state="offline")], TOPICS, PUB, grace_s=15.0)   # A missing from one read
    assert m.refusal("B", "swarm") == "not_member"
    assert m.refusal("A", "swarm") is None
    clock.t = 120.1                                                     # past 105 + 15
    assert m.refusal("A", "swarm") == "not_member"
    clock.t = 100.0
    m.update([view("C", expiration=110.0)], TOPICS, PUB)
    clock.t = 111.0                                                     # its card expired
    assert m.refusal("C", "swarm") == "not_member"


def test_gate_strikes_only_verified_senders_and_bans_on_repeat():
    bans = BanList(threshold=3, window_s=60.0, ban_s=600.0)
    gate = SenderGate(EventBusConfig(), bans=bans)
    gate.update([view("12D3member", expiration=time.time() + 60)])
    assert gate.refusal("12D3member", "rollouts", lambda: True) is None
    for _ in range(10):   # a forged claim of someone's ID never charges that ID
        assert gate.refusal("12D3victim", "rollouts", lambda: False) == "not_member"
    assert not bans.is_banned("12D3victim")
    reasons = [gate.refusal("12D3stranger", "rollouts", lambda: True) for _ in range(5)]
    assert reasons == ["not_member"] * 4 + ["banned"]
    assert bans.is_banned("12D3stranger")
    req = gate.request()
    assert [m.peer_id for m in req.members] == ["12D3member"]
    assert sorted(req.members[0].topics) == ["rollouts", "swarm"]
    assert list(req.banned) == ["12D3stranger"]


def test_gate_folds_the_sidecars_bans():
    gate = SenderGate(EventBusConfig(), ban={"threshold": 20, "window_s": 60, "ban_s": 60})
    gate.fold_sidecar_bans(["12D3x"])
    gate.update([])
    assert gate.refusal("12D3x", "swarm", lambda: True) == "banned"


def test_publishers_knob_is_checked():
    with pytest.raises(ValueError, match="unknown topic"):
        EventBusConfig(publishers={"bogus": ["grpo"]})
    with pytest.raises(ValueError, match="is empty"):
        EventBusConfig(publishers={"rollouts": []})
