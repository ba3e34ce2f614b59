"""`swarmnode status` rendering of node cards (the DHT read itself is covered by integration tests)."""

from node.card import CardView, NodeCard
from node.status import card_rows, format_table, summary_line


def _view(pid, role, state, published, started, **details):
    card = NodeCard(role=role, state=state, version="0.1.0", grpc_addr="127.0.0.1:5000", started_at=started,
                    published_at=published, details=details)
    return CardView(peer_id=pid, card=card, expiration=published + 30)


def test_rows_carry_required_keys_age_and_details():
    rows = card_rows([_view("12D3KooWAAAAAAAAAAAAAAAAAAAAAAAA", "noloco", "ready", 100.0, 40.0, round=7)], now=103.0)
    assert rows == [{"peer_id": "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAA", "role": "noloco", "state": "ready",
                     "version": "0.1.0", "address": "127.0.0.1:5000", "age_s": 3.0, "uptime_s": 63.0, "round": 7}]


def test_one_table_per_role_with_that_roles_own_columns():
    views = [_view("12D3KooWBOOTBOOTBOOTBOOTBOOT", "bootstrap", "ready", 10.0, 1.0),
             _view("12D3KooWWORKWORKWORKWORKWORK", "noloco", "draining", 10.0, 2.0, round=3, blocked=0.25,
                   cfg_hash="ab" * 16, device_kind="cpu", device_memory_bytes=123),
             _view("12D3KooWSTAGESTAGESTAGESTAGE", "stage", "ready", 11.0, 2.0, stage=2, iteration=40),
             _view("12D3KooWGRPOGRPOGRPOGRPOGRPO", "grpo", "joining", 9.0, 2.0, round=5, reward=0.4375,
                   rejected=2, model_id="m" * 20)]
    blocks = [b.splitlines() for b in format_table(card_rows(views, now=12.0)).split("\n\n")]
    assert [len(b) for b in blocks] == [2, 2, 2, 2]
    heads = [b[0].split() for b in blocks]
    assert heads[0] == ["PEER_ID", "ROLE", "STATE", "ADDRESS", "AGE_S"]
    assert heads[1] == ["PEER_ID", "ROLE", "STATE", "ROUND", "BLOCKED", "DEVICE_KIND", "ADDRESS", "AGE_S"]
    assert heads[2] == ["PEER_ID", "ROLE", "STATE", "STAGE", "ITERATION", "ADDRESS", "AGE_S"]
    assert heads[3] == ["PEER_ID", "ROLE", "STATE", "ROUND", "REWARD", "REJECTED", "ADDRESS", "AGE_S"]
    assert blocks[1][1].split()[1:6] == ["noloco", "draining", "3", "0.25", "cpu"]
    assert blocks[2][1].split()[3:5] == ["2", "40"]
    assert blocks[3][1].split()[3:6] == ["5", "0.438", "2"]          # floats to 3 significant digits
    text = format_table(card_rows(views, now=12.0))
    assert "abab" not in text and "mmmm" not in text and "123" not in text   # hashes, ids, sizes: --json only


def test_summary_line_counts_states_per_role():
    views = [_view("a", "bootstrap", "ready", 1.0, 1.0), _view("b", "noloco", "ready", 1.0, 1.0),
             _view("c", "noloco", "ready", 1.0, 1.0), _view("d", "noloco", "joining", 1.0, 1.0)]
    line = summary_line(card_rows(views, now=2.0), now=0.0)
    assert line.split("  ", 1)[1] == "4 nodes: bootstrap 1 ready; noloco 1 joining, 2 ready"


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


def test_grpo_rollout_bans_mark_the_poisoner():
    poisoner, honest = "12D3KooWPOISONPOISONPOISONxyz1234", "12D3KooWHONESTHONESTHONESTabcdefg"
    views = [_view("12D3KooWAAAAAAAAAAAAAAAAAAAA1", "grpo", "ready", 10.0, 1.0, grpo_banned=1,
                   grpo_banned_ids=poisoner[-8:]),
             _view(honest, "grpo", "ready", 10.0, 1.0, grpo_banned=1, grpo_banned_ids=poisoner[-8:]),
             _view(poisoner, "grpo", "ready", 10.0, 1.0, adversary=True)]
    rows = {r["peer_id"]: r for r in card_rows(views, now=12.0)}
    assert rows[poisoner]["banned_by"] == 2 and "banned_by" not in rows[honest]
    table = format_table(list(rows.values()))
    assert "BANNED_BY" in table and "GRPO_BANNED_IDS" not in table and "GRPO_BANNED" in table


def test_protocol_internals_read_as_an_operator_reads_them():
    """A wall-clock detail reads relative to now; a flag shows only when set (the raw values stay in --json)."""
    views = [_view("12D3KooWWORKWORKWORKWORKWORK1", "noloco", "ready", 1_799_999_999.0, 2.0, round=3,
                   next_exchange_at=1_800_000_000.4, finishing=False),
             _view("12D3KooWWORKWORKWORKWORKWORK2", "noloco", "ready", 1_799_999_999.0, 2.0, round=3,
                   next_exchange_at=1_799_999_998.0, finishing=False)]
    rows = card_rows(views, now=1_800_000_000.0)
    assert rows[0]["next_exchange_at"] == 1_800_000_000.4 and rows[0]["finishing"] is False   # raw for --json
    lines = format_table(rows, now=1_800_000_000.0).splitlines()
    assert lines[0].split() == ["PEER_ID", "ROLE", "STATE", "ROUND", "NEXT_EXCHANGE", "ADDRESS", "AGE_S"]
    assert "in 0.4 s" in lines[1] and "2.0 s ago" in lines[2]
    assert "e+09" not in "\n".join(lines) and "False" not in "\n".join(lines)
    views[1].card.details["finishing"] = True           # took its last round: now it matters
    lines = format_table(card_rows(views, now=1_800_000_000.0), now=1_800_000_000.0).splitlines()
    assert "FINISHING" in lines[0] and lines[2].split()[-3] == "yes" and "False" not in "\n".join(lines)
