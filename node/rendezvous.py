"""Signed per-round rendezvous: where the peers of one round (iteration, step) find each other.

A rendezvous is one DHT key per round, ``<run>/<prefix><round>``, holding one signed entry per
peer (subkey = the writer's peer ID, so nobody can write or edit another peer's entry). The
role supplies the prefix and a strict pydantic entry model with an int index field:

    ROSTER = Rendezvous("noloco/roster/", RosterEntry)              # NoLoCo's round roster
    STAGES = Rendezvous("stage/records/", StageRecord, index_field="iteration")   # SkipPipe
    INDEX = Rendezvous("grpo/rollouts/", RolloutIndexEntry, max_payload_bytes=2048)  # GRPO

    ROSTER.key(run_id, 12)                                    -> "<run>/noloco/roster/12"
    await ROSTER.publish(dht, run_id, peer_id, entry, ttl_s)  -> bool (False: logged, go on)
    await ROSTER.read(dht, run_id, 12)                        -> {peer_id: RosterEntry}

and lists ``ROSTER.namespace`` among its ``RoleBase.rendezvous`` so that the node's
``SignedRecordValidator`` accepts (and signs) the records. Owns the key layout, TTL and entry
caps and the index check; store/get are ``node/dht_records.py``'s (shared with the node card),
signing and validation ``security/records.py``'s.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from node.dht_records import read_entries_at, store_entry
from node.logs import emit
from security.records import Namespace

__all__ = ["Rendezvous"]

log = logging.getLogger("swarmnode.rendezvous")

E = TypeVar("E", bound=BaseModel)


class Rendezvous(Generic[E]):
    """One kind of per-round signed record (see the module docstring).

    :param prefix: namespace under ``<run>/``, ending in "/" (``"noloco/roster/"``); the round
        number follows it. Must be unique among the namespaces a node validates.
    :param entry_model: strict pydantic model of one peer's entry (``extra="forbid",
        strict=True``); it must have an int field named ``index_field``.
    :param index_field: the entry field that carries the round; ``publish`` files the entry
        under that round and ``read`` drops entries that claim another one.
    :param max_payload_bytes: cap on one entry's encoded payload (the validator refuses more).
    :param max_ttl_s: the longest TTL a writer may ask for; ``publish`` clamps to it. Raise it
        only if rounds last longer than this (a round's entries must outlive the round).
    :param max_entries: most entries one ``read`` decodes (peers per round); beyond it the rest
        are ignored, which bounds what a flood of fake peers can cost a reader.
    """

    def __init__(self, prefix: str, entry_model: type[E], *, index_field: str = "round",
                 max_payload_bytes: int = 1024, max_ttl_s: float = 120.0, max_entries: int = 1024):
        if not prefix.endswith("/") or prefix.startswith("/") or "//" in prefix:
            raise ValueError(f"rendezvous prefix {prefix!r} must look like 'role/what/' (ends in '/')")
        field = entry_model.model_fields.get(index_field)
        if field is None or field.annotation not in (int, "int"):
            raise ValueError(f"{entry_model.__name__} needs an int field {index_field!r} (the round it is for)")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.prefix, self.entry_model, self.index_field = prefix, entry_model, index_field
        self.max_entries = max_entries
        self.namespace = Namespace(name=prefix, model=entry_model, max_payload_bytes=max_payload_bytes,
                                   max_ttl_s=max_ttl_s)

    def __repr__(self) -> str:
        return f"Rendezvous({self.prefix!r}, {self.entry_model.__name__})"

    def key(self, run_id: str, round: int) -> str:  # noqa: A002 - the protocol's word
        """``<run_id>/<prefix><round>``; ``round`` must be a non-negative int."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 0:
            raise ValueError(f"{self.index_field} must be an int >= 0, got {round!r}")
        return f"{run_id}/{self.prefix}{round}"

    async def publish(self, dht: Any, run_id: str, peer_id: str, entry: E, ttl_s: float,
                      timeout: float = 10.0) -> bool:
        """Store this peer's entry under the round it names (subkey = ``peer_id``, which must be
        the DHT's own peer ID). TTL is clamped to [1 s, ``max_ttl_s``]. Returns False when the
        store failed (a DHT error is logged as a warning): the caller goes on without being
        findable this round."""
        rnd = getattr(entry, self.index_field)
        key = self.key(run_id, rnd)
        ttl_s = max(1.0, min(float(ttl_s), self.namespace.max_ttl_s))
        try:
            ok = await store_entry(dht, key, peer_id, entry, ttl_s, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the caller goes on (e.g. it can still propose)
            emit(log, "rendezvous_publish_failed", "publishing {namespace} entry for {kind} {index} failed: {error}; "
                 "peers reading that {kind} cannot find this node. Check DHT connectivity "
                 "(swarmnode_dht_requests_total{{op=\"store\"}}).", level=logging.WARNING, namespace=self.prefix,
                 kind=self.index_field, index=rnd, error=repr(exc), **{self.index_field: rnd})
            return False
        if not ok:
            emit(log, "rendezvous_publish_failed", "no DHT node accepted the {namespace} entry for {kind} {index}",
                 level=logging.DEBUG, namespace=self.prefix, kind=self.index_field, index=rnd,
                 **{self.index_field: rnd})
        return ok

    async def read(self, dht: Any, run_id: str, round: int, timeout: float = 10.0) -> dict[str, E]:  # noqa: A002
        """``{peer_id: entry}`` for the round: expired, unsigned-looking or malformed entries are
        skipped, and so are entries whose payload names another round. Raises on DHT errors
        and timeouts (the caller decides whether a missed read means a solo round)."""
        entries = await read_entries_at(dht, self.key(run_id, round), self.entry_model, timeout=timeout,
                                        max_entries=self.max_entries)
        return {pid: e.value for pid, e in entries.items() if getattr(e.value, self.index_field) == round}
