"""Keeps this process's revocation list (``security.revocation.REVOKED``) in step with the
coordinator's ``<run>/revoked`` record (token mode; docs/security.md, 'Revocation').

Every node re-reads the record every ``security.revocation_refresh_s`` (at most half of ``card.ttl_s``, so
a revocation is honoured within one card lifetime), and stops with exit 2 when it finds its own
token revoked. The node holding the coordinator key also keeps the record alive: it merges what
it reads into ``<state_dir>/revocations.json`` and re-publishes the list when the DHT copy lacks
an entry of that file or is past half its lifetime, so the list survives DHT churn and a restart
of the whole swarm. ``swarmnode revoke`` (``node/revoke_cli.py``) writes new entries.

Does not own the list's format (``security/revocation.py``) nor its signature
(``security/revocation_record.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from node import metrics
from node.dht_records import read_entries_at, store_entry
from node.logs import emit
from security.revocation import REVOKED, REVOKED_RECORD_TTL_S, RevocationList, RevokedEntry, merge, revoked_key

log = logging.getLogger("swarmnode.revocation")


async def read_revocations(dht: Any, run_id: str, coordinator_peer_id: str,
                           timeout: float = 10.0) -> tuple[RevocationList | None, float]:
    """The coordinator's list and its DHT expiration; (None, 0) when there is none. Only the
    coordinator's subkey counts (the validator refuses any other writer in this namespace)."""
    entries = await read_entries_at(dht, revoked_key(run_id), RevocationList, timeout=timeout, max_entries=4)
    found = entries.get(coordinator_peer_id)
    return (found.value, found.expiration) if found is not None else (None, 0.0)


class RevocationSync:
    """The daemon's supervised task (``run``). ``on_self_revoked(entry)`` is called once when
    this node's own token (``own_serial``) or peer ID is on the list."""

    def __init__(self, dht_getter: Callable[[], Any], run_id: str, coordinator_peer_id: str, peer_id: str,
                 own_serial: int | None, refresh_s: float, state_dir: str,
                 on_self_revoked: Callable[[RevokedEntry], None]):
        self._dht, self.run_id, self.coordinator = dht_getter, run_id, coordinator_peer_id
        self.peer_id, self.own_serial, self.refresh_s = peer_id, own_serial, refresh_s
        self.is_coordinator = peer_id == coordinator_peer_id
        self.path = Path(os.path.expanduser(state_dir)) / "revocations.json"
        self._on_self_revoked = on_self_revoked
        self._told = False

    # ---- the coordinator's own copy ----
    def load_file(self) -> list[RevokedEntry]:
        try:
            raw = json.loads(self.path.read_text())
            return RevocationList.model_validate_json(json.dumps(raw)).entries
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%r): keeping the revocation list from the DHT only", self.path, exc)
            return []

    def save_file(self, entries: list[RevokedEntry]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(RevocationList(entries=entries, published_at=time.time()).model_dump_json(indent=1))
        os.replace(tmp, self.path)

    async def step(self) -> None:
        dht = self._dht()
        if dht is None:
            return
        from hivemind.utils import get_dht_time

        found, expiration = await read_revocations(dht, self.run_id, self.coordinator)
        entries = list(found.entries) if found is not None else []
        if self.is_coordinator:
            mine = self.load_file()
            merged = merge(entries, mine)
            missing = {(e.serial, e.peer_id) for e in merged} - {(e.serial, e.peer_id) for e in entries}
            stale = found is not None and expiration - get_dht_time() < REVOKED_RECORD_TTL_S / 2
            if merged != mine:
                self.save_file(merged)
            if merged and (missing or stale or found is None):
                # our validator signs our own subkey (the coordinator's)
                await store_entry(dht, revoked_key(self.run_id), self.peer_id,
                                  RevocationList(entries=merged, published_at=time.time()), REVOKED_RECORD_TTL_S)
                emit(log, "revocations_published", "re-published the revocation list ({entries} entries)",
                     entries=len(merged))
            entries = merged
        new = REVOKED.update(entries)
        metrics.REVOKED_TOKENS.set(len(REVOKED))
        for e in new:
            emit(log, "token_revoked", "honouring a revocation: {what}", level=logging.WARNING, what=e.describe(),
                 serial=e.serial, revoked_peer=e.peer_id, until=e.until)
        hit = REVOKED.check(self.own_serial, self.peer_id) if not self.is_coordinator else None
        if hit is not None and not self._told:
            self._told = True
            self._on_self_revoked(hit)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a DHT hiccup keeps the last list; the next refresh retries
                log.debug("revocation list refresh failed: %r", exc)
            await asyncio.sleep(self.refresh_s)
