"""Discrete-event simulator of one SkipPipe iteration (docs/pipeline.md, 'Scheduler').

Owns `simulate`: given a `Cluster` and one node path per microbatch, it predicts the iteration
makespan, per-node busy/idle time, queueing delay and deferrals, using the official semantics
with a priority queue instead of the official 10,000-bucket sweep (pinned against the authors'
published times by tests/unit/test_pipeline_official_schedule.py). It does not choose paths
(pipeline/schedule.py) and knows nothing of the network or torch.

Semantics, per microbatch with node path [o, n1, ..., n_{L-1}] (o = its stage-0 originator):
forward w[o] at o, then w[n_i] at each hop, back to o for the loss (0.25 w[o]), then backward
1.5 w down the exact reversed path (each gradient goes to the hop's predecessor), ending with
1.5 w[o] at o. Each hop's send costs c[x][y]; with `Cluster.latency` a link serialises its
messages for their transfer time and overlaps their latencies (as node/netem.py emulates). A node computes one thing at a time (TC2), taking
ready work in (ready time, arrival) order; a forward needs a free slot of the node's memory
window (a slot is held from that hop's forward start to its backward end) and is deferred until
one frees (TC1; backwards and the loss never wait for a slot). After each compute the node
stays busy for `gap_local` (next hop on the same node) or `gap_network` seconds, or, with
`gap_inject`, that long after an originator's first forward of a microbatch whatever comes next
(the authors' runtime: 0.09 s after an injection, 0.13 s after anything else; see
pipeline/official_schedule.py). Makespan = the latest backward completion at any originator.
All microbatches of an origin are ready at t = 0, in their order in `paths`; `ready_at[x]`
delays node x's first compute (and an origin's microbatches) to that time; `release[m]` delays
microbatch m's injection to that time; `after[m] = a` holds it until microbatch a's last
backward is home (a path carrying several microbatches back to back, as the official scheduler
plans them: pipeline/schedule.py, `PathRules.mb_per_path`).

`iteration_period` [ours: the paper's simulator stops at the makespan] chains iterations: each
node takes the next iteration's work only after it aggregated (its last compute and every
origin's EndOfIteration in) and received its replicas' gradients (`Cluster.grad_s`); the period
is the time between successive iteration starts, what a swarm measures step to step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.cluster import Cluster

FWD, LOSS, BWD = "F", "LOSS", "B"


class SimulationDeadlock(RuntimeError):
    """Every remaining forward waits for a memory slot held by a microbatch that cannot finish."""


@dataclass
class SimResult:
    makespan: float
    busy_s: dict[int, float]
    """Compute seconds per node that appears in a path."""
    idle_s: dict[int, float]
    """makespan - busy seconds, per node that appears in a path."""
    idle_fraction: float
    """Sum of idle seconds / (nodes x makespan)."""
    queueing_s: float
    """Sum over all computes of (start - ready)."""
    deferred: int
    """Forwards that found their node's memory window full at least once (TC1)."""
    max_in_flight: dict[int, int]
    intervals: dict[int, list[tuple[float, float, str, int, int]]] = field(repr=False)
    """Per node: (start, end, kind, microbatch, hop) of every compute, in start order."""
    completion: list[float] = field(repr=False, default_factory=list)
    """Per microbatch: when its last backward finished at the originator."""

    @property
    def mean_completion(self) -> float:
        return sum(self.completion) / max(1, len(self.completion))


