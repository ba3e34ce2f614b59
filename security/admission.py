"""Admission tokens (docs/security.md, 'Admission tokens'): issue, encode and verify.

Owns the token format and the rules for accepting one. A token is the protobuf
``protocol.admission_pb2.AdmissionToken{run_id, peer_id, roles, not_before, expires_at, serial}``
serialized with ``deterministic=True``, wrapped in ``SignedAdmissionToken{token, signature}``
where ``signature`` is the coordinator's Ed25519 signature over
``b"swarmnode/admission/v1\\0" + token``. The signature covers the exact token bytes, and the
verifier re-serializes the parsed token and requires the same bytes, so there is one encoding
per token (no unknown fields, no alternative field order). Peers check a token against the key
inside ``security.coordinator_peer_id``: in the node card validator and on every gRPC call
(``x-swarmnode-token-bin``; :func:`token_check` plugs into ``PeerAuthenticator``). ``swarmnode admit``
(``cmd_admit``) issues one and prints it base64.

Pure: protobuf + cryptography, no hivemind, grpc or torch import.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import datetime as _dt
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from protocol.admission_pb2 import AdmissionToken as _TokenPb
from protocol.admission_pb2 import SignedAdmissionToken as _SignedPb
from security.keys import RecordRejected, peer_id_str, public_key_of, verify
from security.revocation import REVOKED, Revocations

__all__ = [
    "AdmissionToken", "AdmissionRejected", "REASONS", "DEFAULT_TTL_S", "MAX_TOKEN_BYTES",
    "issue_token", "verify_token", "decode_token", "encode_b64", "decode_b64", "parse_expires",
    "token_check", "check_own_token", "cmd_admit",
]

_DOMAIN = b"swarmnode/admission/v1\x00"
DEFAULT_TTL_S = 24 * 3600
MAX_TOKEN_BYTES = 2048            # a signed token is ~200 bytes; anything far larger is hostile
NOT_BEFORE_BACKDATE_S = 60        # issued tokens are valid from now - 60 s, to absorb clock skew
REASONS = ("missing", "malformed", "oversize", "signature", "wrong_run", "wrong_peer", "not_yet_valid",
           "expired", "role", "revoked")


class AdmissionRejected(ValueError):
    """A token failed a check; ``reason`` (one of :data:`REASONS`) is the short counter label."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class AdmissionToken:
    run_id: str
    peer_id: str
    roles: tuple[str, ...]
    not_before: int
    expires_at: int
    serial: int

    def allows_role(self, role: str) -> bool:
        return not self.roles or role in self.roles

    def to_proto_bytes(self) -> bytes:
        msg = _TokenPb(run_id=self.run_id, peer_id=self.peer_id, roles=list(self.roles),
                       not_before=self.not_before, expires_at=self.expires_at, serial=self.serial)
        return msg.SerializeToString(deterministic=True)


def issue_token(coordinator_key: Ed25519PrivateKey, *, run_id: str, peer_id: str,
                expires_at: int | float, roles: Iterable[str] = (), not_before: int | float | None = None,
                serial: int | None = None, now: float | None = None) -> bytes:
    """Sign a token for ``peer_id`` and return the ``SignedAdmissionToken`` bytes."""
    now = time.time() if now is None else now
    public_key_of(peer_id)  # raises RecordRejected for a non-Ed25519 / malformed peer ID
    if not run_id:
        raise ValueError("run_id must not be empty")
    nb = int(now - NOT_BEFORE_BACKDATE_S) if not_before is None else int(not_before)
    exp = int(expires_at)
    if exp <= nb:
        raise ValueError(f"expires_at {exp} must be after not_before {nb}")
    roles = tuple(sorted(set(roles)))
    for role in roles:
        if not role or "," in role:
            raise ValueError(f"bad role name {role!r}")
    tok = AdmissionToken(run_id=run_id, peer_id=peer_id, roles=roles, not_before=nb, expires_at=exp,
                         serial=secrets.randbits(63) if serial is None else int(serial))
    body = tok.to_proto_bytes()
    return _SignedPb(token=body, signature=coordinator_key.sign(_DOMAIN + body)).SerializeToString(
        deterministic=True)


