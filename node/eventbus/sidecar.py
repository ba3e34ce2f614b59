"""The event-bus sidecar: a py-libp2p gossipsub host in its own process, served to the daemon
over gRPC on a unix socket.

Runs as ``python -m node.eventbus.sidecar SPEC_JSON`` (started by ``node/eventbus/client.py``).
Owns, inside the child: the libp2p host built from the node's own Ed25519 key file (same peer
ID as the DHT), gossipsub v1.1 with peer scoring on the run's topics, the validators that drop
unsigned, forged, oversized or malformed messages and penalise the neighbour that sent them,
dialling the peers the daemon passes in (from their node cards), the reachability prober, and
the local ``EventBus`` gRPC service.

Process rules: this module NEVER imports hivemind, directly or through other ``node`` modules
(only ``node.eventbus.config``/``wire``, ``security.keys`` and ``protocol.eventbus_pb2*``):
hivemind and py-libp2p register the same protobuf symbols (security.md §10). The child exits
when its stdin closes (the daemon died), so it never outlives its node.

Threads: Trio runs libp2p on the main thread; the gRPC server's worker threads call into it with
``trio.from_thread`` and receive deliveries through per-subscriber ``queue.Queue``s.
"""

from __future__ import annotations

import collections
import functools
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
from libp2p.host.ping import PingService
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.pb.identify_pb2 import Identify as IdentifyMsg
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub import gossipsub as gossipsub_module
from libp2p.pubsub import pubsub as pubsub_module
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.utils import maybe_consume_signed_record
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.pubsub.validators import signature_validator
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import read_length_prefixed_protobuf

from node.eventbus.config import TOPICS, EventBusConfig
from node.eventbus.wire import NoticeError, decode_notice, encode_notice, full_topic
from protocol import eventbus_pb2, eventbus_pb2_grpc
from security.keys import load_key_file

log = logging.getLogger("swarmnode.eventbus.sidecar")
AGENT = "swarmnode-eventbus/1"
READY_PREFIX = "EVENTBUS_READY "
ERROR_PREFIX = "EVENTBUS_ERROR "
#: Reports about us older than this many probe intervals are forgotten.
_REPORT_WINDOW = 3.0
#: A neighbour's unchanged signed peer record is re-verified (and its addresses' TTL refreshed)
#: at most this often; py-libp2p verifies it on every RPC, twice for RPCs with control parts.
_RECORD_RECHECK_S = 60.0
#: The peer with the larger ID waits this long before dialling a newly known peer, so that two
#: nodes told of each other at once do not both dial (one connection per pair, not two).
_DIAL_DEFER_S = 2.0


class SidecarError(RuntimeError):
    """The sidecar cannot serve; the message says what to change (shown by the daemon)."""


class Stats:
    """Per-topic counters (read by Peers; the daemon turns them into Prometheus series)."""

    def __init__(self) -> None:
        self.published = collections.Counter()
        self.received = collections.Counter()
        self.dropped: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def drop(self, topic: str, reason: str) -> None:
        self.dropped[topic][reason] += 1


class CheckedPubsub(Pubsub):
    """Pubsub that counts every message py-libp2p would drop silently on receipt: unsigned or
    forged (and penalises the neighbour), below the score gate, and those lost in the outbound
    queue of a neighbour whose stream died. It also verifies each signature once, not twice."""

    bus: "Bus"

    async def push_msg(self, msg_forwarder: ID, msg: Any) -> None:
        mine = msg_forwarder == self.my_id
        if not mine and not self._is_msg_seen(msg):
            reason = None
            if not msg.signature:
                reason = "unsigned"
            else:
                try:
                    ok = signature_validator(msg)
                except Exception:  # noqa: BLE001 - a malformed key is a forgery too
                    ok = False
                if not ok:
                    reason = "forged"
            if reason is not None:
                self.bus.reject(msg_forwarder, list(msg.topicIDs), reason)
                return
            scorer = getattr(self.router, "scorer", None)
            if scorer is not None and not scorer.allow_publish(msg_forwarder, list(msg.topicIDs)):
                for tid in msg.topicIDs:  # py-libp2p's own gate (next) would drop it without a trace
                    self.bus.stats.drop(self.bus.names.get(tid, "unknown"), "score_gate")
                return
            self.bus.note_forwarder(msg, msg_forwarder)
        if mine or not self._is_msg_seen(msg):
            _VERIFIED[0] = msg  # checked above (or signed here): py-libp2p need not verify it again
        try:
            await super().push_msg(msg_forwarder, msg)
        finally:
            _VERIFIED[0] = None

    def notify_subscriptions(self, publish_message: Any) -> None:
        # hand deliveries to the bus synchronously: py-libp2p's own subscription channel holds 32
        # messages and silently drops the rest of a burst (a quarter of 100 back-to-back 1 KiB)
        for tid in publish_message.topicIDs:
            name = self.bus.names.get(tid)
            if name is not None:
                self.bus.deliver(name, publish_message)

    def _handle_dead_peer(self, peer_id: ID) -> None:
        # py-libp2p closes the neighbour's outbound queue and forgets what was still in it
        queue = self.peer_queues.get(peer_id) if peer_id in self.peers else None
        if queue is not None:
            pending = getattr(queue, "_queue", None)
            for rpc in list(getattr(pending, "_non_priority", ())) + list(getattr(pending, "_priority", ())):
                for m in rpc.publish:
                    for tid in m.topicIDs:
                        self.bus.stats.drop(self.bus.names.get(tid, "unknown"), "peer_gone")
        super()._handle_dead_peer(peer_id)


