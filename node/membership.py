"""Swarm membership: the hivemind DHT process, joining through initial peers, peer counts.

Owns starting the DHT (it forks, so it starts before any gRPC object exists), the bootstrap
loop (dial + ping each initial peer, exponential backoff with jitter, the reason the node is
still joining), re-bootstrap when the routing table empties, and cheap probes for metrics.
It does not own node cards (``node/card.py``) or record signing (``security/records.py``).

The DHT starts with no initial peers and joins afterwards from this loop, so a node whose
bootstrap peers are down still comes up, serves ``/readyz`` with the reason, and keeps trying.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from node.logs import emit
from node.metrics import BOOTSTRAP_ATTEMPTS

if TYPE_CHECKING:  # pragma: no cover
    import hivemind

    from node.config import NodeConfig

log = logging.getLogger("swarmnode.membership")


class DhtStartError(Exception):
    exit_code = 1


# --- coroutines run INSIDE the DHT process (dht.run_coroutine); module level so they pickle ---

async def _dial_and_ping(maddrs: list[str], timeout: float, dht: Any, node: Any) -> dict[str, str]:
    """Connect to each initial peer, ping it into the routing table; return maddr -> outcome."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(maddr: str) -> str:
        try:
            ma = Multiaddr(maddr)
            pid = PeerID.from_base58(ma["p2p"])
            if pid == node.peer_id:
                return "self"
            addr = ma.decapsulate(Multiaddr(f"/p2p/{ma['p2p']}"))
            await asyncio.wait_for(node.p2p._client.connect(pid, [addr]), timeout)
            nid = await asyncio.wait_for(node.protocol.call_ping(pid), timeout)
            return "ok" if nid is not None else "connected but no DHT answer to ping"
        except asyncio.TimeoutError:
            return f"timeout {timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - reported per peer, never raised
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "connection refused" in text.lower():
                return "refused"
            return text[:160]

    outcomes = await asyncio.gather(*(one(m) for m in maddrs))
    result = dict(zip(maddrs, outcomes))
    if any(v == "ok" for v in result.values()):
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
        except Exception:  # noqa: BLE001 - filling the table further is best-effort
            pass
    return result


async def _routing_peer_ids(dht: Any, node: Any) -> set[str]:
    """The base58 peer IDs in the routing table."""
    table = node.protocol.routing_table
    return {pid.to_base58() for pid in (getattr(table, "peer_id_to_uid", {}) or {})}


async def _probe(dht: Any, node: Any) -> tuple[int, dict[str, int]]:
    """Routing-table size and our validator's rejection counts."""
    table = node.protocol.routing_table
    n_peers = len(getattr(table, "peer_id_to_uid", {}) or {})
    rejections: dict[str, int] = {}
    try:
        from security.records import read_rejections
        rejections = await read_rejections(dht, node)
    except Exception:  # noqa: BLE001 - the metric is optional
        pass
    return n_peers, rejections


@dataclass
class JoinStatus:
    joined: bool = False
    attempts: int = 0
    last_outcomes: dict[str, str] = field(default_factory=dict)
    next_retry_s: float = 0.0

    def detail(self) -> str:
        if not self.last_outcomes:
            return "starting"
        ok = sum(v == "ok" for v in self.last_outcomes.values())
        parts = "; ".join(f"{_short(m)}: {v}" for m, v in self.last_outcomes.items())
        return (f"{ok} of {len(self.last_outcomes)} initial_peers answered ({parts}); "
                f"retry {self.attempts + 1} in {self.next_retry_s:.0f} s")


def _short(maddr: str) -> str:
    parts = maddr.split("/")
    return "/".join(parts[1:5]) if len(parts) > 4 else maddr


