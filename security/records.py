"""Signed, owner-bound DHT records (docs/security.md, 'Signed DHT records'): the hivemind validator and the value codec.

Owns what a swarmnode record looks like in the DHT and the rules for accepting one. A node
publishes with ``subkey = its own base58 peer ID``; only the holder of that peer's key can
write that subkey (**subkey == writer**), and nobody can extend or edit another peer's record.

What hivemind hands a validator (hivemind 1.1.12, ``dht/node.py`` / ``dht/protocol.py``):

* ``record.key`` is NOT the key string: it is ``DHTID.generate(source=key).to_bytes()``, i.e.
  20 bytes of SHA-1 over ``msgpack(key)``. So the plain key travels inside the envelope
  (``"k"``) and the validator checks ``DHTID(k) == record.key``. Exact namespaces
  (``<run>/nodes``) are also recognised from the hash alone, so any value under them must be
  a valid envelope.
* ``record.subkey`` is ``msgpack(subkey)`` (a msgpack str for our peer-ID subkeys);
  ``msgpack(None) = b"\\xc0"`` marks a record without subkey.
* ``record.value`` is ``msgpack(value)`` of what the application passed to ``dht.store``.

Wire format (msgpack only, never pickle):

* the application stores ``record_value(key, model)`` = ``{"v": TAG, "k": key, "p": payload}``
  where payload = ``encode_payload(model)`` (msgpack of ``model_dump(mode="json")``);
* ``sign_value`` adds ``"s"``: Ed25519 over ``b"swarmnode/record/v1" + msgpack([key, subkey,
  payload, expiration_time])`` (key and subkey as strings, expiration as float64);
* ``strip_value`` drops ``"s"``; readers get ``{"v", "k", "p"}`` and call
  ``decode_payload(value, Model, key=key)`` or ``read_entries(...)`` for a whole subkey dict.

Which records are ours: a value tagged ``"v": TAG`` whose key is under ``<run>/``; any value
under an exact namespace key; any record whose subkey is a string that parses as a peer ID
(so nobody can overwrite a peer's entry with an untagged value). Everything else (hivemind's
own averager keys, other runs) passes untouched. A record under our run with an unknown
namespace is rejected. Residual risk: for prefix namespaces (``noloco/roster/``) the key is
only known from the envelope, so an untagged regular value (no subkey) there can displace the
dictionary on a storing node (withholding, not forgery: readers ignore untagged values).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Iterable, TypeVar

import base58
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from pydantic import BaseModel

from security.keys import RecordRejected, peer_id_str, public_key_of
from security.revocation import REVOKED

__all__ = [
    "RECORD_TAG", "REASONS", "Namespace", "SignedRecordValidator", "Ed25519PeerIdValidator",
    "RecordRejected", "encode_payload", "record_value", "decode_payload", "read_entries",
    "signing_bytes", "read_rejections",
]

log = logging.getLogger("swarmnode.security.records")

RECORD_TAG = "swarmnode/record/v1"
_DOMAIN = RECORD_TAG.encode()
EXPIRATION_SLACK_S = 5.0
_MAX_KEY_CHARS = 512
_ENVELOPE_OVERHEAD = 1024  # bytes beyond the payload cap allowed for v, k, s and framing
_NO_SUBKEY = (msgpack.packb(None), b"")  # hivemind's IS_REGULAR_VALUE, IS_DICTIONARY
REASONS = ("namespace", "no_subkey", "not_ed25519", "malformed", "signature", "coordinator",
           "expiration", "oversize", "schema", "admission")
_TOKEN_OVERHEAD = 2048 + 16  # security.admission.MAX_TOKEN_BYTES plus its msgpack framing
M = TypeVar("M", bound=BaseModel)


@dataclasses.dataclass(frozen=True)
class Namespace:
    """One kind of record under ``<run>/``: ``name`` is exact ("nodes") or a prefix ending in
    "/" ("noloco/roster/" matches ``<run>/noloco/roster/<anything without '/'>``)."""

    name: str
    model: type[BaseModel]
    max_payload_bytes: int = 4096
    max_ttl_s: float = 60.0
    coordinator_only: bool = False

    def __post_init__(self):
        if not self.name or self.name.startswith("/") or "//" in self.name:
            raise ValueError(f"bad namespace name {self.name!r}")
        if self.max_payload_bytes <= 0 or self.max_ttl_s <= 0:
            raise ValueError(f"namespace {self.name!r}: max_payload_bytes and max_ttl_s must be > 0")

    @property
    def is_prefix(self) -> bool:
        return self.name.endswith("/")

    def matches(self, suffix: str) -> bool:
        if not self.is_prefix:
            return suffix == self.name
        rest = suffix[len(self.name):]
        return suffix.startswith(self.name) and bool(rest) and "/" not in rest


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


# --- codec ---

def encode_payload(model_instance: BaseModel) -> bytes:
    return msgpack.packb(model_instance.model_dump(mode="json"), use_bin_type=True)


def record_value(key: str, model_instance: BaseModel) -> dict:
    """The value to pass to ``dht.store(key, value, expiration, subkey=own_peer_id)``."""
    return {"v": RECORD_TAG, "k": key, "p": encode_payload(model_instance)}


def _load_model(payload: bytes, model: type[M]) -> M:
    """msgpack -> JSON text -> strict pydantic validation (no ext types, no NaN, no bytes)."""
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    return model.model_validate_json(json.dumps(obj, allow_nan=False))


def signing_bytes(key: str, subkey: str, payload: bytes, expiration_time: float) -> bytes:
    return _DOMAIN + msgpack.packb([key, subkey, payload, float(expiration_time)], use_bin_type=True)


def decode_payload(value: Any, model: type[M], *, key: str | None = None) -> M:
    """Decode what ``dht.get`` returned for one of our records (the stripped envelope dict, or
    its msgpack bytes). Raises RecordRejected (a ValueError) if it is not one of ours."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = msgpack.unpackb(value, raw=False)
        except Exception:  # noqa: BLE001 - any parse failure means "not ours"
            raise RecordRejected("value is not msgpack", "malformed") from None
    if not isinstance(value, Mapping) or value.get("v") != RECORD_TAG or not isinstance(value.get("p"), bytes):
        raise RecordRejected("value is not a swarmnode record envelope", "malformed")
    if key is not None and value.get("k") != key:
        raise RecordRejected(f"envelope is for key {value.get('k')!r}, not {key!r}", "malformed")
    try:
        return _load_model(value["p"], model)
    except Exception as exc:  # noqa: BLE001 - pydantic, msgpack and json errors alike
        raise RecordRejected(f"payload does not match {model.__name__}: {exc}", "schema") from None


