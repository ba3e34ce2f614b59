"""pipeline/simulator.py: exclusivity, memory window, causality, closed forms (P6, P7)."""

import pytest

from pipeline.cluster import Cluster
from pipeline.geo import geo_cluster
from pipeline.paths import PathRules
from pipeline.search import full_pipeline_schedule, random_schedule, skippipe_schedule
from pipeline.simulator import SimulationDeadlock, simulate

EPS = 1e-9


def _homogeneous(n, w=1.0, c=0.0, memory=100):
    return Cluster(compute=(w,) * n, comm=[[0.0 if i == j else c for j in range(n)]
                                           for i in range(n)], memory=memory)


def _geo_schedules():
    cluster = geo_cluster(9, memory=3, seed=1)
    part = ((0, 4, 8), (1, 5), (2, 6), (3, 7))
    rules = PathRules(S=4, L=3)
    return cluster, [full_pipeline_schedule(cluster, part, 3),
                     random_schedule(cluster, part, rules, 3, seed=2),
                     skippipe_schedule(cluster, part, rules, 3, max_iters=200, time_budget_s=60)]


def _check_trace(cluster, paths, res):
    """Independent checks of a simulation trace: no overlap, memory, causality, completeness."""
    task = {}
    for node, ivs in res.intervals.items():
        ivs = sorted(ivs)
        for (s0, e0, *_), (s1, _, *_) in zip(ivs, ivs[1:]):
            assert s1 >= e0 - EPS, f"node {node} overlaps two computes"
        events = []
        for s, e, kind, m, hop in ivs:
            task[(m, hop, kind)] = (node, s, e)
        slots = {}
        for s, e, kind, m, hop in ivs:
            if kind == "F":
                slots[(m, hop)] = [s, None]
            elif kind == "B":
                slots[(m, hop)][1] = e
        for s, e in slots.values():
            events += [(s, 1), (e, -1)]
        level = peak = 0
        for _, d in sorted(events, key=lambda t: (t[0], t[1])):
            level += d
            peak = max(peak, level)
        assert peak <= cluster.memory[node], f"node {node} exceeds its memory window"
    for m, path in enumerate(paths):
        L = len(path)
        chain = [(h, "F") for h in range(L)] + [(0, "LOSS")] + [(h, "B") for h in reversed(range(L))]
        for (h0, k0), (h1, k1) in zip(chain, chain[1:]):
            n0, _, e0 = task[(m, h0, k0)]
            n1, s1, _ = task[(m, h1, k1)]
            assert n1 == (path[0] if k1 == "LOSS" else path[h1])
            assert s1 >= e0 + cluster.send_s(n0, n1) - EPS, f"mb {m} starts {k1}@{h1} too early"
    assert len(task) == sum(2 * len(p) + 1 for p in paths)
    assert res.makespan == pytest.approx(max(e for _, _, e in task.values()))


def test_never_overlaps_respects_memory_and_causality():
    cluster, schedules = _geo_schedules()
    for sched in schedules:
        res = simulate(cluster, sched.paths)
        _check_trace(cluster, sched.paths, res)
        assert max(res.max_in_flight.values()) <= 3
        for x in res.busy_s:
            assert res.idle_s[x] == pytest.approx(res.makespan - res.busy_s[x])
        assert 0 <= res.idle_fraction < 1


def test_reproducible():
    cluster, schedules = _geo_schedules()
    a = simulate(cluster, schedules[1].paths, gap_network=0.13, gap_local=0.09)
    b = simulate(cluster, schedules[1].paths, gap_network=0.13, gap_local=0.09)
    assert a.makespan == b.makespan and a.intervals == b.intervals


@pytest.mark.parametrize("S, M, w, c", [(4, 6, 1.0, 10.0), (6, 5, 0.5, 4.0), (3, 1, 2.0, 0.3)])
def test_closed_form_homogeneous_full_pipeline(S, M, w, c):
    """No skipping, one node per stage, links slow enough that forwards and backwards never
    meet on a node: makespan = one microbatch's latency + (M - 1) x the 1.5 w backward."""
    cluster = _homogeneous(S, w=w, c=c)
    sched = full_pipeline_schedule(cluster, tuple((i,) for i in range(S)), M)
    single = 2.5 * S * w + 0.25 * w + 2 * S * c
    assert sched.expected_makespan == pytest.approx(single + (M - 1) * 1.5 * w)
    res = simulate(cluster, sched.paths)
    assert sum(res.busy_s.values()) == pytest.approx(M * (2.5 * S + 0.25) * w)


@pytest.mark.parametrize("S, M, c", [(4, 5, 0.0), (3, 4, 0.7)])
def test_closed_form_memory_one_serialises(S, M, c):
    """memory = 1: the originator starts a microbatch only when the previous one is back."""
    cluster = _homogeneous(S, w=1.0, c=c, memory=1)
    sched = full_pipeline_schedule(cluster, tuple((i,) for i in range(S)), M)
    assert sched.expected_makespan == pytest.approx(M * (2.5 * S + 0.25 + 2 * S * c))
    assert simulate(cluster, sched.paths).deferred == M - 1


def test_memory_window_defers_and_bounds_hold():
    cluster = _homogeneous(4, w=1.0, c=0.0, memory=2)
    sched = full_pipeline_schedule(cluster, ((0,), (1,), (2,), (3,)), 6)
    res = simulate(cluster, sched.paths)
    _check_trace(cluster, sched.paths, res)
    assert res.deferred > 0 and max(res.max_in_flight.values()) == 2
    assert res.makespan >= max(res.busy_s.values())
    assert res.makespan >= 2.5 * 4 + 0.25                      # one microbatch's critical path


def test_gap_keeps_node_busy():
    cluster = _homogeneous(2, w=1.0, c=0.0)
    res = simulate(cluster, [(0, 1), (0, 1)], gap_network=0.5)
    starts = sorted(s for s, _, kind, _, _ in res.intervals[0] if kind == "F")
    assert starts == [0.0, 1.5]


def test_non_collision_aware_estimate_is_optimistic():
    cluster, schedules = _geo_schedules()
    for sched in schedules:
        assert simulate(cluster, sched.paths, exclusive=False).makespan <= \
            simulate(cluster, sched.paths).makespan + EPS


def test_crossed_paths_deadlock_is_reported_not_hung():
    cluster = _homogeneous(4, w=1.0, c=0.1, memory=1)
    with pytest.raises(SimulationDeadlock, match="never finished"):
        simulate(cluster, [(0, 2, 3), (1, 3, 2)])
    assert simulate(_homogeneous(4, memory=2), [(0, 2, 3), (1, 3, 2)]).makespan > 0


def test_rejects_bad_paths():
    cluster = _homogeneous(3)
    with pytest.raises(ValueError, match="outside"):
        simulate(cluster, [(0, 5)])
    with pytest.raises(ValueError, match="needs an originator"):
        simulate(cluster, [(0,)])
