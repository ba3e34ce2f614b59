"""Event bus, pure parts: config checks, the signed bytes, notices, card discovery, counters, and
the sidecar's import hygiene (checked in fresh interpreters: py-libp2p and hivemind cannot share
this pytest process)."""

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from pydantic import ValidationError

from node.eventbus.client import gossip_peers_from_cards, restart_delay
from node.eventbus.config import EventBusConfig
from node.eventbus.metrics import BusCounters
from node.eventbus.wire import (NoticeError, decode_notice, encode_notice, full_topic, short_topic, signed_bytes,
                                verify_message)
from protocol import eventbus_pb2
from security.keys import generate_key, peer_id_bytes, peer_id_str, sign, write_key_file

ROOT = Path(__file__).resolve().parents[2]


def run_py(code: str, timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# ---- config ----

def test_config_defaults_and_caps():
    cfg = EventBusConfig()
    assert cfg.enabled is False and cfg.caps() == {"swarm": 4096, "rollouts": 65536}


@pytest.mark.parametrize("bad", [dict(degree=3, degree_low=4), dict(degree=13, degree_high=12),
                                 dict(publish_threshold=-90, graylist_threshold=-80),
                                 dict(announce_addrs=["/ip4/1.2.3.4/tcp/1/p2p/12D3KooWabc"]),
                                 dict(rollouts_max_bytes=2 * 1024 * 1024), dict(colour="red")])
def test_config_rejects(bad):
    with pytest.raises(ValidationError):
        EventBusConfig(**bad)


def test_node_config_has_the_section():
    from node.config import load_config
    cfg = load_config(overrides={"eventbus": {"enabled": True, "port": 0}}, environ={})
    assert cfg.eventbus.enabled and cfg.eventbus.port == 0


# ---- signed bytes and re-verification ----

def test_signed_bytes_match_py_libp2p_serialization():
    cases = [(b"\x00\x24" + b"p" * 36, b"hello", (7).to_bytes(8, "big"), "swarmnode/r/swarm"),
             (b"id", b"", b"", "t"), (b"x" * 40, b"d" * 70000, b"\x01" * 8, "swarmnode/run-1/rollouts")]
    code = ("import json, sys\nfrom libp2p.pubsub.pb import rpc_pb2\nout = []\n"
            f"for f, d, s, t in {cases!r}:\n"
            "    out.append(('libp2p-pubsub:'.encode() + rpc_pb2.Message(from_id=f, data=d, seqno=s, "
            "topicIDs=[t]).SerializeToString()).hex())\nprint(json.dumps(out))")
    theirs = json.loads(run_py(code))
    assert theirs == [signed_bytes(f, d, s, t).hex() for f, d, s, t in cases]


def test_verify_message():
    key = generate_key()
    pid = peer_id_bytes(key.public_key())
    topic = full_topic("r", "rollouts")
    sig = sign(key, signed_bytes(pid, b"data", b"\x00" * 8, topic))
    assert verify_message(pid, b"data", b"\x00" * 8, topic, sig)
    assert not verify_message(pid, b"datb", b"\x00" * 8, topic, sig)          # tampered payload
    assert not verify_message(pid, b"data", b"\x00" * 7 + b"\x01", topic, sig)  # other seqno
    assert not verify_message(pid, b"data", b"\x00" * 8, full_topic("other", "rollouts"), sig)  # other run
    assert not verify_message(peer_id_bytes(generate_key().public_key()), b"data", b"\x00" * 8, topic, sig)
    assert not verify_message(pid, b"data", b"\x00" * 8, topic, b"")          # unsigned


def test_topics():
    assert full_topic("run-1", "swarm") == "swarmnode/run-1/swarm"
    assert short_topic("run-1", "swarmnode/run-1/rollouts") == "rollouts"
    assert short_topic("run-1", "swarmnode/run-2/rollouts") is None


# ---- notices ----

def test_notice_round_trip():
    data = encode_notice("drain", "r", "12D3KooWme", trigger="sigterm")
    n = decode_notice(data, "r", 4096)
    assert (n.kind, n.sender, n.fields) == ("drain", "12D3KooWme", {"trigger": "sigterm"})


def test_notice_rejections():
    good = encode_notice("ban", "r", "p", target="q")
    with pytest.raises(NoticeError, match="run"):
        decode_notice(good, "other", 4096)
    with pytest.raises(NoticeError, match="cap"):
        decode_notice(good, "r", 10)
    with pytest.raises(NoticeError, match="clock"):
        decode_notice(encode_notice("drain", "r", "p", sent_at=time.time() - 3600), "r", 4096)
    with pytest.raises(NoticeError, match="msgpack"):
        decode_notice(b"\xc1garbage", "r", 4096)
    body = msgpack.unpackb(good)
    for mutate in ({"kind": "nuke"}, {"v": 2}, {"extra": 1}, {"f": [1]}):
        with pytest.raises(NoticeError):
            decode_notice(msgpack.packb({**body, **mutate}), "r", 4096)
    with pytest.raises(ValueError, match="unknown notice kind"):
        encode_notice("nuke", "r", "p")


# ---- discovery from cards, counters ----

def _view(pid, state="ready", **details):
    return SimpleNamespace(peer_id=pid, card=SimpleNamespace(state=state, details=details))


def test_gossip_peers_from_cards():
    views = [_view("me", gossip_addr="/ip4/127.0.0.1/tcp/1"),
             _view("a", gossip_addr="/ip4/127.0.0.1/tcp/2,/ip4/10.0.0.2/tcp/2"),
             _view("b"), _view("c", state="offline", gossip_addr="/ip4/127.0.0.1/tcp/3"),
             _view("d", gossip_addr="junk"), _view("e", gossip_addr=5)]
    assert gossip_peers_from_cards(views, "me") == {"a": ["/ip4/127.0.0.1/tcp/2", "/ip4/10.0.0.2/tcp/2"]}


def test_counters_stay_monotonic_across_restarts():
    def snap(pub, dropped):
        r = eventbus_pb2.PeersReply()
        t = r.topics.add(topic="rollouts", published=pub, received=pub * 2)
        t.dropped["oversize"] = dropped
        return r
    c = BusCounters()
    c.fold(snap(5, 1))                     # the first sidecar died after these
    pub, rec, drop = c.totals(snap(2, 3))  # the second one counts from zero
    assert pub["rollouts"] == 7 and rec["rollouts"] == 14 and drop[("rollouts", "oversize")] == 4
    c.local_drop("swarm", "bad_signature")
    assert c.totals(None)[2][("swarm", "local_bad_signature")] == 1


def test_restart_backoff_doubles_to_its_cap():
    assert [restart_delay(n, 5.0) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_disabled_bus_leaves_roles_on_the_dht():
    from node.config import load_config
    from node.eventbus.service import NodeEventBus

    svc = NodeEventBus(load_config(environ={}), "unused.key", card=None, membership=None, peer_id="p")
    assert svc.bus is None and not svc.enabled and svc.status() == {"state": "disabled"}


def test_status_tells_an_unreachable_node_what_to_fix():
    from node.status import bus_reach_hint, card_rows, format_table

    addr = "/ip4/10.0.0.9/tcp/31338"
    hint = bus_reach_hint({"bus_reach": "0/3", "gossip_addr": addr})
    assert addr in hint and "eventbus.port" in hint and "eventbus.announce_addrs" in hint
    assert bus_reach_hint({"bus_reach": "2/3", "gossip_addr": addr}) == ""
    assert bus_reach_hint({"bus_reach": "0/0"}) == ""          # nobody probed it yet
    assert bus_reach_hint({}) == "" and bus_reach_hint({"bus_reach": "junk"}) == ""
    card = SimpleNamespace(role="bootstrap", state="ready", version="x", grpc_addr="a", published_at=0.0,
                           started_at=0.0, details={"bus_reach": "0/2", "gossip_addr": addr})
    rows = card_rows([SimpleNamespace(peer_id="p", card=card)], now=1.0)
    assert rows[0]["bus_reach"] == "0/2" and "UNREACHABLE" in rows[0]["bus_hint"]
    header, row, note = format_table(rows).splitlines()
    assert "BUS_REACH" in header and "BUS_HINT" not in header and "0/2" in row and addr in row
    assert note.startswith("p…: gossip UNREACHABLE") and addr in note

# ---- the sidecar's process hygiene ----

def test_sidecar_module_never_imports_hivemind():
    out = run_py("import sys, node.eventbus.sidecar\n"
                 "print('hivemind' in sys.modules, 'libp2p' in sys.modules)")
    assert out.split() == ["False", "True"]


def test_daemon_side_never_imports_libp2p():
    out = run_py("import sys, node.eventbus.client, node.eventbus.service, node.daemon\n"
                 "print('libp2p' in sys.modules)")
    assert out.split() == ["False"]


def test_sidecar_key_gives_the_dht_peer_id(tmp_path):
    key = generate_key()
    path = write_key_file(tmp_path / "id.key", key)
    out = run_py("from node.eventbus.sidecar import _seed\n"
                 "from libp2p.crypto.ed25519 import create_new_key_pair\nfrom libp2p.peer.id import ID\n"
                 f"print(ID.from_pubkey(create_new_key_pair(_seed({str(path)!r}, False)).public_key).to_base58())")
    assert out.strip() == peer_id_str(key.public_key())