#: The message ``CheckedPubsub.push_msg`` has just verified (identity, not equality): py-libp2p's
#: own check of it, which follows synchronously, is skipped.
_VERIFIED: list[Any] = [None]


def _signature_once(msg: Any) -> bool:
    if msg is _VERIFIED[0]:
        return True
    return signature_validator(msg)


class RecordCache:
    """py-libp2p parses and verifies the sender's signed peer record on every inbound RPC (a
    quarter of a receiver's CPU in an 8-node burst) and silently drops the whole RPC when that
    fails. This accepts bytes identical to the record last accepted from that peer without
    re-verifying them (at most ``_RECORD_RECHECK_S``), and counts the RPCs py-libp2p drops."""

    def __init__(self, bus: "Bus"):
        self.bus = bus
        self.accepted: dict[ID, tuple[bytes, float]] = {}

    def __call__(self, msg: Any, host: Any, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        record = bytes(msg.senderRecord)
        now = time.monotonic()
        last = self.accepted.get(peer_id)
        if last is not None and last[0] == record and now - last[1] < _RECORD_RECHECK_S:
            return True
        ok = maybe_consume_signed_record(msg, host, peer_id)
        if ok:
            self.accepted[peer_id] = (record, now)
            if len(self.accepted) > 4096:
                self.accepted.pop(next(iter(self.accepted)))
        else:
            for m in msg.publish:
                for tid in m.topicIDs:
                    self.bus.stats.drop(self.bus.names.get(tid, "unknown"), "bad_peer_record")
        return ok


class CountingGossipSub(GossipSub):
    """GossipSub that counts the messages it drops: per-neighbour outbound queue full, and
    messages not forwarded (rate limit, equivocation)."""

    bus: "Bus"

    def _handle_dropped_rpc(self, peer_id: ID, rpc: Any, reason: str) -> None:
        for m in rpc.publish:
            for tid in m.topicIDs:
                self.bus.stats.drop(self.bus.names.get(tid, "unknown"), reason)
        super()._handle_dropped_rpc(peer_id, rpc, reason)

    def _check_spam_protection(self, peer_id: ID, msg: Any) -> bool:
        ok = super()._check_spam_protection(peer_id, msg)
        if not ok:  # delivered locally, but not forwarded
            for tid in msg.topicIDs:
                self.bus.stats.drop(self.bus.names.get(tid, "unknown"), "rate_limited")
        return ok

    def _check_equivocation(self, msg: Any) -> bool:
        ok = super()._check_equivocation(msg)
        if not ok:
            for tid in msg.topicIDs:
                self.bus.stats.drop(self.bus.names.get(tid, "unknown"), "equivocation")
        return ok


class Bus:
    """Everything the sidecar keeps; methods ending in ``_sync`` run on the Trio thread."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.cfg = EventBusConfig(**spec["eventbus"])
        self.run_id: str = spec["run_id"]
        self.caps = self.cfg.caps()
        self.topic_ids = {name: full_topic(self.run_id, name) for name in TOPICS}
        self.names = {v: k for k, v in self.topic_ids.items()}
        self.stats = Stats()
        self.subscribers: list[tuple[frozenset[str], queue.Queue]] = []
        self.sub_lock = threading.Lock()
        self.known: dict[str, list[str]] = {}
        self.dial_fail: dict[str, tuple[int, float]] = {}
        self.first_known: dict[str, float] = {}
        self.probes: dict[str, dict[str, Any]] = {}
        self.reports: dict[str, tuple[bool, list[str], str, float]] = {}  # reporter -> (ok, addrs, error, at)
        self.forwarders: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.host: Any = None
        self.pubsub: CheckedPubsub | None = None
        self.router: GossipSub | None = None
        self.peer_id = ""
        self.listen_addrs: list[str] = []
        self.advertised: list[str] = []
        self.wake = trio.Event()
        self.token: Any = None
        self.publish_lock = trio.Lock()
        self.my_id_bytes = b""

    # ---- validation ----
    def reject(self, forwarder: ID, topic_ids: list[str], reason: str) -> None:
        for tid in topic_ids:
            self.stats.drop(self.names.get(tid, "unknown"), reason)
            if self.router is not None and self.cfg.invalid_message_penalty > 0:
                self.router.scorer.on_invalid_message(forwarder, tid)
        log.info("dropped a %s message from %s on %s", reason, forwarder, topic_ids)

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
        if notice.kind != "reachability":
            return
        fields = notice.fields
        if self.peer_id in (fields.get("ok") or []):
            self.reports[notice.sender] = (True, [], "", time.time())
        fail = fields.get("fail") or {}
        if isinstance(fail, dict) and self.peer_id in fail:
            entry = fail[self.peer_id]
            addrs = [str(a) for a in entry[:1]] if isinstance(entry, list) else []
            err = str(entry[1]) if isinstance(entry, list) and len(entry) > 1 else ""
            self.reports[notice.sender] = (False, addrs, err, time.time())

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
        for p in list(self.probes):
            if p not in self.known:
                del self.probes[p]
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

    # ---- reachability ----
    async def probe_loop(self, probe_host: Any) -> None:
        await trio.sleep(min(2.0, self.cfg.probe_interval_s))
        while True:
            known = list(self.known.items())
            results: dict[str, dict[str, Any]] = {}
            async with trio.open_nursery() as n:
                for peer, addrs in known:
                    n.start_soon(self._probe_peer, probe_host, peer, addrs, results)
            self.probes.update(results)
            if results:
                await self._publish_reachability(results)
            await trio.sleep(self.cfg.probe_interval_s)

    async def _probe_peer(self, probe_host: Any, peer: str, addrs: list[str], out: dict) -> None:
        """Dial each advertised address from a throwaway host (so an existing connection, maybe
        one the peer opened to us, proves nothing), then ping and identify over it."""
        result: dict[str, Any] = {}
        for addr in addrs:
            result = await self._probe_addr(probe_host, peer, addr)
            if result["reachable"]:
                break
        out[peer] = result

    async def _probe_addr(self, probe_host: Any, peer: str, addr: str) -> dict[str, Any]:
        res: dict[str, Any] = {"peer_id": peer, "addr": addr, "reachable": False, "rtt_ms": 0.0, "agent": "",
                               "error": "", "checked_at": time.time()}
        network = probe_host.get_network()
        pid = None
        try:
            pid = ID.from_base58(peer)
            with trio.fail_after(self.cfg.probe_timeout_s):
                await network.dial_addr(multiaddr.Multiaddr(addr), pid)
                t0 = time.perf_counter()
                await PingService(probe_host).ping(pid, 1)
                res["rtt_ms"] = round((time.perf_counter() - t0) * 1000, 3)
                stream = await probe_host.new_stream(pid, [IDENTIFY_PROTOCOL])
                ident = IdentifyMsg()
                ident.ParseFromString(await read_length_prefixed_protobuf(stream, use_varint_format=True))
                res["agent"] = ident.agent_version[:64]
                if PROTOCOL_ID_V11 not in ident.protocols:
                    res["error"] = f"answers but does not speak {PROTOCOL_ID_V11}"
                    return res
            res["reachable"] = True
        except trio.TooSlowError:
            res["error"] = f"timeout {self.cfg.probe_timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - reported per address
            text = str(exc)
            if "handshake" in text or "security" in text:
                res["error"] = "another peer ID answers there (handshake failed)"
            elif "open connection" in text or "TCP" in text:
                res["error"] = "connection refused or no route"
            else:
                res["error"] = (text.splitlines()[0] if text else type(exc).__name__)[:120]
        finally:
            if pid is not None:
                with trio.move_on_after(1.0):
                    try:
                        await network.close_peer(pid)
                    except Exception:  # noqa: BLE001 - best effort
                        pass
        return res

    async def _publish_reachability(self, results: dict[str, dict[str, Any]]) -> None:
        ok = [p for p, r in results.items() if r["reachable"]]
        fail = {p: [r["addr"], r["error"]] for p, r in results.items() if not r["reachable"]}
        cap = self.caps["swarm"]
        while True:  # trim to the topic cap: failures first (they carry the hints), then successes
            data = encode_notice("reachability", self.run_id, self.peer_id, ok=ok, fail=fail)
            if len(data) <= cap or (not ok and not fail):
                break
            if ok:
                ok = ok[: len(ok) // 2]
            else:
                fail = dict(list(fail.items())[: len(fail) // 2])
        try:
            await self.publish("swarm", data)
        except Exception as exc:  # noqa: BLE001 - no mesh yet, etc.
            log.debug("reachability notice not sent: %r", exc)

    def self_reachability(self) -> eventbus_pb2.SelfReachability:
        horizon = time.time() - _REPORT_WINDOW * self.cfg.probe_interval_s - 5
        recent = {r: v for r, v in self.reports.items() if v[3] >= horizon}
        reached = sum(1 for v in recent.values() if v[0])
        failed_addrs = sorted({a for v in recent.values() if not v[0] for a in v[1]})
        hint = ""
        if recent and reached == 0:
            errors = sorted({v[2] for v in recent.values() if v[2]})
            port = self.cfg.port
            hint = (f"no peer could dial this node's gossip address {', '.join(failed_addrs) or self.advertised} "
                    f"({'; '.join(errors) or 'unreachable'}): open TCP port {port or 'eventbus.port'} to the swarm, "
                    "or set eventbus.announce_addrs (and advertise_host) to an address peers can reach")
        return eventbus_pb2.SelfReachability(reporters=len(recent), reached_by=reached,
                                             failed_addrs=failed_addrs, hint=hint)

    # ---- snapshot for Peers ----
    def peers_sync(self) -> eventbus_pb2.PeersReply:
        assert self.router is not None and self.pubsub is not None
        reply = eventbus_pb2.PeersReply(peer_id=self.peer_id, listen_addrs=self.listen_addrs,
                                        advertised_addrs=self.advertised, known_peers=len(self.known))
        reply.connected.extend(sorted(p.to_base58() for p in self.host.get_connected_peers()))
        for name, tid in self.topic_ids.items():
            ts = reply.topics.add(topic=name, mesh_peers=len(self.router.mesh.get(tid, ())),
                                  subscribed_peers=len(self.pubsub.peer_topics.get(tid, ())),
                                  published=self.stats.published[name], received=self.stats.received[name])
            for reason, count in self.stats.dropped[name].items():
                ts.dropped[reason] = count
        for r in self.probes.values():
            reply.probes.add(**r)
        reply.self_reachability.CopyFrom(self.self_reachability())
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


def _score_params(cfg: EventBusConfig) -> ScoreParams:
    return ScoreParams(
        p4_invalid_messages=TopicScoreParams(weight=cfg.invalid_message_penalty, cap=1000.0, decay=0.9),
        p5_behavior_penalty_weight=1.0, p5_behavior_penalty_decay=0.9, p5_behavior_penalty_threshold=10.0,
        p7_ip_colocation_weight=1.0, p7_ip_colocation_threshold=16,
        publish_threshold=cfg.publish_threshold, gossip_threshold=cfg.publish_threshold / 5,
        graylist_threshold=cfg.graylist_threshold, accept_px_threshold=0.0)


def _seed(key_path: str, allow_insecure: bool) -> bytes:
    key = load_key_file(key_path, allow_insecure_mode=allow_insecure)
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


async def _watch_stdin(cancel: trio.CancelScope) -> None:
    """The daemon holds our stdin open; EOF means it is gone: stop."""
    await trio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
    log.info("daemon went away (stdin closed): stopping")
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
        # py-libp2p makes each neighbour's outbound queue with RpcQueue() (32 RPCs, then drops)
        pubsub_module.RpcQueue = functools.partial(RpcQueue, max_size=cfg.outbound_queue)
        # module globals py-libp2p looks up per call; patched here, not in the installed package
        # (see RecordCache and _signature_once for why)
        records = RecordCache(bus)
        pubsub_module.maybe_consume_signed_record = records
        gossipsub_module.maybe_consume_signed_record = records
        pubsub_module.signature_validator = _signature_once
        router = CountingGossipSub([PROTOCOL_ID_V11], degree=cfg.degree, degree_low=cfg.degree_low,
                                   degree_high=cfg.degree_high,
                                   heartbeat_interval=cfg.heartbeat_s,  # type: ignore[arg-type]
                                   score_params=_score_params(cfg),
                                   max_messages_per_topic_per_second=cfg.max_messages_per_peer_per_s,
                                   eclipse_protection_enabled=False)  # colocated test swarms; P7 scores IP colocation
        pubsub = CheckedPubsub(host, router, strict_signing=True, cache_size=4096,
                               max_inbound_rpc_size=max(bus.caps.values()) * 4 + 64 * 1024)
        pubsub.bus = router.bus = bus
        # py-libp2p starts seqnos at int(time()): a sidecar restarted within seconds would reuse the
        # seqnos of its last life, and peers' seen-caches would drop its messages as duplicates
        pubsub.counter = time.time_ns()
        bus.host, bus.pubsub, bus.router = host, pubsub, router
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
                nursery.start_soon(bus.probe_loop, probe_host)
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
