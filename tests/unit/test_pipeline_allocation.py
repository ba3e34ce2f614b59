"""pipeline/allocation.py: the DP + 2*PP score, its minimisers and the stage order (P8)."""

from itertools import permutations

import pytest

from pipeline.allocation import (allocate, bottleneck_matching, brute_force, dp_cost, gcma_lite,
                                 pp_cost, score, tsp_order)
from pipeline.cluster import Cluster
from pipeline.geo import geo_cluster


def _regions_cluster():
    """Three 2-node regions: cheap links inside, region-dependent links across."""
    region = [0, 0, 1, 1, 2, 2]
    across = {(0, 1): 1.0, (1, 2): 1.0, (0, 2): 5.0}
    comm = [[0.0 if i == j else 0.01 if region[i] == region[j]
             else across[tuple(sorted((region[i], region[j])))] for j in range(6)]
            for i in range(6)]
    return Cluster(compute=(1.0,) * 6, comm=comm, memory=3)


def test_bottleneck_matching_equals_brute_force():
    cluster = geo_cluster(7, seed=0)
    a, b = (0, 3, 5), (1, 2, 4, 6)
    want = min(max(max(cluster.send_s(x, y), cluster.send_s(y, x)) for x, y in zip(a, perm))
               for perm in permutations(b, len(a)))
    assert bottleneck_matching(cluster, a, b) == pytest.approx(want)
    assert bottleneck_matching(cluster, b, a) == pytest.approx(want)


def test_score_by_hand_and_its_minimiser():
    """Stages = regions costs DP 0.01 + 2 x (1 + 1 + 5); chaining each replica pipeline inside
    regions 0/1 and 2 instead costs DP 5 + 2 x (0.01 + 1 + 1): the score prefers the latter."""
    cluster = _regions_cluster()
    by_region = ((0, 1), (2, 3), (4, 5))
    assert dp_cost(cluster, by_region) == pytest.approx(0.01)
    assert score(cluster, by_region) == pytest.approx(0.01 + 2 * (1.0 + 1.0 + 5.0))
    part = allocate(cluster, [2, 2, 2])
    assert score(cluster, part) == pytest.approx(5.0 + 2 * (0.01 + 1.0 + 1.0))
    assert sorted(part) == [(0, 4), (1, 5), (2, 3)]


def test_brute_force_is_the_minimum_and_gcma_finds_it():
    cluster = geo_cluster(8, seed=3)
    parts = [2, 2, 2, 2]
    best = brute_force(cluster, parts)
    assert [len(g) for g in best] == parts
    assert sorted(x for g in best for x in g) == list(range(8))
    # no single swap of two nodes between stages improves it
    for s in range(4):
        for t in range(s + 1, 4):
            for i in range(2):
                for j in range(2):
                    cand = [list(g) for g in best]
                    cand[s][i], cand[t][j] = cand[t][j], cand[s][i]
                    assert score(cluster, tuple(tuple(sorted(g)) for g in cand)) >= \
                        score(cluster, best) - 1e-12
    found = gcma_lite(cluster, parts, seed=0)
    assert score(cluster, found) <= score(cluster, best) * 1.05


def test_stage_order_is_the_tsp_optimum():
    cluster = geo_cluster(10, seed=4)
    part = allocate(cluster, [2, 2, 2, 2, 2], seed=0)         # N > 8: GCMA-lite + TSP order
    for perm in permutations(range(1, 5)):
        cand = (part[0], *(part[p] for p in perm))
        assert pp_cost(cluster, cand) >= pp_cost(cluster, part) - 1e-12
    assert tsp_order(cluster, part) == part


def test_allocation_is_deterministic_and_checks_sizes():
    cluster = geo_cluster(12, seed=5)
    assert allocate(cluster, [3, 3, 3, 3], seed=1) == allocate(cluster, [3, 3, 3, 3], seed=1)
    with pytest.raises(ValueError, match="sum to 11"):
        allocate(cluster, [3, 3, 3, 2])
