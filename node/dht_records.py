"""Store and read the swarm's signed per-peer DHT records: one entry per writer under a key.

Owns the plumbing every signed record shares: wrapping a pydantic payload in the record
envelope (``security.records.record_value``), ``dht.store`` with subkey = the writer's own peer
ID and a TTL, ``dht.get`` of the whole subkey dictionary, dropping expired, foreign and
malformed entries (``security.records.read_entries``), and counting every call in
``swarmnode_dht_requests_total`` / ``swarmnode_dht_request_duration_seconds``. The node card
(``node/card.py``) and every rendezvous (``node/rendezvous.py``) go through these two
functions. It does not own signing or validation (``security/records.py``: the DHT's
``SignedRecordValidator`` signs our subkey on store and refuses forgeries) nor key layouts.

    ok = await store_entry(dht, key, peer_id, payload, ttl_s)            # raises on DHT errors
    entries = await read_entries_at(dht, key, Model)  # {peer_id: Entry(value, expiration)}
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from node.metrics import DHT_REQUEST_SECONDS, DHT_REQUESTS
from security.records import read_entries, record_value

__all__ = ["Entry", "store_entry", "read_entries_at"]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Entry(Generic[M]):
    """One peer's decoded record and the DHT time it expires at."""

    value: M
    expiration: float


async def store_entry(dht: Any, key: str, peer_id: str, payload: BaseModel, ttl_s: float,
                      timeout: float = 10.0) -> bool:
    """Store ``payload`` under ``key`` with subkey ``peer_id`` for ``ttl_s`` seconds.

    ``peer_id`` must be the DHT's own peer ID: the validator signs only that subkey, and peers
    refuse an unsigned one. Returns what the DHT answered (False: no node accepted it); raises
    on DHT errors and timeouts, after counting them, so the caller can say what failing means
    for its own peers."""
    from hivemind.utils import get_dht_time

    t0 = time.perf_counter()
    ok = False
    try:
        fut = dht.store(key, record_value(key, payload), get_dht_time() + ttl_s, subkey=peer_id,
                        return_future=True)
        ok = bool(await asyncio.wait_for(asyncio.wrap_future(fut), timeout))
        return ok
    finally:
        DHT_REQUESTS.labels(op="store", outcome="ok" if ok else "failed").inc()
        DHT_REQUEST_SECONDS.labels(op="store").observe(time.perf_counter() - t0)


async def read_entries_at(dht: Any, key: str, model: type[M], timeout: float = 10.0,
                          max_entries: int = 256) -> dict[str, Entry[M]]:
    """``{peer_id: Entry}`` of the live, well-formed entries under ``key`` (at most
    ``max_entries``). Entries whose subkey is not an Ed25519 peer ID, whose envelope is for
    another key or whose payload does not match ``model`` are skipped (the validator should
    already have refused them). Raises on DHT errors and timeouts."""
    from hivemind.utils import get_dht_time

    t0 = time.perf_counter()
    try:
        fut = dht.get(key, latest=True, return_future=True)
        found = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        DHT_REQUESTS.labels(op="get", outcome="ok").inc()
    except Exception:
        DHT_REQUESTS.labels(op="get", outcome="failed").inc()
        raise
    finally:
        DHT_REQUEST_SECONDS.labels(op="get").observe(time.perf_counter() - t0)
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    live = {subkey: item for subkey, item in found.value.items()
            if getattr(item, "expiration_time", now) >= now}
    decoded = read_entries(live, model, key=key, max_entries=max_entries)
    return {pid: Entry(value, float(getattr(live[pid], "expiration_time", now))) for pid, value in decoded.items()}
