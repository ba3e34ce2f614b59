"""security/records.py: SignedRecordValidator on DHTRecords built exactly as hivemind builds them.

hivemind 1.1.12 (dht/node.py store_many, dht/protocol.py): record.key = DHTID.generate(source=key)
.to_bytes() (SHA-1 of msgpack(key)), record.subkey = MSGPackSerializer.dumps(subkey), record.value =
MSGPackSerializer.dumps(value) then validator.sign_value(record); readers get
MSGPackSerializer.loads(validator.strip_value(record)).
"""

import dataclasses
import hashlib
import logging

import base58
import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic import BaseModel, ConfigDict

from security.keys import RecordRejected, generate_key, peer_id_str
from security.records import (
    RECORD_TAG,
    Namespace,
    SignedRecordValidator,
    decode_payload,
    encode_payload,
    read_entries,
    read_rejections,
    record_value,
    signing_bytes,
)

RUN = "run1"


class Card(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    state: str
    grpc: str = ""


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    round: int
    paths: list[list[int]]


CARD = Card(role="noloco", state="READY", grpc="127.0.0.1:5000")


@pytest.fixture(scope="module")
def keys():
    return {name: generate_key() for name in ("a", "b", "coord")}


def make_validator(key, coord_key=None):
    return SignedRecordValidator(RUN, key, [
        Namespace("nodes", Card, max_payload_bytes=4096, max_ttl_s=60),
        Namespace("noloco/roster/", Card, max_ttl_s=120),
        Namespace("schedule", Schedule, max_ttl_s=600, coordinator_only=True),
    ], coordinator_peer_id=peer_id_str(coord_key) if coord_key else None)


def hivemind_record(validator, key, subkey, value, expiration_time) -> DHTRecord:
    """What DHTNode.store_many hands the validator, after sign_value."""
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration_time)
    return dataclasses.replace(record, value=validator.sign_value(record))


def reader_value(validator, record):
    return MSGPackSerializer.loads(validator.strip_value(record))


def assert_rejected(validator, record, reason):
    before = dict(validator.rejections)
    assert validator.validate(record) is False
    assert validator.rejections.get(reason, 0) == before.get(reason, 0) + 1, validator.rejections


def test_good_record_round_trip(keys):
    writer, reader = make_validator(keys["a"], keys["coord"]), make_validator(keys["b"], keys["coord"])
    key, pid = f"{RUN}/nodes", peer_id_str(keys["a"])
    rec = hivemind_record(writer, key, pid, record_value(key, CARD), get_dht_time() + 30)
    env = msgpack.unpackb(rec.value)
    assert set(env) == {"v", "k", "p", "s"} and env["v"] == RECORD_TAG and len(env["s"]) == 64
    assert writer.validate(rec) and reader.validate(rec)
    value = reader_value(reader, rec)
    assert "s" not in value
    assert decode_payload(value, Card, key=key) == CARD
    assert decode_payload(reader.strip_value(rec), Card) == CARD  # raw bytes form too
    assert reader.rejections == {}


def test_prefix_namespace_and_coordinator_namespace(keys):
    coord = make_validator(keys["coord"], keys["coord"])
    reader = make_validator(keys["b"], keys["coord"])
    key = f"{RUN}/noloco/roster/17"
    rec = hivemind_record(coord, key, peer_id_str(keys["coord"]), record_value(key, CARD), get_dht_time() + 60)
    assert reader.validate(rec)
    sched = Schedule(round=3, paths=[[0, 1, 2]])
    rec = hivemind_record(coord, f"{RUN}/schedule", peer_id_str(keys["coord"]),
                          record_value(f"{RUN}/schedule", sched), get_dht_time() + 300)
    assert reader.validate(rec)
    assert decode_payload(reader_value(reader, rec), Schedule) == sched


def test_subkey_not_signer(keys):
    """A signs a record but stores it under B's subkey: sign_value leaves it unsigned; a forged
    envelope carrying A's signature under B's subkey fails the signature check."""
    a, reader = make_validator(keys["a"]), make_validator(keys["coord"])
    key, pid_a, pid_b = f"{RUN}/nodes", peer_id_str(keys["a"]), peer_id_str(keys["b"])
    unsigned = hivemind_record(a, key, pid_b, record_value(key, CARD), get_dht_time() + 30)
    assert "s" not in msgpack.unpackb(unsigned.value)
    assert_rejected(reader, unsigned, "malformed")
    good = hivemind_record(a, key, pid_a, record_value(key, CARD), get_dht_time() + 30)
    forged = dataclasses.replace(good, subkey=MSGPackSerializer.dumps(pid_b))
    assert_rejected(reader, forged, "signature")