def simulate(cluster: Cluster, paths: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], *,
             gap_local: float = 0.0, gap_network: float = 0.0, gap_inject: float | None = None,
             exclusive: bool = True, ready_at: dict[int, float] | None = None,
             release: Sequence[float] | None = None,
             after: Sequence[int | None] | None = None) -> SimResult:
    """Simulate one iteration. `exclusive=False` lets a node overlap computes (no collision
    model: the "non-ca" estimate); every real prediction uses the default True. `ready_at`:
    a node computes nothing before its time (missing nodes: 0). `gap_inject`: the gap after an
    originator's first forward (None: the local/network rule). `release` (seconds per
    microbatch) and `after` (per microbatch: the index of an earlier microbatch of the same
    originator that must be home first, or None) shape when each microbatch is injected."""
    paths = [tuple(p) for p in paths]
    for m, p in enumerate(paths):
        if len(p) < 2:
            raise ValueError(f"microbatch {m}: path {list(p)} needs an originator and >= 1 hop")
        if any(not 0 <= x < cluster.n for x in p):
            raise ValueError(f"microbatch {m}: path {list(p)} names a node outside "
                             f"[0, {cluster.n})")
    release = [0.0] * len(paths) if release is None else [float(t) for t in release]
    after = [None] * len(paths) if after is None else list(after)
    if len(release) != len(paths) or len(after) != len(paths):
        raise ValueError(f"release ({len(release)}) and after ({len(after)}) need one entry per "
                         f"microbatch ({len(paths)})")
    for m, a in enumerate(after):
        if a is not None and not (0 <= a < len(paths) and a != m and paths[a][0] == paths[m][0]):
            raise ValueError(f"microbatch {m}: after={a} must name another microbatch of the "
                             f"same originator {paths[m][0]}")
    followers: dict[int, list[int]] = {}
    for m, a in enumerate(after):
        if a is not None:
            followers.setdefault(a, []).append(m)
    nodes = sorted({x for p in paths for x in p})
    ready: dict[int, list[tuple[float, int, tuple]]] = {x: [] for x in nodes}
    running = {x: 0 for x in nodes}
    in_flight = {x: 0 for x in nodes}
    max_in_flight = {x: 0 for x in nodes}
    busy = {x: 0.0 for x in nodes}
    intervals: dict[int, list] = {x: [] for x in nodes}
    completion = [0.0] * len(paths)
    deferred: set[tuple[int, int]] = set()
    queueing = 0.0
    events: list[tuple] = []
    seq = 0

    def push(t: float, kind: str, x: int, task: tuple | None = None) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, x, task))
        seq += 1

    link_free: dict[tuple[int, int], float] = {}

    def arrival(x: int, y: int, t: float) -> float:
        """When a message sent at `t` from x reaches y (a link with `latency` is a FIFO pipe)."""
        if not cluster.latency or x == y:
            return t + cluster.send_s(x, y)
        lat = cluster.latency[x][y]
        start = max(t, link_free.get((x, y), 0.0))
        link_free[(x, y)] = start + cluster.comm[x][y] - lat
        return link_free[(x, y)] + lat

    def duration(x: int, kind: str) -> float:
        if kind == FWD:
            return cluster.forward_s(x)
        return cluster.loss_s(x) if kind == LOSS else cluster.backward_s(x)

    def next_task(task: tuple) -> tuple | None:
        """(node, task) of the compute that follows `task`, or None when the microbatch is done."""
        m, hop, kind = task
        path = paths[m]
        if kind == FWD:
            if hop + 1 < len(path):
                return path[hop + 1], (m, hop + 1, FWD)
            return path[0], (m, 0, LOSS)
        if kind == LOSS:
            return path[-1], (m, len(path) - 1, BWD)
        return (path[hop - 1], (m, hop - 1, BWD)) if hop > 0 else None

    def try_start(x: int, t: float) -> None:
        nonlocal queueing
        while ready[x] and (not exclusive or running[x] == 0):
            pick = None
            for i, (rt, s, task) in enumerate(ready[x]):
                if task[2] == FWD and in_flight[x] >= cluster.memory[x]:
                    deferred.add((task[0], task[1]))
                    continue
                if pick is None or (rt, s) < ready[x][pick][:2]:
                    pick = i
            if pick is None:
                return
            rt, _, task = ready[x].pop(pick)
            if task[2] == FWD:
                in_flight[x] += 1
                max_in_flight[x] = max(max_in_flight[x], in_flight[x])
            end = t + duration(x, task[2])
            queueing += t - rt
            running[x] += 1
            intervals[x].append((t, end, task[2], task[0], task[1]))
            busy[x] += end - t
            push(end, "done", x, task)

    ready_at = ready_at or {}
    for x in nodes:
        if ready_at.get(x, 0.0) > 0:       # busy until then: a "free" event releases it
            running[x] += 1
            push(ready_at[x], "free", x)
    for m, p in enumerate(paths):
        if after[m] is None:
            push(max(ready_at.get(p[0], 0.0), release[m]), "arrive", p[0], (m, 0, FWD))
    done = 0
    while events:
        t, _, kind, x, task = heapq.heappop(events)
        if kind == "arrive":
            ready[x].append((t, seq, task))
            seq += 1
            try_start(x, t)
        elif kind == "free":
            running[x] -= 1
            try_start(x, t)
        else:                                           # a compute finished
            if task[2] == BWD:
                in_flight[x] -= 1
            nxt = next_task(task)
            if nxt is None:
                completion[task[0]] = t
                done += 1
                for m in followers.get(task[0], ()):         # the path's next microbatch
                    push(max(t, release[m]), "arrive", x, (m, 0, FWD))
                gap = gap_local
            else:
                y, ntask = nxt
                push(arrival(x, y, t), "arrive", y, ntask)
                gap = gap_local if y == x else gap_network
            if gap_inject is not None and task[2] == FWD and task[1] == 0:
                gap = gap_inject
            if gap > 0:
                push(t + gap, "free", x)
            else:
                running[x] -= 1
                try_start(x, t)
    if done < len(paths):
        stuck = {x: [task for _, _, task in ready[x]] for x in nodes if ready[x]}
        raise SimulationDeadlock(
            f"{len(paths) - done} of {len(paths)} microbatches never finished: forwards wait for "
            f"memory slots held by microbatches that cannot progress (waiting per node: "
            f"{ {x: len(v) for x, v in stuck.items()} }). Raise memory, or keep crossed swapped "
            "paths within the memory cap (PathRules.cap_visits_by_memory), or make `after` acyclic")
    makespan = max(completion) if completion else 0.0
    idle = {x: max(0.0, makespan - busy[x] - ready_at.get(x, 0.0)) for x in nodes}
    frac = sum(idle.values()) / (len(nodes) * makespan) if makespan > 0 else 0.0
    return SimResult(makespan=makespan, busy_s=busy, idle_s=idle, idle_fraction=frac,
                     queueing_s=queueing, deferred=len(deferred), max_in_flight=max_in_flight,
                     intervals=intervals, completion=completion)


