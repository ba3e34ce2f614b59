"""node/card.py swarm queries: ``peers`` filters and the typed detail accessors (junk ignored)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from node.card import CardView, NodeCard, card_int, card_str, max_card_int, peers


def view(peer, role="stage", state="ready", **details):
    card = NodeCard(role=role, state=state, version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                    published_at=0.0, details=details)
    return CardView(peer_id=peer, card=card, expiration=0.0)


SWARM = [
    view("me", cfg_hash="h1", iteration=99),
    view("a", cfg_hash="h1", iteration=7),
    view("b", cfg_hash="h1", iteration=12),
    view("c", state="draining", cfg_hash="h1", iteration=40),
    view("d", cfg_hash="other", iteration=50),
    view("e", role="bootstrap", iteration=60),
    view("f", state="joining"),                      # no cfg_hash yet
    view("g", cfg_hash="h1", iteration=True),        # junk: a bool is not an int
    view("h", cfg_hash="h1", iteration="30"),        # junk: a string
    view("i", cfg_hash="h1", iteration=-4),          # junk: negative
    view("j", cfg_hash="h1", iteration=31.0),        # junk: a float
]


def ids(views):
    return [v.peer_id for v in views]


def test_peers_default_keeps_ready_nodes_of_any_role():
    assert ids(peers(SWARM)) == ["me", "a", "b", "d", "e", "g", "h", "i", "j"]


def test_peers_filters_combine():
    assert ids(peers(SWARM, role="stage", cfg_hash="h1", exclude="me")) == ["a", "b", "g", "h", "i", "j"]
    assert ids(peers(SWARM, role="bootstrap")) == ["e"]
    assert ids(peers(SWARM, role="grpo")) == []
    assert ids(peers(SWARM, states=("draining",))) == ["c"]
    assert ids(peers(SWARM, states=None, role="stage", cfg_hash="other")) == ["d"]
    assert len(peers(SWARM, states=None)) == len(SWARM)


def test_peers_unknown_cfg_counts_joiners_only_when_asked():
    live = peers(SWARM, role="stage", cfg_hash="h1", states=("ready", "joining"))
    assert "f" not in ids(live)
    live = peers(SWARM, role="stage", cfg_hash="h1", states=("ready", "joining"), unknown_cfg_ok=True)
    assert "f" in ids(live) and "d" not in ids(live)


def test_typed_accessors_ignore_junk():
    by_id = {v.peer_id: v for v in SWARM}
    assert card_int(by_id["a"], "iteration") == 7
    for junk in "ghij":
        assert card_int(by_id[junk], "iteration") is None, junk
    assert card_int(by_id["f"], "iteration") is None          # absent
    assert card_int(view("z", iteration=0), "iteration") == 0  # zero is a valid round
    assert card_str(by_id["a"], "cfg_hash") == "h1"
    assert card_str(by_id["a"], "iteration") is None
    assert card_str(by_id["f"], "cfg_hash") is None


def test_max_card_int_is_the_frontier_of_the_filtered_peers():
    mine = peers(SWARM, role="stage", cfg_hash="h1", exclude="me")
    # ourselves, draining nodes, other configs, other roles and malformed values never count
    assert max_card_int(mine, "iteration") == 12
    assert max_card_int(peers(SWARM[:1], exclude="me"), "iteration") is None
    assert max_card_int([], "iteration") is None
    assert max_card_int(SWARM[6:], "iteration") is None          # only junk and absent values


def test_card_role_is_any_well_formed_name():
    assert view("x", role="my_role-2").card.role == "my_role-2"
    for bad in ("", "Stage", "a/b", "x" * 33):
        with pytest.raises(ValidationError):
            view("x", role=bad)
