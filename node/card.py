"""Node card: the signed record each node keeps fresh under ``<run>/nodes``, and swarm queries.

Owns the card schema, publishing (on every lifecycle change and every ``card.refresh_s``),
reading the run's live cards, and the queries every role asks of them:

    views = await read_cards(dht, run_id)
    peers(views, role="stage", cfg_hash=h, states=("ready",), exclude=my_peer_id) -> [CardView]
    card_int(view, "round") -> int | None      # ints in [0, 2**53]; junk reads as None
    frontier_card_int(peers(...), "round", max_jump=16) -> int | None   # robust frontier
    card_str(view, "cfg_hash") -> str | None
    max_card_int(peers(...), "iteration") -> int | None   # e.g. the swarm's frontier round

Does not own signing or validation (``security/records.py``), the store/get plumbing
(``node/dht_records.py``) nor the lifecycle (``node/lifecycle.py``); it listens to the latter.
Subkey = the writer's peer ID, so a node can only ever write its own card.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

from node.dht_records import read_entries_at, store_entry
from node.lifecycle import State
from node.logs import emit
from security.records import Namespace

if TYPE_CHECKING:  # pragma: no cover
    from node.config import CardConfig
    from node.membership import Membership

log = logging.getLogger("swarmnode.card")

CARD_MAX_BYTES = 4096
CARD_MAX_TTL_S = 60.0
SHORT_TTL_S = 10.0  # DRAINING / OFFLINE cards fade quickly


class NodeCard(BaseModel):
    """What every node tells the swarm about itself (strict: unknown fields are rejected)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    """The writer's role name (any installed role: ``node/roles.py``)."""
    state: Literal["joining", "ready", "draining", "offline"]
    version: str = Field(max_length=32)
    grpc_addr: str = Field(max_length=80)
    started_at: float
    published_at: float
    details: dict[str, str | int | float | bool] = Field(default_factory=dict, max_length=16)
    """Role details: stage index, round, model hash, ... (small scalars only). Read them with
    :func:`card_int` / :func:`card_str`: a peer's card may carry anything that fits the schema."""


CFG_HASH = "cfg_hash"
"""The role detail every training role publishes: the hash of the config that must match for
two nodes to work together (``peers(cfg_hash=...)`` filters on it)."""


CARD_NAMESPACE = Namespace(name="nodes", model=NodeCard, max_payload_bytes=CARD_MAX_BYTES, max_ttl_s=CARD_MAX_TTL_S)


def cards_key(run_id: str) -> str:
    return f"{run_id}/nodes"


@dataclass
class CardView:
    peer_id: str
    card: NodeCard
    expiration: float

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.card.published_at)


class CardPublisher:
    """Keeps this node's card in the DHT current."""

    def __init__(self, membership: "Membership", cfg: "CardConfig", run_id: str, peer_id: str, role: str,
                 version: str, grpc_addr: str, started_at: float):
        self.membership, self.cfg, self.run_id, self.peer_id = membership, cfg, run_id, peer_id
        self._base = dict(role=role, version=version, grpc_addr=grpc_addr, started_at=started_at)
        self.state: State = State.JOINING
        self.details: dict[str, Any] = {}
        self._wake = asyncio.Event()

    def card(self) -> NodeCard:
        return NodeCard(state=self.state.value, published_at=time.time(), details=dict(self.details), **self._base)

    def update(self, publish: bool = False, **details: Any) -> None:
        """Change role details (e.g. ``round=12``; ``None`` removes one); published with the next
        refresh, or at once with ``publish=True`` when peers act on the value (a NoLoCo worker's round)."""
        changed = any(self.details.get(k) != v for k, v in details.items())
        for k, v in details.items():
            if v is None:
                self.details.pop(k, None)
            else:
                self.details[k] = v
        if publish and changed:
            self._wake.set()

    async def on_state(self, state: State, reason: str, detail: str) -> None:
        """Lifecycle listener: re-publish at once on a state change."""
        if state is not self.state:
            self.state = state
            self._wake.set()

    async def publish(self) -> bool:
        dht = self.membership.dht
        if dht is None:
            return False
        ttl = SHORT_TTL_S if self.state in (State.DRAINING, State.OFFLINE) else self.cfg.ttl_s
        try:
            ok = await store_entry(dht, cards_key(self.run_id), self.peer_id, self.card(), ttl)
        except Exception as exc:  # noqa: BLE001 - counted; the next refresh retries
            emit(log, "card_publish_failed", "publishing node card failed: {error}", level=logging.WARNING,
                 error=repr(exc))
            ok = False
        return ok

    async def run(self) -> None:
        """Refresh loop (supervised by the daemon)."""
        while True:
            self._wake.clear()
            await self.publish()
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.refresh_s)
            except asyncio.TimeoutError:
                pass