@dataclass
class PeriodResult:
    period: float
    """Seconds between successive iteration starts in steady state (mean over the chained
    iterations after the first)."""
    makespan: float
    """The first iteration's makespan (every node free at its start: `simulate`'s figure)."""
    idle_fraction: float
    """Idle share of the period over the nodes on some path (steady state)."""
    periods: list[float] = field(default_factory=list)


def iteration_period(cluster: Cluster, paths, groups, *, iterations: int = 4,
                     after: Sequence[int | None] | None = None) -> PeriodResult:
    """Chain `iterations` simulated iterations (module doc). `groups`: the nodes of each stage
    (the schedule's partitions; group 0 = the origins). Node x aggregates at agg[x] = max(its
    last compute, every origin's completion + that origin's EndOfIteration latency to x) and
    steps at max(agg[x], agg[y] + grad_s[y][x] for every replica y); the next iteration starts
    at the earliest origin's step, and every node is ready at its own step. `after`: as in
    `simulate`."""
    if iterations < 2:
        raise ValueError(f"iterations={iterations}: need >= 2 to measure a period")
    groups = [tuple(g) for g in groups]
    origins = groups[0]
    nodes = sorted({x for g in groups for x in g})
    ready: dict[int, float] = {}
    periods, busy, first = [], 0.0, None
    for _ in range(iterations):
        r = simulate(cluster, paths, ready_at=ready, after=after)
        first = r if first is None else first
        done = {o: max((r.completion[m] for m, p in enumerate(paths) if p[0] == o), default=0.0) for o in origins}
        last = {x: max((end for _, end, *_ in r.intervals.get(x, ())), default=ready.get(x, 0.0)) for x in nodes}
        agg = {x: max(last[x], max(done[o] + cluster.latency_s(o, x) for o in origins)) for x in nodes}
        step = {}
        for g in groups:
            for x in g:
                grad = [agg[y] + cluster.grad_s[y][x] for y in g if y != x] if cluster.grad_s else []
                step[x] = max([agg[x], *grad])
        start = min(step[o] for o in origins)
        ready = {x: t - start for x, t in step.items()}
        periods.append(start)
        busy = sum(r.busy_s.values())
    steady = periods[1:]
    period = sum(steady) / len(steady)
    active = len(first.busy_s)
    return PeriodResult(period=period, makespan=first.makespan,
                        idle_fraction=max(0.0, 1 - busy / (active * period)) if period > 0 else 0.0,
                        periods=periods)
