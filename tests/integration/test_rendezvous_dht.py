"""node/rendezvous.py on real hivemind DHTs (p2pd on 127.0.0.1): publish, read, caps, forgery.

A pipeline-shaped rendezvous (entries indexed by ``iteration``) between two validating nodes
and a forger that runs no validator; the same store/read code serves the node card.
"""

from __future__ import annotations

import asyncio

import hivemind
import pytest
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field

from node.card import CARD_NAMESPACE
from node.dht_records import read_entries_at, store_entry
from node.rendezvous import Rendezvous
from security.keys import generate_key, peer_id_str, write_key_file
from security.records import RECORD_TAG, SignedRecordValidator, encode_payload

pytestmark = pytest.mark.timeout(120)

RUN = "rdvtest"


class StageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    iteration: int = Field(ge=0)
    stage: int = Field(ge=0)
    grpc_addr: str = Field(max_length=80)


STAGES = Rendezvous("stage/records/", StageRecord, index_field="iteration", max_payload_bytes=512, max_ttl_s=30)
SMALL = Rendezvous("stage/small/", StageRecord, index_field="iteration", max_payload_bytes=48)
NAMESPACES = [CARD_NAMESPACE, STAGES.namespace, SMALL.namespace]


def start_dht(tmp_path, name, key, validators, initial_peers=()):
    path = write_key_file(tmp_path / f"{name}.key", key)
    return hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers),
                        identity_path=str(path), record_validators=validators, start=True,
                        check_if_identity_free=False)


async def test_rendezvous_publish_read_caps_and_forgery(tmp_path):
    key_a, key_b, key_c = generate_key(), generate_key(), generate_key()
    pid_a, pid_b = peer_id_str(key_a), peer_id_str(key_b)
    dhts = []
    try:
        a = start_dht(tmp_path, "a", key_a, [SignedRecordValidator(RUN, key_a, NAMESPACES)])
        dhts.append(a)
        b = start_dht(tmp_path, "b", key_b, [SignedRecordValidator(RUN, key_b, NAMESPACES)], a.get_visible_maddrs())
        dhts.append(b)
        c = start_dht(tmp_path, "c", key_c, [], a.get_visible_maddrs())  # the forger
        dhts.append(c)

        ea = StageRecord(iteration=3, stage=0, grpc_addr="127.0.0.1:1")
        eb = StageRecord(iteration=3, stage=1, grpc_addr="127.0.0.1:2")
        assert await STAGES.publish(a, RUN, pid_a, ea, ttl_s=600)   # asks too much: clamped to 30 s
        assert await STAGES.publish(b, RUN, pid_b, eb, ttl_s=20)
        for reader in (a, b):
            assert await STAGES.read(reader, RUN, 3) == {pid_a: ea, pid_b: eb}
        raw = await read_entries_at(b, STAGES.key(RUN, 3), StageRecord)
        assert raw[pid_a].expiration <= get_dht_time() + 30.5      # the clamp, not the 600 s asked for
        assert await STAGES.read(b, RUN, 4) == {}                    # another iteration: nobody yet

        # a signed entry filed under the wrong iteration is stored, but readers of that
        # iteration drop it (the payload is what the writer vouches for)
        wrong = StageRecord(iteration=6, stage=0, grpc_addr="127.0.0.1:1")
        assert await store_entry(a, STAGES.key(RUN, 5), pid_a, wrong, 20)
        assert pid_a in await read_entries_at(b, STAGES.key(RUN, 5), StageRecord)
        assert await STAGES.read(b, RUN, 5) == {}

        # the forger writes under A's subkey: unsigned, and signed by the wrong key
        key3 = STAGES.key(RUN, 3)
        fake = encode_payload(StageRecord(iteration=3, stage=9, grpc_addr="evil:1"))
        exp = get_dht_time() + 25
        await asyncio.to_thread(c.store, key3, {"v": RECORD_TAG, "k": key3, "p": fake}, exp, subkey=pid_a)
        await asyncio.to_thread(c.store, key3, {"v": RECORD_TAG, "k": key3, "p": fake, "s": key_c.sign(b"x" * 8)},
                                exp, subkey=pid_a)
        for reader in (a, b):
            assert await STAGES.read(reader, RUN, 3) == {pid_a: ea, pid_b: eb}

        # the namespace's payload cap: a small entry passes; a big one never reaches another node
        small = StageRecord(iteration=1, stage=0, grpc_addr="h:1")
        big = StageRecord(iteration=1, stage=1, grpc_addr="h" * 60)
        assert len(encode_payload(small)) <= 48 < len(encode_payload(big))
        assert await SMALL.publish(a, RUN, pid_a, small, 20)
        await SMALL.publish(b, RUN, pid_b, big, 20)
        assert await SMALL.read(a, RUN, 1) == {pid_a: small}
    finally:
        for d in reversed(dhts):
            d.shutdown()


async def test_publish_failure_returns_false_and_logs(caplog):
    class BrokenDht:
        def store(self, *args, **kwargs):
            raise RuntimeError("p2pd is gone")

    with caplog.at_level("WARNING", logger="swarmnode.rendezvous"):
        ok = await STAGES.publish(BrokenDht(), RUN, "12D3KooWx", StageRecord(iteration=1, stage=0, grpc_addr="h:1"), 10)
    assert ok is False
    assert any("stage/records/" in r.getMessage() and "p2pd is gone" in r.getMessage() for r in caplog.records)
