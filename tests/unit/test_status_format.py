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


def test_banned_peers_are_marked_by_how_many_nodes_ban_them():
    flooder, honest = "12D3KooWFLOODFLOODFLOODxyz12345", "12D3KooWHONESTHONESTHONESTabcdefg"
    views = [_view("12D3KooWAAAAAAAAAAAAAAAAAAAA1", "noloco", "ready", 10.0, 1.0, banned=1, banned_ids=flooder[-8:]),
             _view("12D3KooWBBBBBBBBBBBBBBBBBBBB2", "noloco", "ready", 10.0, 1.0, banned=2,
                   banned_ids=f"10.0.0.9,{flooder[-8:]}"),
             _view(flooder, "noloco", "ready", 10.0, 1.0, banned=0, banned_ids=""),
             _view(honest, "noloco", "ready", 10.0, 1.0, banned=0, banned_ids="")]
    rows = {r["peer_id"]: r for r in card_rows(views, now=12.0)}
    assert rows[flooder]["banned_by"] == 2
    assert all("banned_by" not in rows[p] for p in rows if p != flooder)
    table = format_table(list(rows.values()))
    assert "BANNED_BY" in table and "BANNED_IDS" not in table