async def read_cards(dht: Any, run_id: str, timeout: float = 10.0, max_cards: int = 4096) -> list[CardView]:
    """The run's live node cards, bootstrap first (expired ones are dropped by the DHT; invalid
    ones by our validator, and defensively here). Raises on DHT errors and timeouts."""
    entries = await read_entries_at(dht, cards_key(run_id), NodeCard, timeout=timeout, max_entries=max_cards)
    views = [CardView(peer_id=pid, card=e.value, expiration=e.expiration) for pid, e in entries.items()]
    views.sort(key=lambda v: (v.card.role != "bootstrap", v.card.role, v.peer_id))
    return views


# ---- swarm queries ----

CARD_INT_MAX = 2 ** 53
"""Largest card int a reader accepts: a value adopted from a peer (a round label) must still be
publishable after ``+ 1`` by msgpack (uint64) and exact in JSON/float64 readers."""


def card_int(view: CardView, key: str) -> int | None:
    """Role detail ``key`` of a peer's card as an int in [0, CARD_INT_MAX]; None when absent or
    anything else (a bool, a negative or huge number, a string, a float): a peer's junk never
    crashes a reader, nor poisons a value the reader republishes."""
    value = view.card.details.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= CARD_INT_MAX
    return value if ok else None


def card_str(view: CardView, key: str) -> str | None:
    """Role detail ``key`` as a string; None when absent or not a string."""
    value = view.card.details.get(key)
    return value if isinstance(value, str) else None


def peers(views: Iterable[CardView], *, role: str | None = None, cfg_hash: str | None = None,
          states: Collection[str] | None = ("ready",), exclude: str | None = None,
          unknown_cfg_ok: bool = False) -> list[CardView]:
    """The cards that match every filter given, in input order.

    :param role: only nodes of this role (usually the caller's own ``name``); None: any role.
    :param cfg_hash: only nodes whose ``cfg_hash`` detail equals this (nodes that can work with
        the caller); None: no config filter.
    :param states: lifecycle states to keep (``"joining"``, ``"ready"``, ``"draining"``,
        ``"offline"``); the default keeps READY nodes only, the ones that serve. None: any.
    :param exclude: a peer ID to leave out (the caller's own).
    :param unknown_cfg_ok: also keep nodes that publish no ``cfg_hash`` yet (a node publishes it
        once its config is built): use it to count who is about to join, never to pick a donor.
    """
    out = []
    for v in views:
        if exclude is not None and v.peer_id == exclude:
            continue
        if role is not None and v.card.role != role:
            continue
        if states is not None and v.card.state not in states:
            continue
        if cfg_hash is not None:
            theirs = v.card.details.get(CFG_HASH)
            if theirs != cfg_hash and not (unknown_cfg_ok and theirs is None):
                continue
        out.append(v)
    return out


def max_card_int(views: Iterable[CardView], key: str) -> int | None:
    """The highest valid :func:`card_int` ``key`` among ``views``; None when no card has one.
    Filter first with :func:`peers` (e.g. the frontier round of the live peers of our config)."""
    return max((n for n in (card_int(v, key) for v in views) if n is not None), default=None)


def frontier_card_int(views: Iterable[CardView], key: str, max_jump: int, own: int | None = None) -> int | None:
    """The swarm's frontier of ``key`` (e.g. the round), robust to a few forged cards: the
    highest :func:`card_int` among ``views`` within ``max_jump`` of the lower median (the anchor)
    of their values and ``own`` (the caller's value, if it has one worth counting: a worker's
    round, not a joiner's 0). A stranger claiming an absurd round is outside that window and
    ignored; an honest frontier a few rounds ahead of the median is kept. None when no card has
    an acceptable value. Residual risk: sybils holding a majority of the READY cards move the
    median (admission is the defence there: docs/security.md, 'Admission tokens')."""
    theirs = [n for n in (card_int(v, key) for v in views) if n is not None]
    values = sorted(theirs + ([own] if own is not None else []))
    if not theirs:
        return None
    anchor = values[(len(values) - 1) // 2]
    return max((n for n in theirs if abs(n - anchor) <= max_jump), default=None)
