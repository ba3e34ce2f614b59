"""Event-bus series on the node's registry (``node.metrics.REGISTRY``).

Owns: messages published / received / dropped per topic (the sidecar's counters, kept
monotonic across sidecar restarts by folding each dead sidecar's last snapshot into a base,
plus drops made by the daemon's own re-check), mesh peers per topic, reachable peers, whether
the sidecar is up, sidecar restarts and notices seen. Values are read at scrape time from the
client's cached snapshot (refreshed by ``EventBus.poll``): a scrape never waits on the sidecar.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from node.metrics import REGISTRY

if TYPE_CHECKING:  # pragma: no cover
    from node.eventbus.client import EventBus

RESTARTS = Counter("swarmnode_eventbus_sidecar_restarts", "Event-bus sidecar restarts after it died.",
                   registry=REGISTRY)
NOTICES = Counter("swarmnode_eventbus_notices_received", "Verified swarm notices from peers.", ["kind"],
                  registry=REGISTRY)


class BusCounters:
    """Counts that outlive one sidecar process."""

    def __init__(self) -> None:
        self.published: collections.Counter = collections.Counter()
        self.received: collections.Counter = collections.Counter()
        self.dropped: collections.Counter = collections.Counter()   # (topic, reason) -> n
        self._lock = threading.Lock()

    def fold(self, snap: Any) -> None:
        """Add a (dead) sidecar's last counters to the base."""
        if snap is None:
            return
        with self._lock:
            for t in snap.topics:
                self.published[t.topic] += t.published
                self.received[t.topic] += t.received
                for reason, n in t.dropped.items():
                    self.dropped[(t.topic, reason)] += n

    def local_drop(self, topic: str, reason: str) -> None:
        with self._lock:
            self.dropped[(topic, f"local_{reason}")] += 1

    def totals(self, snap: Any) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
        with self._lock:
            pub, rec, drop = collections.Counter(self.published), collections.Counter(self.received), \
                collections.Counter(self.dropped)
        if snap is not None:
            for t in snap.topics:
                pub[t.topic] += t.published
                rec[t.topic] += t.received
                for reason, n in t.dropped.items():
                    drop[(t.topic, reason)] += n
        return pub, rec, drop


class _BusCollector(Collector):
    def __init__(self) -> None:
        self.buses: "weakref.WeakSet[EventBus]" = weakref.WeakSet()

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        pub_f = CounterMetricFamily("swarmnode_eventbus_messages_published", "Messages this node gossiped.",
                                    labels=["topic"])
        rec_f = CounterMetricFamily("swarmnode_eventbus_messages_received", "Messages received from peers.",
                                    labels=["topic"])
        drop_f = CounterMetricFamily("swarmnode_eventbus_messages_dropped",
                                     "Messages dropped: oversize, unsigned, forged, invalid, slow_subscriber; "
                                     "not_member, role_not_allowed, members_unknown, banned (the sender rule); "
                                     "local_* = by the daemon's re-check.", labels=["topic", "reason"])
        mesh_f = GaugeMetricFamily("swarmnode_eventbus_mesh_peers", "Gossipsub mesh peers per topic.",
                                   labels=["topic"])
        reach_f = GaugeMetricFamily("swarmnode_eventbus_reachable_peers",
                                    "Known peers whose gossip address this node could dial (last probe).")
        up_f = GaugeMetricFamily("swarmnode_eventbus_up", "1 while the event-bus sidecar serves.")
        pub, rec, drop = collections.Counter(), collections.Counter(), collections.Counter()
        mesh: collections.Counter = collections.Counter()
        reachable = up = 0
        for bus in list(self.buses):
            snap = bus.snapshot()
            p, r, d = bus.counters.totals(snap)
            pub.update(p)
            rec.update(r)
            drop.update(d)
            up += 1 if bus.up else 0
            if snap is not None:
                for t in snap.topics:
                    mesh[t.topic] += t.mesh_peers
                reachable += sum(1 for pr in snap.probes if pr.reachable)
        for topic in sorted(set(pub) | set(rec) | set(mesh)):
            pub_f.add_metric([topic], pub[topic])
            rec_f.add_metric([topic], rec[topic])
            mesh_f.add_metric([topic], mesh[topic])
        for (topic, reason), n in sorted(drop.items()):
            drop_f.add_metric([topic, reason], n)
        reach_f.add_metric([], reachable)
        up_f.add_metric([], up)
        yield from (pub_f, rec_f, drop_f, mesh_f, reach_f, up_f)


_COLLECTOR = _BusCollector()
REGISTRY.register(_COLLECTOR)


def register(bus: "EventBus") -> None:
    _COLLECTOR.buses.add(bus)


def unregister(bus: "EventBus") -> None:
    _COLLECTOR.buses.discard(bus)
