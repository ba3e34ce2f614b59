"""pipeline/paths.py and the schedule validator: rules R1-R5 at their edges (P1-P5)."""

import json

import pytest

from pipeline.cluster import Cluster
from pipeline.paths import PathRules, enumerate_paths, orderings, stage_violation
from pipeline.schedule import Schedule, ScheduleViolation, validate_schedule


def _rule(path, rules):
    bad = stage_violation(path, rules)
    return None if bad is None else bad[0]


def test_enumeration_every_path_legal_and_complete():
    rules = PathRules(S=6, L=4)
    paths = enumerate_paths(rules)
    assert len(paths) == len(set(paths))
    for p in paths:
        assert p[0] == 0 and 0 not in p[1:]                        # P1/P2: stage 0 once, first
        assert len(set(p)) == rules.L                              # P2
        assert stage_violation(p, rules) is None
    # completeness: brute force over all sequences of L distinct stages
    from itertools import permutations
    brute = {(0, *q) for q in permutations(range(1, 6), 3) if stage_violation((0, *q), rules) is None}
    assert brute == set(paths)
    assert paths[0] == (0, 1, 2, 3), "in-order paths come first"
    assert (0, 2, 1, 3) in paths and (0, 3, 1, 2) not in paths     # adjacent swap only


def test_skip_ratio_helper():
    assert PathRules.from_skip_ratio(6, 1 / 3).L == 4
    assert PathRules.from_skip_ratio(4, 1 / 3).L == 3
    assert PathRules.from_skip_ratio(5, 0).L == 5


def test_r1_r2():
    rules = PathRules(S=4, L=3)
    assert _rule((1, 2, 3), rules) == "R1"
    assert _rule((0, 1, 0), rules) == "R1"
    assert _rule((0, 1, 1), rules) == "R2"
    assert _rule((0, 1), rules) == "R2"
    assert _rule((0, 1, 2, 3), rules) == "R2"
    assert _rule((0, 1, 7), rules) == "R2"
    assert _rule((0, 1, 2), rules) is None


def test_r3_swap_limits_at_their_edges():
    r = PathRules(S=8, L=7, max_jump=7, max_swap_distance=1, max_swaps=2, max_total_swap_distance=2)
    assert _rule((0, 2, 1, 4, 3, 5, 6), r) is None                  # 2 adjacent swaps: edge ok
    assert _rule((0, 2, 1, 4, 3, 6, 5), r) == "R3"                  # 3 swaps
    assert _rule((0, 3, 1, 2, 4, 5, 6), r) == "R3"                  # swap distance 2
    wide = PathRules(S=8, L=7, max_jump=7, max_swap_distance=2, max_swaps=2,
                     max_total_swap_distance=2)
    assert _rule((0, 3, 1, 2, 4, 5, 6), wide) == "R3"               # 2 + 1 = 3 > total 2
    assert _rule((0, 1, 4, 2, 3, 5, 6), wide) == "R3"
    assert _rule((0, 1, 2, 5, 3, 4, 6), PathRules(S=8, L=7, max_jump=7, max_swap_distance=2,
                                                  max_swaps=2, max_total_swap_distance=3)) is None
    tight = PathRules(S=8, L=7, max_jump=7, max_swaps=2, max_total_swap_distance=1)
    assert _rule((0, 2, 1, 3, 4, 5, 6), tight) is None
    assert _rule((0, 2, 1, 4, 3, 5, 6), tight) == "R3"              # total distance 2 > 1
    assert _rule((0, 2, 1, 3), PathRules(S=4, L=4, max_swaps=0)) == "R3"


def test_r4_jump_at_its_edge():
    r = PathRules(S=7, L=3, max_jump=4)
    assert _rule((0, 4, 5), r) is None                              # jump of exactly 4
    assert _rule((0, 5, 6), r) == "R4"                              # 5 > 4
    assert _rule((0, 1, 5), r) is None
    assert _rule((0, 1, 6), r) == "R4"
    assert _rule((0, 1, 2), PathRules(S=4, L=3, max_jump=1)) is None
    assert _rule((0, 1, 3), PathRules(S=4, L=3, max_jump=1)) == "R4"


def test_orderings_of_a_stage_set():
    got = orderings((1, 2, 3), PathRules(S=5, L=4))
    assert got[0] == (0, 1, 2, 3)
    assert set(got) == {(0, 1, 2, 3), (0, 1, 3, 2), (0, 2, 1, 3)}   # no distance-2 swaps


# --- validator -------------------------------------------------------------------------------

PARTS = ((0, 1), (2,), (3,), (4,))         # 2 originators, stages 1..3 one node each
CLUSTER = Cluster(compute=(1.0,) * 5, comm=[[0.0] * 5 for _ in range(5)], memory=3)
RULES = PathRules(S=4, L=3)


