"""The SkipPipe authors' schedule file, read as inputs to our simulator (docs/pipeline.md, 'Golden test').

Owns `OfficialRuntime` (the constants of the authors' single-process simulator,
`schedulers/com_sym.py` in github.com/gensyn-ai/skippipe) and `official_runs`, which turns the
JSON their `create_schedule.py` writes (`schedule.json` there; `tests/data/` holds a copy) into
one `OfficialRun` per schedule it holds: the cost model, one node path per microbatch, when
each microbatch may be injected and which earlier microbatch of its path must be home first,
and the time the authors' simulator predicted. `run.simulate()` feeds them to
pipeline/simulator.py. It does not plan (pipeline/search.py) or validate
(pipeline/schedule.py); pure Python, no I/O beyond `load`.

How the authors' script builds each schedule (create_schedule.py), reproduced here:

- every path (a scheduler "agent") carries two microbatches back to back: the second is
  injected only once the first's backward is home (com_sym.py keeps the first's id in
  `freed`); its release time is 2.5 s after the first's;
- ``non-ca`` / ``random``: three paths per data node (memory 3), released `k x compute_s`
  apart (k = the path's rank at its node, the agent's `dt`);
- ``ca``: one path per data node carrying three such pairs (the coarsened search), pairs
  released 1 s apart;
- ``baseline``: the first three data nodes each send three chains of three microbatches
  (released 0.1 s apart) down the in-order pipeline made of the partitions' column of that
  data node; the other two data nodes send nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.cluster import Cluster
from pipeline.simulator import SimResult, simulate

COM_SYM_GAP_INJECT_S = 0.09
"""com_sym.py: a node stays busy 0.09 s after injecting a microbatch (its first forward)."""
COM_SYM_GAP_S = 0.13
"""com_sym.py: ... and 0.13 s after any other compute (a forwarded or returning message)."""

EXPECTED_KEYS = {"baseline": "baseline-expected-time", "ca": "ca-expected-time",
                 "non-ca": "nonca-expected-time", "random": "random-expected-time"}
"""Schedule name -> the JSON key of the authors' simulated time for it."""


@dataclass(frozen=True)
class OfficialRuntime:
    """The semantics of the authors' simulator that are not in their schedule file."""

    compute_s: float
    """Forward seconds per hop on every node (their `wm`; 0.44 s for the committed file:
    `implied_compute_s` reads it off the file's processing order)."""
    gap_inject_s: float = COM_SYM_GAP_INJECT_S
    gap_s: float = COM_SYM_GAP_S


@dataclass(frozen=True)
class OfficialRun:
    name: str
    """"baseline", "ca", "non-ca" or "random"."""
    cluster: Cluster
    paths: tuple[tuple[int, ...], ...]
    """One node path per microbatch, [originator, hop 1, ...]."""
    release: tuple[float, ...]
    after: tuple[int | None, ...]
    expected_s: float
    """The authors' simulated time for this schedule (their run_simulation)."""
    runtime: OfficialRuntime = field(repr=False)

    def simulate(self) -> SimResult:
        rt = self.runtime
        return simulate(self.cluster, self.paths, gap_inject=rt.gap_inject_s, gap_local=rt.gap_s,
                        gap_network=rt.gap_s, release=self.release, after=self.after)


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def implied_compute_s(data: dict) -> float:
    """The per-hop compute time the file was made with: the authors start a data node's paths
    `compute_s` apart, so the second entry of a data node's non-ca processing order is it."""
    order = data["non-ca-processing-order"][str(data["partitions"][0][0])]
    return float(order[1][1] - order[0][1])


def _route(hops: dict[str, int]) -> tuple[int, ...]:
    """{"a": b, "b": c, ...} (the authors' next-hop map) -> (a, b, c, ...)."""
    nxt = {int(k): int(v) for k, v in hops.items()}
    start = (set(nxt) - set(nxt.values())).pop()
    route = [start]
    while route[-1] in nxt:
        route.append(nxt[route[-1]])
    return tuple(route)


def _pairs(routes: dict[str, dict], origins: list[int], pairs_per_path: int,
           pair_gap_s: float, compute_s: float) -> tuple[list, list, list]:
    """Every path's microbatches, pair-major (all first microbatches, then all second ones)."""
    routes_by_origin: dict[int, list[tuple[int, ...]]] = {o: [] for o in origins}
    for key in sorted(routes, key=int):
        r = _route(routes[key])
        routes_by_origin[r[0]].append(r)
    chains = []                                      # (route, release of its first microbatch)
    for o in origins:
        for k, r in enumerate(routes_by_origin[o]):
            for c in range(pairs_per_path):
                chains.append((r, c * pair_gap_s + k * compute_s))
    paths = [r for r, _ in chains] * 2
    release = [t for _, t in chains] + [t + 2.5 for _, t in chains]
    after = [None] * len(chains) + list(range(len(chains)))
    return paths, release, after


def official_runs(data: dict, runtime: OfficialRuntime) -> dict[str, OfficialRun]:
    """The four schedules of an authors' schedule file, keyed "baseline", "ca", "non-ca",
    "random" (create_schedule.py's layout: module doc)."""
    n = len(data["delays"])
    cluster = Cluster(compute=(runtime.compute_s,) * n, comm=data["delays"], memory=data["memory"])
    parts = [[int(x) for x in g] for g in data["partitions"]]
    origins = parts[0]
    inputs = {
        "ca": _pairs(data["ca-paths"], origins, 3, 1.0, runtime.compute_s),
        "non-ca": _pairs(data["non-ca-paths"], origins, 1, 0.0, runtime.compute_s),
        "random": _pairs(data["random-paths"], origins, 1, 0.0, runtime.compute_s),
    }
    paths, release, after = [], [], []
    for num in range(len(parts[1])):                 # baseline: one column per data node
        route = tuple(g[num] for g in parts)
        for _chain in range(3):
            for d in range(3):
                after.append(len(paths) - 1 if d else None)
                paths.append(route)
                release.append(0.1 * d)
    inputs["baseline"] = (paths, release, after)
    return {name: OfficialRun(name=name, cluster=cluster, paths=tuple(p), release=tuple(r),
                              after=tuple(a), expected_s=float(data[EXPECTED_KEYS[name]]),
                              runtime=runtime)
            for name, (p, r, a) in inputs.items()}
