"""The node's cached view of the run's live node cards: who may call it, and who an address is.

Refreshed by the daemon (:meth:`KnownPeers.run`, supervised) from the DHT. The call guard asks
it whether a caller is a live member (``is_known``; in token mode only peers whose card passed
the admission check ever get there), and signed outgoing calls ask it which peer ID an address
belongs to (``resolve``, the target the call is signed for). A miss asks for an early refresh,
so a peer that has just published its card is not turned away for a whole ``refresh_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

log = logging.getLogger("swarmnode.grpc")


class KnownPeers:
    """The run's live node cards as this node last read them (``read() -> list[CardView]``,
    refreshed every ``refresh_s`` by :meth:`run`, and soon after a miss). Cards in state
    ``offline`` do not count."""

    def __init__(self, read: Callable[[], Awaitable[list]] | None = None, refresh_s: float = 5.0,
                 own_peer_id: str | None = None, own_addr: str | None = None):
        self._read, self.refresh_s = read, refresh_s
        self._peers: dict[str, Any] = {}
        self._addrs: dict[str, str] = {}
        self._own = (own_peer_id, own_addr)
        if own_peer_id and own_addr:
            self._addrs[own_addr] = own_peer_id
        self._miss = asyncio.Event()
        self._lock = asyncio.Lock()
        self._waiters = 0
        self.max_waiters = 8
        self.last_refresh = 0.0

    def update(self, views: Iterable[Any]) -> None:
        peers, addrs = {}, {}
        for v in views:
            if v.card.state == "offline":
                continue
            peers[v.peer_id] = v
            addrs.setdefault(v.card.grpc_addr, v.peer_id)  # read_cards' order: bootstrap first, then by ID
        own_id, own_addr = self._own
        if own_id and own_addr:
            addrs[own_addr] = own_id
        self._peers, self._addrs = peers, addrs
        self.last_refresh = time.monotonic()

    def add(self, peer_id: str, addr: str | None = None) -> None:
        """Tests and benchmarks: admit ``peer_id`` by hand."""
        self._peers[peer_id] = None
        if addr:
            self._addrs[addr] = peer_id

    def is_known(self, peer_id: str) -> bool:
        if peer_id in self._peers:
            return True
        self._miss.set()  # a new peer: refresh soon rather than in refresh_s
        return False

    async def wait_known(self, peer_id: str, timeout: float = 2.0, min_interval_s: float = 0.5) -> bool:
        """Is ``peer_id`` a live member, re-reading the cards now if the view is older than
        ``min_interval_s``? Re-reads are serialised and spaced, so unknown callers (strangers
        included) cost at most one DHT read per ``min_interval_s``; waits at most ``timeout``.
        At most ``max_waiters`` calls wait at once; beyond that an unknown caller is refused at
        once, so a flood of strangers cannot hold the server's call slots while they wait."""
        if peer_id in self._peers:
            return True
        if self._waiters >= self.max_waiters:
            return False
        self._waiters += 1
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:
                    if peer_id not in self._peers and time.monotonic() - self.last_refresh >= min_interval_s:
                        await self.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a slow or failing DHT read: refuse, as before
            log.debug("known peers re-read for %s failed: %r", peer_id[-8:], exc)
        finally:
            self._waiters -= 1
        return peer_id in self._peers

    def resolve(self, addr: str) -> str | None:
        found = self._addrs.get(addr)
        if found is None:
            self._miss.set()
        return found

    def __len__(self) -> int:
        return len(self._peers)

    async def refresh(self) -> None:
        if self._read is not None:
            self.update(await self._read())

    async def run(self) -> None:
        """Refresh loop (supervised by the daemon); errors keep the last view."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - DHT hiccups: keep the last good view
                log.debug("known peers refresh failed: %r", exc)
            await asyncio.sleep(min(1.0, self.refresh_s))  # misses refresh at most about once a second
            self._miss.clear()
            try:
                await asyncio.wait_for(self._miss.wait(), max(0.0, self.refresh_s - 1.0))
            except asyncio.TimeoutError:
                pass
