"""The NoLoCo/DiLoCo round roster: who waits for an outer round, and where to reach them.

Owns NoLoCo's entry type only: the roster is a ``node.rendezvous.Rendezvous`` under
``<run>/noloco/roster/<round>``, one signed entry per worker (subkey = its
peer ID; the role lists ``ROSTER`` in its ``rendezvous`` so the node's validator accepts it).
Key layout, publishing and reading are the rendezvous'; pairing is ``optimizers/exchange.py``'s.

    ROSTER.key(run_id, round) -> "<run>/noloco/roster/<round>"      (also: roster_key)
    await publish_entry(dht, run_id, peer_id, RosterEntry(...), ttl_s) -> bool
    await read_roster(dht, run_id, round) -> {peer_id: RosterEntry}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from node.rendezvous import Rendezvous

__all__ = ["RosterEntry", "ROSTER", "ROSTER_NAMESPACE", "ROSTER_MAX_TTL_S", "roster_key", "publish_entry",
           "read_roster"]

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


ROSTER: Rendezvous[RosterEntry] = Rendezvous("noloco/roster/", RosterEntry, max_payload_bytes=1024,
                                             max_ttl_s=ROSTER_MAX_TTL_S, max_entries=ROSTER_MAX_ENTRIES)
ROSTER_NAMESPACE = ROSTER.namespace


def roster_key(run_id: str, round: int) -> str:  # noqa: A002 - the protocol's word
    return ROSTER.key(run_id, round)


async def publish_entry(dht: Any, run_id: str, peer_id: str, entry: RosterEntry, ttl_s: float,
                        timeout: float = 10.0) -> bool:
    """``ROSTER.publish``: store this worker's entry for ``entry.round``; False if the store
    failed (partners cannot find this worker this round; it can still propose)."""
    return await ROSTER.publish(dht, run_id, peer_id, entry, ttl_s, timeout=timeout)


async def read_roster(dht: Any, run_id: str, round: int, timeout: float = 10.0) -> dict[str, RosterEntry]:  # noqa: A002
    """``ROSTER.read``: ``{peer_id: RosterEntry}`` for the round. Raises on DHT errors/timeouts."""
    return await ROSTER.read(dht, run_id, round, timeout=timeout)