def _good_paths():
    # 6 microbatches x 2 hops = 12 visits, 4 per stage; each stage node visited 4 times
    return [(0, 2, 3), (1, 3, 4), (0, 2, 4), (1, 2, 3), (0, 3, 4), (1, 2, 4)]


def _sched(paths, rules=RULES, parts=PARTS):
    return Schedule(partitions=parts, paths=paths, rules=rules)


def test_validator_accepts_a_good_schedule_and_roundtrips_json():
    rules = PathRules(S=4, L=3, cap_visits_by_memory=False)
    s = validate_schedule(_sched(_good_paths(), rules), CLUSTER)
    back = Schedule.from_json(s.to_json())
    assert back == s and back.sha256() == s.sha256()
    assert json.loads(s.to_json())["microbatches"][0] == [0, 0, 0]


@pytest.mark.parametrize("mutate, rule", [
    (lambda p: [(2, 3, 4)] + p[1:], "R1"),                  # starts at a stage-1 node
    (lambda p: [(0, 2, 1)] + p[1:], "R1"),                  # visits another originator
    (lambda p: [(0, 2, 2)] + p[1:], "R2"),                  # repeats a stage
    (lambda p: [(0, 2)] + p[1:], "R2"),                     # too short
    (lambda p: [(0, 9, 3)] + p[1:], "P5"),                  # node serving no stage
    (lambda p: [(0, 4, 2)] + p[1:], "R3"),                  # swap of distance 2
    (lambda p: [(0, 2, 3), (1, 2, 3)] * 3, "R5"),            # stage 3 never visited
    (lambda p: p[:5], "STRUCT"),                            # unequal microbatches per origin
])
def test_validator_names_each_violated_constraint(mutate, rule):
    rules = PathRules(S=4, L=3, cap_visits_by_memory=False)
    with pytest.raises(ScheduleViolation) as info:
        validate_schedule(_sched(mutate(_good_paths()), rules), CLUSTER)
    assert info.value.rule == rule
    assert f"schedule refused: {rule} (" in str(info.value)


def test_validator_r4_and_memory_cap():
    rules = PathRules(S=4, L=3, max_jump=1, cap_visits_by_memory=False)
    with pytest.raises(ScheduleViolation, match="R4"):
        validate_schedule(_sched(_good_paths(), rules), CLUSTER)
    with pytest.raises(ScheduleViolation, match=r"R5 .*node 2 .*memory 3"):
        validate_schedule(_sched(_good_paths(), RULES), CLUSTER)     # 4 visits > memory 3
    roomy = Cluster(compute=(1.0,) * 5, comm=[[0.0] * 5 for _ in range(5)], memory=4)
    validate_schedule(_sched(_good_paths(), RULES), roomy)


def test_validator_structure():
    rules = PathRules(S=4, L=3, cap_visits_by_memory=False)
    with pytest.raises(ScheduleViolation, match="STRUCT"):
        validate_schedule(_sched(_good_paths(), rules, parts=((0, 1), (2,), (3, 4))), CLUSTER)
    with pytest.raises(ScheduleViolation, match="STRUCT"):
        validate_schedule(_sched(_good_paths(), rules, parts=((0, 1), (2,), (3,), (3, 4))))
    with pytest.raises(ScheduleViolation, match="STRUCT"):
        Schedule.from_json('{"paths": 3}')


def test_successor_and_predecessor_maps_consistent():
    """P5: one successor per hop; backward goes to the exact predecessor, inverse of forward."""
    rules = PathRules(S=4, L=3, cap_visits_by_memory=False)
    s = validate_schedule(_sched(_good_paths(), rules), CLUSTER)
    for pid, path in enumerate(s.paths):
        for hop in range(1, len(path)):
            assert s.predecessor(pid, hop) == path[hop - 1]
            assert s.successor(pid, hop - 1) == path[hop]
        assert s.successor(pid, len(path) - 1) == path[0]          # last hop returns home
    for node in (2, 3, 4):
        for pid, (hop, pred, succ) in s.routes(node).items():
            assert s.paths[pid][hop] == node
            assert s.successor(pid, hop - 1) == node and s.predecessor(pid, hop) == pred
            assert s.stage_of(succ) != s.stage_of(node)
    assert [s.path_id(o, q) for o, q, _ in s.microbatches()] == [p for _, _, p in s.microbatches()]


def test_schedule_config_builds_rules():
    from pydantic import ValidationError

    from pipeline.config import ScheduleConfig
    cfg = ScheduleConfig()
    assert (cfg.rules().S, cfg.rules().L) == (6, 4)
    assert ScheduleConfig(stages=4, skip_ratio=1 / 3).rules().L == 3
    assert ScheduleConfig(stages=5, skip_ratio=0).rules().L == 5
    with pytest.raises(ValidationError, match="extra"):
        ScheduleConfig(stage=4)
    with pytest.raises(ValidationError):
        ScheduleConfig(skip_ratio=1.0)
