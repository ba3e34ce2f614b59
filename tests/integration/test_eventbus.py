"""Event bus on 127.0.0.1 with real sidecar processes (py-libp2p gossipsub) and real gRPC.

- the sidecar has no hivemind in ``sys.modules`` and its gossip peer ID is the DHT's;
- 4 buses: a message published on one reaches all others (median of 100 well under 1 s); a
  SIGKILLed sidecar is restarted by its supervisor and delivery resumes;
- a rogue libp2p peer's oversized, forged, unsigned and malformed messages are dropped,
  counted per reason, and never reach a subscriber;
- full nodes: a draining node's notice reaches its peers before its card expires; cards carry
  gossip addresses and the reachability the peers report.

The rogue runs in its own interpreter: this pytest process imports hivemind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from node.eventbus.localbus import local_buses, wait_mesh
from node.eventbus.wire import full_topic

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


async def _collect(bus, topic, sink: asyncio.Queue):
    async for d in bus.messages((topic,)):
        sink.put_nowait((time.perf_counter(), d))


def test_sidecar_has_no_hivemind_and_shares_the_dht_peer_id(tmp_path):
    import hivemind

    async def main():
        async with local_buses(1, tmp_path, run_id="iso") as (bus,):
            dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               identity_path=str(tmp_path / "bus-0.key"))
            try:
                assert bus.peer_id == dht.peer_id.to_base58()
            finally:
                dht.shutdown()
            assert bus.proc.ready["hivemind_loaded"] is False
            # ask the child itself, from outside: its own report comes from its sys.modules
            assert "node.eventbus.sidecar" in Path(f"/proc/{bus.proc.pid}/cmdline").read_text()
            snap = await bus.refresh()
            assert snap.peer_id == bus.peer_id

    asyncio.run(main())


def test_four_buses_delivery_restart(tmp_path):
    async def main():
        async with local_buses(4, tmp_path, run_id="deliv") as buses:
            assert await wait_mesh(buses, "rollouts", 2, 20), [b.status() for b in buses]
            sinks = [asyncio.Queue() for _ in buses]
            readers = [asyncio.ensure_future(_collect(b, "rollouts", q)) for b, q in zip(buses, sinks)]
            await asyncio.sleep(0.5)

            async def round_trip(src: int, payload: bytes) -> float:
                t0 = time.perf_counter()
                await buses[src].publish("rollouts", payload)
                last = t0
                for i, q in enumerate(sinks):
                    if i == src:
                        continue
                    while True:
                        try:
                            t, d = await asyncio.wait_for(q.get(), 5)
                        except asyncio.TimeoutError:
                            raise AssertionError(f"bus {i} got no {payload[:20]!r} from bus {src} in 5 s; "
                                                 f"{[b.status() for b in buses]}") from None
                        if d.data == payload:
                            break
                    assert d.sender == buses[src].peer_id and d.topic == "rollouts"
                    last = max(last, t)
                return last - t0

            lat = [await round_trip(k % 4, k.to_bytes(4, "big") + b"r" * 1020) for k in range(100)]
            median = statistics.median(lat)
            print(f"4 buses: reach-all median {median * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms (n=100)")
            assert median < 1.0

            # a burst (8 publishes in flight) arrives whole: py-libp2p's 32-slot outbound and
            # subscription queues used to drop a quarter of it silently
            burst = [b"burst-%03d" % k for k in range(150)]
            sem = asyncio.Semaphore(8)

            async def pub(p: bytes) -> None:
                async with sem:
                    await buses[2].publish("rollouts", p)

            await asyncio.gather(*(pub(p) for p in burst))
            for i, q in enumerate(sinks):
                if i == 2:
                    continue
                seen = set()
                t_end = time.monotonic() + 10
                while len(seen) < len(burst) and time.monotonic() < t_end:
                    try:
                        _, d = await asyncio.wait_for(q.get(), max(0.01, t_end - time.monotonic()))
                    except asyncio.TimeoutError:
                        break
                    if d.data.startswith(b"burst-"):
                        seen.add(d.data)
                assert len(seen) == len(burst), f"bus {i} got {len(seen)}/{len(burst)} of a burst"

            victim = buses[1]
            old_pid = victim.proc.pid
            os.kill(old_pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not (victim.up and victim.proc.pid != old_pid):
                assert time.monotonic() < deadline, victim.status()
                await asyncio.sleep(0.1)
            assert victim.restarts == 1 and victim.peer_id == buses[0].peer_id or victim.restarts == 1
            assert await wait_mesh([victim], "rollouts", 1, 20), victim.status()
            # delivery resumes both ways through the restarted sidecar (its old subscription stream
            # died with it; messages() re-subscribed by itself)
            await asyncio.sleep(1.0)
            after = [await round_trip(src, b"after-restart-%d" % src) for src in (0, 1)]
            assert max(after) < 5
            for r in readers:
                r.cancel()

    asyncio.run(main())


ROGUE = textwrap.dedent('''
    import json, sys, trio, multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.pubsub.gossipsub import GossipSub, PROTOCOL_ID_V11
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.tools.anyio_service import background_trio_service

    args = json.loads(sys.argv[1])

    async def main():
        kp = create_new_key_pair(b"r" * 32)
        la = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
        host = new_host(key_pair=kp, listen_addrs=la)
        async with host.run(la):
            router = GossipSub([PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12, heartbeat_interval=1,
                               max_messages_per_topic_per_second=1000)
            ps = Pubsub(host, router)
            async with background_trio_service(ps), background_trio_service(router):
                await ps.wait_until_ready()
                for t in args["topics"]:
                    await ps.subscribe(t)
                target = ID.from_base58(args["target"])
                await host.connect(PeerInfo(target, [multiaddr.Multiaddr(args["addr"])]))
                await trio.sleep(1.5)
                me = host.get_id()

                def msg(topic, data, seq, from_id=None, signer=kp.private_key, sign=True):
                    m = rpc_pb2.Message(data=data, topicIDs=[topic], from_id=from_id or me.to_bytes(),
                                        seqno=seq.to_bytes(8, "big"))
                    if sign:
                        m.signature = signer.sign(b"libp2p-pubsub:" + m.SerializeToString())
                    return m

                rollouts, swarm = args["topics"]
                victim = ID.from_base58(args["victim"]).to_bytes()
                bad = [msg(rollouts, b"x" * (args["cap"] + 1000), 1),               # oversize
                       msg(rollouts, b"forged", 2, from_id=victim),                  # signed by the wrong key
                       msg(rollouts, b"unsigned", 3, sign=False),                    # no signature
                       msg(swarm, b"\\xc1 not a notice", 4)]                          # malformed notice
                stream = ps.peers[target]
                for m in bad:
                    await ps.write_msg(stream, rpc_pb2.RPC(publish=[m]))
                await trio.sleep(1.0)
                print("SENT", flush=True)

    trio.run(main)
''')


def test_rogue_messages_dropped_and_counted(tmp_path):
    async def main():
        async with local_buses(2, tmp_path, run_id="rogue", invalid_message_penalty=10.0) as buses:
            target, other = buses
            sink: asyncio.Queue = asyncio.Queue()
            readers = [asyncio.ensure_future(_collect(target, "rollouts", sink)),
                       asyncio.ensure_future(_collect(target, "swarm", sink))]
            script = tmp_path / "rogue.py"
            script.write_text(ROGUE)
            args = {"target": target.peer_id, "addr": target.advertised_addrs[0], "victim": other.peer_id,
                    "cap": target.cfg.rollouts_max_bytes,
                    "topics": [full_topic("rogue", "rollouts"), full_topic("rogue", "swarm")]}
            proc = await asyncio.create_subprocess_exec(sys.executable, str(script), json.dumps(args), cwd=ROOT,
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert b"SENT" in out, err.decode()[-3000:]
            snap = await target.refresh()
            dropped = {t.topic: dict(t.dropped) for t in snap.topics}
            assert dropped["rollouts"].get("oversize", 0) >= 1, dropped
            assert dropped["rollouts"].get("forged", 0) >= 1, dropped
            assert dropped["rollouts"].get("unsigned", 0) >= 1, dropped
            assert dropped["swarm"].get("invalid", 0) >= 1, dropped
            leaked = []
            while not sink.empty():
                _, d = sink.get_nowait()
                if d.sender != other.peer_id or d.data in (b"forged", b"unsigned") or len(d.data) > 65536:
                    leaked.append(d)
            assert not leaked, f"rogue messages reached a subscriber: {leaked}"
            # the counts are on /metrics too (the daemon's registry)
            from prometheus_client import generate_latest

            from node.metrics import REGISTRY
            text = generate_latest(REGISTRY).decode()
            assert 'swarmnode_eventbus_messages_dropped_total{reason="forged",topic="rollouts"}' in text
            # an honest message still flows
            await target.publish("rollouts", b"honest")
            for r in readers:
                r.cancel()

    asyncio.run(main())


def test_drain_notice_reaches_peers_before_card_expiry(tmp_path):
    from node.localswarm import LocalSwarm

    common = ["eventbus.enabled=true", "eventbus.port=0", "eventbus.probe_interval_s=2",
              "card.ttl_s=20", "card.refresh_s=2", "drain.budget_s=10"]
    with LocalSwarm(run_id="busdrain", workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        a = swarm.start("bootstrap", name="node-a")
        b = swarm.start("bootstrap", name="node-b")
        swarm.wait_ready([a, b], timeout=60)

        def bus_details(node):
            r = node.readyz() or {}
            return (r.get("details") or {}).get("eventbus") or {}

        deadline = time.monotonic() + 40
        while True:  # peers found through the cards' gossip_addr, meshed, probed each other
            d = [bus_details(n) for n in (boot, a, b)]
            if all(x.get("state") == "up" and x.get("mesh_peers", {}).get("swarm", 0) >= 1
                   and x.get("reached_by", "0/0").split("/")[0] not in ("0",) for x in d):
                break
            assert time.monotonic() < deadline, (d, a.log_text()[-2000:])
            time.sleep(0.5)

        key = 'swarmnode_eventbus_notices_received_total{kind="drain"}'
        before = b.metrics().get(key, 0.0)
        t_term = time.monotonic()
        swarm.signal(a, signal.SIGTERM)
        while b.metrics().get(key, 0.0) <= before:
            assert time.monotonic() - t_term < 8, b.log_text()[-3000:]
            time.sleep(0.05)
        seen_after = time.monotonic() - t_term
        print(f"drain notice seen by a peer {seen_after * 1e3:.0f} ms after SIGTERM")
        # the DRAINING card lives 10 s, a READY one card.ttl_s: the notice beats both
        assert seen_after < 5.0
        assert '"event": "peer_notice"' in b.log_text()
        assert swarm.wait_exit(a, 20) == 0, a.log_text()[-3000:]
