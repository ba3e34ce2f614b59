"""The NoLoCo/DiLoCo round roster: who waits for an outer round, and where to reach them.

Owns the signed DHT record ``<run>/noloco/roster/<round>`` (noloco.md §3.6): one entry per
worker (subkey = its peer ID, signed by ``security.records.SignedRecordValidator``, which
must list ``ROSTER_NAMESPACE``), and the two helpers that publish and read it. It does not
own pairing (``optimizers/exchange.py``) nor the validator (``security/records.py``).

    roster_key(run_id, round) -> "<run>/noloco/roster/<round>"
    await publish_entry(dht, run_id, peer_id, RosterEntry(...), ttl_s) -> bool
    await read_roster(dht, run_id, round) -> {peer_id: RosterEntry}
    ready_peers(card_views, peer_id=..., cfg_hash=...) -> the other READY workers of our config
    frontier_round(card_views, peer_id=..., cfg_hash=...) -> highest live peer round or None
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field

from security.records import Namespace, read_entries, record_value

__all__ = ["RosterEntry", "ROSTER_NAMESPACE", "ROSTER_MAX_TTL_S", "roster_key", "publish_entry", "read_roster",
           "card_round", "ready_peers", "frontier_round"]

log = logging.getLogger("swarmnode.noloco.roster")

ROSTER_MAX_TTL_S = 120.0
ROSTER_MAX_ENTRIES = 1024


class RosterEntry(BaseModel):
    """One worker waiting for an outer round (strict: unknown fields and coercions rejected)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    round: int = Field(ge=0)
    grpc_addr: str = Field(min_length=1, max_length=80)
    """Where its ``NoLoCo.Exchange`` listens ("host:port")."""
    cfg_hash: str = Field(max_length=32)
    """Only workers with the same method/model config hash average together."""
    waiting_since: float
    """Wall-clock time the worker entered the round (informational; not trusted for ordering)."""


ROSTER_NAMESPACE = Namespace(name="noloco/roster/", model=RosterEntry, max_payload_bytes=1024,
                             max_ttl_s=ROSTER_MAX_TTL_S)


def roster_key(run_id: str, round: int) -> str:  # noqa: A002 - the protocol's word
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    return f"{run_id}/noloco/roster/{int(round)}"


async def publish_entry(dht: Any, run_id: str, peer_id: str, entry: RosterEntry, ttl_s: float,
                        timeout: float = 10.0) -> bool:
    """Store this worker's entry (subkey = ``peer_id``, which must be the DHT's own peer ID:
    the validator signs only that subkey). Returns False (and logs) if the store failed."""
    from hivemind.utils import get_dht_time

    ttl_s = max(1.0, min(float(ttl_s), ROSTER_MAX_TTL_S))
    key = roster_key(run_id, entry.round)
    try:
        fut = dht.store(key, record_value(key, entry), get_dht_time() + ttl_s, subkey=peer_id,
                        return_future=True)
        return bool(await asyncio.wait_for(asyncio.wrap_future(fut), timeout))
    except Exception as exc:  # noqa: BLE001 - the caller goes on (it can still propose)
        log.warning("publishing roster entry for round %d failed: %r; partners cannot find this worker "
                    "this round (it can still propose). Check DHT connectivity.", entry.round, exc,
                    extra={"event": "roster_publish_failed", "round": entry.round})
        return False


async def read_roster(dht: Any, run_id: str, round: int, timeout: float = 10.0) -> dict[str, RosterEntry]:  # noqa: A002
    """``{peer_id: RosterEntry}`` for the round: entries whose payload says another round are
    dropped, invalid ones are skipped by ``read_entries``. Raises on DHT errors/timeouts."""
    key = roster_key(run_id, round)
    fut = dht.get(key, latest=True, return_future=True)
    found = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
    if found is None:
        return {}
    entries = read_entries(found.value, RosterEntry, key=key, max_entries=ROSTER_MAX_ENTRIES)
    return {pid: e for pid, e in entries.items() if e.round == round}


def card_round(view: Any) -> int | None:
    """The round a worker's node card (``node.card.CardView``) announces; None if absent or not
    a non-negative int."""
    r = view.card.details.get("round")
    return r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else None


def ready_peers(views: Iterable[Any], *, peer_id: str, cfg_hash: str) -> list[Any]:
    """The node cards of the other READY noloco workers with our ``cfg_hash``: the peers this
    worker may pair with, take state from, or follow to a higher round."""
    return [v for v in views if v.peer_id != peer_id and v.card.role == "noloco" and v.card.state == "ready"
            and v.card.details.get("cfg_hash") == cfg_hash]


def frontier_round(views: Iterable[Any], *, peer_id: str, cfg_hash: str) -> int | None:
    """The highest round on ``ready_peers``' cards; None when there is none. A worker behind it
    adopts it as its round label so it can pair again (``noloco.catch_up``)."""
    rounds = [r for r in map(card_round, ready_peers(views, peer_id=peer_id, cfg_hash=cfg_hash)) if r is not None]
    return max(rounds, default=None)
