"""node/coordinator_wait.py: who a node waits for and since when, and how `/readyz`, the card
and `swarmnode status` show it."""

from __future__ import annotations

from node import coordinator_wait as cw
from node.status import card_rows, format_table

PEER = "12D3KooWCoordinatorPeerIdForTheUnitTestsOnly1234567"


def test_a_wait_starts_at_the_first_failure_after_an_answer_and_ends_at_the_next_answer():
    w = cw.CoordinatorWait(now=100.0)
    assert w.waiting and w.state == "looking" and w.peer_id is None
    assert "no bootstrap card" in w.sentence()
    w.found(PEER)
    assert w.state == "unreachable" and w.since == 100.0          # still the same wait
    assert w.answered(now=110.0) is True and not w.waiting and w.card_value() is None
    assert w.detail(now=120.0) == {"state": "answering", "peer_id": PEER, "since": 110.0}
    assert w.answered(now=111.0) is False                         # no change
    assert w.failed("UNAVAILABLE: connection refused", now=130.0) is True
    assert w.failed("UNAVAILABLE: connection refused", now=132.0) is False   # the same wait
    d = w.detail(now=142.5)
    assert d["state"] == "unreachable" and d["since"] == 130.0 and d["waiting_s"] == 12.5
    assert d["error"].startswith("UNAVAILABLE")
    assert PEER[:16] in w.sentence() and "restart the bootstrap" in w.sentence()
    assert cw.parse_card_value(w.card_value()) == (PEER, 130.0)


def test_a_node_that_never_reached_its_coordinator_waits_since_it_started():
    w = cw.CoordinatorWait(PEER, now=40.0)                        # known in advance (token mode)
    w.begin(now=50.0)                                             # done building: it starts looking
    assert w.failed("DEADLINE_EXCEEDED: ", now=60.0) is False
    assert w.state == "unreachable" and w.since == 50.0 and w.waited_s(now=70.0) == 20.0
    w.answered(now=80.0)
    w.begin(now=90.0)                                             # no-op once it answered
    assert w.since == 80.0


def test_junk_card_values_are_ignored():
    for junk in (None, 3, "", "@", "peer", "peer@soon", "@12"):
        assert cw.parse_card_value(junk) is None, junk
    assert cw.parse_card_value("?@12") == (None, 12.0)
    assert cw.status_hint({"coordinator_wait": "?@100"}, now=130.0).startswith(
        "WAITING for the coordinator (not found yet) for 30 s")


class _Card:
    def __init__(self, details):
        self.role, self.state, self.version, self.grpc_addr = "stage", "joining", "0.1.0", "127.0.0.1:1"
        self.published_at = self.started_at = 1000.0
        self.details = details


class _View:
    def __init__(self, peer_id, details):
        self.peer_id, self.card = peer_id, _Card(details)


def test_status_says_which_nodes_wait_for_their_coordinator_under_the_table():
    views = [_View("12D3KooWstageNodeA", {"stage": 1, "coordinator_wait": f"{PEER}@1000"}),
             _View("12D3KooWstageNodeB", {"stage": 2})]
    rows = card_rows(views, now=1042.0)
    assert rows[0]["coordinator_hint"].startswith(f"WAITING for the coordinator {PEER} for 42 s")
    assert "coordinator_hint" not in rows[1]
    text = format_table(rows, now=1042.0)
    assert f"12D3KooWstageNod…: WAITING for the coordinator {PEER} for 42 s" in text
    assert "COORDINATOR_WAIT" not in text.splitlines()[0]       # a sentence under the table, not a column
