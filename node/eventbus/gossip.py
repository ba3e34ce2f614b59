"""py-libp2p's gossipsub as the sidecar runs it: counted drops, one signature check, cached peer
records, our peer-score parameters, and the router + pubsub built from ``[eventbus]``.

Owns every adaptation of py-libp2p 0.8.1 (subclasses and the module globals it looks up per
call, patched in the sidecar process only, never in the installed package): each message py-libp2p
would drop silently is counted under a reason; unsigned or forged messages also cost their
forwarder score (gossipsub v1.1 P4), as do those the topic validators refuse.

Runs only in the sidecar process (imports libp2p; never hivemind: docs/security.md, 'Process separation').
"""

from __future__ import annotations

import collections
import functools
import time
from typing import TYPE_CHECKING, Any

from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as gossipsub_module
from libp2p.pubsub import pubsub as pubsub_module
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.pubsub.utils import maybe_consume_signed_record
from libp2p.pubsub.validators import signature_validator

from node.eventbus.config import EventBusConfig

if TYPE_CHECKING:  # pragma: no cover
    from node.eventbus.sidecar import Bus

#: A neighbour's unchanged signed peer record is re-verified (and its addresses' TTL refreshed)
#: at most this often; py-libp2p verifies it on every RPC, twice for RPCs with control parts.
_RECORD_RECHECK_S = 60.0


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
    forged (and penalises the neighbour), from a peer that is not a member allowed on the topic
(``Bus.screen``, before anything else looks at it) or banned, below the score gate, and those lost in the outbound
    queue of a neighbour whose stream died. It also verifies each signature once, not twice."""

    bus: "Bus"

    async def push_msg(self, msg_forwarder: ID, msg: Any) -> None:
        mine = msg_forwarder == self.my_id
        if not mine and (self.is_peer_blacklisted(msg_forwarder) or self.is_peer_blacklisted(ID(msg.from_id))):
            for tid in msg.topicIDs:  # py-libp2p's own check (next) would drop it without a trace
                self.bus.stats.drop(self.bus.names.get(tid, "unknown"), "banned")
            return
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
            if not self.bus.screen(msg_forwarder, msg):  # not a member allowed on the topic
                self._mark_msg_seen(msg)  # its other copies are dropped as seen, not charged again
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


def score_params(cfg: EventBusConfig) -> ScoreParams:
    return ScoreParams(
        p4_invalid_messages=TopicScoreParams(weight=cfg.invalid_message_penalty, cap=1000.0, decay=0.9),
        p5_behavior_penalty_weight=1.0, p5_behavior_penalty_decay=0.9, p5_behavior_penalty_threshold=10.0,
        p7_ip_colocation_weight=1.0, p7_ip_colocation_threshold=16,
        publish_threshold=cfg.publish_threshold, gossip_threshold=cfg.publish_threshold / 5,
        graylist_threshold=cfg.graylist_threshold, accept_px_threshold=0.0)


def build(host: Any, cfg: EventBusConfig, bus: "Bus", max_message_bytes: int) -> tuple[CheckedPubsub, "CountingGossipSub"]:
    """The pubsub and its gossipsub v1.1 router for ``host`` (start both as Trio services)."""
    # py-libp2p makes each neighbour's outbound queue with RpcQueue() (32 RPCs, then drops)
    pubsub_module.RpcQueue = functools.partial(RpcQueue, max_size=cfg.outbound_queue)
    # module globals py-libp2p looks up per call (see RecordCache and _signature_once for why)
    records = RecordCache(bus)
    pubsub_module.maybe_consume_signed_record = records
    gossipsub_module.maybe_consume_signed_record = records
    pubsub_module.signature_validator = _signature_once
    router = CountingGossipSub([PROTOCOL_ID_V11], degree=cfg.degree, degree_low=cfg.degree_low,
                               degree_high=cfg.degree_high,
                               heartbeat_interval=cfg.heartbeat_s,  # type: ignore[arg-type]
                               score_params=score_params(cfg),
                               max_messages_per_topic_per_second=cfg.max_messages_per_peer_per_s,
                               eclipse_protection_enabled=False)  # colocated test swarms; P7 scores IP colocation
    pubsub = CheckedPubsub(host, router, strict_signing=True, cache_size=4096,
                           max_inbound_rpc_size=max_message_bytes * 4 + 64 * 1024)
    pubsub.bus = router.bus = bus
    # py-libp2p starts seqnos at int(time()): a sidecar restarted within seconds would reuse the
    # seqnos of its last life, and peers' seen-caches would drop its messages as duplicates
    pubsub.counter = time.time_ns()
    return pubsub, router
