"""Building SkipPipe schedules: the collision-aware search and the two baselines (docs/pipeline.md, 'Scheduler').

Owns `skippipe_schedule` (cost-aware balanced greedy start, then a seeded local search that
keeps a move only if R1-R5 still hold and the simulated makespan improves, bounded by
`time_budget_s`), `random_schedule` (random legal balanced paths: DT-FM-Skip, all costs equal),
`full_pipeline_schedule` (every microbatch visits every stage in order) and `plan` (allocation
+ one of those). Every returned schedule has passed `validate_schedule`. Pure functions; the
coordinator (bootstrap role hook) calls `plan` and publishes the result.

With between-iteration costs in the cost model (`Cluster.sync_s`, `eoi_s`: our extension) the
search minimises the steady-state iteration period instead of one iteration's makespan, so it
does not send an iteration's first hops to nodes still exchanging the last one's gradients.

Every local-search move (reorder a path's stages, move a hop to another replica with spare
capacity, swap replicas or whole routes between two microbatches, exchange one stage between two
microbatches) keeps the per-stage visit counts and the per-node caps, so balance and the memory
cap (R5) survive by construction; R1-R4 are re-checked per move. Deterministic per seed when
the search stops on `max_iters` or `patience` rather than on the time budget.

The search plans routes: one per microbatch with `rules.mb_per_path = 1` (ours), else one per
path carrying `mb_per_path` microbatches back to back (the paper's scheduler: 2), each scored
with those microbatches chained (pipeline/schedule.py `chain_routes`); the node caps count
routes either way.
"""

from __future__ import annotations

import math
import random
import time

from pipeline.allocation import Partition, allocate
from pipeline.cluster import Cluster
from pipeline.paths import PathRules, enumerate_paths, orderings, stage_violation
from pipeline.schedule import Schedule, ScheduleViolation, chain_routes, stage_quota, validate_schedule
from pipeline.simulator import SimulationDeadlock, iteration_period, simulate

LOAD_WEIGHT = 1.0
"""Greedy: seconds of penalty per microbatch already routed through a node, times its w."""


SYNC_ITERATIONS = 3
"""Iterations chained per objective when the cost model has between-iteration costs."""


def _objective(cluster: Cluster, routes: list, collision_aware: bool, partition: Partition,
               mb_per_path: int = 1) -> tuple[float, float]:
    """What the search minimises: the simulated makespan, or with between-iteration costs in the
    cost model (replica gradient exchange, EndOfIteration) the steady-state iteration period;
    the mean microbatch completion breaks ties. Each route carries `mb_per_path` microbatches
    back to back."""
    paths, after = chain_routes(routes, mb_per_path)
    try:
        r = simulate(cluster, paths, exclusive=collision_aware, after=after)
        if cluster.has_sync and collision_aware:
            period = iteration_period(cluster, paths, partition, iterations=SYNC_ITERATIONS,
                                      after=after).period
            return period, r.mean_completion
    except SimulationDeadlock:
        return math.inf, math.inf
    return r.makespan, r.mean_completion


def _mb_order(origins: tuple[int, ...], mb_per_origin: int) -> list[int]:
    """Originator of each microbatch, interleaved: o0, o1, ..., o0, o1, ..."""
    return [o for _ in range(mb_per_origin) for o in origins]


def _caps(cluster: Cluster, partition: Partition, rules: PathRules, quota: int) -> dict[int, float]:
    caps = {x: (cluster.memory[x] if rules.cap_visits_by_memory else math.inf)
            for g in partition[1:] for x in g}
    for s, g in enumerate(partition[1:], start=1):
        if sum(caps[x] for x in g) < quota:
            raise ScheduleViolation(
                "R5", f"stage {s} has {len(g)} nodes with memory {[cluster.memory[x] for x in g]}"
                      f" but must take {quota} paths; add replicas, raise memory, lower "
                      "mb_per_origin, or carry more microbatches per path (mb_per_path; the "
                      "paper's scheduler: 2)")
    return caps


