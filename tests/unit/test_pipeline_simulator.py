"""pipeline/simulator.py: exclusivity, memory window, causality, closed forms (P6, P7)."""

import pytest

from pipeline.cluster import Cluster, ClusterError
from pipeline.geo import geo_cluster
from pipeline.paths import PathRules
from pipeline.search import full_pipeline_schedule, random_schedule, skippipe_schedule
from pipeline.simulator import SimulationDeadlock, iteration_period, simulate

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


def test_ready_at_delays_a_node_and_its_origin():
    cluster = _homogeneous(3, w=1.0, c=0.5)
    base = simulate(cluster, [(0, 1, 2)])
    assert base.makespan == pytest.approx(10.75)          # 2.5 x 3 w + 0.25 w + 6 sends x 0.5
    later = simulate(cluster, [(0, 1, 2)], ready_at={1: 3.3})
    assert min(s for s, *_ in later.intervals[1]) == pytest.approx(3.3)
    assert later.makespan == pytest.approx(10.75 + 3.3 - 1.5)   # its first forward would start at 1.5
    assert simulate(cluster, [(0, 1, 2)], ready_at={0: 2.0}).makespan == pytest.approx(12.75)


def test_iteration_period_chains_the_replica_exchange_by_hand():
    """Stage 1 has replicas 1 and 3; only node 1 is on the path. Without gradient times the
    period is the makespan (10.75). With grad_s[3][1] = 3: every node hears the origin's
    EndOfIteration 0.5 s after 10.75, node 1 steps at 11.25 + 3 = 14.25 while the origin starts
    the next iteration at 10.75, so node 1 is ready 3.5 s into it instead of needing the
    forward at 1.5: +2 s per iteration, steady from the second one."""
    cluster = _homogeneous(4, w=1.0, c=0.5)
    groups = ((0,), (1, 3), (2,))
    assert iteration_period(cluster, [(0, 1, 2)], groups).period == pytest.approx(10.75)
    grad = [[0.0] * 4 for _ in range(4)]
    grad[3][1], grad[1][3] = 3.0, 0.2
    synced = Cluster(compute=cluster.compute, comm=cluster.comm, memory=cluster.memory, grad_s=grad)
    res = iteration_period(synced, [(0, 1, 2)], groups, iterations=4)
    assert res.makespan == pytest.approx(10.75) and synced.has_sync and not cluster.has_sync
    assert res.periods == pytest.approx([10.75, 12.75, 12.75, 12.75]) and res.period == pytest.approx(12.75)


def test_links_serialise_messages_but_overlap_latency():
    """With the latency split given, two forwards leaving node 0 for node 1 at once share the
    link's transfer time (0.4 s each) and each still takes the 0.1 s latency."""
    comm = [[0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]]
    lat = [[0.0, 0.1, 0.1], [0.1, 0.0, 0.1], [0.1, 0.1, 0.0]]
    free = Cluster(compute=(0.0, 1.0, 1.0), comm=comm, memory=3)
    piped = Cluster(compute=(0.0, 1.0, 1.0), comm=comm, memory=3, latency=lat)
    paths = [(0, 1), (0, 1)]
    first_fwd = lambda r: sorted(s for s, _, k, *_ in r.intervals[1] if k == "F")  # noqa: E731
    assert first_fwd(simulate(free, paths)) == pytest.approx([0.5, 1.5])
    assert first_fwd(simulate(piped, paths)) == pytest.approx([0.5, 1.5])       # compute-bound anyway
    fast = Cluster(compute=(0.0, 0.1, 0.1), comm=comm, memory=3, latency=lat)
    assert first_fwd(simulate(fast, paths)) == pytest.approx([0.5, 0.9])      # second waits for the link
    assert first_fwd(simulate(Cluster(compute=(0.0, 0.1, 0.1), comm=comm, memory=3), paths)) == \
        pytest.approx([0.5, 0.6])
    with pytest.raises(ClusterError, match="latency"):
        Cluster(compute=(1.0, 1.0), comm=[[0, 0.1], [0.1, 0]], memory=1, latency=[[0, 0.2], [0.2, 0]])
    with pytest.raises(ClusterError, match="grad_s"):
        Cluster(compute=(1.0, 1.0), comm=[[0, 0.1], [0.1, 0]], memory=1, grad_s=[[0.0, -1.0], [0.0, 0.0]])


def _two_nodes():
    return Cluster(compute=(1.0, 1.0), comm=[[0.0, 0.5], [0.5, 0.0]], memory=3)


def test_after_injects_a_paths_next_microbatch_once_the_previous_is_home():
    """One microbatch on 0 -> 1: F 1 + .5 + F 1 + .5 + loss .25 + .5 + B 1.5 + .5 + B 1.5 = 7.25 s;
    chained, the second starts when the first is home: 14.5 s."""
    cluster = _two_nodes()
    assert simulate(cluster, [(0, 1)]).makespan == pytest.approx(7.25)
    res = simulate(cluster, [(0, 1), (0, 1)], after=[None, 0])
    assert res.completion == pytest.approx([7.25, 14.5])
    assert res.max_in_flight == {0: 1, 1: 1}


def test_release_delays_an_injection():
    res = simulate(_two_nodes(), [(0, 1), (0, 1)], release=[0.0, 10.0])
    assert res.completion == pytest.approx([7.25, 17.25])


def test_gap_inject_applies_after_an_originators_first_forward_only():
    res = simulate(_two_nodes(), [(0, 1), (0, 1)], gap_inject=0.2)
    starts = [(s, kind, m) for s, _, kind, m, hop in res.intervals[0] if kind == "F"]
    assert starts == [(0.0, "F", 0), (pytest.approx(1.2), "F", 1)]
    plain = simulate(_two_nodes(), [(0, 1), (0, 1)], gap_local=0.2, gap_network=0.0)
    assert [s for s, _, kind, *_ in plain.intervals[0] if kind == "F"] == [0.0, 1.0]


def test_after_must_name_another_microbatch_of_the_same_origin():
    cluster = Cluster(compute=(1.0,) * 3, comm=[[0.0, 0.5, 0.5]] * 3, memory=3)
    with pytest.raises(ValueError, match="same originator"):
        simulate(cluster, [(0, 1), (2, 1)], after=[None, 0])
    with pytest.raises(ValueError, match="one entry per microbatch"):
        simulate(cluster, [(0, 1)], release=[0.0, 1.0])