def decode_token(blob: bytes) -> tuple[AdmissionToken, bytes, bytes]:
    """Parse without checking the signature -> (token, signed bytes, signature). Strict encoding."""
    if not isinstance(blob, (bytes, bytearray)):
        raise AdmissionRejected(f"admission token must be bytes, got {type(blob).__name__}", "malformed")
    if len(blob) > MAX_TOKEN_BYTES:
        raise AdmissionRejected(f"admission token is {len(blob)} bytes; cap {MAX_TOKEN_BYTES}", "oversize")
    try:
        signed = _SignedPb.FromString(bytes(blob))
        msg = _TokenPb.FromString(signed.token)
    except DecodeError as exc:
        raise AdmissionRejected(f"admission token is not a SignedAdmissionToken protobuf ({exc})",
                                "malformed") from None
    tok = AdmissionToken(run_id=msg.run_id, peer_id=msg.peer_id, roles=tuple(msg.roles),
                         not_before=msg.not_before, expires_at=msg.expires_at, serial=msg.serial)
    canonical = _SignedPb(token=signed.token, signature=signed.signature).SerializeToString(deterministic=True)
    if canonical != bytes(blob) or tok.to_proto_bytes() != signed.token:  # rebuilt: unknown fields dropped
        raise AdmissionRejected("admission token is not canonically encoded (unknown or reordered fields)",
                                "malformed")
    if len(signed.signature) != 64:
        raise AdmissionRejected(f"admission token signature is {len(signed.signature)} bytes, expected 64",
                                "malformed")
    return tok, signed.token, signed.signature


def verify_token(blob: bytes, *, coordinator_peer_id: str, run_id: str, peer_id: str,
                 role: str | None = None, now: float | None = None,
                 revoked_serials: Iterable[int] = (), revocations: Revocations | None = REVOKED) -> AdmissionToken:
    """Return the token if it admits ``peer_id`` to ``run_id`` (in ``role``) at ``now``.

    Checks, in order: size and strict encoding -> coordinator signature -> run -> peer ->
    not_before -> expires_at -> role -> revocation (``revoked_serials`` and ``revocations``, by
    default this process's view of the coordinator's list, ``security/revocation.py``: every
    caller honours a revocation without being told). Raises :class:`AdmissionRejected`.
    """
    tok, body, sig = decode_token(blob)
    try:
        public_key_of(coordinator_peer_id)
    except RecordRejected as exc:
        raise ValueError(f"security.coordinator_peer_id {coordinator_peer_id!r} is not an Ed25519 peer ID: "
                         f"{exc}") from None
    if not verify(coordinator_peer_id, _DOMAIN + body, sig):
        raise AdmissionRejected(f"admission token for {tok.peer_id[-8:]} is not signed by the coordinator "
                                f"{coordinator_peer_id[-8:]} (security.coordinator_peer_id)", "signature")
    if tok.run_id != run_id:
        raise AdmissionRejected(f"admission token is for run {tok.run_id!r}, not {run_id!r}", "wrong_run")
    if tok.peer_id != peer_id:
        raise AdmissionRejected(f"admission token belongs to peer ...{tok.peer_id[-8:]}, not the caller "
                                f"...{peer_id[-8:]}", "wrong_peer")
    now = time.time() if now is None else now
    if now < tok.not_before:
        raise AdmissionRejected(f"admission token is valid only from {_iso(tok.not_before)} (now {_iso(now)}); "
                                "check this node's clock", "not_yet_valid")
    if now >= tok.expires_at:
        raise AdmissionRejected(f"admission token expired at {_iso(tok.expires_at)} (now {_iso(now)}); ask the "
                                "coordinator for a new one (`swarmnode admit`)", "expired")
    if role is not None and not tok.allows_role(role):
        raise AdmissionRejected(f"admission token allows roles {list(tok.roles)}, not {role!r}", "role")
    if tok.serial in set(revoked_serials):
        raise AdmissionRejected(f"admission token serial {tok.serial} is revoked", "revoked")
    hit = revocations.check(tok.serial, tok.peer_id) if revocations is not None else None
    if hit is not None:
        raise AdmissionRejected(f"admission token of ...{tok.peer_id[-8:]} was revoked: {hit.describe()}; ask the "
                                "coordinator for a new token (`swarmnode admit`)", "revoked")
    return tok


