"""Cluster cost model for the SkipPipe scheduler and simulator (docs/pipeline.md, 'Terms').

Owns `Cluster`: per-node forward compute time `w[x]`, the per-send cost matrix `c[x][y]`, and the
per-node memory window; plus `comm_matrix`, which turns a latency/bandwidth matrix (as the
coordinator measures it or as `node/netem.py` configures it) into `c`. Pure Python: no torch, no
network. It does not own node identity (the coordinator maps node indices to peer IDs) nor how
`w` is measured.

Nodes are indices 0..N-1 into the matrices. Costs: forward `w[x]` for one
stage's layers, backward `1.5 w[x]`, loss `0.25 w[x]` at the originator; one activation (or
gradient) send `c[x][y] = latency + bytes / bandwidth (+ fixed)`.

Between iterations [ours; the paper's simulator ignores it]: a node aggregates once every
origin's EndOfIteration reached it, steps once every replica's gradient did (`grad_s`:
latency + gradient bytes / bandwidth), and only then takes the next iteration's work
(pipeline/simulator.py's `iteration_period`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

BACKWARD_FACTOR = 1.5
"""Backward time as a multiple of forward time (official emulation)."""
LOSS_FACTOR = 0.25
"""Loss (head forward + backward) time at the originator as a multiple of its forward time."""


class ClusterError(ValueError):
    """The cost model is malformed (wrong shape, negative time, no memory)."""


@dataclass(frozen=True)
class Cluster:
    """Costs of one swarm: `compute[x]` s per forward, `comm[x][y]` s per send, `memory[x]` slots."""

    compute: tuple[float, ...]
    comm: tuple[tuple[float, ...], ...]
    memory: tuple[int, ...]
    names: tuple[str, ...] = field(default=())
    latency: tuple[tuple[float, ...], ...] = field(default=())
    """Optional: the latency part of each `comm` entry. Given, a link carries one message at a
    time for `comm - latency` seconds (its bandwidth), and latencies of queued messages overlap
    (node/netem.py's MessageLink); empty: every send costs `comm` independently."""
    grad_s: tuple[tuple[float, ...], ...] = field(default=())
    """Optional: grad_s[y][x] = seconds node y's stage gradient takes to reach node x (latency +
    gradient bytes / bandwidth); used between replicas of a stage by
    `simulator.iteration_period`. Empty: iterations are modelled as independent."""

    def __post_init__(self) -> None:
        n = len(self.compute)
        if n == 0:
            raise ClusterError("cluster has no nodes; give at least one compute time")
        object.__setattr__(self, "compute", tuple(float(v) for v in self.compute))
        object.__setattr__(self, "comm", tuple(tuple(float(v) for v in row) for row in self.comm))
        mem = self.memory
        mem = (int(mem),) * n if isinstance(mem, (int, float)) else tuple(int(m) for m in mem)
        object.__setattr__(self, "memory", mem)
        if not self.names:
            object.__setattr__(self, "names", tuple(f"n{i}" for i in range(n)))
        if len(self.comm) != n or any(len(row) != n for row in self.comm):
            raise ClusterError(f"comm must be {n} x {n} to match compute (one row per node)")
        if len(self.memory) != n or len(self.names) != n:
            raise ClusterError(f"memory and names must have {n} entries, one per node")
        if self.latency:
            lat = tuple(tuple(float(v) for v in row) for row in self.latency)
            if len(lat) != n or any(len(row) != n for row in lat) or any(
                    not 0 <= lat[x][y] <= self.comm[x][y] + 1e-12 for x in range(n) for y in range(n) if x != y):
                raise ClusterError(f"latency must be {n} x {n} with 0 <= latency <= comm on every link")
            object.__setattr__(self, "latency", lat)
        if self.grad_s:
            grad = tuple(tuple(float(v) for v in row) for row in self.grad_s)
            if len(grad) != n or any(len(row) != n for row in grad) or any(
                    not math.isfinite(v) or v < 0 for row in grad for v in row):
                raise ClusterError(f"grad_s must be {n} x {n} finite seconds >= 0")
            object.__setattr__(self, "grad_s", grad)
        for x, w in enumerate(self.compute):
            if not math.isfinite(w) or w < 0:
                raise ClusterError(f"compute[{x}]={w} must be a finite number of seconds >= 0")
        for x, row in enumerate(self.comm):
            for y, v in enumerate(row):
                if not math.isfinite(v) or v < 0:
                    raise ClusterError(f"comm[{x}][{y}]={v} must be finite seconds >= 0")
        for x, m in enumerate(self.memory):
            if m < 1:
                raise ClusterError(f"memory[{x}]={m}: a node needs at least one microbatch slot")

    @property
    def has_sync(self) -> bool:
        """Whether the between-iteration costs are modelled (else iterations are independent)."""
        return bool(self.grad_s)

    def latency_s(self, x: int, y: int) -> float:
        """One small message's time x -> y (an EndOfIteration): the latency when known, else comm."""
        if x == y:
            return 0.0
        return self.latency[x][y] if self.latency else self.comm[x][y]

    @property
    def n(self) -> int:
        return len(self.compute)

    def forward_s(self, x: int) -> float:
        return self.compute[x]

    def backward_s(self, x: int) -> float:
        return BACKWARD_FACTOR * self.compute[x]

    def loss_s(self, x: int) -> float:
        return LOSS_FACTOR * self.compute[x]

    def send_s(self, x: int, y: int) -> float:
        return 0.0 if x == y else self.comm[x][y]

    def cost_hash(self) -> str:
        """sha256 of the canonical cost model (rounded to microseconds), for the schedule record."""
        body = {"compute": [round(v, 6) for v in self.compute],
                "comm": [[round(v, 6) for v in row] for row in self.comm],
                "memory": list(self.memory), "names": list(self.names)}
        for name in ("latency", "grad_s"):
            if getattr(self, name):
                body[name] = [[round(v, 6) for v in row] for row in getattr(self, name)]
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                              .encode()).hexdigest()


def comm_matrix(latency_s: list[list[float]], bandwidth_bps: list[list[float | None]] | None,
                activation_bytes: int, fixed_s: float = 0.0) -> tuple[tuple[float, ...], ...]:
    """c[x][y] = latency + activation_bytes / bandwidth + fixed_s; bandwidth in bytes/s
    (None or inf = unlimited); the diagonal is 0 (a node never sends to itself). The official
    scheduler adds a fixed 0.35 s per send (`fixed_s`) to cover serialisation."""
    n = len(latency_s)
    out = []
    for x in range(n):
        row = []
        for y in range(n):
            if x == y:
                row.append(0.0)
                continue
            bw = None if bandwidth_bps is None else bandwidth_bps[x][y]
            t = float(latency_s[x][y]) + fixed_s
            if bw is not None and math.isfinite(bw):
                if bw <= 0:
                    raise ClusterError(f"bandwidth[{x}][{y}]={bw} must be > 0 bytes/s")
                t += activation_bytes / bw
            row.append(t)
        out.append(tuple(row))
    return tuple(out)
