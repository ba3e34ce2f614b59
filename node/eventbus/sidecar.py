"""The event-bus sidecar: a py-libp2p gossipsub host in its own process, served to the daemon
over gRPC on a unix socket.

Runs as ``python -m node.eventbus.sidecar SPEC_JSON`` (started by ``node/eventbus/client.py``).
Owns, inside the child: the libp2p host built from the node's own Ed25519 key file (same peer
ID as the DHT), the run's topics and their validators (drop oversized or malformed messages;
py-libp2p then penalises the neighbour that sent them), the sender rule (``Bus.screen``: only
members the daemon names may publish, each on its topics; repeat offenders are banned), delivery to local subscribers,
dialling the peers the daemon passes in (from their node cards), and the local ``EventBus``
gRPC service. The gossipsub adaptations live in ``gossip``, the reachability prober in ``reach``.

Process rules: this module NEVER imports hivemind, directly or through other ``node`` modules
(only ``node.eventbus.config``/``wire``/``gossip``/``reach``/``members``, ``security.keys``,
``security.limits`` and ``protocol.eventbus_pb2*``): hivemind and py-libp2p register the same protobuf symbols
(docs/security.md, 'Process separation'). The child exits when its stdin closes (the daemon died), so it never
outlives its node.

Threads: Trio runs libp2p on the main thread; the gRPC server's worker threads call into it with
``trio.from_thread`` and receive deliveries through per-subscriber ``queue.Queue``s.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import secrets
import sys
import threading
import time
from concurrent import futures
from contextlib import AsyncExitStack
from typing import Any

import grpc
import multiaddr
import trio
from cryptography.hazmat.primitives import serialization
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service

from node.eventbus import gossip
from node.eventbus.config import TOPICS, EventBusConfig
from node.eventbus.members import BusMembers
from node.eventbus.reach import Prober
from node.eventbus.wire import NoticeError, decode_notice, full_topic
from protocol import eventbus_pb2, eventbus_pb2_grpc
from security.keys import load_key_file
from security.limits import BanList

log = logging.getLogger("swarmnode.eventbus.sidecar")
READY_PREFIX = "EVENTBUS_READY "
ERROR_PREFIX = "EVENTBUS_ERROR "
#: The peer with the larger ID waits this long before dialling a newly known peer, so that two
#: nodes told of each other at once do not both dial (one connection per pair, not two).
_DIAL_DEFER_S = 2.0


class SidecarError(RuntimeError):
    """The sidecar cannot serve; the message says what to change (shown by the daemon)."""


class Bus:
    """Everything the sidecar keeps; methods ending in ``_sync`` run on the Trio thread."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.cfg = EventBusConfig(**spec["eventbus"])
        self.run_id: str = spec["run_id"]
        self.caps = self.cfg.caps()
        self.topic_ids = {name: full_topic(self.run_id, name) for name in TOPICS}
        self.names = {v: k for k, v in self.topic_ids.items()}
        self.stats = gossip.Stats()
        self.subscribers: list[tuple[frozenset[str], queue.Queue]] = []
        self.sub_lock = threading.Lock()
        self.known: dict[str, list[str]] = {}
        self.dial_fail: dict[str, tuple[int, float]] = {}
        self.first_known: dict[str, float] = {}
        self.prober: Prober | None = None
        self.forwarders: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.host: Any = None
        self.pubsub: gossip.CheckedPubsub | None = None
        self.router: gossip.CountingGossipSub | None = None
        self.peer_id = ""
        self.listen_addrs: list[str] = []
        self.advertised: list[str] = []
        self.wake = trio.Event()
        self.token: Any = None
        self.publish_lock = trio.Lock()
        self.my_id_bytes = b""
        # the sender rule (node/eventbus/members.py): on in every node; off only for a bus without a
        # swarm (node/eventbus/localbus.py: benchmarks and transport tests)
        self.members_only = bool(spec.get("members_only", False))
        self.members = BusMembers()
        ban = spec.get("ban") or {}
        self.bans = BanList(threshold=int(ban.get("threshold", 20)), window_s=float(ban.get("window_s", 60.0)),
                            ban_s=float(ban.get("ban_s", 600.0)))
        self.daemon_banned: set[str] = set()

    # ---- validation ----
    def reject(self, forwarder: ID, topic_ids: list[str], reason: str) -> None:
        for tid in topic_ids:
            self.stats.drop(self.names.get(tid, "unknown"), reason)
            if self.router is not None and self.cfg.invalid_message_penalty > 0:
                self.router.scorer.on_invalid_message(forwarder, tid)
        log.info("dropped a %s message from %s on %s", reason, forwarder, topic_ids)

    def screen(self, forwarder: ID, msg: Any) -> bool:
        """The sender rule, before any other work on a signed message (its signature is verified):
        True when its originator may publish on its topic. Otherwise the drop is counted under the
        reason; a sender that is known not to be allowed is charged a strike (banned after
        ``limits.ban_threshold`` in ``limits.ban_window_s``: blacklisted, its connection closed),
        and a neighbour that originated the message itself also loses gossipsub score."""
        if not self.members_only:
            return True
        origin = ID(msg.from_id).to_base58()
        reason = None
        for tid in msg.topicIDs:
            name = self.names.get(tid)
            if name is not None:
                reason = self.members.refusal(origin, name)
                if reason is not None:
                    break
        if reason is None:
            return True
        for tid in msg.topicIDs:
            self.stats.drop(self.names.get(tid, "unknown"), reason)
        if reason == "members_unknown":
            return False
        if self.router is not None and self.cfg.invalid_message_penalty > 0 and \
                forwarder.to_bytes() == bytes(msg.from_id):
            for tid in msg.topicIDs:
                self.router.scorer.on_invalid_message(forwarder, tid)
        if self.bans.record_rejection(origin, f"bus_{reason}"):
            log.warning("banned %s from the bus for %.0f s: repeated messages while %s", origin, self.bans.ban_s,
                        reason)
            self._sync_blacklist()
        return False

    def banned_ids(self) -> set[str]:
        return {str(k) for k in self.bans.banned()} | self.daemon_banned

    def _sync_blacklist(self) -> None:
        """py-libp2p's blacklist = our bans + the daemon's (expired ones are lifted)."""
        if self.pubsub is None:
            return
        want = set()
        for peer in self.banned_ids():
            try:
                want.add(ID.from_base58(peer))
            except Exception:  # noqa: BLE001 - not a peer ID (a banned IP from the daemon)
                continue
        have = self.pubsub.get_blacklisted_peers()
        for pid in have - want:
            self.pubsub.remove_from_blacklist(pid)
        for pid in want - have:
            self.pubsub.add_to_blacklist(pid)

    def set_members_sync(self, members: dict[str, list[str]], banned: list[str]) -> tuple[int, int]:
        self.members.replace(members)
        self.daemon_banned = set(banned)
        self._sync_blacklist()
        return len(members), len(self.pubsub.get_blacklisted_peers()) if self.pubsub is not None else 0

    def validator(self, name: str):
        cap = self.caps[name]

        def validate(forwarder: ID, msg: Any) -> bool:
            # py-libp2p penalises the forwarder (P4 invalid messages) when this returns False
            if len(msg.data) > cap:
                self.stats.drop(name, "oversize")
                return False
            if name == "swarm":
                try:
                    notice = decode_notice(msg.data, self.run_id, cap)
                except NoticeError:
                    self.stats.drop(name, "invalid")
                    return False
                if notice.sender != ID(msg.from_id).to_base58():
                    self.stats.drop(name, "invalid")  # speaks for someone else
                    return False
            return True

        return validate

    def note_forwarder(self, msg: Any, forwarder: ID) -> None:
        key = bytes(msg.from_id) + bytes(msg.seqno)
        if key not in self.forwarders:
            self.forwarders[key] = forwarder.to_base58()
            while len(self.forwarders) > 4096:
                self.forwarders.popitem(last=False)

    # ---- delivery to local subscribers ----
    def fan_out(self, name: str, msg: Any) -> None:
        key = bytes(msg.from_id) + bytes(msg.seqno)
        out = eventbus_pb2.BusMessage(topic=name, data=msg.data, from_peer=msg.from_id, seqno=msg.seqno,
                                      signature=msg.signature, full_topic=self.topic_ids[name],
                                      forwarder=self.forwarders.get(key, ""), received_at=time.time())
        with self.sub_lock:
            subs = list(self.subscribers)
        for topics, q in subs:
            if topics and name not in topics:
                continue
            try:
                q.put_nowait(out)
            except queue.Full:
                try:
                    q.get_nowait()
                except queue.Empty:
                    pass
                self.stats.drop(name, "slow_subscriber")
                q.put_nowait(out)

    def deliver(self, name: str, msg: Any) -> None:
        """A validated message on one of our topics (called from ``CheckedPubsub``, Trio thread)."""
        if bytes(msg.from_id) == self.my_id_bytes:
            return
        self.stats.received[name] += 1
        if name == "swarm":
            self._on_swarm_notice(msg)
        self.fan_out(name, msg)

    def _on_swarm_notice(self, msg: Any) -> None:
        try:
            notice = decode_notice(msg.data, self.run_id, self.caps["swarm"])
        except NoticeError:
            return
        if notice.kind == "reachability" and self.prober is not None:
            self.prober.on_notice(notice)

    # ---- publish ----
    async def publish(self, name: str, data: bytes) -> tuple[bytes, int]:
        assert self.pubsub is not None and self.router is not None
        tid = self.topic_ids[name]
        # one publish at a time (gRPC worker threads enter Trio concurrently), so the seqno read
        # here is the one publish() takes
        async with self.publish_lock:
            seqno = (self.pubsub.counter + 1).to_bytes(8, "big")  # what publish() is about to use
            await self.pubsub.publish(tid, data)
        self.stats.published[name] += 1
        return seqno, len(self.router.mesh.get(tid, ()))

    # ---- peers: dialling what the daemon passed in ----
    def set_peers_sync(self, peers: dict[str, list[str]]) -> tuple[int, int]:
        self.known = {p: a for p, a in peers.items() if p != self.peer_id and a}
        now = time.monotonic()
        self.first_known = {p: self.first_known.get(p, now) for p in self.known}
        for p in list(self.dial_fail):
            if p not in self.known:
                del self.dial_fail[p]
        if self.prober is not None:
            self.prober.forget(self.known)
        self.wake.set()
        connected = sum(1 for p in self.known if self._connected(p))
        return len(self.known), connected

    def _connected(self, peer: str) -> bool:
        try:
            return bool(self.host.get_network().get_connections(ID.from_base58(peer)))
        except Exception:  # noqa: BLE001 - a malformed peer ID is simply not connected
            return False

    async def connect_loop(self) -> None:
        while True:
            now = time.monotonic()
            async with trio.open_nursery() as n:
                for peer, addrs in list(self.known.items()):
                    fails, next_at = self.dial_fail.get(peer, (0, 0.0))
                    if self._connected(peer) or now < next_at:
                        continue
                    if (not fails and peer > self.peer_id
                            and now < self.first_known.get(peer, 0.0) + _DIAL_DEFER_S):
                        continue  # it dials us first; we dial it only if that has not happened
                    n.start_soon(self._connect_one, peer, addrs)
            self.wake = trio.Event()
            with trio.move_on_after(_DIAL_DEFER_S / 2):
                await self.wake.wait()

    async def _connect_one(self, peer: str, addrs: list[str]) -> None:
        try:
            info = PeerInfo(ID.from_base58(peer), [multiaddr.Multiaddr(a) for a in addrs])
            with trio.fail_after(self.cfg.probe_timeout_s):
                await self.host.connect(info)
            self.dial_fail.pop(peer, None)
        except BaseException as exc:  # noqa: BLE001 - retried with backoff
            if isinstance(exc, trio.Cancelled):
                raise
            fails = self.dial_fail.get(peer, (0, 0.0))[0] + 1
            self.dial_fail[peer] = (fails, time.monotonic() + min(60.0, 0.5 * 2 ** fails))

    # ---- snapshot for Peers ----
    def peers_sync(self) -> eventbus_pb2.PeersReply:
        assert self.router is not None and self.pubsub is not None
        reply = eventbus_pb2.PeersReply(peer_id=self.peer_id, listen_addrs=self.listen_addrs,
                                        advertised_addrs=self.advertised, known_peers=len(self.known),
                                        banned=sorted(str(k) for k in self.bans.banned()))
        reply.connected.extend(sorted(p.to_base58() for p in self.host.get_connected_peers()))
        for name, tid in self.topic_ids.items():
            ts = reply.topics.add(topic=name, mesh_peers=len(self.router.mesh.get(tid, ())),
                                  subscribed_peers=len(self.pubsub.peer_topics.get(tid, ())),
                                  published=self.stats.published[name], received=self.stats.received[name])
            for reason, count in self.stats.dropped[name].items():
                ts.dropped[reason] = count
        if self.prober is not None:
            for r in self.prober.probes.values():
                reply.probes.add(**r)
            reply.self_reachability.CopyFrom(self.prober.self_reachability())
        return reply