def test_qm_or_rsa_writer_subkey(keys):
    reader = make_validator(keys["b"])
    key = f"{RUN}/nodes"
    qm = base58.b58encode(bytes([0x12, 0x20]) + hashlib.sha256(b"some rsa key").digest()).decode()
    exp = get_dht_time() + 30
    payload = encode_payload(CARD)
    env = {"v": RECORD_TAG, "k": key, "p": payload, "s": b"\x00" * 64}
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(qm),
                    MSGPackSerializer.dumps(env), exp)
    assert_rejected(reader, rec, "not_ed25519")
    rec = dataclasses.replace(rec, subkey=MSGPackSerializer.dumps(b"raw-bytes-subkey"))
    assert_rejected(reader, rec, "not_ed25519")


def test_tampered_payload(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    key = f"{RUN}/nodes"
    rec = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, CARD), get_dht_time() + 30)
    env = msgpack.unpackb(rec.value)
    env["p"] = encode_payload(Card(role="noloco", state="DRAINING", grpc="127.0.0.1:5000"))
    assert_rejected(reader, dataclasses.replace(rec, value=msgpack.packb(env)), "signature")


def test_over_long_expiration(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    key = f"{RUN}/nodes"
    rec = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, CARD), get_dht_time() + 3600)
    assert_rejected(reader, rec, "expiration")
    assert_rejected(a, rec, "expiration")  # our own store is refused locally too


def test_extended_expiration_after_signing(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    key = f"{RUN}/nodes"
    rec = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, CARD), get_dht_time() + 20)
    assert reader.validate(rec)
    assert_rejected(reader, dataclasses.replace(rec, expiration_time=rec.expiration_time + 30), "signature")


def test_oversize_payload(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    key = f"{RUN}/nodes"
    for size in (4100, 5000, 50_000):  # payload just over the 4 KiB cap, envelope over, far over
        big = Card(role="x" * size, state="READY")
        rec = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, big), get_dht_time() + 30)
        assert_rejected(reader, rec, "oversize")
    # under a prefix namespace (known only from the envelope) a big value is still parsed and judged
    key = f"{RUN}/noloco/roster/9"
    big = Card(role="x" * 50_000, state="READY")
    rec = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, big), get_dht_time() + 30)
    assert_rejected(reader, rec, "oversize")
    assert_rejected(reader, dataclasses.replace(rec, subkey=b"\xc0"), "no_subkey")


def test_extra_field_in_payload(keys):
    reader = make_validator(keys["b"])
    key, pid = f"{RUN}/nodes", peer_id_str(keys["a"])
    payload = msgpack.packb({**CARD.model_dump(mode="json"), "evil": 1})
    exp = get_dht_time() + 30
    env = {"v": RECORD_TAG, "k": key, "p": payload, "s": keys["a"].sign(signing_bytes(key, pid, payload, exp))}
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(pid), msgpack.packb(env), exp)
    assert_rejected(reader, rec, "schema")
    payload = msgpack.packb({"role": 1, "state": "READY"})  # wrong type under strict
    env = {**env, "p": payload, "s": keys["a"].sign(signing_bytes(key, pid, payload, exp))}
    assert_rejected(reader, dataclasses.replace(rec, value=msgpack.packb(env)), "schema")


def test_unknown_namespace_in_our_run(keys, caplog):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    key, pid = f"{RUN}/secret-namespace", peer_id_str(keys["a"])
    assert a.sign_value(DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(pid),
                                  MSGPackSerializer.dumps(record_value(key, CARD)), get_dht_time() + 30)) \
        == MSGPackSerializer.dumps(record_value(key, CARD))  # not signed
    payload = encode_payload(CARD)
    exp = get_dht_time() + 30
    env = {"v": RECORD_TAG, "k": key, "p": payload, "s": keys["a"].sign(signing_bytes(key, pid, payload, exp))}
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(pid), msgpack.packb(env), exp)
    with caplog.at_level(logging.INFO):
        assert_rejected(reader, rec, "namespace")
    # another role's record in a mixed swarm: not stored here, said at INFO (a WARNING per 10 s was noise)
    said = [r for r in caplog.records if "secret-namespace" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said), [(r.levelname, r.getMessage()) for r in said]
    rec = dataclasses.replace(rec, key=DHTID.generate(source=f"{RUN}/noloco/roster/1/deeper").to_bytes())
    assert_rejected(reader, rec, "malformed")  # envelope key must hash to the DHT key


