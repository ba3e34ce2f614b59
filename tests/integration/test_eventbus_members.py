"""The event bus's sender rule on real sidecars (py-libp2p gossipsub, real gRPC; issue 33, finding 1).

Three buses on 127.0.0.1 wired to each other, the sender rule on (``members_only``, what every
node runs): two members (a ``grpo`` peer and a ``bootstrap``), and a stranger, a bus with its own
key that the others know no card of. Checked, on the receiving sidecars' own counters and on
what reaches the daemon side:

- the stranger's rollouts and swarm notices never reach a subscriber; they are dropped as
  ``not_member`` before any work, its reachability reports are not counted (``reporter_ids``),
  and after ``ban.threshold`` of them it is banned (the sidecar's ``banned``, then the daemon's
  ban list) and its later messages are dropped as ``banned``;
- the bootstrap member's rollouts are dropped as ``role_not_allowed`` (``eventbus.publishers``:
  only ``grpo`` publishes rollouts) while its swarm notices arrive;
- the grpo member's rollouts still arrive.

The stranger scenario on full nodes in token mode is test_grpo_bus_stranger.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from node.eventbus.localbus import local_buses, set_members, wait_mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BAN = {"threshold": 5, "window_s": 60.0, "ban_s": 600.0}


async def _collect(bus, sink: asyncio.Queue):
    async for d in bus.messages():
        sink.put_nowait(d)


async def _until(pred, timeout: float, what: str):
    t0 = time.monotonic()
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.3)


def _dropped(snap, topic: str) -> dict[str, int]:
    return next((dict(t.dropped) for t in snap.topics if t.topic == topic), {})


def test_only_members_allowed_on_a_topic_get_through_and_strangers_are_banned(tmp_path):
    async def main():
        async with local_buses(3, tmp_path, run_id="members", members_only=True, ban=BAN,
                               probe_interval_s=1.0, probe_timeout_s=2.0) as buses:
            grpo, boot, stranger = buses
            await set_members(buses, {grpo.peer_id: "grpo", boot.peer_id: "bootstrap"})
            assert await wait_mesh(buses, "rollouts", 1, timeout=60), "no mesh"
            sinks = {b.peer_id: asyncio.Queue() for b in (grpo, boot)}
            seen: dict[str, list] = {b.peer_id: [] for b in (grpo, boot)}
            readers = [asyncio.ensure_future(_collect(b, sinks[b.peer_id])) for b in (grpo, boot)]
            await asyncio.sleep(1.0)

            def arrived(at, pred):
                async def check():
                    while not sinks[at.peer_id].empty():
                        seen[at.peer_id].append(sinks[at.peer_id].get_nowait())
                    return any(pred(d) for d in seen[at.peer_id])
                return check

            # honest traffic flows: the grpo member's rollouts, the bootstrap's swarm notice
            await grpo.publish("rollouts", b"SNRS honest shard")
            await boot.announce("drain", trigger="test")
            await _until(arrived(boot, lambda d: (d.sender, d.topic, d.data) == (grpo.peer_id, "rollouts",
                                                                                 b"SNRS honest shard")),
                         15, "the grpo member's rollouts at the bootstrap")
            await _until(arrived(grpo, lambda d: d.sender == boot.peer_id and d.topic == "swarm"
                                 and d.notice.kind == "drain"), 15, "the bootstrap's drain notice at the grpo member")

            # a member of a role that may not publish rollouts: dropped before any work
            await boot.publish("rollouts", b"SNRS from a bootstrap")

            async def role_refused():
                snap = await grpo.refresh()
                return snap is not None and _dropped(snap, "rollouts").get("role_not_allowed", 0) >= 1
            await _until(role_refused, 15, "role_not_allowed at the grpo member")

            # the stranger: rollouts and notices, never delivered; banned after BAN threshold
            for k in range(4):
                await stranger.publish("rollouts", b"SNRS stranger %d" % k)
            await stranger.announce("drain", trigger="stranger")

            async def stranger_banned():
                snaps = [await b.refresh() for b in (grpo, boot)]
                return all(s is not None and stranger.peer_id in s.banned for s in snaps) and snaps
            snaps = await _until(stranger_banned, 60, "both members' sidecars to ban the stranger")
            for snap in snaps:
                assert _dropped(snap, "rollouts").get("not_member", 0) >= 1, _dropped(snap, "rollouts")
            # the sidecars' bans are the daemon side's too
            for b in (grpo, boot):
                assert b.gate.bans.is_banned(stranger.peer_id)
            for k in range(3):   # its connections are closed; whatever still arrives is dropped
                try:
                    await stranger.publish("rollouts", b"SNRS after the ban %d" % k)
                except Exception:  # noqa: BLE001 - no mesh left is fine too
                    pass
            await asyncio.sleep(2.0)

            # reachability: the stranger probed both members and told them they are reachable;
            # only the other member's report counts
            async def reporters():
                snap = await grpo.refresh()
                ids = list(snap.self_reachability.reporter_ids) if snap is not None else []
                return ids if boot.peer_id in ids else None
            ids = await _until(reporters, 30, "the bootstrap member's reachability report at the grpo member")
            assert stranger.peer_id not in ids, ids
            st = grpo.status()
            assert st["reached_by"].endswith("/1"), st

            # nothing from the stranger, nor the bootstrap's rollouts, ever reached a subscriber
            for peer, sink in sinks.items():
                got = seen[peer]
                while not sink.empty():
                    got.append(sink.get_nowait())
                assert not [d for d in got if d.sender == stranger.peer_id], (peer, got)
                assert not [d for d in got if d.sender == boot.peer_id and d.topic == "rollouts"], (peer, got)
            for r in readers:
                r.cancel()

    asyncio.run(main())
