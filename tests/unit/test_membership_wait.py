"""Membership.wait_joined: a role that reads swarm state at start waits for the DHT join first."""

from __future__ import annotations

import asyncio
import time

from node.membership import Membership


def test_wait_joined_returns_once_the_join_lands_and_false_after_the_timeout():
    m = Membership(cfg=None, identity_path="", validators=[])

    async def join_later():
        await asyncio.sleep(0.3)
        m.status.joined = True

    async def go():
        t0 = time.monotonic()
        task = asyncio.ensure_future(join_later())
        ok = await m.wait_joined(5.0)
        await task
        return ok, time.monotonic() - t0
    ok, waited = asyncio.run(go())
    assert ok and 0.25 <= waited < 2.0, waited

    never = Membership(cfg=None, identity_path="", validators=[])
    t0 = time.monotonic()
    assert asyncio.run(never.wait_joined(0.3)) is False
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert asyncio.run(m.wait_joined(0.0)) is True       # already joined: at once
