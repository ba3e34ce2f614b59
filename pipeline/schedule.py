"""The SkipPipe schedule: its data model, canonical JSON and the validator (docs/pipeline.md, 'Path rules').

Owns `Schedule` (partitions, one node path per microbatch, rules, epoch, expected makespan, cost
hash), its canonical JSON + sha256 (what the coordinator publishes), the successor/predecessor
maps a stage uses to source-route a microbatch and return its gradient, and
`validate_schedule`, which refuses a schedule that breaks a rule before anyone uses it, raising
`ScheduleViolation` naming the rule (R1-R5, P5, STRUCT). Building schedules (the SkipPipe search
and the two baselines) is in pipeline/search.py; allocation in pipeline/allocation.py. Pure
functions: no grpc, hivemind, node or torch code.

Microbatch table: microbatch `seq` of originator `o` follows the `seq`-th path whose first node
is `o` (so `path_id(o, seq)`); every originator has the same number of microbatches. With
`rules.mb_per_path = m > 1` (the paper's scheduler; ours is 1) an originator's microbatches ride
q = mb_per_origin / m paths, m each, back to back: seq j rides path j % q and is injected once
seq j - q is home (`after`), so seqs j and j - q have the same route. The memory cap (R5)
counts paths: at most `memory` per node, i.e. `memory x m` microbatch visits.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace

from pipeline.cluster import Cluster
from pipeline.paths import RULE_NAMES, PathRules, stage_violation

Partition = tuple[tuple[int, ...], ...]


class ScheduleViolation(ValueError):
    """A schedule breaks a SkipPipe rule; `.rule` is its id (R1..R5, P5, STRUCT)."""

    def __init__(self, rule: str, detail: str):
        self.rule, self.detail = rule, detail
        super().__init__(f"schedule refused: {rule} ({RULE_NAMES.get(rule, '?')}): {detail}")


@dataclass(frozen=True)
class Schedule:
    partitions: Partition
    """partitions[s] = node indices serving stage s; stage 0 nodes are the originators."""
    paths: tuple[tuple[int, ...], ...]
    """path_id -> node path [originator, hop 1, ...]; the return to the originator is implicit."""
    rules: PathRules
    epoch: int = 0
    expected_makespan: float = 0.0
    """Simulated iteration seconds (pipeline/simulator.py) on the cost model it was planned on."""
    cost_hash: str = ""
    """Cluster.cost_hash() of that cost model."""
    method: str = ""
    """"skippipe", "random" or "full" (which builder made it)."""
    names: tuple[str, ...] = field(default=())
    """Optional node names (peer IDs) by index, for the coordinator."""
    incarnations: tuple[float, ...] = field(default=())
    """Per name, the `started_at` of the process the plan was made with (from its node card; empty
    in older plans). A node whose process differs between the running iteration's epoch and a new
    one (restarted as itself and rebuilt: same peer ID) counts as lost for that iteration: what it
    held of it died with the old process, so the iteration is aborted like one that lost a node.
    Any coordinator sets it from the cards, so this holds across a takeover too."""
    reset_moments: bool = False
    """Set on the first plan the coordinator publishes without a quarantined node that carried its
    stage alone (a failed solo audit, non-finite outputs; not a replica caught by its weight
    commit, whose twin carried the stage): every stage node clears its AdamW moments before its
    first step on this epoch (`stage_exec.py`). The
    quarantined node's outputs or gradients went into every stage's gradients until then, and
    AdamW's second moment averages them for about 1 / (1 - beta2) steps: 6 iterations of a noisy
    stage's gradients kept the honest stages stepping at a fraction of their LR for the rest of a
    100-iteration run (eval 14% worse; 2% with the reset). All replicas of a stage step their first
    iteration on an epoch together, so they clear at the same iteration and stay bit-identical."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "partitions", tuple(tuple(int(x) for x in g)
                                                     for g in self.partitions))
        object.__setattr__(self, "paths", tuple(tuple(int(x) for x in p) for p in self.paths))
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "incarnations", tuple(float(x) for x in self.incarnations))

    def renewed_since(self, older: "Schedule") -> set[str]:
        """Names in both plans whose process changed between `older` and this one (both must carry
        `incarnations`)."""
        if len(older.incarnations) != len(older.names) or len(self.incarnations) != len(self.names):
            return set()
        then = dict(zip(older.names, older.incarnations))
        return {n for n, t in zip(self.names, self.incarnations) if n in then and then[n] != t}

    # --- lookups a stage uses -------------------------------------------------------------
    def stage_of(self, node: int) -> int:
        for s, group in enumerate(self.partitions):
            if node in group:
                return s
        raise KeyError(f"node {node} is not in any stage of this schedule")

    def stages(self, path_id: int) -> tuple[int, ...]:
        return tuple(self.stage_of(x) for x in self.paths[path_id])

    @property
    def origins(self) -> tuple[int, ...]:
        return self.partitions[0]

    def path_ids(self, origin: int) -> list[int]:
        return [i for i, p in enumerate(self.paths) if p[0] == origin]

    @property
    def mb_per_origin(self) -> int:
        return len(self.path_ids(self.origins[0])) if self.origins else 0

    def path_id(self, origin: int, seq: int) -> int:
        ids = self.path_ids(origin)
        if not 0 <= seq < len(ids):
            raise KeyError(f"originator {origin} has {len(ids)} microbatches; no seq {seq}")
        return ids[seq]

    def microbatches(self) -> list[tuple[int, int, int]]:
        """(originator, seq, path_id) for every microbatch of the iteration."""
        return [(o, seq, pid) for o in self.origins for seq, pid in enumerate(self.path_ids(o))]

    @property
    def paths_per_origin(self) -> int:
        """Paths each originator's microbatches ride (mb_per_origin / rules.mb_per_path)."""
        return self.mb_per_origin // self.rules.mb_per_path

    def previous_on_path(self, origin: int, seq: int) -> int | None:
        """Path ID of the microbatch that must be home before `origin`'s microbatch `seq`
        leaves (seq - paths_per_origin: its path's previous one), or None."""
        q = self.paths_per_origin
        return self.path_id(origin, seq - q) if seq >= q else None

    def after(self) -> list[int | None]:
        """Per path ID: the path ID of the microbatch that must be home before this one leaves
        its originator (the same path's previous microbatch), or None (module doc)."""
        out: list[int | None] = [None] * len(self.paths)
        for o, seq, pid in self.microbatches():
            out[pid] = self.previous_on_path(o, seq)
        return out

    def successor(self, path_id: int, hop: int) -> int:
        """Node that receives the forward after `hop` (the originator after the last hop)."""
        path = self.paths[path_id]
        return path[hop + 1] if hop + 1 < len(path) else path[0]

    def predecessor(self, path_id: int, hop: int) -> int:
        """Node that sent hop `hop` its forward, i.e. where its gradient goes (hop 0: none)."""
        if hop == 0:
            raise ValueError("hop 0 is the originator: its input is the data, not a node")
        return self.paths[path_id][hop - 1]

    def routes(self, node: int) -> dict[int, tuple[int, int, int]]:
        """For each path through `node`: path_id -> (hop, predecessor, successor)."""
        out = {}
        for pid, path in enumerate(self.paths):
            for hop, x in enumerate(path):
                if x == node and hop > 0:
                    out[pid] = (hop, path[hop - 1], self.successor(pid, hop))
        return out

    def stage_visits(self) -> Counter:
        return Counter(s for pid in range(len(self.paths)) for s in self.stages(pid)[1:])

    def node_visits(self) -> Counter:
        return Counter(x for p in self.paths for x in p[1:])

    # --- canonical form --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "method": self.method, "rules": self.rules.as_dict(),
                "partitions": [list(g) for g in self.partitions],
                "paths": {str(i): list(p) for i, p in enumerate(self.paths)},
                "microbatches": [list(m) for m in self.microbatches()],
                "expected_makespan": self.expected_makespan,
                "cost_hash": self.cost_hash, "names": list(self.names),
                **({"incarnations": list(self.incarnations)} if self.incarnations else {}),
                **({"reset_moments": True} if self.reset_moments else {})}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Parse (JSON only, never pickle); call validate_schedule before use."""
        try:
            d = json.loads(text)
            paths = [d["paths"][str(i)] for i in range(len(d["paths"]))]
            return cls(partitions=d["partitions"], paths=paths, rules=PathRules(**d["rules"]),
                       epoch=int(d["epoch"]), expected_makespan=float(d["expected_makespan"]),
                       cost_hash=str(d["cost_hash"]), method=str(d.get("method", "")),
                       names=tuple(d.get("names", ())),
                       incarnations=tuple(float(x) for x in d.get("incarnations", ())),
                       reset_moments=d.get("reset_moments", False) is True)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleViolation("STRUCT", f"malformed schedule JSON: {exc!r}") from exc


def chain_routes(routes, mb_per_path: int) -> tuple[list[tuple[int, ...]], list[int | None]]:
    """(one node path per microbatch, `after`) for `routes` that each carry `mb_per_path`
    microbatches back to back: the routes repeated `mb_per_path` times, so with every
    originator's routes listed in order the microbatch table of the module doc holds and
    microbatch i waits for i - len(routes). `Schedule.after()` gives the same for the result."""
    routes = [tuple(r) for r in routes]
    n = len(routes)
    return routes * mb_per_path, [None] * n + list(range(n * (mb_per_path - 1)))


def stage_quota(n_microbatches: int, rules: PathRules) -> int:
    """Visits every stage s >= 1 gets under exact balance (R5); raises if none is possible."""
    total = n_microbatches * (rules.L - 1)
    if total % (rules.S - 1):
        raise ScheduleViolation(
            "R5", f"{n_microbatches} microbatches x {rules.L - 1} stages = {total} visits cannot "
                  f"split equally over {rules.S - 1} stages; pick the microbatch count so "
                  f"S-1={rules.S - 1} divides microbatches x (L-1)")
    return total // (rules.S - 1)


def validate_schedule(schedule: Schedule, cluster: Cluster | None = None) -> Schedule:
    """Return `schedule` if it obeys every rule, else raise ScheduleViolation naming the first
    broken one. With `cluster`, node indices and the memory cap (R5) are checked too."""
    rules, parts = schedule.rules, schedule.partitions
    if len(parts) != rules.S:
        raise ScheduleViolation("STRUCT", f"{len(parts)} partitions but rules.S={rules.S}")
    if any(not g for g in parts):
        raise ScheduleViolation("STRUCT", "a stage has no node; every stage needs >= 1 node")
    flat = [x for g in parts for x in g]
    if len(set(flat)) != len(flat):
        raise ScheduleViolation("STRUCT", "a node serves two stages (or is listed twice)")
    if cluster is not None and any(not 0 <= x < cluster.n for x in flat):
        raise ScheduleViolation("STRUCT", f"partitions name nodes outside [0, {cluster.n})")
    if not schedule.paths:
        raise ScheduleViolation("STRUCT", "schedule has no paths")
    stage_of = {x: s for s, g in enumerate(parts) for x in g}
    for pid, path in enumerate(schedule.paths):
        if path[0] not in parts[0]:
            raise ScheduleViolation("R1", f"path {pid} {list(path)} starts at node {path[0]}, "
                                          "which is not a stage-0 originator")
        for hop, x in enumerate(path):
            if x not in stage_of:
                raise ScheduleViolation("P5", f"path {pid} hop {hop}: node {x} serves no stage")
        bad = stage_violation(tuple(stage_of[x] for x in path), rules)
        if bad is not None:
            raise ScheduleViolation(bad[0], f"path {pid} (nodes {list(path)}): {bad[1]}")
    counts = Counter(p[0] for p in schedule.paths)
    per_origin = {o: counts.get(o, 0) for o in parts[0]}
    if len(set(per_origin.values())) != 1:
        raise ScheduleViolation("STRUCT", f"originators have unequal microbatch counts "
                                          f"{per_origin}; give each the same mb_per_origin")
    _check_paths(schedule)
    quota = stage_quota(len(schedule.paths), rules)
    visits = schedule.stage_visits()
    for s in range(1, rules.S):
        if visits.get(s, 0) != quota:
            raise ScheduleViolation("R5", f"stage {s} gets {visits.get(s, 0)} visits, expected "
                                          f"{quota} on every stage >= 1 ({dict(visits)})")
    if cluster is not None and rules.cap_visits_by_memory:
        m = rules.mb_per_path
        for x, v in schedule.node_visits().items():
            if v > cluster.memory[x] * m:
                raise ScheduleViolation(
                    "R5", f"node {x} (stage {stage_of[x]}) is on {v / m:g} paths ({v} microbatch "
                          f"visits, {m} per path) > its memory {cluster.memory[x]}; give that "
                          "stage more replicas, raise its memory, lower mb_per_origin or carry "
                          "more microbatches per path (mb_per_path; the paper's scheduler: 2)")
    return schedule


def _check_paths(schedule: Schedule) -> None:
    """With several microbatches per path: whole paths per originator, one route per path."""
    m = schedule.rules.mb_per_path
    if m == 1:
        return
    n = schedule.mb_per_origin
    if n % m:
        raise ScheduleViolation("STRUCT", f"{n} microbatches per originator do not fill paths of "
                                          f"mb_per_path={m}; make mb_per_origin a multiple of it")
    after = schedule.after()
    for pid, prev in enumerate(after):
        if prev is not None and schedule.paths[pid] != schedule.paths[prev]:
            raise ScheduleViolation(
                "R5", f"path {pid} {list(schedule.paths[pid])} should repeat the route of path "
                      f"{prev} {list(schedule.paths[prev])}: with mb_per_path={m} an originator's "
                      f"microbatch seq j rides the same path as seq j - {schedule.paths_per_origin}")


def checkfree_plus_paths(schedule: Schedule) -> Schedule:
    """CheckFree+ swaps in a planned schedule (docs/pipeline.md, 'CheckFree+'): every odd microbatch of each
    originator takes transformer stages (1, 2) swapped, and likewise (T-1, T), wherever its path
    visits the pair in order back to back; the nodes (so visits and memory) are unchanged. With
    k = 0 this is `pipeline.checkfree.checkfree_plus_order`. The schedule's rules are widened to
    allow these two adjacent swaps (max_jump, max_swaps and total swap distance at least 2; the
    in-order "full" builder plans with none); a swap that would still break R3/R4 (the path already
    swaps) is left out. Needs T = S - 1 >= 4 transformer stages."""
    t = schedule.rules.S - 1
    if schedule.rules.mb_per_path != 1:
        raise ScheduleViolation("CF+", f"CheckFree+ swaps every odd microbatch, which would split "
                                       f"paths carrying mb_per_path={schedule.rules.mb_per_path} "
                                       "microbatches; use mb_per_path = 1 with checkfree_plus")
    if t < 4:
        raise ScheduleViolation("CF+", f"CheckFree+ needs at least 4 transformer stages, the schedule has {t}")
    stage_of = {x: s for s, g in enumerate(schedule.partitions) for x in g}
    r = schedule.rules
    rules = replace(r, max_jump=max(r.max_jump, 2), max_swap_distance=max(r.max_swap_distance, 1),
                    max_swaps=max(r.max_swaps, 2), max_total_swap_distance=max(r.max_total_swap_distance, 2))
    paths = list(schedule.paths)
    for origin in schedule.origins:
        for seq, pid in enumerate(schedule.path_ids(origin)):
            if seq % 2 == 0:
                continue
            path = list(paths[pid])
            for a, b in ((1, 2), (t - 1, t)):
                stages = [stage_of[x] for x in path]
                if a in stages and stages.index(a) + 1 < len(stages) and stages[stages.index(a) + 1] == b:
                    i = stages.index(a)
                    cand = path[:i] + [path[i + 1], path[i]] + path[i + 2:]
                    if stage_violation(tuple(stage_of[x] for x in cand), rules) is None:
                        path = cand
            paths[pid] = tuple(path)
    return replace(schedule, paths=tuple(paths), rules=rules)