class Membership:
    """One node's view of the swarm through its hivemind DHT."""

    def __init__(self, cfg: "NodeConfig", identity_path: str, validators: list):
        self.cfg = cfg
        self.identity_path = identity_path
        self.validators = validators
        self.dht: "hivemind.DHT | None" = None
        self.status = JoinStatus()

    # -- start / stop (main thread, before any gRPC object exists) --
    def start_dht(self) -> None:
        import hivemind

        host = self.cfg.host
        proto = "ip6" if ":" in host else "ip4"
        try:
            self.dht = hivemind.DHT(
                start=True,
                host_maddrs=[f"/{proto}/{host}/tcp/{self.cfg.dht.host_port}"],
                announce_maddrs=self.cfg.dht.announce_maddrs or None,
                identity_path=self.identity_path,
                record_validators=self.validators,
                startup_timeout=self.cfg.dht.startup_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - p2pd errors arrive as many types
            text = str(exc)
            hint = ""
            if "address already in use" in text.lower() or "bind" in text.lower():
                hint = (f"; port {self.cfg.dht.host_port} (dht.host_port, --dht-port) is in use: pick a free "
                        "one or 0 for any")
            raise DhtStartError(f"the DHT (p2pd) did not start: {text.strip()[-400:]}{hint}") from None

    @property
    def peer_id(self) -> str:
        assert self.dht is not None
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        if self.dht is None:
            return []
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def alive(self) -> bool:
        return self.dht is not None and self.dht.is_alive()

    def shutdown(self) -> None:
        if self.dht is not None:
            try:
                self.dht.shutdown()
            finally:
                self.dht = None

    # -- probes (any thread) --
    def probe(self, timeout: float = 1.0) -> tuple[int, dict[str, int]] | None:
        if self.dht is None or not self.dht.is_alive():
            return None
        fut = self.dht.run_coroutine(_probe, return_future=True)
        try:
            return fut.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - timeout or a DHT in trouble: caller skips
            fut.cancel()
            return None

    async def peer_count(self) -> int:
        """Routing-table size (0 when the DHT does not answer within 2 s)."""
        res = await asyncio.to_thread(self.probe, 2.0)
        return res[0] if res else 0

    # -- joining --
    async def join_once(self) -> dict[str, str]:
        assert self.dht is not None
        peers = list(self.cfg.dht.initial_peers)
        # MPFuture is a concurrent.futures.Future: wrap it for the event loop
        fut = self.dht.run_coroutine(partial(_dial_and_ping, peers, self.cfg.dht.bootstrap_timeout_s),
                                     return_future=True)
        return await asyncio.wait_for(asyncio.wrap_future(fut),
                                      self.cfg.dht.bootstrap_timeout_s * 2 + 5)

    async def redial_missing(self) -> dict[str, str]:
        """Dial and ping the initial peers that are not in the routing table (a bootstrap that
        died and came back at the same address); maddr -> outcome, {} when none is missing."""
        assert self.dht is not None
        fut = self.dht.run_coroutine(_routing_peer_ids, return_future=True)
        known = await asyncio.wait_for(asyncio.wrap_future(fut), 5.0)
        missing = [p for p in self.cfg.dht.initial_peers
                   if p.rsplit("/p2p/", 1)[-1] not in known and not p.endswith("/p2p/" + self.peer_id)]
        if not missing:
            return {}
        fut = self.dht.run_coroutine(partial(_dial_and_ping, missing, self.cfg.dht.bootstrap_timeout_s),
                                     return_future=True)
        return await asyncio.wait_for(asyncio.wrap_future(fut), self.cfg.dht.bootstrap_timeout_s * 2 + 5)

    async def wait_joined(self, timeout_s: float) -> bool:
        """Until the node has joined the swarm; False after `timeout_s` without. The daemon starts
        the role while the node joins: a role reading swarm state at start (cards, donors) calls
        this first, or it sees an empty swarm (a joiner would start the run over from round 0)."""
        deadline = time.monotonic() + timeout_s
        while not self.status.joined:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def join(self, on_progress) -> bool:
        """Try the initial peers until one answers; ``on_progress(status)`` after every attempt.

        Returns False only when ``dht.bootstrap_deadline_s`` passed without success.
        """
        peers = [p for p in self.cfg.dht.initial_peers if not p.endswith("/p2p/" + self.peer_id)]
        if not peers:
            self.status.joined = True
            await on_progress(self.status)
            return True
        started = time.monotonic()
        delay = 1.0
        while True:
            self.status.attempts += 1
            try:
                outcomes = await self.join_once()
            except Exception as exc:  # noqa: BLE001 - DHT process busy or gone: report and retry
                outcomes = {p: f"error: {exc!r}"[:160] for p in peers}
            self.status.last_outcomes = outcomes
            ok = any(v == "ok" for v in outcomes.values())
            BOOTSTRAP_ATTEMPTS.labels(outcome="ok" if ok else "failed").inc()
            if ok:
                self.status.joined = True
                emit(log, "bootstrap_attempt", "joined the swarm", outcome="ok", attempt=self.status.attempts,
                     peers=outcomes)
                await on_progress(self.status)
                return True
            deadline = self.cfg.dht.bootstrap_deadline_s
            if deadline is not None and time.monotonic() - started > deadline:
                return False
            self.status.next_retry_s = delay * (1 + random.uniform(-0.2, 0.2))
            emit(log, "bootstrap_attempt", "no initial peer answered: {detail}", level=logging.WARNING, detail=self.status.detail(),
                 outcome="failed", attempt=self.status.attempts, peers=outcomes)
            await on_progress(self.status)
            await asyncio.sleep(self.status.next_retry_s)
            delay = min(self.cfg.dht.retry_max_s, delay * 2)

