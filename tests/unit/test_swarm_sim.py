"""Pure scheduling logic of benchmarks/noloco_swarm_sim.py (no training, no torch work)."""

from __future__ import annotations

import random

import pytest

from benchmarks.noloco_swarm_sim import (
    blocked_stats,
    build_schedule,
    group_allreduce_s,
    make_links,
    make_speeds,
    pair_transfer_s,
    pick_partner,
    schedule_diloco,
    schedule_local,
    schedule_noloco,
)
from node.netem import modelled_allreduce_s, transfer_s

MiB = 1 << 20


def const_pair(s):
    return lambda a, b: s


def test_diloco_blocked_is_barrier_wait_plus_allreduce():
    dur = [[10.0, 10.0], [13.0, 11.0], [20.0, 5.0]]
    ar = 2.5
    s = schedule_diloco(dur, ar)
    # round 1: arrivals 10, 13, 20 -> end 22.5 for everyone
    r1 = {r.worker: r for r in s.records if r.round == 1}
    for w, arrival in ((0, 10.0), (1, 13.0), (2, 20.0)):
        assert r1[w].arrival == pytest.approx(arrival)
        assert r1[w].finish == pytest.approx(22.5)
        assert r1[w].blocked == pytest.approx(20.0 - arrival + ar)
    # round 2 starts at 22.5 for everyone: arrivals 32.5, 33.5, 27.5 -> end 33.5 + 2.5
    r2 = {r.worker: r for r in s.records if r.round == 2}
    assert [r2[w].arrival for w in range(3)] == pytest.approx([32.5, 33.5, 27.5])
    assert all(r2[w].finish == pytest.approx(36.0) for w in range(3))
    assert r2[2].blocked == pytest.approx(33.5 - 27.5 + ar)
    assert len(s.events) == 2 and all(len(m) == 3 for _, m, _ in s.events)


def test_noloco_pairs_two_waiting_workers():
    # w0 arrives at 5, w1 at 7: pair at 7, both finish at 7 + 1
    s = schedule_noloco([[5.0], [7.0]], const_pair(1.0), round_timeout=10.0)
    recs = {r.worker: r for r in s.records}
    assert recs[0].outcome == recs[1].outcome == "pair"
    assert recs[0].finish == recs[1].finish == pytest.approx(8.0)
    assert recs[0].blocked == pytest.approx(3.0) and recs[1].blocked == pytest.approx(1.0)
    assert recs[0].group == recs[1].group == [0, 1]


def test_noloco_overlap_hides_the_wait_and_shortens_the_next_round():
    # w0 arrives at 5, w1 at 7, pair at 8; w0 may compute 2 s of its next round meanwhile
    s = schedule_noloco([[5.0, 4.0], [7.0, 4.0]], const_pair(1.0), round_timeout=10.0, overlap_s=[2.0, 2.0])
    r = {(x.worker, x.round): x for x in s.records}
    assert r[(0, 1)].blocked == pytest.approx(1.0)    # 3 s at the exchange, 2 of them computing
    assert r[(1, 1)].blocked == pytest.approx(0.0)    # its 1 s transfer is hidden too
    assert r[(0, 2)].arrival == pytest.approx(8.0 + 4.0 - 2.0)
    assert r[(1, 2)].arrival == pytest.approx(8.0 + 4.0 - 1.0)
    plain = schedule_noloco([[5.0, 4.0], [7.0, 4.0]], const_pair(1.0), round_timeout=10.0)
    assert {(x.worker, x.round): x.blocked for x in plain.records}[(0, 1)] == pytest.approx(3.0)


def test_noloco_lone_worker_goes_solo_after_timeout():
    # partner arrives after the timeout: both go solo, each blocked exactly the timeout
    s = schedule_noloco([[5.0], [16.0]], const_pair(1.0), round_timeout=10.0)
    recs = {r.worker: r for r in s.records}
    assert recs[0].outcome == "solo" and recs[0].finish == pytest.approx(15.0)
    assert recs[0].blocked == pytest.approx(10.0)
    assert recs[1].outcome == "solo" and recs[1].blocked == pytest.approx(10.0)
    # a partner arriving exactly at the deadline still pairs (arrivals before timeouts)
    s = schedule_noloco([[5.0], [15.0]], const_pair(0.0), round_timeout=10.0)
    assert {r.outcome for r in s.records} == {"pair"}


