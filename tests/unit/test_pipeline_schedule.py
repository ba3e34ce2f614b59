"""pipeline/search.py: SkipPipe and baseline schedules are legal, balanced and ordered (P1-P7)."""

from collections import Counter

import pytest

from pipeline.cluster import Cluster
from pipeline.geo import compare, geo_cluster
from pipeline.paths import PathRules, stage_violation
from pipeline.schedule import Schedule, ScheduleViolation, validate_schedule
from pipeline.search import (full_pipeline_schedule, plan, random_schedule, skippipe_schedule)
from pipeline.simulator import simulate

SMALL = dict(n=9, parts=[3, 2, 2, 2], rules=PathRules(S=4, L=3), mb=3)      # 3 data + 3 x 2
PAPER = dict(n=20, parts=[5, 3, 3, 3, 3, 3], rules=PathRules(S=6, L=4), mb=3)  # k = 1/3


def _legal_and_balanced(sched: Schedule, cluster: Cluster):
    validate_schedule(sched, cluster)
    rules = sched.rules
    stage_of = {x: s for s, g in enumerate(sched.partitions) for x in g}
    for pid, path in enumerate(sched.paths):
        stages = [stage_of[x] for x in path]
        assert stages[0] == 0 and path[0] in sched.partitions[0]            # P1
        assert len(set(stages)) == rules.L and 0 not in stages[1:]         # P2
        assert stage_violation(tuple(stages), rules) is None                # P3
    visits = Counter(stage_of[x] for p in sched.paths for x in p[1:])
    assert len(set(visits[s] for s in range(1, rules.S))) == 1               # P4 balance
    assert sum(visits.values()) == len(sched.paths) * (rules.L - 1)
    if rules.cap_visits_by_memory:
        for x, v in sched.node_visits().items():
            assert v <= cluster.memory[x]
    per_origin = Counter(p[0] for p in sched.paths)
    assert set(per_origin) == set(sched.partitions[0]) and len(set(per_origin.values())) == 1


@pytest.mark.parametrize("setup", [SMALL, PAPER], ids=["9-nodes", "20-nodes"])
def test_every_schedule_legal_and_balanced(setup):
    cluster = geo_cluster(setup["n"], seed=0)
    for method in ("skippipe", "random", "full"):
        sched = plan(cluster, setup["parts"], setup["rules"], setup["mb"], method=method,
                     time_budget_s=120, max_iters=300) if method == "skippipe" else \
            plan(cluster, setup["parts"], setup["rules"], setup["mb"], method=method)
        _legal_and_balanced(sched, cluster)
        assert sched.method == method and sched.cost_hash == cluster.cost_hash()
        assert sched.expected_makespan == pytest.approx(simulate(cluster, sched.paths).makespan)


def test_skippipe_beats_random_on_geo_matrix():
    """Heterogeneous geo-distributed cluster, k = 1/3: SkipPipe <= random legal paths (the
    assertion); full pipeline figures are reported by `python -m pipeline.geo`."""
    for seed in (0, 1):
        cluster = geo_cluster(20, seed=seed)
        out = compare(cluster, PAPER["parts"], PAPER["rules"], PAPER["mb"], seed=seed,
                      time_budget_s=120, max_iters=3000, patience=800)
        assert out["skippipe"]["makespan_s"] <= out["random"]["makespan_s"]
        assert out["skippipe"]["makespan_s"] < out["full"]["makespan_s"]


def test_search_only_improves_and_is_deterministic():
    cluster = geo_cluster(9, seed=2)
    part = ((0, 4, 8), (1, 5), (2, 6), (3, 7))
    rules = SMALL["rules"]
    start = skippipe_schedule(cluster, part, rules, 3, max_iters=0)
    a = skippipe_schedule(cluster, part, rules, 3, seed=7, max_iters=1500, time_budget_s=120)
    b = skippipe_schedule(cluster, part, rules, 3, seed=7, max_iters=1500, time_budget_s=120)
    assert a.to_json() == b.to_json() and a.sha256() == b.sha256()
    assert a.expected_makespan <= start.expected_makespan


def test_collision_aware_no_worse_than_non_ca():
    """P7: makespan(TC2) <= makespan(no TC2), both measured by the collision-aware simulator."""
    cluster = geo_cluster(20, seed=0)
    part = plan(cluster, PAPER["parts"], PAPER["rules"], PAPER["mb"], method="full").partitions
    ca = skippipe_schedule(cluster, part, PAPER["rules"], 3, max_iters=2000, patience=800,
                           time_budget_s=120)
    nonca = skippipe_schedule(cluster, part, PAPER["rules"], 3, max_iters=2000, patience=800,
                              time_budget_s=120, collision_aware=False)
    assert ca.expected_makespan <= nonca.expected_makespan
    _legal_and_balanced(nonca, cluster)


