"""The coordinator lease: which bootstrap is the swarm's active coordinator (one or more standbys).

Every bootstrap runs a :class:`CoordinatorLease`. It keeps one signed entry under
``<run>/coordinator/lease`` (subkey = its own peer ID, so no node can write or edit another's;
the payload is a strict :class:`LeaseEntry`, msgpack in the record envelope of
security/records.py, never pickled): its state (``standby`` / ``claiming`` / ``active``), its gRPC
address and the highest schedule epoch it knows, stored every ``lease_s / 4`` with a TTL of
``lease_s``. Every ``POLL_S`` it reads the other bootstraps' fresh entries and applies the pure
rules of node/lease_logic.py: a standby claims when no active entry was seen for ``lease_s``, the
lowest peer ID among the claims that are fresh after ``settle_s`` wins, and an active bootstrap
that sees a lower peer ID active steps down. No hand-back: a bootstrap that returns (restarted,
its old lease expired) finds the fresh entry of the one that took over and stays a standby; it
never claims while its DHT has no peer (it could not see that entry), so a returning bootstrap
started without initial peers waits until the swarm redials it (``dht.redial_s``).

The services a bootstrap hosts for the roles (the SkipPipe schedule coordinator) follow it
through ``ctx.coordinator_lease``: :attr:`active`, :meth:`on_change` (called with the new state)
and :meth:`note_epoch`, which stores the entry with a new epoch *before* the coordinator publishes
it, so a standby that takes over always plans above every epoch a stage node may hold.
Stage nodes find the active coordinator with :func:`read_holder`.

Events: ``coordinator_active`` (this bootstrap serves), ``coordinator_standby`` (it does not:
which peer does), ``coordinator_took_over`` (it became active after another one's lease lapsed:
``lease_missing_s``), ``coordinator_stepped_down``; the gauge ``swarmnode_coordinator_active``;
``/readyz`` ``details.coordinator_lease``; the bootstrap's card detail ``coordinator``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Literal

from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field

from node import ready_details
from node.dht_records import read_entries_at, store_entry
from node.lease_logic import ACTIVE, STANDBY, Change, LeaseLogic, Seen, active_holder
from node.logs import emit
from node.metrics import REGISTRY
from security.records import Namespace

log = logging.getLogger("swarmnode.coordinator_lease")

POLL_S = 1.0
"""Seconds between two reads of the lease entries (how soon a lapse or a rival is seen)."""
STATE_FILE = "coordinator_lease.json"
"""In ``state_dir``: written when this bootstrap first becomes active. A bootstrap that finds it
at start is a restart: it waits ``lease_s`` like a standby before claiming (the swarm may have a
new active coordinator that its fresh DHT has not seen yet)."""

COORDINATOR_ACTIVE = Gauge("swarmnode_coordinator_active", "1 while this bootstrap is the swarm's active "
                           "coordinator (holds the lease), 0 while it is a standby.", registry=REGISTRY)


class LeaseConfig(BaseModel):
    """``[bootstrap]``: how this bootstrap takes part in the coordinator lease."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    standby: bool = False
    """Start as a standby: serve nothing until no active coordinator was seen for ``lease_s``.
    Set it on every bootstrap but the first (they join through its multiaddr); a primary
    (false) claims at once on its first start."""
    lease_s: float = Field(10.0, ge=2.0, le=60.0)
    """How long an active coordinator's lease lives without a refresh (it refreshes every
    ``lease_s / 4``): a standby takes over about ``lease_s + settle_s`` after the active one
    died. Lower it for a faster takeover; raise it where DHT stores are slow (a lease that lapses
    while the active one lives makes a standby claim it, and the active one steps down)."""
    settle_s: float = Field(2.0, ge=0.5, le=30.0)
    """How long a claim waits for rival claims before it wins: at least one DHT round trip. Raise
    it on a slow or large DHT."""


