"""The event bus inside a running node: start it beside the role, feed it peers from node cards,
publish the node's gossip address and reachability on its card, announce its drain.

Owns the glue between :class:`node.eventbus.client.EventBus` and the daemon (card, membership,
supervisor, the node's ban list): the bus accepts messages only from the run's live members
(``gate.py``), read from the cards here. One supervised task runs it all and never fails the node: a bus that cannot start
or keeps dying ends in state ``failed`` and roles use their DHT fallback. The sidecar must come
up with the node's own peer ID (the DHT's), or it is refused.

Card details it maintains: ``gossip_addr`` (comma-separated multiaddrs peers dial for gossip)
and ``bus_reach`` (``"<peers that reached us>/<peers that reported>"``, from their probes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from node.eventbus.client import EventBus, gossip_peers_from_cards
from node.logs import emit

if TYPE_CHECKING:  # pragma: no cover
    from node.card import CardPublisher
    from node.config import NodeConfig
    from node.membership import Membership
    from security.limits import BanList

log = logging.getLogger("swarmnode.eventbus")


class NodeEventBus:
    """``bus`` is what roles use (``ctx.eventbus.bus``), None while disabled."""

    def __init__(self, cfg: "NodeConfig", key_path: str, card: "CardPublisher", membership: "Membership",
                 peer_id: str, bans: "BanList | None" = None):
        """``bans``: the node's ban list (the call guard's): bus strikes and bans land there."""
        self.cfg, self.card, self.membership, self.peer_id = cfg, card, membership, peer_id
        self.bus: EventBus | None = None
        if cfg.eventbus.enabled:
            lim = cfg.limits
            self.bus = EventBus(cfg.eventbus, run_id=cfg.run_id, key_path=key_path, listen_host=cfg.host,
                                advertise_host=cfg.grpc_host, allow_insecure_key=cfg.identity.allow_insecure_mode,
                                expected_peer_id=peer_id, members_only=True, bans=bans,
                                ban={"threshold": lim.ban_threshold, "window_s": lim.ban_window_s, "ban_s": lim.ban_s})
            self.bus.on_up.append(self._publish_addr)  # a restart with port 0 changes the address
        self._hint_logged = ""

    @property
    def enabled(self) -> bool:
        return self.bus is not None

    def status(self) -> dict[str, Any]:
        if self.bus is None:
            return {"state": "disabled"}
        return self.bus.status()

    async def run(self) -> None:
        """Supervised task body: start the sidecar (retried with backoff), keep it alive, and keep
        its snapshot, notices and peer set going until the bus stops or gives up."""
        bus = self.bus
        if bus is None:
            return
        try:
            async with asyncio.TaskGroup() as tg:  # one failing loop cancels the others
                for loop in (bus.supervise(), bus.poll(), bus.listen(), self._discover(bus)):
                    tg.create_task(loop)
        except* Exception as group:  # the bus is advisory: never fail the node for it
            error = repr(group.exceptions[0])
            await bus.stop()
            bus.state, bus.last_error = "failed", error
            emit(log, "eventbus_failed", "event bus stopped: {error}; roles use the DHT fallback", level=logging.ERROR, error=error)

    def _publish_addr(self, bus: EventBus) -> None:
        self.card.update(publish=True, gossip_addr=",".join(bus.advertised_addrs)[:200])

    async def _discover(self, bus: EventBus) -> None:
        """Every card refresh: the run's cards -> the sidecar's peer set and the bus's members (who
        may publish on which topic); our reachability -> card."""
        from node.card import read_cards

        interval = max(1.0, min(self.cfg.card.refresh_s, 5.0))
        while not bus.finished:
            dht = self.membership.dht
            if dht is not None:
                try:
                    views = await read_cards(dht, self.cfg.run_id, timeout=5.0)
                    await bus.set_members(views)
                    await bus.set_peers(gossip_peers_from_cards(views, self.peer_id))
                except Exception as exc:  # noqa: BLE001 - next round retries
                    log.debug("event-bus discovery failed: %r", exc)
            st = bus.status()
            if "reached_by" in st:
                self.card.update(bus_reach=st["reached_by"])
            hint = st.get("hint", "")
            if hint and hint != self._hint_logged:
                emit(log, "eventbus_unreachable", "event bus: {hint}", level=logging.WARNING, hint=hint)
            self._hint_logged = hint
            await asyncio.sleep(interval)

    async def announce_drain(self, trigger: str) -> bool:
        """Drain step: gossip a ``drain`` (or ``preemption``) notice so peers react before the
        card changes or expires."""
        if self.bus is None or not self.bus.up:
            return False
        kind = "preemption" if trigger in ("aws", "gcp") else "drain"
        return await self.bus.announce(kind, trigger=trigger)

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.stop()
