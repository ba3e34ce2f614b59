"""Event bus on 127.0.0.1 with real sidecar processes (py-libp2p gossipsub) and real gRPC.

- the sidecar has no hivemind in ``sys.modules`` and its gossip peer ID is the DHT's;
- 4 buses: a message published on one reaches all others (median of 100 well under 1 s); a
  SIGKILLed sidecar is restarted by its supervisor and delivery resumes;
- a rogue libp2p peer's oversized, forged, unsigned and malformed messages are dropped,
  counted per reason, and never reach a subscriber; its score falls under the publish
  threshold, so its next well-formed message is ignored too;
- four full nodes (daemons): peers found through the cards' gossip addresses, the bus keeps
  the DHT's peer ID, a node whose announced address is dead is told what to fix (/readyz and
  `swarmnode status`), a SIGKILLed sidecar is restarted by its daemon (/readyz, metrics) and
  receives again, and a draining node's notice reaches its peers long before its card expires.

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
            old_pid, old_peer_id = victim.proc.pid, victim.peer_id
            os.kill(old_pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not (victim.up and victim.proc.pid != old_pid):
                assert time.monotonic() < deadline, victim.status()
                await asyncio.sleep(0.1)
            assert victim.restarts == 1 and victim.peer_id == old_peer_id and victim.state == "up"
            assert await wait_mesh([victim], "rollouts", 1, 20), victim.status()
            # delivery resumes both ways through the restarted sidecar (its old subscription stream
            # died with it; messages() re-subscribed by itself)
            await asyncio.sleep(1.0)
            after = [await round_trip(src, b"after-restart-%d" % src) for src in (0, 1)]
            assert max(after) < 5
            for r in readers:
                r.cancel()

    asyncio.run(main())


def test_sidecar_that_cannot_start_gives_up_and_says_why(tmp_path):
    """Its port is taken: each start fails, the supervisor backs off, then gives up (state
    ``failed``, roles on the DHT) with an error naming the setting to change."""
    import socket

    from node.eventbus.client import EventBus, EventBusUnavailable, restart_delay
    from node.eventbus.config import EventBusConfig
    from security.keys import generate_key, write_key_file

    async def main():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            cfg = EventBusConfig(enabled=True, port=busy.getsockname()[1], restart_max=1)
            bus = EventBus(cfg, run_id="busy", key_path=str(write_key_file(tmp_path / "k.key", generate_key())),
                           listen_host="127.0.0.1")
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(bus.supervise(), 60)
                assert bus.state == "failed" and bus.finished and not bus.up, bus.status()
                assert "eventbus.port" in bus.status()["error"], bus.status()
                assert time.monotonic() - t0 >= restart_delay(1, cfg.restart_backoff_max_s)  # it backed off
                with pytest.raises(EventBusUnavailable, match="failed"):
                    await bus.publish("swarm", b"x")
                assert [d async for d in bus.messages()] == []   # ends at once: nothing comes back
            finally:
                await bus.stop()

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
                stream = ps.peers[target]
                # an honest message first: delivered
                await ps.write_msg(stream, rpc_pb2.RPC(publish=[msg(rollouts, b"rogue-before", 1)]))
                await trio.sleep(0.5)
                bad = [msg(rollouts, b"x" * (args["cap"] + 1000), 10 + k) for k in range(args["oversize"])]
                bad += [msg(rollouts, b"forged", 20, from_id=victim),                # signed by the wrong key
                        msg(rollouts, b"unsigned", 21, sign=False),                  # no signature
                        msg(swarm, b"\\xc1 not a notice", 22)]                       # malformed notice
                # then, within a heartbeat or two (scores decay), a well-formed one: its sender's
                # score is now under eventbus.publish_threshold, so it is ignored
                for m in bad + [msg(rollouts, b"rogue-after", 30)]:
                    await ps.write_msg(stream, rpc_pb2.RPC(publish=[m]))
                await trio.sleep(1.0)
                print("SENT", flush=True)

    trio.run(main)
''')


def test_rogue_messages_dropped_counted_and_penalised(tmp_path):
    async def main():
        async with local_buses(2, tmp_path, run_id="rogue", invalid_message_penalty=10.0,
                               publish_threshold=-50.0) as buses:
            target, other = buses
            sink: asyncio.Queue = asyncio.Queue()
            readers = [asyncio.ensure_future(_collect(target, "rollouts", sink)),
                       asyncio.ensure_future(_collect(target, "swarm", sink))]
            script = tmp_path / "rogue.py"
            script.write_text(ROGUE)
            # 6 oversize + forged + unsigned = -80 on rollouts at 10 per message: under -50
            args = {"target": target.peer_id, "addr": target.advertised_addrs[0], "victim": other.peer_id,
                    "cap": target.cfg.rollouts_max_bytes, "oversize": 6,
                    "topics": [full_topic("rogue", "rollouts"), full_topic("rogue", "swarm")]}
            proc = await asyncio.create_subprocess_exec(sys.executable, str(script), json.dumps(args), cwd=ROOT,
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert b"SENT" in out, err.decode()[-3000:]
            snap = await target.refresh()
            dropped = {t.topic: dict(t.dropped) for t in snap.topics}
            assert dropped["rollouts"].get("oversize", 0) == 6, dropped
            assert dropped["rollouts"].get("forged", 0) == 1, dropped
            assert dropped["rollouts"].get("unsigned", 0) == 1, dropped
            assert dropped["swarm"].get("invalid", 0) == 1, dropped
            assert dropped["rollouts"].get("score_gate", 0) == 1, dropped   # the penalised sender's next one
            await asyncio.sleep(0.5)
            got = []
            while not sink.empty():
                got.append(sink.get_nowait()[1])
            # only the rogue's message from before its bad ones got through
            assert [(d.topic, d.data) for d in got if d.sender != other.peer_id] == [("rollouts", b"rogue-before")], got
            # the counts are on /metrics too (the daemon's registry)
            from prometheus_client import generate_latest

            from node.metrics import REGISTRY
            text = generate_latest(REGISTRY).decode()
            for reason in ("forged", "oversize", "unsigned", "score_gate"):
                assert f'swarmnode_eventbus_messages_dropped_total{{reason="{reason}",topic="rollouts"}}' in text
            # honest peers are not affected
            await other.publish("rollouts", b"honest")
            _, d = await asyncio.wait_for(sink.get(), 5)
            assert (d.sender, d.data) == (other.peer_id, b"honest")
            for r in readers:
                r.cancel()

    asyncio.run(main())


def test_nodes_discover_probe_restart_and_drain(tmp_path):
    """Four real nodes: peers found from cards, the bus keeps the DHT's peer ID, an unreachable
    node is told what to fix (in /readyz and `swarmnode status`), a SIGKILLed sidecar is
    restarted by its daemon and still receives, and a draining node's notice beats its card."""
    from node.localswarm import LocalSwarm, free_port

    dead = f"/ip4/127.0.0.1/tcp/{free_port()}"   # nobody listens there
    ttl = 20.0
    common = ["eventbus.enabled=true", "eventbus.port=0", "eventbus.probe_interval_s=2", "eventbus.probe_timeout_s=2",
              f"card.ttl_s={ttl:g}", "card.refresh_s=2", "drain.budget_s=10"]
    with LocalSwarm(run_id="busnodes", workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        a = swarm.start("bootstrap", name="node-a")
        b = swarm.start("bootstrap", name="node-b")
        c = swarm.start("bootstrap", name="node-c", extra_set=[f'eventbus.announce_addrs=["{dead}"]'])
        nodes = (boot, a, b, c)
        swarm.wait_ready(list(nodes[1:]), timeout=90)

        def bus(node):
            return ((node.readyz() or {}).get("details") or {}).get("eventbus") or {}

        def meshed(x):
            return x.get("state") == "up" and x.get("mesh_peers", {}).get("swarm", 0) >= 1

        def reached(x):
            done, _, total = x.get("reached_by", "0/0").partition("/")
            return int(done) >= 1

        def probed(x, reachable):
            return x.get("probed_peers") == 3 and x.get("reachable_peers") == reachable

        deadline = time.monotonic() + 60
        while True:  # gossip addrs from cards, meshed, probed; c's announced address is dead
            d = [bus(n) for n in nodes]
            if (all(meshed(x) for x in d) and all(reached(x) and probed(x, 2) for x in d[:3])
                    and probed(d[3], 3) and dead in d[3].get("hint", "")):
                break
            assert time.monotonic() < deadline, (json.dumps(d, indent=1), c.log_text()[-2000:])
            time.sleep(0.5)
        for n, x in zip(nodes, d):
            assert x["peer_id"] == n.peer_id, (n.name, x)   # the gossip identity is the DHT's
        assert "eventbus.announce_addrs" in d[3]["hint"] and not reached(d[3])
        m = b.metrics()
        assert m.get('swarmnode_eventbus_mesh_peers{topic="swarm"}', 0) >= 1, m
        assert m.get("swarmnode_eventbus_reachable_peers", 0) >= 2, m
        assert m.get('swarmnode_eventbus_messages_received_total{topic="swarm"}', 0) >= 1, m  # probe notices

        # `swarmnode status` shows every node's reachability and tells c what to fix
        out = subprocess.run([sys.executable, "-m", "node.cli", "status", "--initial-peers", swarm.bootstrap_maddr,
                              "--run-id", "busnodes", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        rows = {r["peer_id"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
        assert set(rows) == {n.peer_id for n in nodes}, rows
        assert dead in rows[c.peer_id]["bus_hint"] and "eventbus.announce_addrs" in rows[c.peer_id]["bus_hint"]
        assert not any("bus_hint" in rows[n.peer_id] for n in nodes[:3]), rows

        # SIGKILL b's sidecar by its PID: b's daemon restarts it, reports it, and b still receives
        old_pid = d[2]["pid"]
        assert old_pid and "node.eventbus.sidecar" in Path(f"/proc/{old_pid}/cmdline").read_text()
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 40
        while True:
            x = bus(b)
            if x.get("restarts") == 1 and x.get("pid") not in (None, old_pid) and meshed(x):
                break
            assert time.monotonic() < deadline, (x, b.log_text()[-2000:])
            time.sleep(0.3)
        assert b.metrics().get("swarmnode_eventbus_sidecar_restarts_total") == 1.0
        assert b.alive() and (b.readyz() or {}).get("ready"), "a sidecar crash must not take the node down"

        key = 'swarmnode_eventbus_notices_received_total{kind="drain"}'
        before = {n.name: n.metrics().get(key, 0.0) for n in (b, c)}
        t_term = time.monotonic()
        swarm.signal(a, signal.SIGTERM)
        seen: dict[str, float] = {}
        while len(seen) < 2:
            for n in (b, c):
                if n.name not in seen and n.metrics().get(key, 0.0) > before[n.name]:
                    seen[n.name] = time.monotonic() - t_term
            assert time.monotonic() - t_term < 8, (seen, b.log_text()[-3000:])
            time.sleep(0.05)
        print(f"drain notice seen {', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in seen.items())} after SIGTERM")
        # a's last READY card lives card.ttl_s after its last refresh: the notice beats it by far
        assert max(seen.values()) < ttl / 4
        assert '"event": "peer_notice"' in b.log_text()
        assert swarm.wait_exit(a, 20) == 0, a.log_text()[-3000:]
