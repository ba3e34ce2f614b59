"""The swarm view: Prometheus series built from the run's node cards, served by the bootstrap.

A bootstrap node reads every live card each few seconds (``node/bootstrap_role.py``) and hands
them to :data:`CENSUS`; its ops HTTP serves the result at ``/metrics/swarm``. One scrape of the
bootstrap therefore shows the whole run, including workers behind NAT that Prometheus cannot
reach. Every series carries the bootstrap's ``run`` label:

- ``swarmnode_swarm_nodes{role,state}``: live cards by role and lifecycle state; every role seen
  since the bootstrap started keeps all four states, zeros included, so a "below N ready" alert
  still sees a role whose last node left (and a role never deployed raises nothing);
- ``swarmnode_swarm_joins_total{role}`` / ``swarmnode_swarm_leaves_total{role,how}``: peer IDs
  that appeared / disappeared between two reads; ``how`` is ``drained`` (its last card said
  draining or offline) or ``vanished`` (the card expired while joining or ready: a crash or an
  unannounced preemption);
- ``swarmnode_swarm_unreachable_nodes{role}``: nodes whose event-bus peers all failed to dial
  them (the ``bus_reach`` card detail, ``node/status.py``);
- ``swarmnode_swarm_card_info{peer_id,role,state,version}`` (= 1), ``swarmnode_swarm_card_age_seconds{peer_id,role}``
  and ``swarmnode_swarm_card_detail{peer_id,role,detail}``: one series per node and numeric card
  detail (round, stage, iteration, reward, ...). These carry the peer ID on purpose: this is a
  census of a few hundred nodes at most (cards are capped at 16 details), not a hot series;
- ``swarmnode_swarm_census_timestamp_seconds`` / ``swarmnode_swarm_census_failures_total``.

Scrapes read the latest snapshot only and never wait on the DHT. Card contents come from peers:
detail keys that are not short snake_case names and values that are not finite numbers are
skipped, so a peer cannot inject label junk.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from node.lifecycle import State
from node.status import bus_reach_hint

SWARM_REGISTRY = CollectorRegistry(auto_describe=True)
"""What ``/metrics/swarm`` serves (apart from the node's own ``/metrics`` registry)."""

STATES = tuple(s.value for s in State)
_DETAIL_KEY = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_GONE_DRAINED = ("draining", "offline")


def numeric_details(details: dict) -> dict[str, float]:
    """The card details a dashboard can plot: snake_case keys with finite int/float/bool values."""
    out = {}
    for key, value in details.items():
        if not isinstance(key, str) or not _DETAIL_KEY.match(key) or isinstance(value, str):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


@dataclass
class _Node:
    role: str
    state: str
    version: str
    age_s: float
    details: dict[str, float]
    unreachable: bool


@dataclass
class _Snapshot:
    run: str = ""
    nodes: dict[str, _Node] = field(default_factory=dict)
    at: float = 0.0


class SwarmCensus(Collector):
    """The latest read of the run's cards, as Prometheus series. ``update`` from the census loop,
    ``collect`` from the scrape thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap = _Snapshot()
        self._joins: Counter = Counter()              # role -> n
        self._leaves: Counter = Counter()             # (role, how) -> n
        self._failures = 0
        self._roles: set[str] = set()                 # every role seen since start
        self.active = False

    def describe(self) -> Iterable:
        return []

    def update(self, run: str, views: list, now: float | None = None) -> None:
        """A fresh read of run ``run``'s live cards (``node.card.read_cards``)."""
        now = time.time() if now is None else now
        nodes = {v.peer_id: _Node(role=v.card.role, state=v.card.state, version=v.card.version,
                                  age_s=max(0.0, now - v.card.published_at),
                                  details=numeric_details(v.card.details),
                                  unreachable=bool(bus_reach_hint(v.card.details)))
                 for v in views}
        with self._lock:
            before = self._snap.nodes
            for pid in nodes.keys() - before.keys():
                self._joins[nodes[pid].role] += 1
            for pid in before.keys() - nodes.keys():
                gone = before[pid]
                self._leaves[(gone.role, "drained" if gone.state in _GONE_DRAINED else "vanished")] += 1
            self._roles |= {n.role for n in nodes.values()}
            self._snap = _Snapshot(run=run, nodes=nodes, at=now)
            self.active = True

    def failed(self) -> None:
        """A census read failed (DHT busy or timing out); the previous snapshot stays served."""
        with self._lock:
            self._failures += 1

    def collect(self) -> Iterable:
        with self._lock:
            snap, joins, leaves, failures = self._snap, Counter(self._joins), Counter(self._leaves), self._failures
            roles = sorted(self._roles)
        run = snap.run
        by_state = Counter((n.role, n.state) for n in snap.nodes.values())
        nodes = GaugeMetricFamily("swarmnode_swarm_nodes", "Live node cards in the run by role and state.",
                                  labels=["run", "role", "state"])
        unreachable = GaugeMetricFamily("swarmnode_swarm_unreachable_nodes",
                                        "Nodes no event-bus peer could dial (card detail bus_reach 0/N).",
                                        labels=["run", "role"])
        joined = CounterMetricFamily("swarmnode_swarm_joins", "Peer IDs that appeared in the run's cards.",
                                     labels=["run", "role"])
        left = CounterMetricFamily("swarmnode_swarm_leaves", "Peer IDs whose card disappeared, by how: drained "
                                   "(last card draining/offline) or vanished (expired while joining/ready).",
                                   labels=["run", "role", "how"])
        for role in roles:
            for state in STATES:
                nodes.add_metric([run, role, state], by_state[(role, state)])
            unreachable.add_metric([run, role], sum(1 for n in snap.nodes.values() if n.role == role and n.unreachable))
            joined.add_metric([run, role], joins[role])
            for how in ("drained", "vanished"):
                left.add_metric([run, role, how], leaves[(role, how)])
        info = GaugeMetricFamily("swarmnode_swarm_card_info", "One series per live node card (value 1).",
                                 labels=["run", "peer_id", "role", "state", "version"])
        age = GaugeMetricFamily("swarmnode_swarm_card_age_seconds", "Seconds since the node last published its card.",
                                labels=["run", "peer_id", "role"])
        detail = GaugeMetricFamily("swarmnode_swarm_card_detail",
                                   "Numeric role details of each node's card (round, stage, iteration, reward, ...).",
                                   labels=["run", "peer_id", "role", "detail"])
        for pid, n in sorted(snap.nodes.items()):
            info.add_metric([run, pid, n.role, n.state, n.version], 1)
            age.add_metric([run, pid, n.role], round(n.age_s, 3))
            for key, value in sorted(n.details.items()):
                detail.add_metric([run, pid, n.role, key], value)
        stamp = GaugeMetricFamily("swarmnode_swarm_census_timestamp_seconds", "Unix time of the latest card read.",
                                  labels=["run"])
        stamp.add_metric([run], snap.at)
        fails = CounterMetricFamily("swarmnode_swarm_census_failures", "Card reads that failed (DHT busy or down).",
                                    labels=["run"])
        fails.add_metric([run], failures)
        yield from (nodes, unreachable, joined, left, info, age, detail, stamp, fails)


CENSUS = SwarmCensus()
SWARM_REGISTRY.register(CENSUS)
