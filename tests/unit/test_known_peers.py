"""node/known_peers.py KnownPeers: who may call this node, from its cached view of the cards."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from node.call_guard import _bannable
from node.known_peers import KnownPeers


def _view(peer_id: str, addr: str, state: str = "ready"):
    return SimpleNamespace(peer_id=peer_id, card=SimpleNamespace(state=state, grpc_addr=addr))


async def test_unknown_callers_wait_for_one_bounded_re_read():
    reads = 0
    joined: list = []

    async def read():
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)
        return list(joined)

    known = KnownPeers(read, own_peer_id="me", own_addr="127.0.0.1:1")
    assert not known.is_known("joiner")
    joined.append(_view("joiner", "127.0.0.1:2"))
    assert await known.wait_known("joiner", min_interval_s=0.0)  # a card just published is found
    assert reads == 1 and known.resolve("127.0.0.1:2") == "joiner" and known.resolve("127.0.0.1:1") == "me"
    # strangers: re-reads are spaced, however many of them call at once
    results = await asyncio.gather(*(known.wait_known(f"stranger{i}", min_interval_s=10.0) for i in range(5)))
    assert results == [False] * 5 and reads == 1


async def test_waiters_are_capped_so_strangers_cannot_hold_call_slots():
    release = asyncio.Event()

    async def slow_read():
        await release.wait()
        return []

    known = KnownPeers(slow_read)
    waiting = [asyncio.ensure_future(known.wait_known(f"s{i}", timeout=5.0, min_interval_s=0.0))
               for i in range(known.max_waiters)]
    await asyncio.sleep(0.01)
    # the cap is reached: the next unknown caller is refused at once, without waiting
    t0 = asyncio.get_running_loop().time()
    assert await known.wait_known("one-more", timeout=5.0, min_interval_s=0.0) is False
    assert asyncio.get_running_loop().time() - t0 < 0.1
    release.set()
    assert await asyncio.gather(*waiting) == [False] * known.max_waiters
    assert known._waiters == 0  # every waiter left its slot


def test_offline_cards_do_not_count():
    known = KnownPeers()
    known.update([_view("a", "127.0.0.1:5"), _view("b", "127.0.0.1:6", state="offline")])
    assert known.is_known("a") and not known.is_known("b") and len(known) == 1


def test_only_peers_and_remote_ips_are_banned_never_loopback():
    assert _bannable("12D3KooWAbc") and _bannable("203.0.113.7") and _bannable("2001:db8::1")
    assert not _bannable("127.0.0.1") and not _bannable("::1") and not _bannable(None)