def token_check(*, coordinator_peer_id: str, run_id: str, role: str | None = None,
                revoked_serials: Callable[[], Iterable[int]] = tuple,
                clock: Callable[[], float] = time.time) -> Callable[[str, bytes | None], AdmissionToken]:
    """A ``check_token`` for ``security.peer_auth.PeerAuthenticator`` in token mode: the call's
    ``x-swarmnode-token-bin`` must admit the verified caller to ``run_id``. The coordinator's own
    key needs no token (it signs them; the DHT validator exempts its records the same way): its
    calls, e.g. the stage-integrity audits' state downloads, pass on its signature, which the
    authenticator verifies after this check."""
    public_key_of(coordinator_peer_id)

    def check(peer_id: str, blob: bytes | None) -> AdmissionToken | None:
        if peer_id == coordinator_peer_id:
            return None
        if blob is None:
            raise AdmissionRejected("no admission token (x-swarmnode-token-bin); this run is in token mode: ask "
                                    "the coordinator for one (`swarmnode admit`)", "missing")
        return verify_token(blob, coordinator_peer_id=coordinator_peer_id, run_id=run_id, peer_id=peer_id,
                            role=role, now=clock(), revoked_serials=revoked_serials())
    return check


def check_own_token(blob: bytes | None, *, coordinator_peer_id: str, run_id: str, peer_id: str, role: str,
                    now: float | None = None) -> AdmissionToken | None:
    """A node's own token, checked before it touches the network (token mode). None for the
    coordinator itself (it needs none); ValueError saying what to do for a missing, foreign,
    expired or wrong-role token."""
    if peer_id == coordinator_peer_id:
        return None
    if blob is None:
        raise ValueError(f"security.admission = 'token' but this node has no admission token: ask the coordinator "
                         f"for one (`swarmnode admit --peer-id {peer_id} --run-id {run_id} --roles {role} "
                         "--identity <coordinator key>`) and set security.admission_token_file (or "
                         "SWARMNODE_SECURITY__ADMISSION_TOKEN)")
    try:
        return verify_token(blob, coordinator_peer_id=coordinator_peer_id, run_id=run_id, peer_id=peer_id,
                            role=role, now=now)
    except AdmissionRejected as exc:
        raise ValueError(f"security.admission_token is not usable ({exc.reason}): {exc}") from None


def encode_b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode("ascii")


def decode_b64(text: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise AdmissionRejected("admission token is not valid base64", "malformed") from None


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_expires(text: str, now: float | None = None) -> int:
    """``--expires``: a duration from now (``90s``, ``30m``, ``24h``, ``7d``) or an ISO-8601 time
    with a timezone (``2026-12-31T00:00:00Z``). Returns unix seconds; ValueError otherwise."""
    now = time.time() if now is None else now
    m = _DURATION.match(text.strip())
    if m:
        return int(now + float(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        when = _dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--expires {text!r}: give a duration (30m, 24h, 7d) or an ISO-8601 time "
                         "(2026-12-31T00:00:00Z)") from None
    if when.tzinfo is None:
        raise ValueError(f"--expires {text!r}: add a timezone, e.g. {text}Z")
    if when.timestamp() <= now:
        raise ValueError(f"--expires {text!r} is in the past")
    return int(when.timestamp())


# --- CLI: swarmnode admit ---

def cmd_admit(args: argparse.Namespace) -> int:
    from security.keys import load_key_file

    key = load_key_file(args.identity)
    try:
        expires_at = parse_expires(args.expires)
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        blob = issue_token(key, run_id=args.run_id, peer_id=args.peer_id, expires_at=expires_at, roles=roles)
    except (ValueError, RecordRejected) as exc:
        print(f"swarmnode admit: {exc}", file=sys.stderr)
        return 2
    print(encode_b64(blob))
    serial = decode_token(blob)[0].serial
    print(f"# coordinator {peer_id_str(key)} admits ...{args.peer_id[-8:]} to run {args.run_id!r} until "
          f"{_iso(expires_at)}; serial {serial} (for `swarmnode revoke --serial`)", file=sys.stderr)
    return 0
