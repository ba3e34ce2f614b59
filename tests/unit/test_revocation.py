"""security/revocation.py and its uses: the list, merging, verify_token, read_entries, the record."""

from __future__ import annotations

import time

import msgpack
import pytest

from node.card import CARD_NAMESPACE, NodeCard
from security.admission import AdmissionRejected, issue_token, verify_token
from security.keys import generate_key, peer_id_str
from security.records import record_value, read_entries
from security.revocation import REVOKED, Revocations, RevokedEntry, merge

RUN = "rv"
NOW = int(time.time())


@pytest.fixture(autouse=True)
def _clean():
    REVOKED.clear()
    yield
    REVOKED.clear()


def _token(coord, peer, serial):
    return issue_token(coord, run_id=RUN, peer_id=peer, expires_at=time.time() + 3600, serial=serial)


def test_entry_needs_a_target():
    with pytest.raises(ValueError, match="serial, a peer_id or both"):
        RevokedEntry(until=NOW + 10, at=NOW)


def test_check_by_serial_and_by_peer():
    r = Revocations()
    a, b = peer_id_str(generate_key()), peer_id_str(generate_key())
    r.update([RevokedEntry(serial=7, peer_id=a, until=NOW + 7200, at=NOW),
              RevokedEntry(peer_id=b, until=NOW + 7200, at=NOW, reason="leak")])
    assert r.check(7, a) is not None and r.check(8, a) is None  # a new token of a is fine
    assert r.check(1, b) is not None and r.check(None, b).reason == "leak"  # every token of b
    assert r.peer_entry(a) is not None and r.peer_entry(peer_id_str(generate_key())) is None
    assert r.update([RevokedEntry(peer_id=b, until=NOW - 1, at=NOW)]) == [] and len(r) == 0  # expired: dropped


def test_merge_unions_and_drops_expired():
    a = peer_id_str(generate_key())
    old = [RevokedEntry(serial=1, peer_id=a, until=NOW + 10, at=NOW), RevokedEntry(serial=2, until=NOW - 5, at=NOW)]
    new = [RevokedEntry(serial=1, until=NOW + 100, at=NOW + 1), RevokedEntry(peer_id=a, until=NOW + 50, at=NOW)]
    out = merge(old, new, now=NOW)
    assert [(e.serial, e.peer_id, e.until) for e in out] == [(None, a, NOW + 50), (1, a, NOW + 100)]  # by time


def test_verify_token_honours_the_process_list():
    coord, peer_key = generate_key(), generate_key()
    cid, pid = peer_id_str(coord), peer_id_str(peer_key)
    blob = _token(coord, pid, 42)
    assert verify_token(blob, coordinator_peer_id=cid, run_id=RUN, peer_id=pid).serial == 42
    REVOKED.update([RevokedEntry(serial=42, until=NOW + 7200, at=NOW, reason="stolen")])
    with pytest.raises(AdmissionRejected) as ei:
        verify_token(blob, coordinator_peer_id=cid, run_id=RUN, peer_id=pid)
    assert ei.value.reason == "revoked" and "stolen" in str(ei.value) and "swarmnode admit" in str(ei.value)
    # the DHT validator passes revocations=None (it must never refuse a stored card: see records.py)
    assert verify_token(blob, coordinator_peer_id=cid, run_id=RUN, peer_id=pid, revocations=None).serial == 42


def test_read_entries_drops_revoked_writers():
    coord = generate_key()
    keys = [generate_key() for _ in range(3)]
    ids = [peer_id_str(k) for k in keys]
    key = f"{RUN}/nodes"
    card = NodeCard(role="noloco", state="ready", version="1", grpc_addr="127.0.0.1:1", started_at=1.0,
                    published_at=1.0)
    entries = {}
    for i, pid in enumerate(ids):  # what strip_value hands readers: the envelope with its token "t"
        entries[pid] = msgpack.packb({**record_value(key, card), "t": _token(coord, pid, 100 + i)}, use_bin_type=True)
    assert set(read_entries(entries, NodeCard, key=key)) == set(ids)
    REVOKED.update([RevokedEntry(serial=100, until=NOW + 7200, at=NOW),
                    RevokedEntry(peer_id=ids[1], until=NOW + 7200, at=NOW)])
    assert set(read_entries(entries, NodeCard, key=key)) == {ids[2]}
    assert REVOKED.peer_entry(ids[0]).serial == 100  # seen writing with a revoked serial: refused by name
    assert CARD_NAMESPACE.name == "nodes"


def test_revocation_record_is_coordinator_only():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time

    from security.records import SignedRecordValidator
    from security.revocation import revoked_key
    from security.revocation_record import REVOKED_NAMESPACE, signed_record_value

    coord, forger = generate_key(), generate_key()
    cid, fid = peer_id_str(coord), peer_id_str(forger)
    v = SignedRecordValidator(RUN, None, [REVOKED_NAMESPACE], coordinator_peer_id=cid)
    entries = [RevokedEntry(serial=5, until=NOW + 7200, at=NOW)]
    exp = get_dht_time() + 3600

    def rec(signer, subkey):
        value = msgpack.packb(signed_record_value(signer, RUN, entries, exp), use_bin_type=True)
        return DHTRecord(DHTID.generate(source=revoked_key(RUN)).to_bytes(), msgpack.packb(subkey), value, exp)
    assert v.validate(rec(coord, cid))
    assert not v.validate(rec(forger, fid)) and v.rejections["coordinator"] == 1
    assert not v.validate(rec(forger, cid)) and v.rejections["signature"] == 1