class Servicer(eventbus_pb2_grpc.EventBusServicer):
    """The local gRPC service; every method runs on a gRPC worker thread."""

    def __init__(self, bus: Bus):
        self.bus = bus

    def _topic(self, name: str, context: grpc.ServicerContext) -> str:
        if name not in self.bus.topic_ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown topic {name!r}; topics are {', '.join(TOPICS)}")
        return name

    def Publish(self, request, context):  # noqa: N802 - gRPC API
        name = self._topic(request.topic, context)
        cap = self.bus.caps[name]
        if len(request.data) > cap:
            self.bus.stats.drop(name, "oversize")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"message of {len(request.data)} bytes is over the {name} topic's cap of {cap} bytes "
                          f"(eventbus.{name}_max_bytes); send large payloads through the DHT index + Fetch")
        try:
            seqno, mesh = trio.from_thread.run(self.bus.publish, name, request.data, trio_token=self.bus.token)
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "event-bus sidecar is stopping")
        return eventbus_pb2.PublishReply(seqno=seqno, mesh_peers=mesh)

    def Subscribe(self, request, context):  # noqa: N802
        topics = frozenset(self._topic(t, context) for t in request.topics)
        q: queue.Queue = queue.Queue(maxsize=self.bus.cfg.subscriber_queue)
        entry = (topics, q)
        with self.bus.sub_lock:
            self.bus.subscribers.append(entry)
        context.add_callback(lambda: q.put(None) if not q.full() else None)
        try:
            while context.is_active():
                try:
                    item = q.get(timeout=1.0)
                except queue.Empty:
                    continue
                if item is None:
                    return
                yield item
        finally:
            with self.bus.sub_lock:
                if entry in self.bus.subscribers:
                    self.bus.subscribers.remove(entry)

    def Peers(self, request, context):  # noqa: N802
        try:
            return trio.from_thread.run_sync(self.bus.peers_sync, trio_token=self.bus.token)
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "event-bus sidecar is stopping")

    def SetPeers(self, request, context):  # noqa: N802
        peers = {p.peer_id: list(p.addrs)[:8] for p in request.peers[:4096]}
        for pid, addrs in peers.items():
            for a in addrs:
                try:
                    multiaddr.Multiaddr(a)
                    ID.from_base58(pid)
                except Exception:  # noqa: BLE001
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad peer address {pid}: {a!r}")
        try:
            known, connected = trio.from_thread.run_sync(self.bus.set_peers_sync, peers, trio_token=self.bus.token)
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "event-bus sidecar is stopping")
        return eventbus_pb2.SetPeersReply(known=known, connected=connected)

    def SetMembers(self, request, context):  # noqa: N802
        members = {m.peer_id: [t for t in m.topics if t in self.bus.topic_ids][:8] for m in request.members[:65536]}
        banned = list(request.banned[:65536])
        try:
            n, b = trio.from_thread.run_sync(self.bus.set_members_sync, members, banned, trio_token=self.bus.token)
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "event-bus sidecar is stopping")
        return eventbus_pb2.SetMembersReply(members=n, banned=b)


