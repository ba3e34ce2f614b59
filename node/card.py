"""Node card: the signed record each node keeps fresh under ``<run>/nodes``.

Owns the card schema, publishing (on every lifecycle change and every ``card.refresh_s``)
and reading the run's live cards. Does not own signing or validation
(``security/records.py``) nor the lifecycle (``node/lifecycle.py``); it listens to the latter.
Subkey = the writer's peer ID, so a node can only ever write its own card.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from node.config import RoleName
from node.lifecycle import State
from node.metrics import DHT_REQUEST_SECONDS, DHT_REQUESTS
from security.records import Namespace, decode_payload, record_value

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

    role: RoleName
    state: Literal["joining", "ready", "draining", "offline"]
    version: str = Field(max_length=32)
    grpc_addr: str = Field(max_length=80)
    started_at: float
    published_at: float
    details: dict[str, str | int | float | bool] = Field(default_factory=dict, max_length=16)
    """Role details: stage index, round, model hash, ... (small scalars only)."""


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
        """Change role details (e.g. ``round=12``); published with the next refresh, or at once
        with ``publish=True`` when peers act on the value (a NoLoCo worker's round)."""
        changed = any(self.details.get(k) != v for k, v in details.items())
        self.details.update(details)
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
        from hivemind.utils import get_dht_time
        t0 = time.perf_counter()
        try:
            key = cards_key(self.run_id)
            fut = dht.store(key, record_value(key, self.card()), get_dht_time() + ttl,
                            subkey=self.peer_id, return_future=True)
            ok = bool(await asyncio.wait_for(asyncio.wrap_future(fut), 10))
        except Exception as exc:  # noqa: BLE001 - counted; the next refresh retries
            log.warning("publishing node card failed: %r", exc, extra={"event": "card_publish_failed"})
            ok = False
        DHT_REQUESTS.labels(op="store", outcome="ok" if ok else "failed").inc()
        DHT_REQUEST_SECONDS.labels(op="store").observe(time.perf_counter() - t0)
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
    """The run's live node cards (expired ones are dropped by the DHT; invalid ones by our validator)."""
    from hivemind.utils import get_dht_time
    t0 = time.perf_counter()
    try:
        fut = dht.get(cards_key(run_id), latest=True, return_future=True)
        found = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        DHT_REQUESTS.labels(op="get", outcome="ok").inc()
    except Exception:
        DHT_REQUESTS.labels(op="get", outcome="failed").inc()
        raise
    finally:
        DHT_REQUEST_SECONDS.labels(op="get").observe(time.perf_counter() - t0)
    views: list[CardView] = []
    if found is None or not isinstance(found.value, dict):
        return views
    now = get_dht_time()
    for subkey, item in list(found.value.items())[:max_cards]:
        if item.expiration_time < now:
            continue
        try:
            card = decode_payload(item.value, NodeCard, key=cards_key(run_id))
        except Exception:  # noqa: BLE001 - the validator should have dropped it; skip defensively
            continue
        views.append(CardView(peer_id=str(subkey), card=card, expiration=item.expiration_time))
    views.sort(key=lambda v: (v.card.role != "bootstrap", v.card.role, v.peer_id))
    return views