def test_missing_subkey(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    key = f"{RUN}/nodes"
    rec = hivemind_record(a, key, None, record_value(key, CARD), get_dht_time() + 30)
    assert rec.subkey == b"\xc0"  # hivemind's IS_REGULAR_VALUE
    assert_rejected(reader, rec, "no_subkey")
    raw = DHTRecord(DHTID.generate(source=key).to_bytes(), b"\xc0", MSGPackSerializer.dumps(b"junk"),
                    get_dht_time() + 30)
    assert_rejected(reader, raw, "no_subkey")  # exact namespace known from the key hash alone


def test_coordinator_only_written_by_non_coordinator(keys):
    a, reader = make_validator(keys["a"], keys["coord"]), make_validator(keys["b"], keys["coord"])
    key = f"{RUN}/schedule"
    rec = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, Schedule(round=1, paths=[])),
                          get_dht_time() + 30)
    assert "s" in msgpack.unpackb(rec.value)  # a signs it (own subkey) ...
    assert_rejected(reader, rec, "coordinator")  # ... but is not the coordinator
    no_coord = make_validator(keys["b"])
    assert_rejected(no_coord, rec, "coordinator")  # no coordinator configured: nobody may write


def test_untagged_value_under_peer_id_subkey_rejected(keys):
    """Nobody may overwrite a peer's entry under a prefix key with an untagged value."""
    reader = make_validator(keys["b"])
    key = f"{RUN}/noloco/roster/4"
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(peer_id_str(keys["a"])),
                    MSGPackSerializer.dumps(encode_payload(CARD)), get_dht_time() + 30)
    assert_rejected(reader, rec, "malformed")


def test_other_run_and_foreign_keys_pass_untouched(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    pid = peer_id_str(keys["a"])
    # another run's record, even tagged and signed by that run's validator
    other = SignedRecordValidator("run2", keys["a"], [Namespace("nodes", Card)])
    rec = hivemind_record(other, "run2/nodes", pid, record_value("run2/nodes", CARD), get_dht_time() + 30)
    assert a.sign_value(dataclasses.replace(rec, value=MSGPackSerializer.dumps(record_value("run2/nodes", CARD)))) \
        == MSGPackSerializer.dumps(record_value("run2/nodes", CARD))
    assert reader.validate(rec) and reader.strip_value(rec) == rec.value
    # hivemind averager-style keys: bytes subkeys, arbitrary values, long expirations
    for key, subkey, value in [("my_averager.0b001", b"\x00\x24peer-bytes", [b"x", 1.5, None]),
                               ("expert.1.2", -1, ("tuple", 1)), ("plain", None, {"any": "thing"})]:
        rec = hivemind_record(a, key, subkey, value, get_dht_time() + 10_000)
        assert rec.value == MSGPackSerializer.dumps(value)
        assert reader.validate(rec)
        assert MSGPackSerializer.loads(reader.strip_value(rec)) == value
    assert reader.rejections == {}


def test_composite_validator_and_read_rejections(keys):
    a, reader = make_validator(keys["a"]), make_validator(keys["b"])
    composite = CompositeValidator([reader])
    key = f"{RUN}/nodes"
    good = hivemind_record(a, key, peer_id_str(keys["a"]), record_value(key, CARD), get_dht_time() + 30)
    assert composite.validate(good)
    assert decode_payload(MSGPackSerializer.loads(composite.strip_value(good)), Card) == CARD
    assert not composite.validate(dataclasses.replace(good, expiration_time=good.expiration_time + 1))

    class Protocol:
        record_validator = composite

    class Node:
        protocol = Protocol()

    import asyncio
    counts = asyncio.run(read_rejections(None, Node()))
    assert counts == {"signature": 1}
    counts["signature"] = 99
    assert reader.rejections == {"signature": 1}  # a copy


def test_rejection_logged_at_warning(keys, caplog):
    reader = make_validator(keys["b"])
    key = f"{RUN}/nodes"
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), b"\xc0", b"\xc0", get_dht_time() + 30)
    with caplog.at_level(logging.WARNING, logger="swarmnode.security.records"):
        for _ in range(5):
            reader.validate(rec)
    lines = [r for r in caplog.records if "no_subkey" in r.getMessage()]
    assert len(lines) == 1  # rate-limited
    assert reader.rejections["no_subkey"] == 5


def test_read_entries_and_decode_errors(keys):
    a = make_validator(keys["a"])
    key, pid = f"{RUN}/nodes", peer_id_str(keys["a"])
    rec = hivemind_record(a, key, pid, record_value(key, CARD), get_dht_time() + 30)
    good = MSGPackSerializer.loads(a.strip_value(rec))
    entries = {pid: good, "not-a-peer": good, peer_id_str(keys["b"]): b"untagged", 5: good}
    assert read_entries(entries, Card, key=key) == {pid: CARD}
    assert read_entries(None, Card, key=key) == {}
    with pytest.raises(RecordRejected):
        decode_payload(good, Card, key=f"{RUN}/other")
    with pytest.raises(RecordRejected):
        decode_payload(b"\xc1", Card)
    with pytest.raises(RecordRejected, match="Schedule"):
        decode_payload(good, Schedule)