def test_noloco_pairs_only_within_round_skew():
    # w0 is fast and its partners never come in time: solo rounds end at 1.1, 2.2, 3.3; its
    # round 4 arrives at 4.3 and waits until 4.4. w1's round 1 arrives at 4.35: skew 3.
    dur = [[1.0, 1.0, 1.0, 1.0], [4.35]]
    s = schedule_noloco(dur, const_pair(0.0), round_timeout=0.1, max_round_skew=2)
    assert {r.outcome for r in s.records} == {"solo"}
    s = schedule_noloco(dur, const_pair(0.0), round_timeout=0.1, max_round_skew=3)
    w1r1 = next(r for r in s.records if r.worker == 1 and r.round == 1)
    assert w1r1.outcome == "pair" and w1r1.partner_round == 4 and w1r1.finish == pytest.approx(4.35)
    for r in s.records:
        if r.outcome == "pair":
            assert abs(r.round - r.partner_round) <= 3


def test_pick_partner_skew_preference_and_randomness():
    waiting = {0: (1, 0.0), 1: (4, 0.0), 5: (2, 0.0)}
    assert pick_partner(waiting, 2, 2, random.Random(0)) == 5           # same round first
    assert pick_partner(waiting, 7, 2, random.Random(0)) is None         # nobody within skew
    assert pick_partner({0: (1, 0.0)}, 2, 0, random.Random(0)) is None   # skew 0: same round only
    two = {0: (1, 0.0), 1: (4, 0.0)}
    picks = {pick_partner(two, 2, 2, random.Random(seed)) for seed in range(40)}
    assert picks == {0, 1}                                               # uniform among candidates


def test_every_round_accounted_and_causal():
    sched, _ = build_schedule("noloco", 8, 6, 20, 0, 1.0, 0.1, 64 * MiB, 10.0, 2)
    assert len(sched.records) == 8 * 6
    for w in range(8):
        rs = sched.of(w)
        assert [r.round for r in rs] == list(range(1, 7))
        for a, b in zip(rs, rs[1:]):
            assert b.arrival > a.finish >= a.arrival
    assert all(r.blocked >= 0 for r in sched.records)
    times = [t for t, _, _ in sched.events]
    assert times == sorted(times)
    # each (worker, round) appears in exactly one event
    seen = [m for _, ms, _ in sched.events for m in ms]
    assert len(seen) == len(set(seen)) == 48


def test_deterministic_for_a_seed():
    a, _ = build_schedule("noloco", 16, 6, 20, 3, 1.0, 0.1, 64 * MiB, 10.0, 2)
    b, _ = build_schedule("noloco", 16, 6, 20, 3, 1.0, 0.1, 64 * MiB, 10.0, 2)
    c, _ = build_schedule("noloco", 16, 6, 20, 4, 1.0, 0.1, 64 * MiB, 10.0, 2)
    assert a.records == b.records and a.events == b.events
    assert a.records != c.records


def test_speeds_links_and_transfer_model():
    sp = make_speeds(5, 0, 2.0)
    assert sorted(sp) == pytest.approx([2.0, 2.5, 3.0, 3.5, 4.0])
    links = make_links(4, 0)
    for i in range(4):
        for j in range(4):
            if i != j:
                lk = links.link(links.nodes[i], links.nodes[j])
                assert 20 <= lk.latency_ms <= 150 and 50 <= lk.bandwidth_mbps <= 500
                assert lk == links.link(links.nodes[j], links.nodes[i])  # symmetric
    lk = links.link("w00", "w01")
    assert pair_transfer_s(links, 0, 1, MiB) == pytest.approx(transfer_s(lk, MiB))
    all_links = [links.link(links.nodes[i], links.nodes[j]) for i in range(4) for j in range(i + 1, 4)]
    assert group_allreduce_s(links, [0, 1, 2, 3], MiB) == pytest.approx(
        modelled_allreduce_s(MiB, 4, all_links))


def test_local_and_stats():
    s = schedule_local([[1.0, 2.0], [3.0, 3.0]])
    assert [r.finish for r in s.of(1)] == [3.0, 6.0] and all(r.blocked == 0 for r in s.records)
    st = blocked_stats(schedule_diloco([[1.0], [3.0]], 0.0))
    assert st["mean"] == pytest.approx(1.0) and st["max"] == pytest.approx(2.0)
    assert st["p50"] == pytest.approx(1.0)