def test_infeasible_inputs_are_refused_naming_the_rule():
    cluster = geo_cluster(9, seed=0)
    part = ((0, 4, 8), (1, 5), (2, 6), (3, 7))
    with pytest.raises(ScheduleViolation, match=r"R5 .*S-1=3 divides"):
        random_schedule(cluster, ((0, 4), (1, 5, 8), (2, 6), (3, 7)), PathRules(S=4, L=3), 1)
    with pytest.raises(ScheduleViolation, match=r"R5 .*add replicas"):
        skippipe_schedule(cluster, part, PathRules(S=4, L=3), 6)    # 12 visits > 2 x memory 3
    with pytest.raises(ScheduleViolation, match="STRUCT"):
        skippipe_schedule(cluster, part, PathRules(S=5, L=3), 3)


def test_full_pipeline_visits_every_stage_in_order():
    cluster = geo_cluster(9, seed=0)
    part = ((0, 4, 8), (1, 5), (2, 6), (3, 7))
    sched = full_pipeline_schedule(cluster, part, 4)
    assert all(sched.stages(pid) == (0, 1, 2, 3) for pid in range(len(sched.paths)))
    assert Counter(sched.node_visits()) == Counter({x: 6 for g in part[1:] for x in g})


def test_geo_script_prints_the_three_schedules(capsys):
    from pipeline.geo import main
    main(["--nodes", "9", "--parts", "3,2,2,2", "--S", "4", "--skip", "0.3333", "--budget-s", "5"])
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["L"] == 3 and out["nodes"] == 9
    assert out["skippipe"]["makespan_s"] <= out["random"]["makespan_s"]
    assert {"full", "random", "skippipe", "ratio_skippipe_vs_full"} <= set(out)


# --------------------------------------------------------------- paths carrying several microbatches

def test_the_papers_cap_counts_paths_and_ours_counts_microbatches():
    """The same 6 microbatches per data node on 9 nodes: refused with one microbatch per path
    (ours: 12 visits per stage > 2 replicas x memory 3), legal as 3 paths of 2 (the paper's)."""
    cluster = geo_cluster(9, seed=0)
    part = ((0, 4, 8), (1, 5), (2, 6), (3, 7))
    with pytest.raises(ScheduleViolation, match=r"R5 .*mb_per_path"):
        skippipe_schedule(cluster, part, PathRules(S=4, L=3), 6)
    rules = PathRules(S=4, L=3, mb_per_path=2)
    sched = skippipe_schedule(cluster, part, rules, 6, max_iters=200, time_budget_s=20)
    assert len(sched.paths) == 18 and sched.mb_per_origin == 6 and sched.paths_per_origin == 3
    assert max(sched.node_visits().values()) == 6 and set(sched.node_visits().values()) == {6}
    after = sched.after()
    assert sum(a is not None for a in after) == 9
    assert all(sched.paths[pid] == sched.paths[prev] for pid, prev in enumerate(after) if prev is not None)
    res = simulate(cluster, sched.paths, after=after)
    assert sched.expected_makespan == pytest.approx(res.makespan)
    assert res.deferred == 0 and max(res.max_in_flight.values()) <= 3
    assert random_schedule(cluster, part, rules, 6, seed=1).node_visits() == sched.node_visits()


def test_paths_of_several_microbatches_are_refused_when_split_or_unfilled():
    cluster = geo_cluster(9, seed=0)
    part = ((0, 4, 8), (1, 5), (2, 6), (3, 7))
    rules = PathRules(S=4, L=3, mb_per_path=2)
    sched = random_schedule(cluster, part, rules, 4, seed=0)       # two paths of 2 per data node
    o = next(o for o in part[0] if len({sched.paths[i] for i in sched.path_ids(o)}) == 2)
    ids, paths = sched.path_ids(o), list(sched.paths)
    paths[ids[2]], paths[ids[3]] = paths[ids[3]], paths[ids[2]]    # seq 2 takes seq 1's route
    with pytest.raises(ScheduleViolation, match=r"R5 .*same path as seq j - 2"):
        validate_schedule(Schedule(partitions=part, paths=tuple(paths), rules=rules), cluster)
    with pytest.raises(ScheduleViolation, match=r"STRUCT .*multiple of it"):
        validate_schedule(Schedule(partitions=part, paths=sched.paths[:3], rules=rules), cluster)
    with pytest.raises(ScheduleViolation, match="STRUCT .*mb_per_path=2"):
        random_schedule(cluster, part, rules, 3)
    with pytest.raises(ValueError, match="mb_per_path=0"):
        PathRules(mb_per_path=0)


def test_schedule_config_takes_the_papers_setting():
    from pipeline.config import ScheduleConfig
    assert ScheduleConfig().mb_per_path == 1 and ScheduleConfig().mb_per_origin == 3     # ours
    paper = ScheduleConfig(mb_per_origin=6, mb_per_path=2, memory=3)
    assert paper.rules().mb_per_path == 2 and paper.rules().L == 4
    with pytest.raises(ValueError, match="multiple of"):
        ScheduleConfig(mb_per_origin=5, mb_per_path=2)
    with pytest.raises(ValueError, match="mb_per_path = 1"):
        ScheduleConfig(mb_per_origin=6, mb_per_path=2, checkfree_plus=True)
