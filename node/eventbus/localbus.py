"""N event-bus sidecars on 127.0.0.1 driven from one process: for integration tests and
``benchmarks/eventbus.py``.

Each bus gets its own Ed25519 key file and a real sidecar process; every bus is told every
other one's gossip address (what node cards do in a swarm). No daemon, DHT or role is started,
so the sender rule (``members.py``) is off unless ``members_only``: then ``set_members`` plays
the node cards (peer -> role).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from types import SimpleNamespace
from pathlib import Path
from typing import Any, AsyncIterator

from node.eventbus.client import EventBus
from node.eventbus.config import EventBusConfig
from security.keys import generate_key, write_key_file


async def wire_peers(buses: list[EventBus]) -> None:
    peers = {b.peer_id: b.advertised_addrs for b in buses if b.up}
    await asyncio.gather(*(b.set_peers(peers) for b in buses if b.up))


async def wait_mesh(buses: list[EventBus], topic: str, min_peers: int, timeout: float) -> bool:
    """Until every bus has at least ``min_peers`` mesh peers on ``topic``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = await asyncio.gather(*(b.refresh() for b in buses))
        meshes = [next((t.mesh_peers for t in s.topics if t.topic == topic), 0) if s else 0 for s in snaps]
        if all(m >= min_peers for m in meshes):
            return True
        await asyncio.sleep(0.2)
    return False


async def set_members(buses: list[EventBus], roles: dict[str, str], ttl_s: float = 60.0) -> None:
    """Tell every bus that the peers in ``roles`` (peer ID -> role) hold live cards, as a card
    read would (``EventBus.set_members``)."""
    views = [SimpleNamespace(peer_id=p, card=SimpleNamespace(role=r, state="ready"), expiration=time.time() + ttl_s)
             for p, r in roles.items()]
    await asyncio.gather(*(b.set_members(views) for b in buses))


@asynccontextmanager
async def local_buses(n: int, workdir: str | Path, run_id: str = "local", *, members_only: bool = False,
                      ban: dict[str, float] | None = None, **cfg: Any) -> AsyncIterator[list[EventBus]]:
    """Start ``n`` sidecars (``cfg`` overrides EventBusConfig fields), wire them, supervise
    them (a killed sidecar restarts), and stop them all on exit. ``members_only`` / ``ban``: as
    in :class:`EventBus` (every bus)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    settings = {"enabled": True, "port": 0, "heartbeat_s": 0.5, **cfg}
    buses = []
    for i in range(n):
        path = workdir / f"bus-{i}.key"
        if not path.exists():
            write_key_file(path, generate_key())
        buses.append(EventBus(EventBusConfig(**settings), run_id=run_id, key_path=str(path), listen_host="127.0.0.1",
                              members_only=members_only, ban=ban))
    tasks: list[asyncio.Task] = []
    try:
        # two at a time: eight interpreters importing py-libp2p at once on a small machine can
        # outlast eventbus.start_timeout_s
        gate = asyncio.Semaphore(2)

        async def start(b: EventBus) -> None:
            async with gate:
                await b.start()

        results = await asyncio.gather(*(start(b) for b in buses), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        await wire_peers(buses)
        tasks = [asyncio.ensure_future(b.supervise()) for b in buses]
        yield buses
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*(b.stop() for b in buses), return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)