def _routes_per_origin(rules: PathRules, mb_per_origin: int) -> int:
    """Paths (routes) each originator's microbatches ride: mb_per_origin / rules.mb_per_path."""
    if mb_per_origin < 1:
        raise ScheduleViolation("STRUCT", f"mb_per_origin={mb_per_origin} must be >= 1")
    if mb_per_origin % rules.mb_per_path:
        raise ScheduleViolation("STRUCT", f"mb_per_origin={mb_per_origin} is not a multiple of "
                                          f"mb_per_path={rules.mb_per_path}; change either")
    return mb_per_origin // rules.mb_per_path


def _check_inputs(cluster: Cluster, partition: Partition, rules: PathRules, mb_per_origin: int):
    """(routes to plan, visits per stage in routes, per-node caps in routes). The search plans
    routes; `chain_routes` turns them into one path per microbatch."""
    if len(partition) != rules.S:
        raise ScheduleViolation("STRUCT", f"partition has {len(partition)} stages, rules.S="
                                          f"{rules.S}")
    n_routes = len(partition[0]) * _routes_per_origin(rules, mb_per_origin)
    quota = stage_quota(n_routes, rules)
    return n_routes, quota, _caps(cluster, partition, rules, quota)


def _balanced_paths(cluster: Cluster, partition: Partition, rules: PathRules, mb_per_origin: int,
                    rng: random.Random | None, simulate_greedy: bool = True
                    ) -> list[tuple[int, ...]]:
    """One legal route per path (per microbatch when rules.mb_per_path = 1) with exact stage
    balance and node caps, each originator's routes interleaved. With `rng`
    choices are uniform among feasible ones (random baseline); without, greedy: each
    microbatch takes the candidate (stage order, replicas picked by link + load) that gives
    the smallest simulated makespan of the paths chosen so far (`simulate_greedy`), or the
    smallest path cost estimate."""
    n_mb, quota, caps = _check_inputs(cluster, partition, rules, mb_per_origin)
    stage_of = {x: s for s, g in enumerate(partition) for x in g}
    left = {s: quota for s in range(1, rules.S)}
    cap_left = dict(caps)
    load = {x: 0 for x in cap_left}
    sets = sorted({frozenset(p[1:]) for p in enumerate_paths(rules)}, key=sorted)
    out = []
    for i, origin in enumerate(_mb_order(partition[0], _routes_per_origin(rules, mb_per_origin))):
        remaining = n_mb - i - 1
        feasible = [t for t in sets if all(left[s] >= 1 for s in t)
                    and all(left[s] - (s in t) <= remaining for s in left)]
        if not feasible:
            raise ScheduleViolation("R5", "no legal stage set keeps the stage load balanced; "
                                          "relax max_jump or change mb_per_origin")
        by_sim = simulate_greedy and rng is None
        best, best_cost = None, (math.inf, math.inf) if by_sim else math.inf
        candidates = ([rng.choice(feasible)] if rng else feasible)
        for t in candidates:
            orders = orderings(tuple(t), rules)
            for stages in ([rng.choice(orders)] if rng else orders):
                nodes, prev, cost = [origin], origin, 0.0
                for s in stages[1:]:
                    opts = [x for x in partition[s] if cap_left[x] >= 1]
                    if rng:
                        x = rng.choice(opts)
                    else:
                        x = min(opts, key=lambda y: (cluster.send_s(prev, y) + cluster.forward_s(y)
                                                     * (2.5 + LOAD_WEIGHT * load[y]), y))
                    cost += 2 * cluster.send_s(prev, x) + cluster.forward_s(x) * (
                        2.5 + LOAD_WEIGHT * load[x])          # fwd + bwd, plus queueing
                    nodes.append(x)
                    prev = x
                cost += 2 * cluster.send_s(prev, origin)
                if by_sim:
                    cost = _objective(cluster, out + [tuple(nodes)], True, partition,
                                      rules.mb_per_path)
                if cost < best_cost:
                    best, best_cost = tuple(nodes), cost
        for x in best[1:]:
            cap_left[x] -= 1
            load[x] += 1
            left[stage_of[x]] -= 1
        out.append(best)
    return out


