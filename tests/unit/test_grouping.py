"""N1: seeded grouping (official rule, remainder policy, roster hash)."""

import itertools

import numpy as np
import pytest

from optimizers.grouping import (groups_for_roster, my_group, official_groups, partition,
                                 roster_hash)


def _ids(W: int) -> list[str]:
    return [f"Qm{i:03d}peer" for i in range(W)]


@pytest.mark.parametrize("W,k", [(2, 2), (4, 2), (8, 2), (16, 4), (12, 3), (8, 8)])
@pytest.mark.parametrize("step", [20, 40, 100, 5000])
def test_n1_official_golden(W, k, step):
    perm = np.random.default_rng(step + 1).permutation(W)
    n_grp = W // k
    expected = [[int(perm[i]) for i in range(W) if i % n_grp == g] for g in range(n_grp)]
    assert official_groups(step, W, k) == expected


def test_n1_official_requires_divisible():
    with pytest.raises(ValueError, match="groups_for_roster"):
        official_groups(20, 5, 2)


def test_n1_roster_matches_official_with_seed_zero():
    ids = _ids(8)
    for r in range(1, 6):
        got = groups_for_roster(ids, r, seed=0, H=20, k=2)
        assert got == [[ids[i] for i in g] for g in official_groups(r * 20, 8, 2)]


@pytest.mark.parametrize("W", range(1, 20))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_n1_disjoint_covering_sizes(W, k):
    ids = _ids(W)
    for r in range(3):
        groups = groups_for_roster(ids, r, seed=7, H=50, k=k)
        flat = list(itertools.chain.from_iterable(groups))
        assert sorted(flat) == sorted(ids)                  # covering and disjoint
        sizes = sorted(len(g) for g in groups)
        n_full, rem = divmod(W, k)
        if n_full == 0:
            assert sizes == [W]                             # W < k: one group of all (solo if 1)
        elif rem == 0:
            assert sizes == [k] * n_full
        elif rem == 1:
            assert sizes == [k] * (n_full - 1) + [k + 1]
            assert len(groups[-1]) == k + 1                 # the *last* group takes k+1
        else:
            assert sizes == sorted([k] * n_full + [rem])
            assert all(len(g) >= 2 for g in groups)         # nobody left alone


def test_n1_remainder_k2_odd_gives_one_triple_and_solo_only_when_alone():
    assert [len(g) for g in groups_for_roster(_ids(5), 3, 0, 20, 2)] == [2, 3]
    assert groups_for_roster(["only"], 3, 0, 20, 2) == [["only"]]
    assert groups_for_roster([], 3, 0, 20, 2) == []
    assert partition([4, 1, 0, 3, 2], 2) == [[4, 0], [1, 3, 2]]


def test_n1_same_everywhere_regardless_of_roster_order():
    ids = _ids(10)
    rng = np.random.default_rng(0)
    ref = groups_for_roster(ids, 4, 3, 20, 2)
    for _ in range(5):
        shuffled = list(rng.permutation(ids))
        assert groups_for_roster(shuffled, 4, 3, 20, 2) == ref
        assert roster_hash(shuffled) == roster_hash(ids)
    for pid in ids:
        g = my_group(pid, ids, 4, 3, 20, 2)
        assert pid in g and g in ref


def test_n1_changes_between_rounds_and_seeds():
    ids = _ids(8)
    rounds = [groups_for_roster(ids, r, 0, 20, 2) for r in range(10)]
    assert len({str(sorted(map(sorted, g))) for g in rounds}) >= 8
    assert groups_for_roster(ids, 2, 0, 20, 2) != groups_for_roster(ids, 2, 1, 20, 2)


def test_n1_roster_hash_and_errors():
    assert roster_hash(_ids(4)) != roster_hash(_ids(5))
    assert len(roster_hash(_ids(4))) == 16
    with pytest.raises(ValueError, match="duplicate"):
        groups_for_roster(["a", "a", "b"], 0, 0, 20, 2)
    with pytest.raises(ValueError, match="not in the roster"):
        my_group("z", ["a", "b"], 0, 0, 20, 2)
