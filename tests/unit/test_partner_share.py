"""optimizers/partner_share.py: the cap on any one peer's share of our recent pair exchanges."""

from __future__ import annotations

import random

import pytest

from optimizers.partner_share import PartnerShare


def test_the_cap_is_twice_the_fair_share_over_a_span_of_about_four_exchanges_per_peer():
    s = PartnerShare(2.0, 16, min_count=2)
    assert [(s.span(n), s.cap(n)) for n in (1, 2, 3, 4, 8, 100)] == \
        [(16, 32), (16, 16), (16, 11), (16, 8), (32, 8), (400, 8)]
    # distinct partners of the last `window` exchanges count as peers we could pair with
    for p in "abcdefgh":
        s.record(p)
    assert (s.span(1), s.cap(1)) == (32, 8)
    assert PartnerShare(1.0, 16, min_count=3).cap(100) == 4  # the fair count (400 / 100) is above min_count
    assert PartnerShare(1.0, 16, min_count=5).cap(100) == 5


def test_a_peer_taking_more_than_its_share_is_over_and_others_are_not():
    s = PartnerShare(2.0, 16)
    for i in range(16):  # the greedy peer took 10 of 16, the three honest ones 2 each
        s.record("greedy" if i % 8 < 5 else "abc"[i % 3])
    assert s.counts()["greedy"] == 10
    assert s.over("greedy", 4) and not any(s.over(p, 4) for p in "abc")
    assert not s.over("stranger", 4)


def test_the_span_grows_with_the_swarm():
    """Fifty others: a greedy peer may take 8 of the last 200 exchanges (4% against a fair 2%),
    not most of them; a span of only `window` (16) would cap every peer at the minimum count."""
    s = PartnerShare(2.0, 16)
    others = [f"p{i}" for i in range(50)]
    for i in range(200):
        s.record("greedy" if i % 25 == 0 else others[i % 50])  # greedy: 8 of 200
    assert s.span(50) == 200 and s.over("greedy", 50)
    assert not any(s.over(p, 50) for p in others)


def test_a_swarm_of_two_is_never_capped():
    two = PartnerShare(2.0, 16)
    for _ in range(40):
        two.record("only")
    assert not two.over("only", 1)  # one other: the cap (32) exceeds the span


@pytest.mark.parametrize("n, limit", [(3, 0.01), (4, 0.03), (8, 0.04), (20, 0.06)])
def test_honest_random_partners_rarely_reach_the_cap(n, limit):
    """Partners chosen uniformly at random, one over the cap replaced by another under it (what the
    exchange does): the share of rounds whose first pick was over the cap (about 1.5% with four
    others, 2-3% with eight)."""
    rng = random.Random(n)
    s = PartnerShare(2.0, 16)
    peers = [f"p{i}" for i in range(n)]
    over = 0
    for _ in range(10_000):
        p = rng.choice(peers)
        if s.over(p, n):
            over += 1
            p = rng.choice([q for q in peers if not s.over(q, n)])
        s.record(p)
    assert over / 10_000 < limit, over


def test_the_span_forgets():
    s = PartnerShare(2.0, 16)
    for _ in range(16):
        s.record("x")
    assert s.over("x", 4)
    for i in range(16):
        s.record("abcd"[i % 4])
    assert not s.over("x", 4) and s.counts() == {p: 4 for p in "abcd"}


@pytest.mark.parametrize("kw", [dict(factor=0.9), dict(window=0), dict(min_count=0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="partner share"):
        PartnerShare(**kw)
