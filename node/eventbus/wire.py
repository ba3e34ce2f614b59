"""What travels on the event bus, and how the daemon re-checks what its sidecar hands over.

Owns the run-scoped topic names, the exact bytes a gossipsub message signature covers (so the
daemon verifies the originator's Ed25519 signature itself: the sidecar's output is untrusted
input, docs/security.md, 'Trust model'), and the ``swarm`` topic's notices (msgpack maps, strict schema).

Pure: msgpack and ``security.keys`` only; no grpc, hivemind or libp2p import, so both the
daemon and the sidecar may use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from security.keys import verify

SIGNING_PREFIX = b"libp2p-pubsub:"
NOTICE_KINDS = ("drain", "preemption", "stage_down", "ban", "reachability")
NOTICE_VERSION = 1
#: A notice older than this (sender clock vs ours) is stale: drop it.
NOTICE_MAX_AGE_S = 120.0


def full_topic(run_id: str, name: str) -> str:
    """The gossipsub topic ID of a run's topic: ``swarmnode/<run>/<name>``."""
    return f"swarmnode/{run_id}/{name}"


def short_topic(run_id: str, topic_id: str) -> str | None:
    prefix = f"swarmnode/{run_id}/"
    return topic_id[len(prefix):] if topic_id.startswith(prefix) else None


# --- the signed bytes (gossipsub's rpc.proto Message, proto2: every set field is written) ---

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(tag: int, value: bytes) -> bytes:
    return bytes([tag]) + _varint(len(value)) + value


def signed_bytes(from_peer: bytes, data: bytes, seqno: bytes, topic_id: str) -> bytes:
    """``"libp2p-pubsub:" + Message{from=1, data=2, seqno=3, topicIDs=4}`` as py-libp2p and
    go-libp2p sign it (fields in number order, all present)."""
    return (SIGNING_PREFIX + _field(0x0A, from_peer) + _field(0x12, data) + _field(0x1A, seqno)
            + _field(0x22, topic_id.encode()))


def verify_message(from_peer: bytes, data: bytes, seqno: bytes, topic_id: str, signature: bytes) -> bool:
    """True iff ``signature`` is the originator's over this message (key from the peer ID)."""
    if not signature or not from_peer:
        return False
    return verify(bytes(from_peer), signed_bytes(bytes(from_peer), bytes(data), bytes(seqno), topic_id),
                  bytes(signature))


# --- swarm notices ---

class NoticeError(ValueError):
    """A ``swarm`` message that is not a well-formed notice for this run (dropped, counted)."""


@dataclass
class Notice:
    kind: str
    run_id: str
    sender: str          # base58 peer ID the notice speaks for (must be the signed originator)
    sent_at: float
    fields: dict[str, Any] = field(default_factory=dict)


def encode_notice(kind: str, run_id: str, sender: str, sent_at: float | None = None, **fields: Any) -> bytes:
    if kind not in NOTICE_KINDS:
        raise ValueError(f"unknown notice kind {kind!r}; one of {', '.join(NOTICE_KINDS)}")
    body = {"v": NOTICE_VERSION, "kind": kind, "run": run_id, "peer": sender,
            "t": time.time() if sent_at is None else sent_at, "f": fields}
    return msgpack.packb(body, use_bin_type=True)


def decode_notice(data: bytes, run_id: str, max_bytes: int, now: float | None = None) -> Notice:
    """Parse and check a notice; :class:`NoticeError` says why it is refused."""
    if len(data) > max_bytes:
        raise NoticeError(f"notice is {len(data)} bytes, cap {max_bytes}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=max_bytes,
                               max_bin_len=max_bytes, max_array_len=4096, max_map_len=4096)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types
        raise NoticeError(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, dict) or set(body) != {"v", "kind", "run", "peer", "t", "f"}:
        raise NoticeError("wrong notice keys")
    if body["v"] != NOTICE_VERSION:
        raise NoticeError(f"notice version {body['v']!r}, expected {NOTICE_VERSION}")
    if body["kind"] not in NOTICE_KINDS:
        raise NoticeError(f"unknown notice kind {body['kind']!r}")
    if body["run"] != run_id:
        raise NoticeError(f"notice for run {body['run']!r}, this is {run_id!r}")
    if not isinstance(body["peer"], str) or not isinstance(body["t"], (int, float)) or not isinstance(body["f"], dict):
        raise NoticeError("wrong notice field types")
    now = time.time() if now is None else now
    if abs(now - float(body["t"])) > NOTICE_MAX_AGE_S:
        raise NoticeError(f"notice is {now - float(body['t']):.0f} s off our clock (max {NOTICE_MAX_AGE_S:.0f} s)")
    return Notice(kind=body["kind"], run_id=body["run"], sender=body["peer"], sent_at=float(body["t"]),
                  fields=body["f"])