def read_entries(entries: Any, model: type[M], *, key: str, max_entries: int = 256) -> dict[str, M]:
    """``{peer_id: payload}`` from ``dht.get(key).value`` (subkey -> ValueWithExpiration).

    Skips entries whose subkey is not an Ed25519 peer ID or whose value is not ours, and those
    of writers the coordinator revoked (``security.revocation.REVOKED``: by peer ID, or by the
    serial of the admission token the record carries); reads at most ``max_entries`` (readers
    cap the subkeys they consume per key)."""
    out: dict[str, M] = {}
    if not isinstance(entries, Mapping):
        return out
    for subkey, item in entries.items():
        if len(out) >= max_entries:
            break
        value = getattr(item, "value", item)
        if not isinstance(subkey, str):
            continue
        try:
            public_key_of(subkey)
            payload = decode_payload(value, model, key=key)
        except RecordRejected:
            continue
        if len(REVOKED) and _revoked_writer(subkey, value):
            continue
        out[subkey] = payload
    return out


def _revoked_writer(writer: str, value: Any) -> bool:
    """Was ``writer``'s record written under a revoked token (or is the writer revoked)?"""
    serial = None
    env = value if isinstance(value, Mapping) else _unpack_envelope(bytes(value)) if isinstance(
        value, (bytes, bytearray)) else None
    token = env.get("t") if isinstance(env, Mapping) else None
    if isinstance(token, bytes):
        from security.admission import AdmissionRejected, decode_token
        try:
            serial = decode_token(token)[0].serial
        except AdmissionRejected:
            serial = None
    hit = REVOKED.check(serial, writer)
    if hit is not None and hit.serial is not None:
        REVOKED.note_writer(writer, hit)  # so its calls are refused by name too
    return hit is not None


