"""node/card.py CardPublisher: role details reach the DHT at the next refresh, or at once when
peers act on them (a NoLoCo worker's round: ``update(publish=True)``)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from node.card import CardPublisher
from node.config import CardConfig


class _FakeMembership:
    """Counts stores; the DHT itself is exercised by the integration tests."""

    def __init__(self):
        self.stores = []
        self.dht = self

    def store(self, key, value, expiration, subkey=None, return_future=False):
        self.stores.append((key, subkey))
        fut = concurrent.futures.Future()  # what hivemind's DHT.store(return_future=True) gives
        fut.set_result(True)
        return fut


async def test_round_change_publishes_at_once_unchanged_value_does_not():
    mem = _FakeMembership()
    pub = CardPublisher(mem, CardConfig(ttl_s=30, refresh_s=20), "run", "12D3KooWpeer", "noloco", "0.1",
                        "127.0.0.1:1", 0.0)
    task = asyncio.create_task(pub.run())
    try:
        await asyncio.sleep(0.05)
        assert mem.stores == [("run/nodes", "12D3KooWpeer")]  # the first publish; the next refresh is 20 s away
        pub.update(round=1)  # details only: waits for the refresh
        await asyncio.sleep(0.05)
        assert len(mem.stores) == 1 and pub.card().details["round"] == 1
        pub.update(round=2, publish=True)
        await asyncio.sleep(0.05)
        assert len(mem.stores) == 2
        pub.update(round=2, publish=True)  # nothing changed: no extra store
        await asyncio.sleep(0.05)
        assert len(mem.stores) == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_none_removes_a_detail_and_the_card_stays_valid():
    """A replacement withdraws its claim with ``update(recovering=None)``: the key goes, the card
    still validates (a None value made every later publish fail)."""
    mem = _FakeMembership()
    pub = CardPublisher(mem, CardConfig(ttl_s=30, refresh_s=20), "run", "12D3KooWpeer", "stage", "0.1",
                        "127.0.0.1:1", 0.0)
    pub.update(recovering=2, iteration=7)
    assert pub.card().details == {"recovering": 2, "iteration": 7}
    pub.update(publish=True, recovering=None)
    assert pub.card().details == {"iteration": 7}
    assert pub._wake.is_set()        # a removal is a change: published at once
    assert await pub.publish()
    assert mem.stores == [("run/nodes", "12D3KooWpeer")]
