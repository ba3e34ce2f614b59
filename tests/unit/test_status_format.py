"""`swarmnode status` rendering of node cards (the DHT read itself is covered by integration tests)."""

from node.card import CardView, NodeCard
from node.status import card_rows, format_table


def _view(pid, role, state, published, started, **details):
    card = NodeCard(role=role, state=state, version="0.1.0", grpc_addr="127.0.0.1:5000", started_at=started,
                    published_at=published, details=details)
    return CardView(peer_id=pid, card=card, expiration=published + 30)


def test_rows_carry_required_keys_age_and_details():
    rows = card_rows([_view("12D3KooWAAAAAAAAAAAAAAAAAAAAAAAA", "noloco", "ready", 100.0, 40.0, round=7)], now=103.0)
    assert rows == [{"peer_id": "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAA", "role": "noloco", "state": "ready",
                     "version": "0.1.0", "address": "127.0.0.1:5000", "age_s": 3.0, "uptime_s": 63.0, "round": 7}]


def test_table_has_a_header_and_one_line_per_node():
    views = [_view("12D3KooWBOOTBOOTBOOTBOOTBOOT", "bootstrap", "ready", 10.0, 1.0),
             _view("12D3KooWWORKWORKWORKWORKWORK", "noloco", "draining", 10.0, 2.0, round=3)]
    lines = format_table(card_rows(views, now=12.0)).splitlines()
    assert lines[0].split()[:6] == ["PEER_ID", "ROLE", "STATE", "ROUND", "ADDRESS", "AGE_S"]
    assert len(lines) == 3 and "draining" in lines[2] and " 3 " in f" {lines[2]} "


def test_empty_swarm_says_what_to_check():
    assert "no live nodes" in format_table([])