def _unpack_envelope(raw: bytes) -> dict | None:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - not msgpack at all
        return None
    return obj if isinstance(obj, dict) and obj.get("v") == RECORD_TAG else None


def _looks_like_peer_id(subkey: Any) -> bool:
    if not isinstance(subkey, str) or not 20 <= len(subkey) <= 128:
        return False
    try:
        raw = base58.b58decode(subkey.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        return False
    return len(raw) >= 2 and raw[0] in (0x00, 0x12) and raw[1] == len(raw) - 2


# --- the validator ---

class SignedRecordValidator(RecordValidatorBase):
    """Accepts a record under ``<run_id>/<namespace>`` only if signed by the peer in its subkey.

    Build it before ``hivemind.DHT`` forks; it runs in the DHT process. ``rejections`` counts
    refusals by reason (read them from the main process with ``dht.run_coroutine(read_rejections)``).
    """

    def __init__(self, run_id: str, private_key: Ed25519PrivateKey | None, namespaces: Iterable[Namespace],
                 coordinator_peer_id: str | None = None, *, admission_token: bytes | None = None,
                 require_admission: bool = False):
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id must be non-empty and contain no '/': {run_id!r}")
        self.run_id = run_id
        self._prefix = run_id + "/"
        self._namespaces = sorted(namespaces, key=lambda ns: len(ns.name), reverse=True)
        if len({ns.name for ns in self._namespaces}) != len(self._namespaces):
            raise ValueError("duplicate namespace names")
        self._exact_ids = {DHTID.generate(source=self._prefix + ns.name).to_bytes(): ns
                           for ns in self._namespaces if not ns.is_prefix}
        if coordinator_peer_id is not None:
            public_key_of(coordinator_peer_id)  # raises RecordRejected (ValueError) for a bad ID
        self.coordinator_peer_id = coordinator_peer_id
        # token mode (docs/security.md, 'Admission tokens'): sign_value attaches our admission token as envelope field
        # "t"; _check requires a valid one for every writer but the coordinator
        if require_admission and coordinator_peer_id is None:
            raise ValueError("require_admission needs coordinator_peer_id (security.coordinator_peer_id)")
        self.require_admission, self._admission_token = require_admission, admission_token
        self._private_key = private_key
        self.local_peer_id = peer_id_str(private_key) if private_key is not None else None
        self._overhead = _ENVELOPE_OVERHEAD + (_TOKEN_OVERHEAD if require_admission or admission_token else 0)
        self._max_value_bytes = max((ns.max_payload_bytes for ns in self._namespaces), default=0) + self._overhead
        self.rejections: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    @property
    def priority(self) -> int:
        return 10  # like hivemind's RSASignatureValidator: validate first, strip before others

    # -- helpers --
    def namespace_of(self, key: str) -> Namespace | None:
        if not key.startswith(self._prefix):
            return None
        suffix = key[len(self._prefix):]
        return next((ns for ns in self._namespaces if ns.matches(suffix)), None)

    def _own_envelope(self, record: DHTRecord) -> tuple[dict | None, Namespace | None, bool]:
        """-> (envelope or None, namespace or None, ours?). Raises _Reject on a bad key."""
        env = _unpack_envelope(record.value)  # always parsed: a big tagged value must not pass as foreign
        if env is not None:
            k = env.get("k")
            if not isinstance(k, str) or len(k) > _MAX_KEY_CHARS or \
                    DHTID.generate(source=k).to_bytes() != record.key:
                raise _Reject("malformed", "envelope key does not hash to the DHT key")
            if not k.startswith(self._prefix):
                return env, None, False  # another run's record: its own validators judge it
            ns = self.namespace_of(k)
            if ns is None:
                raise _Reject("namespace", f"unknown namespace in key {k!r}")
            return env, ns, True
        ns = self._exact_ids.get(record.key)
        if ns is not None:
            return None, ns, True
        if record.subkey not in _NO_SUBKEY:
            try:
                subkey = msgpack.unpackb(record.subkey, raw=False)
            except Exception:  # noqa: BLE001
                subkey = None
            if _looks_like_peer_id(subkey):
                if len(record.value) > self._max_value_bytes:
                    raise _Reject("oversize", "value under a peer-ID subkey exceeds every namespace cap")
                raise _Reject("malformed", "untagged value under a peer-ID subkey")
        return None, None, False

    def _check(self, record: DHTRecord) -> None:
        env, ns, ours = self._own_envelope(record)
        if not ours:
            return
        if record.subkey in _NO_SUBKEY:
            raise _Reject("no_subkey", f"record in {ns.name!r} has no subkey (must be the writer's peer ID)")
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
            public_key = public_key_of(subkey) if isinstance(subkey, str) else None
        except Exception:  # noqa: BLE001 - RecordRejected or msgpack errors
            public_key = None
        if public_key is None:
            raise _Reject("not_ed25519", "subkey is not an Ed25519 peer ID (12D3KooW...)")
        if len(record.value) > ns.max_payload_bytes + self._overhead:
            raise _Reject("oversize", f"value of {len(record.value)} bytes in {ns.name!r}")
        if env is None or set(env) - {"t"} != {"v", "k", "p", "s"} or not isinstance(env["p"], bytes) \
                or not isinstance(env["s"], bytes) or len(env["s"]) != 64:
            raise _Reject("malformed", f"not a signed swarmnode envelope in {ns.name!r}")
        token = None
        if self.require_admission and subkey != self.coordinator_peer_id:
            token = self._check_admission(env.get("t"), subkey, ns, record.expiration_time)
        if ns.coordinator_only and subkey != self.coordinator_peer_id:
            raise _Reject("coordinator", f"{ns.name!r} is coordinator-only; writer {subkey[:16]}...")
        if record.expiration_time > get_dht_time() + ns.max_ttl_s + EXPIRATION_SLACK_S:
            raise _Reject("expiration", f"expiration {record.expiration_time - get_dht_time():.0f} s ahead "
                                        f"exceeds {ns.name!r} max TTL {ns.max_ttl_s:g} s")
        if len(env["p"]) > ns.max_payload_bytes:
            raise _Reject("oversize", f"payload of {len(env['p'])} bytes > {ns.max_payload_bytes} in {ns.name!r}")
        try:
            public_key.verify(env["s"], signing_bytes(env["k"], subkey, env["p"], record.expiration_time))
        except InvalidSignature:
            raise _Reject("signature", f"bad signature for writer {subkey[:16]}... in {ns.name!r}") from None
        try:
            payload = _load_model(env["p"], ns.model)
        except Exception as exc:  # noqa: BLE001
            raise _Reject("schema", f"payload does not match {ns.model.__name__}: "
                                    f"{str(exc).splitlines()[0][:200]}") from None
        role = getattr(payload, "role", None)  # a node card names its writer's role: the token must allow it
        if token is not None and isinstance(role, str) and not token.allows_role(role):
            raise _Reject("admission", f"record in {ns.name!r} by ...{subkey[-8:]} claims role {role!r}; its "
                                       f"admission token allows {list(token.roles)}")

    def _check_admission(self, token: Any, writer: str, ns: Namespace, expiration_time: float):
        """The writer's token, valid at the record's time: ``min(now, expiration_time)``, and the
        record may not outlive it. So a record never turns invalid while peers store it (it
        expires with its token), which matters because hivemind drops a whole subkey dictionary
        (every card of ``<run>/nodes``) when one entry in it fails validation."""
        from security.admission import AdmissionRejected, verify_token
        if not isinstance(token, bytes):
            raise _Reject("admission", f"record in {ns.name!r} by ...{writer[-8:]} carries no admission token "
                                       "(this run is in token mode)")
        try:
            # revocations=None: the validator never refuses a record for a revoked token. hivemind drops a
            # whole subkey dictionary (every card) on a lookup when one entry fails, so revoked writers are
            # dropped by the readers instead (read_entries), which every node does after its next refresh
            tok = verify_token(token, coordinator_peer_id=self.coordinator_peer_id, run_id=self.run_id,
                               peer_id=writer, now=min(get_dht_time(), expiration_time), revocations=None)
        except AdmissionRejected as exc:
            raise _Reject("admission", f"record in {ns.name!r} by ...{writer[-8:]}: {exc}") from None
        if expiration_time > tok.expires_at + EXPIRATION_SLACK_S:
            raise _Reject("admission", f"record in {ns.name!r} by ...{writer[-8:]} expires "
                                       f"{expiration_time - tok.expires_at:.0f} s after its admission token; "
                                       "renew the token (swarmnode admit)")
        return tok

    def _count(self, reason: str, detail: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last_log.get(reason, -1e9) >= 10.0:  # at most one line per reason per 10 s
            extra = self._suppressed.pop(reason, 0)
            more = f" (+{extra} more since last log)" if extra else ""
            if reason == "namespace":   # a record of a role this node does not run (a mixed swarm): expected
                log.info("not storing DHT record [%s]: %s%s (a namespace of a role this node does not run; the "
                         "nodes of that role store it)", reason, detail, more)
            else:
                log.warning("rejected DHT record [%s]: %s%s", reason, detail, more)
            self._last_log[reason] = now
        else:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1

    # -- RecordValidatorBase --
    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
            return True
        except _Reject as rej:
            self._count(rej.reason, rej.detail)
            return False
        except Exception as exc:  # noqa: BLE001 - a validator must never crash the DHT
            self._count("malformed", f"{type(exc).__name__}: {exc}")
            return False

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._private_key is None:
            return record.value
        env = _unpack_envelope(record.value)
        if env is None or set(env) != {"v", "k", "p"} or not isinstance(env.get("k"), str) \
                or not isinstance(env.get("p"), bytes) or self.namespace_of(env["k"]) is None \
                or DHTID.generate(source=env["k"]).to_bytes() != record.key:
            return record.value
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
        except Exception:  # noqa: BLE001
            return record.value
        if subkey != self.local_peer_id:
            return record.value  # only our own subkey is ours to sign; validate() will refuse it
        sig = self._private_key.sign(signing_bytes(env["k"], subkey, env["p"], record.expiration_time))
        extra = {"t": self._admission_token} if self._admission_token else {}
        return msgpack.packb({**env, "s": sig, **extra}, use_bin_type=True)

    def strip_value(self, record: DHTRecord) -> bytes:
        env = _unpack_envelope(record.value)
        if env is None or "s" not in env or not isinstance(env.get("k"), str) \
                or not env["k"].startswith(self._prefix):
            return record.value
        # the token ("t", verified by validate) stays: readers check it against the revocation list
        return msgpack.packb({k: v for k, v in env.items() if k != "s"}, use_bin_type=True)


Ed25519PeerIdValidator = SignedRecordValidator  # an older name, kept for callers


async def read_rejections(dht: Any, node: Any) -> dict[str, int]:
    """Run in the DHT process via ``dht.run_coroutine(read_rejections)``: summed rejection counts
    of every SignedRecordValidator in ``node.protocol.record_validator`` (a CompositeValidator)."""
    root = node.protocol.record_validator
    validators = getattr(root, "_validators", None)
    validators = list(validators) if validators is not None else ([root] if root is not None else [])
    totals: dict[str, int] = {}
    for v in validators:
        if isinstance(v, SignedRecordValidator):
            for reason, n in v.rejections.items():
                totals[reason] = totals.get(reason, 0) + n
    return totals