class LeaseEntry(BaseModel):
    """One bootstrap's lease entry (strict: a malformed entry is dropped unread)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    state: Literal["standby", "claiming", "active"]
    grpc_addr: str = Field(max_length=80)
    epoch: int = Field(ge=0)
    since: float
    """Unix seconds this state began."""


LEASE_NAMESPACE = Namespace(name="coordinator/lease", model=LeaseEntry, max_payload_bytes=512, max_ttl_s=60.0)


def lease_key(run_id: str) -> str:
    return f"{run_id}/{LEASE_NAMESPACE.name}"


async def read_lease(dht: Any, run_id: str, timeout: float = 5.0) -> dict[str, LeaseEntry]:
    """``{peer_id: LeaseEntry}`` of the fresh, well-formed entries (raises on DHT errors)."""
    entries = await read_entries_at(dht, lease_key(run_id), LeaseEntry, timeout=timeout, max_entries=64)
    return {p: e.value for p, e in entries.items()}


async def read_holder(dht: Any, run_id: str, timeout: float = 5.0) -> tuple[str, LeaseEntry] | None:
    """(peer ID, entry) of the active coordinator named by the lease; None when none is active."""
    entries = await read_lease(dht, run_id, timeout)
    holder = active_holder({p: Seen(e.state, e.epoch) for p, e in entries.items()})
    return None if holder is None else (holder, entries[holder])


class CoordinatorLease:
    """This bootstrap's part in the lease (see the module docstring)."""

    def __init__(self, ctx: Any, cfg: LeaseConfig):
        self.ctx, self.cfg = ctx, cfg
        self.run_id, self.me = ctx.config.run_id, ctx.peer_id
        self._state_path = Path(ctx.config.state_dir).expanduser() / STATE_FILE
        restarted = self._state_path.exists()
        self.claim_at_once = not cfg.standby and not restarted
        self.logic = LeaseLogic(self.me, cfg.lease_s, cfg.settle_s, time.time(), claim_at_once=self.claim_at_once)
        self._since = time.time()
        self._listeners: list[Callable[[str], Any]] = []
        self._stored = asyncio.Event()
        self._last_store = 0.0
        self.seen_holder: str | None = None      # the last other active bootstrap seen (for took_over)
        self._detail: dict[str, Any] = self._make_detail()
        COORDINATOR_ACTIVE.set(0)
        ready_details.provide("coordinator_lease", lambda: self._detail)

    @property
    def active(self) -> bool:
        return self.logic.state == ACTIVE

    @property
    def max_epoch(self) -> int:
        return self.logic.max_epoch

    @property
    def holder(self) -> str | None:
        """The active coordinator's peer ID as this bootstrap last saw it (itself when active)."""
        return self.me if self.active else self.logic.holder

    def remember_epoch(self, epoch: int) -> None:
        """An epoch this bootstrap knows of (e.g. saved in its state_dir): the lease goes on above it."""
        self.logic.note_epoch(epoch)

    def on_change(self, fn: Callable[[str], Any]) -> None:
        """``fn(new_state)`` (sync or async) after every state change."""
        self._listeners.append(fn)

    async def note_epoch(self, epoch: int, timeout: float = 3.0) -> None:
        """Store the entry with ``epoch`` now (before the coordinator publishes it); a DHT error
        is logged and the caller goes on (the next refresh stores it)."""
        self.logic.note_epoch(epoch)
        await self._store(timeout=timeout)

    def _entry(self) -> LeaseEntry:
        since = {ACTIVE: self.logic.active_since}.get(self.logic.state) or self._since
        return LeaseEntry(state=self.logic.state, grpc_addr=self.ctx.grpc_addr, epoch=self.logic.max_epoch,
                          since=float(since))

    async def _store(self, timeout: float = 5.0) -> bool:
        try:
            ok = await store_entry(self.ctx.membership.dht, lease_key(self.run_id), self.me, self._entry(),
                                   self.cfg.lease_s, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - retried at the next refresh
            log.warning("storing the coordinator lease entry failed: %r", exc)
            return False
        self._last_store = time.monotonic()
        return ok

    def _make_detail(self) -> dict[str, Any]:
        return {"state": self.logic.state, "active_peer": self.holder,
                "epoch": self.logic.max_epoch, "standby": self.cfg.standby}

    async def run(self) -> None:
        """The lease loop (supervised by the bootstrap role)."""
        emit(log, "coordinator_standby", "coordinator lease: starting as a standby (lease_s {lease_s:g}, settle_s "
             "{settle_s:g}); {how}", lease_s=self.cfg.lease_s, settle_s=self.cfg.settle_s, holder=None,
             how="claims at once when no coordinator is active" if self.claim_at_once
             else f"takes over when no active coordinator is seen for {self.cfg.lease_s:g} s")
        self._card()
        refresh_s = self.cfg.lease_s / 4
        while True:
            others: dict[str, Seen] | None = None
            try:
                entries = await read_lease(self.ctx.membership.dht, self.run_id, timeout=max(POLL_S * 3, 3.0))
                others = {p: Seen(e.state, e.epoch) for p, e in entries.items() if p != self.me}
            except Exception as exc:  # noqa: BLE001 - a failed read changes nothing; the next poll retries
                log.debug("reading the coordinator lease failed: %r", exc)
            if others is not None:
                holder = active_holder(others)
                if holder is not None:
                    self.seen_holder = holder
                connected = not self.logic.needs_peers or await self.ctx.membership.peer_count() > 0
                change = self.logic.tick(time.time(), others, connected=connected)
                if change is not None:
                    self._since = time.time()
                    await self._store()              # say the new state before acting on it
                    await self._changed(change)
                elif time.monotonic() - self._last_store >= refresh_s:
                    await self._store()
            elif time.monotonic() - self._last_store >= refresh_s and self.active:
                await self._store()
            self._detail = self._make_detail()
            await asyncio.sleep(POLL_S)

    async def _changed(self, change: Change) -> None:
        COORDINATOR_ACTIVE.set(1 if change.new == ACTIVE else 0)
        if change.new == ACTIVE:
            self._remember()
            if self.seen_holder is not None:
                emit(log, "coordinator_took_over", "took over as the active coordinator: the lease of {previous} "
                     "was missing for {lease_missing_s:.1f} s; schedule epochs go on after {epoch}",
                     level=logging.WARNING, previous=self.seen_holder, lease_missing_s=change.missing_s,
                     epoch=self.logic.max_epoch)
            emit(log, "coordinator_active", "this bootstrap is the active coordinator ({why})", why=change.why,
                 epoch=self.logic.max_epoch, since=self.logic.active_since)
        elif change.old == ACTIVE:
            emit(log, "coordinator_stepped_down", "stepping down as coordinator: {why}", level=logging.WARNING,
                 why=change.why, holder=self.logic.holder)
            emit(log, "coordinator_standby", "this bootstrap is a standby coordinator (active: {holder})",
                 holder=self.logic.holder, why=change.why)
        elif change.new == STANDBY:
            emit(log, "coordinator_standby", "this bootstrap is a standby coordinator ({why})", holder=self.logic.holder,
                 why=change.why)
        else:
            emit(log, "coordinator_claiming", "claiming the coordinator lease ({why}); settling {settle_s:g} s",
                 why=change.why, settle_s=self.cfg.settle_s)
        self._card()
        self._detail = self._make_detail()
        for fn in list(self._listeners):
            try:
                out = fn(change.new)
                if asyncio.iscoroutine(out):
                    await out
            except Exception as exc:  # noqa: BLE001 - one listener never stops the lease
                log.error("coordinator lease listener failed: %r", exc)

    def _card(self) -> None:
        try:
            self.ctx.card.update(publish=True, coordinator=self.logic.state)
        except Exception as exc:  # noqa: BLE001 - the card is informative only
            log.debug("card update failed: %r", exc)

    def _remember(self) -> None:
        try:
            self._state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._state_path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"run_id": self.run_id, "active_since": time.time()}))
            os.replace(tmp, self._state_path)
        except OSError as exc:
            log.warning("cannot write %s (%r): a restart of this bootstrap would claim the lease at once",
                        self._state_path, exc)


__all__ = ["COORDINATOR_ACTIVE", "CoordinatorLease", "LEASE_NAMESPACE", "LeaseConfig", "LeaseEntry", "POLL_S",
           "lease_key", "read_holder", "read_lease"]