def _seed(key_path: str, allow_insecure: bool) -> bytes:
    key = load_key_file(key_path, allow_insecure_mode=allow_insecure)
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


#: Set once the daemon has asked us to stop (stdin closed): errors py-libp2p raises while its
#: services tear down after that (messages still arriving on closing connections) are noise.
_STOP_REQUESTED = [False]


async def _watch_stdin(cancel: trio.CancelScope) -> None:
    """The daemon holds our stdin open; EOF means it is gone (or stopping us): stop."""
    await trio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
    log.info("daemon went away (stdin closed): stopping")
    _STOP_REQUESTED[0] = True
    cancel.cancel()


async def serve(spec: dict[str, Any]) -> None:
    bus = Bus(spec)
    cfg = bus.cfg
    seed = _seed(spec["key_path"], spec.get("allow_insecure_key", False))
    host_ip = spec["listen_host"]
    proto = "ip6" if ":" in host_ip else "ip4"
    listen = [multiaddr.Multiaddr(f"/{proto}/{host_ip}/tcp/{cfg.port}")]
    host = new_host(key_pair=create_new_key_pair(seed), listen_addrs=listen)
    probe_listen = [multiaddr.Multiaddr(f"/{proto}/{'127.0.0.1' if proto == 'ip4' else '::1'}/tcp/0")]
    probe_host = new_host(key_pair=create_new_key_pair(secrets.token_bytes(32)), listen_addrs=probe_listen)
    server = None
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(host.run(listen))
        await stack.enter_async_context(probe_host.run(probe_listen))
        pubsub, router = gossip.build(host, cfg, bus, max(bus.caps.values()))
        bus.host, bus.pubsub, bus.router = host, pubsub, router
        bus.prober = Prober(bus, probe_host)
        bus.peer_id = host.get_id().to_base58()
        bus.my_id_bytes = host.get_id().to_bytes()
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await pubsub.wait_until_ready()
        subs = {}
        for name, tid in bus.topic_ids.items():
            pubsub.set_topic_validator(tid, bus.validator(name), False)
            subs[name] = await pubsub.subscribe(tid)  # joins the mesh; deliveries: notify_subscriptions
        bus.listen_addrs = [str(a).split("/p2p/")[0] for a in host.get_addrs()]
        if not bus.listen_addrs:  # py-libp2p logs a failed listen and carries on without one
            raise SidecarError(f"cannot listen on {listen[0]} (port taken?): free TCP port {cfg.port} or set "
                               "another eventbus.port")
        bus.advertised = list(spec.get("announce_addrs") or []) or [
            a.replace("/0.0.0.0/", f"/{spec.get('advertise_host') or '127.0.0.1'}/") for a in bus.listen_addrs]
        bus.token = trio.lowlevel.current_trio_token()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="eventbus-grpc"),
                             options=[("grpc.max_receive_message_length", 2 * max(bus.caps.values()) + 4096),
                                      ("grpc.max_send_message_length", 2 * max(bus.caps.values()) + 4096)])
        eventbus_pb2_grpc.add_EventBusServicer_to_server(Servicer(bus), server)
        sock = spec["socket_path"]
        if os.path.exists(sock):
            os.unlink(sock)
        if server.add_insecure_port(f"unix:{sock}") == 0:
            raise RuntimeError(f"cannot listen on unix socket {sock}")
        server.start()
        os.chmod(sock, 0o600)
        print(READY_PREFIX + json.dumps({"peer_id": bus.peer_id, "listen_addrs": bus.listen_addrs,
                                         "advertised_addrs": bus.advertised, "pid": os.getpid(),
                                         "hivemind_loaded": "hivemind" in sys.modules}), flush=True)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(bus.connect_loop)
                nursery.start_soon(bus.prober.run)
                if spec.get("watch_stdin", True):
                    nursery.start_soon(_watch_stdin, nursery.cancel_scope)
        finally:
            server.stop(grace=0.5)
            with bus.sub_lock:
                for _, q in bus.subscribers:
                    try:
                        q.put_nowait(None)
                    except queue.Full:
                        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m node.eventbus.sidecar SPEC_JSON (started by the swarmnode daemon)", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    # py-libp2p's yamux sends a WINDOW_UPDATE frame (an encrypted write) after every read by
    # default; off, it batches them at half the window like go-yamux: a fifth less receiver CPU
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
    logging.basicConfig(level=logging.INFO if spec.get("verbose") else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s eventbus-sidecar %(levelname)s %(name)s: %(message)s")
    logging.getLogger("libp2p").setLevel(logging.DEBUG if spec.get("debug_libp2p") else logging.CRITICAL)
    assert "hivemind" not in sys.modules, "the event-bus sidecar must never import hivemind"
    try:
        trio.run(serve, spec)
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:  # noqa: BLE001 - Trio wraps it in exception groups
        reason = _sidecar_error(exc)
        if reason is None and _STOP_REQUESTED[0]:
            log.info("ignored while stopping: %r", exc)
            return 0
        if reason is None:
            raise
        print(ERROR_PREFIX + str(reason), flush=True)  # the daemon shows this line as the reason
        return 1
    return 0


def _sidecar_error(exc: BaseException) -> SidecarError | None:
    if isinstance(exc, SidecarError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _sidecar_error(inner)
        if found is not None:
            return found
    return None


if __name__ == "__main__":
    sys.exit(main())