def _finish(cluster: Cluster, partition: Partition, routes, rules, method: str,
            epoch: int) -> Schedule:
    paths, after = chain_routes(routes, rules.mb_per_path)
    sched = Schedule(partitions=partition, paths=tuple(paths), rules=rules, epoch=epoch,
                     expected_makespan=simulate(cluster, paths, after=after).makespan,
                     cost_hash=cluster.cost_hash(), method=method, names=cluster.names)
    return validate_schedule(sched, cluster)


def full_pipeline_schedule(cluster: Cluster, partition: Partition, mb_per_origin: int, *,
                           epoch: int = 0) -> Schedule:
    """Baseline: every microbatch visits stages 1..S-1 in order (L = S, no swaps); replicas of
    a stage take microbatches round-robin; the memory window works by deferral (no cap)."""
    S = len(partition)
    rules = PathRules(S=S, L=S, max_jump=1, max_swaps=0, max_total_swap_distance=0,
                      cap_visits_by_memory=False)
    paths = []
    for j, origin in enumerate(_mb_order(partition[0], mb_per_origin)):
        paths.append((origin, *(partition[s][j % len(partition[s])] for s in range(1, S))))
    return _finish(cluster, partition, paths, rules, "full", epoch)


def random_schedule(cluster: Cluster, partition: Partition, rules: PathRules, mb_per_origin: int,
                    *, seed: int = 0, epoch: int = 0) -> Schedule:
    """Baseline: random legal balanced paths (random stage sets, orders and replicas)."""
    paths = _balanced_paths(cluster, partition, rules, mb_per_origin, random.Random(seed))
    return _finish(cluster, partition, paths, rules, "random", epoch)


def _moves(rng: random.Random, paths: list[tuple[int, ...]], partition: Partition,
           rules: PathRules, caps: dict[int, float], stage_of: dict[int, int]):
    """One random move that keeps stage visit counts and node caps; None if it does not apply."""
    new = list(paths)
    a = rng.randrange(len(paths))
    kind = rng.random()
    pa = list(paths[a])
    if kind < 0.3:                                        # reorder a's stages
        orders = orderings(tuple(stage_of[x] for x in pa[1:]), rules)
        node_at = {stage_of[x]: x for x in pa}
        new[a] = tuple(node_at[s] for s in rng.choice(orders))
    elif kind < 0.55:                                     # move a hop to another replica
        hop = rng.randrange(1, len(pa))
        s = stage_of[pa[hop]]
        visits = {x: sum(p[1:].count(x) for p in paths) for x in partition[s]}
        opts = [x for x in partition[s] if x != pa[hop] and visits[x] < caps[x]]
        if not opts:
            return None
        pa[hop] = rng.choice(opts)
        new[a] = tuple(pa)
    else:
        b = rng.randrange(len(paths))
        if b == a:
            return None
        pb = list(paths[b])
        if kind < 0.75:                                   # swap replicas at a shared stage
            shared = [(i, j) for i, x in enumerate(pa) for j, y in enumerate(pb)
                      if i > 0 and j > 0 and stage_of[x] == stage_of[y] and x != y]
            if not shared:
                return None
            i, j = rng.choice(shared)
            pa[i], pb[j] = pb[j], pa[i]
        elif kind < 0.9:                                  # exchange a stage between a and b
            sa, sb = {stage_of[x] for x in pa[1:]}, {stage_of[x] for x in pb[1:]}
            only_a, only_b = sorted(sa - sb), sorted(sb - sa)
            if not only_a:
                return None
            s, t = rng.choice(only_a), rng.choice(only_b)
            i = next(k for k, x in enumerate(pa) if stage_of[x] == s)
            j = next(k for k, x in enumerate(pb) if stage_of[x] == t)
            pa[i], pb[j] = pb[j], pa[i]
            for p in (pa, pb):                            # keep positions if legal, else sort
                if stage_violation(tuple(stage_of[x] for x in p), rules) is not None:
                    p[1:] = sorted(p[1:], key=lambda x: stage_of[x])
        else:                                             # swap the routes of two originators
            if pa[0] == pb[0]:
                return None
            pa[1:], pb[1:] = pb[1:], pa[1:]
        new[a], new[b] = tuple(pa), tuple(pb)
    for p in (new[a],) + ((new[b],) if kind >= 0.55 else ()):
        if stage_violation(tuple(stage_of[x] for x in p), rules) is not None:
            return None
    return new


