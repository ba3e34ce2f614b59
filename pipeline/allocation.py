"""Node-to-stage allocation for SkipPipe (docs/pipeline.md, 'Scheduler'): which nodes serve which stage.

Owns the allocation score `DP_cost + 2 * PP_cost` (DT-FM/GCMA):
- DP_cost = the worst link between two replicas of one stage (their gradient averaging),
- PP_cost = the sum, around the stage cycle 0 -> 1 -> ... -> S-1 -> 0, of the bottleneck
  bipartite matching cost between consecutive stages,
and its minimisation: brute force over every labelled partition for N <= 8 nodes, else
GCMA-lite (a seeded genetic search, population 60, 600 trials); the stage order is then the
TSP optimum of that cycle. Pure Python over a `Cluster`; paths and balance live elsewhere.

A partition is a tuple of tuples: `partition[s]` = the nodes of stage s (stage 0 = the
originators, which hold data, embedding, head and loss), each sorted.
"""

from __future__ import annotations

import random
from itertools import combinations, permutations

from pipeline.cluster import Cluster

Partition = tuple[tuple[int, ...], ...]
BRUTE_FORCE_MAX_NODES = 8


def link(cluster: Cluster, x: int, y: int) -> float:
    """Symmetric link cost: the slower direction."""
    return max(cluster.send_s(x, y), cluster.send_s(y, x))


def _max_matching(adj: list[list[int]], n_right: int) -> int:
    match_r = [-1] * n_right

    def augment(u: int, seen: list[bool]) -> bool:
        for v in adj[u]:
            if not seen[v]:
                seen[v] = True
                if match_r[v] < 0 or augment(match_r[v], seen):
                    match_r[v] = u
                    return True
        return False

    return sum(augment(u, [False] * n_right) for u in range(len(adj)))


def bottleneck_matching(cluster: Cluster, a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """Smallest t such that min(|a|, |b|) disjoint pairs (x in a, y in b) all have link <= t."""
    if not a or not b:
        return 0.0
    need = min(len(a), len(b))
    for t in sorted({link(cluster, x, y) for x in a for y in b}):
        adj = [[j for j, y in enumerate(b) if link(cluster, x, y) <= t] for x in a]
        if _max_matching(adj, len(b)) >= need:
            return t
    raise AssertionError("unreachable: the largest threshold admits every pair")


def dp_cost(cluster: Cluster, partition: Partition) -> float:
    return max((link(cluster, x, y) for group in partition for x, y in combinations(group, 2)),
               default=0.0)


def pp_cost(cluster: Cluster, partition: Partition) -> float:
    S = len(partition)
    return sum(bottleneck_matching(cluster, partition[s], partition[(s + 1) % S])
               for s in range(S)) if S > 1 else 0.0


def score(cluster: Cluster, partition: Partition) -> float:
    """DP_cost + 2 * PP_cost (lower is better)."""
    return dp_cost(cluster, partition) + 2 * pp_cost(cluster, partition)


def _check(cluster: Cluster, parts: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    parts = tuple(int(p) for p in parts)
    if len(parts) < 2 or any(p < 1 for p in parts):
        raise ValueError(f"parts={list(parts)}: need stage 0 and >= 1 stage, each >= 1 node")
    if sum(parts) != cluster.n:
        raise ValueError(f"parts={list(parts)} sum to {sum(parts)} nodes but the cluster has "
                         f"{cluster.n}; give one size per stage that adds up to the node count")
    return parts


def tsp_order(cluster: Cluster, partition: Partition) -> Partition:
    """Reorder stages 1..S-1 (stage 0 fixed, sizes kept per position) to minimise PP_cost."""
    S = len(partition)
    if S > 9:
        raise ValueError(f"S={S}: TSP stage ordering is exhaustive and meant for S <= 9")
    candidates = permutations(range(1, S))
    best, best_cost = partition, pp_cost(cluster, partition)
    sizes = [len(g) for g in partition]
    for perm in candidates:
        if any(sizes[p] != sizes[i + 1] for i, p in enumerate(perm)):
            continue
        cand = (partition[0], *(partition[p] for p in perm))
        c = pp_cost(cluster, cand)
        if c < best_cost - 1e-12:
            best, best_cost = cand, c
    return best


def _labelled_partitions(nodes: tuple[int, ...], parts: tuple[int, ...]):
    if not parts:
        yield ()
        return
    for group in combinations(nodes, parts[0]):
        rest = tuple(x for x in nodes if x not in group)
        for tail in _labelled_partitions(rest, parts[1:]):
            yield (group, *tail)


def brute_force(cluster: Cluster, parts: list[int] | tuple[int, ...]) -> Partition:
    """Exact minimum of `score` over every labelled partition (ties: first in lexicographic
    order). Cost grows as N! / prod(parts!): meant for N <= 8."""
    parts = _check(cluster, parts)
    best, best_score = None, float("inf")
    for cand in _labelled_partitions(tuple(range(cluster.n)), parts):
        sc = score(cluster, cand)
        if sc < best_score - 1e-12:
            best, best_score = cand, sc
    return best


def _from_perm(perm: list[int], parts: tuple[int, ...]) -> Partition:
    out, i = [], 0
    for p in parts:
        out.append(tuple(sorted(perm[i:i + p])))
        i += p
    return tuple(out)


def gcma_lite(cluster: Cluster, parts: list[int] | tuple[int, ...], *, seed: int = 0,
              population: int = 60, trials: int = 600) -> Partition:
    """Seeded genetic search: keep parent A's groups for a random subset of stages, fill the
    rest in parent B's node order, mutate by swapping two nodes of different stages; the
    child replaces the worst member when it scores better."""
    parts = _check(cluster, parts)
    rng = random.Random(seed)
    n = cluster.n

    def fitness(perm: list[int]) -> float:
        return score(cluster, _from_perm(perm, parts))

    pop = []
    for _ in range(population):
        perm = list(range(n))
        rng.shuffle(perm)
        pop.append((fitness(perm), perm))
    offsets = [sum(parts[:s]) for s in range(len(parts))]
    for _ in range(trials):
        pa = min(rng.sample(pop, 2))[1]
        pb = min(rng.sample(pop, 2))[1]
        keep = [s for s in range(len(parts)) if rng.random() < 0.5]
        child: list[int | None] = [None] * n
        for s in keep:
            child[offsets[s]:offsets[s] + parts[s]] = pa[offsets[s]:offsets[s] + parts[s]]
        used = {x for x in child if x is not None}
        fill = iter(x for x in pb if x not in used)
        child = [x if x is not None else next(fill) for x in child]
        if len(parts) > 1 and rng.random() < 0.7:
            i, j = rng.sample(range(n), 2)
            child[i], child[j] = child[j], child[i]
        f = fitness(child)
        worst = max(range(population), key=lambda k: pop[k][0])
        if f < pop[worst][0] and all(_from_perm(child, parts) != _from_perm(p, parts)
                                     for _, p in pop):
            pop[worst] = (f, child)
    return _from_perm(min(pop)[1], parts)


def allocate(cluster: Cluster, parts: list[int] | tuple[int, ...], *, seed: int = 0) -> Partition:
    """Best partition found: brute force for N <= 8, else GCMA-lite; stages 1.. in TSP order."""
    parts = _check(cluster, parts)
    if cluster.n <= BRUTE_FORCE_MAX_NODES:
        return brute_force(cluster, parts)
    return tsp_order(cluster, gcma_lite(cluster, parts, seed=seed))
