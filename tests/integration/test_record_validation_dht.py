"""Signed records on real hivemind DHTs (p2pd on 127.0.0.1): identity, publish, forgery refused.

Facts checked here about hivemind 1.1.12:
* an Ed25519 key written by security.keys is accepted through ``identity_path`` and
  ``dht.peer_id.to_base58()`` / ``.to_bytes()`` equal ``peer_id_str`` / ``peer_id_bytes``;
* its ``check_if_identity_free`` (on by default when ``initial_peers`` is given) calls
  ``PeerID.from_identity``, which only understands RSA keys: with an Ed25519 key it raises, so a
  node that joins at construction passes ``check_if_identity_free=False`` (node/membership.py
  starts the DHT without initial peers and joins afterwards, which skips that path).
"""

import time

import hivemind
import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict

from security.keys import encode_private_key, generate_key, peer_id_bytes, peer_id_str, write_key_file
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

RUN = "itest"
KEY = f"{RUN}/nodes"


class Card(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    state: str


def validator(key):
    return SignedRecordValidator(RUN, key, [Namespace("nodes", Card, max_payload_bytes=4096, max_ttl_s=60)])


def start_dht(tmp_path, name, key, validators, initial_peers=()):
    path = write_key_file(tmp_path / f"{name}.key", key)
    return hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers),
                        identity_path=str(path), record_validators=validators, start=True,
                        check_if_identity_free=False)


def test_hivemind_peer_id_from_identity_is_rsa_only():
    with pytest.raises(Exception):
        PeerID.from_identity(encode_private_key(generate_key()))


def test_signed_record_published_and_forgery_refused(tmp_path):
    key_a, key_b, key_c = generate_key(), generate_key(), generate_key()
    pid_a = peer_id_str(key_a)
    dhts = []
    try:
        a = start_dht(tmp_path, "a", key_a, [validator(key_a)])
        dhts.append(a)
        b = start_dht(tmp_path, "b", key_b, [validator(key_b)], a.get_visible_maddrs())
        dhts.append(b)
        # the forger runs no validator, so its DHT sends whatever bytes it is given
        c = start_dht(tmp_path, "c", key_c, [], a.get_visible_maddrs())
        dhts.append(c)
        for dht, key in ((a, key_a), (b, key_b), (c, key_c)):
            assert dht.peer_id.to_base58() == peer_id_str(key) and dht.peer_id.to_base58().startswith("12D3KooW")
            assert dht.peer_id.to_bytes() == peer_id_bytes(key)  # identity multihash: 0x00 0x24 PublicKey

        card = Card(role="noloco", state="READY")
        assert a.store(KEY, record_value(KEY, card), get_dht_time() + 30, subkey=pid_a)

        found = b.get(KEY, latest=True)
        assert found is not None and pid_a in found.value
        assert decode_payload(found.value[pid_a].value, Card, key=KEY) == card

        # C forges A's card: its own signature under A's subkey, later expiration
        fake = Card(role="noloco", state="DRAINING")
        payload, exp = encode_payload(fake), get_dht_time() + 50
        forged = {"v": RECORD_TAG, "k": KEY, "p": payload, "s": key_c.sign(signing_bytes(KEY, pid_a, payload, exp))}
        c.store(KEY, forged, exp, subkey=pid_a)
        # and an untagged overwrite of A's entry
        c.store(KEY, encode_payload(fake), exp, subkey=pid_a)

        # the forgery provably reached the DHT before the readers are asked: a raw read on the
        # forger (no validator) serves it under A's subkey, and A and B have both refused it
        raw = c.get(KEY, latest=True)
        assert raw is not None and pid_a in raw.value and raw.value[pid_a].expiration_time == exp, raw
        counts = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            counts = {name: d.run_coroutine(read_rejections) for name, d in (("a", a), ("b", b))}
            if sum(counts["a"].values()) and sum(counts["b"].values()):
                break
            time.sleep(0.2)
        total = {r: counts["a"].get(r, 0) + counts["b"].get(r, 0) for r in set(counts["a"]) | set(counts["b"])}
        assert total.get("signature", 0) >= 1, counts
        assert total.get("malformed", 0) >= 1, counts
        assert c.run_coroutine(read_rejections) == {}  # no SignedRecordValidator there

        for reader in (b, a):
            found = reader.get(KEY, latest=True)
            assert found is not None
            assert read_entries(found.value, Card, key=KEY) == {pid_a: card}
            assert found.value[pid_a].expiration_time < exp
    finally:
        for d in reversed(dhts):
            d.shutdown()