def test_constructor_checks(keys):
    with pytest.raises(ValueError):
        SignedRecordValidator("a/b", None, [])
    with pytest.raises(ValueError):
        SignedRecordValidator(RUN, None, [], coordinator_peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(ValueError):
        Namespace("/nodes", Card)
    v = SignedRecordValidator(RUN, None, [Namespace("nodes", Card)])
    rec = DHTRecord(DHTID.generate(source=f"{RUN}/nodes").to_bytes(), MSGPackSerializer.dumps("x"),
                    MSGPackSerializer.dumps(record_value(f"{RUN}/nodes", CARD)), get_dht_time() + 30)
    assert v.sign_value(rec) == rec.value  # a read-only validator never signs


def _token_validator(key, coord_key, token=None):
    return SignedRecordValidator(RUN, key, [Namespace("nodes", Card, max_payload_bytes=4096, max_ttl_s=60),
                                            Namespace("noloco/roster/", Card, max_ttl_s=120)],
                                 coordinator_peer_id=peer_id_str(coord_key), admission_token=token,
                                 require_admission=True)


def test_token_mode_admits_only_writers_with_a_valid_token_for_their_role(keys):
    import time

    from security.admission import issue_token

    coord, a = keys["coord"], keys["a"]
    pid_a, key = peer_id_str(a), f"{RUN}/nodes"
    reader = _token_validator(keys["b"], coord)

    def card_by(token, card=CARD, subkey_key=a):
        writer = _token_validator(subkey_key, coord, token)
        return hivemind_record(writer, key, peer_id_str(subkey_key), record_value(key, card), get_dht_time() + 30)

    good = issue_token(coord, run_id=RUN, peer_id=pid_a, expires_at=time.time() + 3600, roles=["noloco"])
    assert reader.validate(card_by(good))
    roster_key = f"{RUN}/noloco/roster/3"  # roster entries need the token too
    writer = _token_validator(a, coord, good)
    assert reader.validate(hivemind_record(writer, roster_key, pid_a, record_value(roster_key, CARD),
                                           get_dht_time() + 30))
    assert_rejected(reader, hivemind_record(_token_validator(a, coord), roster_key, pid_a,
                                            record_value(roster_key, CARD), get_dht_time() + 30), "admission")
    assert_rejected(reader, card_by(None), "admission")                                   # no token
    expired = issue_token(coord, run_id=RUN, peer_id=pid_a, expires_at=time.time() - 10,
                          not_before=time.time() - 100)
    assert_rejected(reader, card_by(expired), "admission")                                # expired
    foreign = issue_token(coord, run_id=RUN, peer_id=peer_id_str(keys["b"]), expires_at=time.time() + 3600)
    assert_rejected(reader, card_by(foreign), "admission")                                # someone else's
    forged = issue_token(keys["b"], run_id=RUN, peer_id=pid_a, expires_at=time.time() + 3600)
    assert_rejected(reader, card_by(forged), "admission")                                 # not the coordinator's
    other_run = issue_token(coord, run_id="other", peer_id=pid_a, expires_at=time.time() + 3600)
    assert_rejected(reader, card_by(other_run), "admission")
    stage_only = issue_token(coord, run_id=RUN, peer_id=pid_a, expires_at=time.time() + 3600, roles=["stage"])
    assert_rejected(reader, card_by(stage_only), "admission")                             # role not allowed
    # the coordinator needs no token for its own records
    assert reader.validate(card_by(None, subkey_key=coord))


def test_token_mode_records_expire_with_their_token(keys):
    """A record may not outlive its writer's token, and one stored while the token was valid
    stays valid until it expires itself: hivemind drops a whole subkey dictionary (every card)
    when one entry fails validation, so no entry may turn invalid while peers hold it."""
    from security.admission import issue_token

    coord, a = keys["coord"], keys["a"]
    pid_a, key = peer_id_str(a), f"{RUN}/nodes"
    reader = _token_validator(keys["b"], coord)
    writer_of = lambda tok: _token_validator(a, coord, tok)  # noqa: E731
    now = get_dht_time()
    short = issue_token(coord, run_id=RUN, peer_id=pid_a, expires_at=now + 20)
    assert reader.validate(hivemind_record(writer_of(short), key, pid_a, record_value(key, CARD), now + 15))
    assert_rejected(reader, hivemind_record(writer_of(short), key, pid_a, record_value(key, CARD), now + 40),
                    "admission")  # outlives the token
    # stored while valid: token expired 5 s ago, the record 6 s ago (a peer with a slower clock
    # still serves it): it is the record's expiry that drops it, not a validation failure
    old = issue_token(coord, run_id=RUN, peer_id=pid_a, expires_at=now - 5, not_before=now - 100)
    assert reader.validate(hivemind_record(writer_of(old), key, pid_a, record_value(key, CARD), now - 6))
    # a new record with the expired token is refused
    assert_rejected(reader, hivemind_record(writer_of(old), key, pid_a, record_value(key, CARD), now + 10),
                    "admission")

