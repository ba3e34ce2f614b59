"""A geo-distributed cost model and the full / random / SkipPipe comparison (docs/pipeline.md, 'Scheduler' and 'Benchmarks').

Owns `REGIONS` (12 cloud regions modelled on the SkipPipe evaluation's locations, by
coordinates), a link model from great-circle distance (one-way latency = 2 ms + distance x 1.5
route factor / 200 km per ms; bandwidth = min(250 MB/s, 1.2 GB/s / latency_ms) across regions,
2 GB/s and 1 ms inside one), `geo_links` (latency ms / bandwidth Mbit/s matrices in the shape
`node/netem.py`'s `[netem.matrix]` takes), `geo_cluster` (the scheduler's `Cluster`) and
`compare` (simulated iteration time of the three schedules). Our own model, not measured pings:
label results from it *modelled*. Pure Python.

    python -m pipeline.geo                      # 20 nodes, S = 6, k = 1/3 (paper setting)
    python -m pipeline.geo --nodes 9 --parts 3,2,2,2 --S 4 --skip 0.3333   # 3 data + 3x2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from pipeline.allocation import allocate
from pipeline.cluster import Cluster, comm_matrix
from pipeline.paths import PathRules
from pipeline.search import full_pipeline_schedule, random_schedule, skippipe_schedule
from pipeline.simulator import simulate

REGIONS: dict[str, tuple[float, float]] = {
    "oregon": (45.6, -121.2), "los-angeles": (34.05, -118.24), "iowa": (41.26, -95.86),
    "montreal": (45.5, -73.6), "london": (51.5, -0.13), "belgium": (50.45, 3.82),
    "netherlands": (53.4, 6.8), "frankfurt": (50.1, 8.7), "singapore": (1.35, 103.8),
    "taiwan": (24.0, 120.5), "tokyo": (35.7, 139.7), "sydney": (-33.9, 151.2),
}
ACTIVATION_BYTES = 8 * 1024 * 1024 * 2
"""One microbatch's activations at paper scale: 8 samples x seq 1024 x d 1024 x bf16."""
FORWARD_S = 8 * 4 * 0.055
"""Forward of one 4-layer stage for 8 samples at the official emulation's 0.055 s/sample/layer."""
SPEED_CLASSES = (1.0, 0.7, 1.3, 0.85, 1.6)
"""Relative forward time of the GPU a node gets (heterogeneous compute), drawn per node."""


def _km(a: tuple[float, float], b: tuple[float, float]) -> float:
    la1, lo1, la2, lo2 = map(math.radians, (*a, *b))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    return 2 * 6371.0 * math.asin(math.sqrt(h))


def region_link(r1: str, r2: str) -> tuple[float, float]:
    """(one-way latency ms, bandwidth MB/s) between two regions (same region: 1 ms, 2 GB/s)."""
    if r1 == r2:
        return 1.0, 2000.0
    lat = 2.0 + _km(REGIONS[r1], REGIONS[r2]) * 1.5 / 200.0
    return lat, min(250.0, 1200.0 / lat)


def node_regions(n_nodes: int, regions: list[str] | None = None) -> list[str]:
    """Node i sits in region i mod len(regions) (the official id_to_loc placement)."""
    regions = list(regions or REGIONS)
    return [regions[i % len(regions)] for i in range(n_nodes)]


def geo_links(n_nodes: int, regions: list[str] | None = None) -> tuple[list, list]:
    """(latency_ms, bandwidth_mbps) N x N matrices for `[netem.matrix]` (diagonal 0 / inf)."""
    placed = node_regions(n_nodes, regions)
    lat = [[0.0] * n_nodes for _ in range(n_nodes)]
    bw = [[math.inf] * n_nodes for _ in range(n_nodes)]
    for i in range(n_nodes):
        for j in range(n_nodes):
            if i != j:
                ms, mbs = region_link(placed[i], placed[j])
                lat[i][j], bw[i][j] = ms, mbs * 8.0      # MB/s -> Mbit/s
    return lat, bw


def geo_cluster(n_nodes: int = 20, *, regions: list[str] | None = None, memory: int = 3,
                activation_bytes: int = ACTIVATION_BYTES, forward_s: float = FORWARD_S,
                heterogeneous: bool = True, seed: int = 0, fixed_s: float = 0.0) -> Cluster:
    """Cluster on the modelled geo links; node speeds drawn from SPEED_CLASSES by `seed`."""
    lat_ms, bw_mbps = geo_links(n_nodes, regions)
    lat_s = [[v / 1000.0 for v in row] for row in lat_ms]
    bw_bps = [[None if math.isinf(v) else v * 1e6 / 8 for v in row] for row in bw_mbps]
    rng = random.Random(seed)
    speed = [rng.choice(SPEED_CLASSES) if heterogeneous else 1.0 for _ in range(n_nodes)]
    placed = node_regions(n_nodes, regions)
    return Cluster(compute=tuple(forward_s * s for s in speed),
                   comm=comm_matrix(lat_s, bw_bps, activation_bytes, fixed_s),
                   memory=memory, names=tuple(f"{r}-{i}" for i, r in enumerate(placed)))


def compare(cluster: Cluster, parts: list[int], rules: PathRules, mb_per_origin: int, *,
            seed: int = 0, time_budget_s: float = 30.0, max_iters: int = 20000,
            patience: int = 3000) -> dict:
    """Simulated iteration time and idle fraction of full / random / SkipPipe on one allocation."""
    t0 = time.monotonic()
    partition = allocate(cluster, parts, seed=seed)
    t_alloc = time.monotonic() - t0
    full = full_pipeline_schedule(cluster, partition, mb_per_origin)
    rand = random_schedule(cluster, partition, rules, mb_per_origin, seed=seed)
    t0 = time.monotonic()
    skip = skippipe_schedule(cluster, partition, rules, mb_per_origin, seed=seed,
                             time_budget_s=time_budget_s, max_iters=max_iters, patience=patience)
    t_search = time.monotonic() - t0
    out = {"nodes": cluster.n, "S": rules.S, "L": rules.L, "skip_ratio": round(rules.skip_ratio, 4),
           "mb_per_origin": mb_per_origin, "partition": [list(g) for g in partition],
           "allocation_s": round(t_alloc, 3), "search_s": round(t_search, 3)}
    for name, sched in (("full", full), ("random", rand), ("skippipe", skip)):
        r = simulate(cluster, sched.paths)
        out[name] = {"makespan_s": round(r.makespan, 3), "idle_fraction": round(r.idle_fraction, 3)}
    out["ratio_skippipe_vs_full"] = round(skip.expected_makespan / full.expected_makespan, 3)
    out["ratio_skippipe_vs_random"] = round(skip.expected_makespan / rand.expected_makespan, 3)
    out["ratio_random_vs_full"] = round(rand.expected_makespan / full.expected_makespan, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--parts", default="5,3,3,3,3,3", help="nodes per stage, stage 0 first")
    ap.add_argument("--S", type=int, default=6)
    ap.add_argument("--skip", type=float, default=1 / 3)
    ap.add_argument("--mb-per-origin", type=int, default=3)
    ap.add_argument("--memory", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    parts = [int(p) for p in args.parts.split(",")]
    cluster = geo_cluster(args.nodes, memory=args.memory, seed=args.seed)
    rules = PathRules.from_skip_ratio(args.S, args.skip)
    print(json.dumps(compare(cluster, parts, rules, args.mb_per_origin, seed=args.seed,
                             time_budget_s=args.budget_s), indent=1))


if __name__ == "__main__":
    main()
