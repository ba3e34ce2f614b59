"""optimizers/roster.py: key layout, strict schema, namespace matching and a signed round trip."""

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic import ValidationError

from optimizers.roster import ROSTER_NAMESPACE, RosterEntry, roster_key
from security.keys import generate_key, peer_id_str
from security.records import SignedRecordValidator, read_entries, record_value

RUN = "run7"


def entry(**kw):
    base = dict(round=3, grpc_addr="127.0.0.1:5000", cfg_hash="abc123", waiting_since=1.5)
    return RosterEntry(**{**base, **kw})


def test_roster_key_layout():
    assert roster_key(RUN, 0) == "run7/noloco/roster/0"
    assert roster_key(RUN, 12) == "run7/noloco/roster/12"
    with pytest.raises(ValueError):
        roster_key(RUN, -1)


def test_entry_schema_is_strict():
    e = entry()
    assert RosterEntry.model_validate_json(e.model_dump_json()) == e
    with pytest.raises(ValidationError):
        entry(extra_field=1)
    with pytest.raises(ValidationError):
        entry(round="3")                      # strict: no str -> int coercion
    with pytest.raises(ValidationError):
        entry(grpc_addr="h" * 81)
    with pytest.raises(ValidationError):
        entry(cfg_hash="x" * 33)
    with pytest.raises(ValidationError):
        entry(round=-1)


def test_namespace_matches_round_keys_only():
    v = SignedRecordValidator(RUN, None, [ROSTER_NAMESPACE])
    assert v.namespace_of(roster_key(RUN, 5)) is ROSTER_NAMESPACE
    assert v.namespace_of("run7/noloco/roster/") is None          # no round
    assert v.namespace_of("run7/noloco/roster/5/x") is None       # nested
    assert v.namespace_of("other/noloco/roster/5") is None        # another run
    assert ROSTER_NAMESPACE.max_payload_bytes == 1024 and ROSTER_NAMESPACE.max_ttl_s == 120.0


def _record(key, subkey, value, ttl):
    return DHTRecord(key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(subkey),
                     value=MSGPackSerializer.dumps(value), expiration_time=get_dht_time() + ttl)


def test_signed_entry_round_trip_and_forgery():
    sk = generate_key()
    pid = peer_id_str(sk)
    v = SignedRecordValidator(RUN, sk, [ROSTER_NAMESPACE])
    key = roster_key(RUN, 3)
    rec = _record(key, pid, record_value(key, entry()), 30)
    signed = DHTRecord(rec.key, rec.subkey, v.sign_value(rec), rec.expiration_time)
    assert v.validate(signed)
    stripped = MSGPackSerializer.loads(v.strip_value(signed))
    assert read_entries({pid: stripped}, RosterEntry, key=key) == {pid: entry()}
    # TTL above the namespace cap is refused
    long = _record(key, pid, record_value(key, entry()), 600)
    assert not v.validate(DHTRecord(long.key, long.subkey, v.sign_value(long), long.expiration_time))
    # another peer's subkey cannot be signed by us
    other = peer_id_str(generate_key())
    forged = _record(key, other, record_value(key, entry()), 30)
    assert not v.validate(DHTRecord(forged.key, forged.subkey, v.sign_value(forged), forged.expiration_time))
    assert msgpack.unpackb(v.sign_value(forged)) == msgpack.unpackb(forged.value)


def _view(peer, round_, role="noloco", state="ready", cfg="abc123"):
    from node.card import CardView, NodeCard
    details = {"cfg_hash": cfg} if cfg is not None else {}
    if round_ is not None:
        details["round"] = round_
    card = NodeCard(role=role, state=state, version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                    published_at=0.0, details=details)
    return CardView(peer_id=peer, card=card, expiration=0.0)


def test_noloco_follows_the_highest_live_compatible_peer():
    """The role's donor/frontier filter (node.card.peers + max_card_int) over mixed cards."""
    from node.card import max_card_int
    from optimizers.noloco_role import NoLoCoRole

    role = NoLoCoRole.__new__(NoLoCoRole)  # only the filter's inputs: our peer ID and config hash
    role.ctx, role._cfg_hash = type("Ctx", (), {"peer_id": "me"})(), "abc123"  # what the cfg_hash property reads
    views = [_view("me", 99), _view("a", 7), _view("b", 12), _view("c", 40, state="draining"),
             _view("d", 50, cfg="other"), _view("e", 60, role="bootstrap"), _view("f", None),
             _view("g", True), _view("h", "30")]
    # ourselves, draining nodes, other configs, other roles and malformed rounds never count
    assert [v.peer_id for v in role._ready_peers(views)] == ["a", "b", "f", "g", "h"]
    assert max_card_int(role._ready_peers(views), "round") == 12
    assert max_card_int(role._ready_peers(views[:1]), "round") is None


def test_roster_is_a_rendezvous_and_the_old_names_are_views_of_it():
    from node.rendezvous import Rendezvous
    from optimizers.roster import ROSTER

    assert isinstance(ROSTER, Rendezvous) and ROSTER.entry_model is RosterEntry
    assert ROSTER_NAMESPACE is ROSTER.namespace and ROSTER.key(RUN, 4) == roster_key(RUN, 4)