def _local_search(cluster, paths, partition, rules, caps, stage_of, rng, collision_aware,
                  max_iters, patience, deadline):
    best = _objective(cluster, paths, collision_aware, partition, rules.mb_per_path)
    since = 0
    for _ in range(max_iters):
        if since >= patience or time.monotonic() > deadline:
            break
        since += 1
        cand = _moves(rng, paths, partition, rules, caps, stage_of)
        if cand is None:
            continue
        obj = _objective(cluster, cand, collision_aware, partition, rules.mb_per_path)
        if obj < best:
            paths, best, since = cand, obj, 0
    return paths, best


def skippipe_schedule(cluster: Cluster, partition: Partition, rules: PathRules,
                      mb_per_origin: int, *, seed: int = 0, time_budget_s: float = 30.0,
                      max_iters: int = 20000, patience: int = 3000, restarts: int = 0,
                      collision_aware: bool = True, epoch: int = 0) -> Schedule:
    """SkipPipe search: local search minimising the simulated makespan (mean microbatch
    completion breaks ties) from the balanced cost-aware greedy start and from `restarts`
    random balanced starts; the best result wins. Each start gets `max_iters` moves, stops
    after `patience` moves without gain, and gets an equal share of what is left of
    `time_budget_s`. `collision_aware=False` scores moves with a simulator in which nodes may
    overlap computes (the "non-ca" variant); `expected_makespan` is always the
    collision-aware prediction."""
    _, quota, caps = _check_inputs(cluster, partition, rules, mb_per_origin)
    stage_of = {x: s for s, g in enumerate(partition) for x in g}
    rng = random.Random(seed)
    end = time.monotonic() + time_budget_s
    starts = [_balanced_paths(cluster, partition, rules, mb_per_origin, None)]
    best_paths, best = None, (math.inf, math.inf)
    for k in range(1 + max(0, restarts)):
        if k > 0:
            starts.append(_balanced_paths(cluster, partition, rules, mb_per_origin,
                                          random.Random(rng.random())))
        share = (end - time.monotonic()) / (1 + restarts - k)
        paths, obj = _local_search(cluster, starts[k], partition, rules, caps, stage_of, rng,
                                   collision_aware, max_iters, patience,
                                   time.monotonic() + max(0.0, share))
        if obj < best:
            best_paths, best = paths, obj
    if best_paths is None or best[0] == math.inf:
        best_paths = starts[0]
    return _finish(cluster, partition, best_paths, rules, "skippipe" if collision_aware
                   else "skippipe-non-ca", epoch)


def plan(cluster: Cluster, parts: list[int] | Partition, rules: PathRules, mb_per_origin: int, *,
         method: str = "skippipe", seed: int = 0, time_budget_s: float = 30.0,
         epoch: int = 0, **search_kw) -> Schedule:
    """Allocate (if `parts` are sizes) and build a validated schedule with `method`
    ("skippipe", "random" or "full")."""
    if parts and isinstance(parts[0], int):
        partition = allocate(cluster, parts, seed=seed)
    else:
        partition = tuple(tuple(g) for g in parts)
    if method == "skippipe":
        return skippipe_schedule(cluster, partition, rules, mb_per_origin, seed=seed,
                                 time_budget_s=time_budget_s, epoch=epoch, **search_kw)
    if method == "random":
        return random_schedule(cluster, partition, rules, mb_per_origin, seed=seed, epoch=epoch)
    if method == "full":
        return full_pipeline_schedule(cluster, partition, mb_per_origin, epoch=epoch)
    raise ValueError(f"method={method!r}; use 'skippipe', 'random' or 'full'")

