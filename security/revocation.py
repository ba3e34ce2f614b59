"""Token revocation (docs/security.md, 'Revocation'): the coordinator-signed list of withdrawn
admission tokens, and this process's view of it.

Owns the record payload (``<run>/revoked``, one entry whose subkey is ``security.coordinator_peer_id``,
so only the coordinator's key can write it: ``security/revocation_record.py``), merging lists, and :data:`REVOKED`, the process-wide set that the
one token check (``security.admission.verify_token``) and the one record reader
(``security.records.read_entries``) consult. So every consumer of a token or a signed record
(gRPC calls, node cards, roster entries, rollout indexes, the event bus) honours a revocation as
soon as this process has read the list; the daemon refreshes it every
``security.revocation_refresh_s`` (``node/revocation_sync.py``). An entry names a token serial,
a peer ID, or both:

* serial: that token is refused (the peer may be admitted again with a new token);
* peer ID alone: every token of that peer is refused;
* both: that token is refused, and the peer ID lets calls be refused by name before its card
  is even read.

Entries carry ``until`` (unix s) and are dropped after it: make it outlast the revoked token.
Pure: pydantic and the standard library (the event-bus sidecar may import it: no hivemind).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["RevokedEntry", "RevocationList", "REVOKED_RECORD_TTL_S", "Revocations", "REVOKED", "revoked_key",
           "merge"]

REVOKED_RECORD_TTL_S = 24 * 3600.0
"""Lifetime of the list in the DHT; every publish sets ``now + REVOKED_RECORD_TTL_S`` so a newer
list always has the later expiration (hivemind keeps the later one)."""
MAX_ENTRIES = 512
MAX_REVOKED_BYTES = 64 * 1024


class RevokedEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    serial: int | None = Field(None, ge=0, lt=2 ** 64)
    """The revoked token's serial (``swarmnode admit`` prints it)."""
    peer_id: str | None = Field(None, max_length=128)
    """The revoked peer; alone, every token of that peer is refused."""
    until: int = Field(ge=0)
    """Unix seconds after which the entry is dropped (the revoked token has expired by then)."""
    at: int = Field(ge=0)
    """Unix seconds of the revocation."""
    reason: str = Field("", max_length=200)

    @model_validator(mode="after")
    def _names_something(self) -> "RevokedEntry":
        if self.serial is None and self.peer_id is None:
            raise ValueError("a revocation entry needs a serial, a peer_id or both")
        return self

    def matches(self, serial: int | None, peer_id: str | None) -> bool:
        if self.serial is not None:
            return serial is not None and serial == self.serial
        return peer_id is not None and peer_id == self.peer_id

    def describe(self) -> str:
        what = f"serial {self.serial}" if self.serial is not None else f"every token of ...{(self.peer_id or '')[-8:]}"
        why = f" ({self.reason})" if self.reason else ""
        return f"{what} revoked by the coordinator at {_iso(self.at)}{why}"


class RevocationList(BaseModel):
    """The payload of ``<run>/revoked``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    entries: list[RevokedEntry] = Field(default_factory=list, max_length=MAX_ENTRIES)
    published_at: float = 0.0


def revoked_key(run_id: str) -> str:
    return f"{run_id}/revoked"


def _key(e: RevokedEntry) -> tuple:
    return (e.serial, e.peer_id if e.serial is None else None)


def merge(*lists: Iterable[RevokedEntry], now: float | None = None) -> list[RevokedEntry]:
    """Union of entries (one per serial, or per peer for peer-only entries; the latest ``until``
    wins), without those past ``until``, oldest revocation first."""
    now = time.time() if now is None else now
    out: dict[tuple, RevokedEntry] = {}
    for entries in lists:
        for e in entries:
            if e.until <= now:
                continue
            k, old = _key(e), out.get(_key(e))
            if old is None or e.until > old.until:
                if old is not None and e.peer_id is None and old.peer_id is not None:
                    e = e.model_copy(update={"peer_id": old.peer_id})  # keep the name we knew
                out[k] = e
    merged = sorted(out.values(), key=lambda e: (e.at, e.serial or 0, e.peer_id or ""))
    if len(merged) > MAX_ENTRIES:
        raise ValueError(f"the revocation list would hold {len(merged)} entries (cap {MAX_ENTRIES}); revoke by "
                         "peer ID, or use shorter token lifetimes so entries expire sooner")
    return merged


@dataclasses.dataclass(frozen=True)
class _View:
    entries: tuple[RevokedEntry, ...] = ()
    serials: dict = dataclasses.field(default_factory=dict)
    peers: dict = dataclasses.field(default_factory=dict)  # peer-only entries, and peers named beside a serial


class Revocations:
    """The revocation list as this process last read it. Thread-safe (one immutable view swapped
    on update), cheap to ask (two dict lookups)."""

    def __init__(self) -> None:
        self._view = _View()
        self._writers: dict[str, RevokedEntry] = {}  # peers seen writing with a revoked token serial
        self._lock = threading.Lock()
        self.updated_at = 0.0

    def update(self, entries: Iterable[RevokedEntry], now: float | None = None) -> list[RevokedEntry]:
        """Replace the list; returns the entries that are new to this process."""
        now = time.time() if now is None else now
        live = tuple(e for e in entries if e.until > now)
        serials = {e.serial: e for e in live if e.serial is not None}
        peers = {e.peer_id: e for e in live if e.peer_id is not None}
        with self._lock:
            old = {_key(e) for e in self._view.entries}
            self._view = _View(live, serials, peers)
            self._writers = {p: e for p, e in self._writers.items() if e.serial in serials}
            self.updated_at = time.monotonic()
        return [e for e in live if _key(e) not in old]

    def clear(self) -> None:
        self.update(())

    @property
    def entries(self) -> tuple[RevokedEntry, ...]:
        return self._view.entries

    def __len__(self) -> int:
        return len(self._view.entries)

    def check(self, serial: int | None, peer_id: str | None) -> RevokedEntry | None:
        """The entry that revokes a token with ``serial`` held by ``peer_id``, or None."""
        view = self._view
        if serial is not None and serial in view.serials:
            return view.serials[serial]
        hit = view.peers.get(peer_id) if peer_id is not None else None
        return hit if hit is not None and hit.serial is None else None

    def peer_entry(self, peer_id: str) -> RevokedEntry | None:
        """An entry naming ``peer_id`` (by itself or beside a serial), or a revoked serial this
        peer was seen using: lets a call from it be refused by name. Only a hint: whether the
        token it now holds is revoked is :meth:`check`'s answer."""
        view = self._view
        return view.peers.get(peer_id) or self._writers.get(peer_id)

    def note_writer(self, peer_id: str, entry: RevokedEntry) -> None:
        if len(self._writers) < 4096:
            self._writers[peer_id] = entry


REVOKED = Revocations()
"""This process's view; the daemon keeps it fresh in token mode (empty otherwise)."""


def _iso(t: float) -> str:
    import datetime as _dt
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")
