"""security.limits: token buckets, per-peer concurrency slots and the ban list, with an injected clock."""

from __future__ import annotations

import pytest

from security.limits import BanList, ConcurrencyLimiter, LimitExceeded, PeerRateLimiter, TokenBucket


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_token_bucket_refills_at_rate():
    c = Clock()
    b = TokenBucket(10, 5, clock=c)
    assert all(b.try_take() for _ in range(5)) and not b.try_take()
    assert b.wait_s() == pytest.approx(0.1)
    c.t += 0.1
    assert b.try_take() and not b.try_take()
    c.t += 100
    assert b.level() == 5  # capped at burst


def test_bytes_bucket_allows_debt_then_waits():
    c = Clock()
    b = TokenBucket(1000, 1000, clock=c, allow_debt=True)
    assert b.try_take(5000)  # one message larger than the burst passes
    assert not b.try_take(1)
    assert b.wait_s(1) == pytest.approx(4.0, abs=1e-6)
    c.t += 4.01
    assert b.try_take(1)


def test_peer_rate_limiter_is_per_peer():
    c = Clock()
    lim = PeerRateLimiter(requests_per_s=2, bytes_per_s=100, request_burst=2, bytes_burst=100, clock=c)
    lim.check_request("a")
    lim.check_request("a")
    with pytest.raises(LimitExceeded) as ei:
        lim.check_request("a")
    assert ei.value.reason == "rate_requests" and ei.value.code_name == "RESOURCE_EXHAUSTED"
    assert ei.value.grpc_code.name == "RESOURCE_EXHAUSTED"
    lim.check_request("b")  # another peer is unaffected
    lim.check_bytes("a", 150)
    with pytest.raises(LimitExceeded) as ei:
        lim.check_bytes("a", 1)
    assert ei.value.reason == "rate_bytes"
    c.t += 1.0
    lim.check_request("a")
    lim.check_bytes("a", 10)


def test_rate_limiter_prunes_idle_peers():
    c = Clock()
    lim = PeerRateLimiter(requests_per_s=1, bytes_per_s=1, max_peers=3, clock=c)
    for p in "abcdef":
        lim.check_request(p)
        c.t += 10  # earlier peers are idle (full) again
    assert lim.tracked_peers() <= 3


def test_concurrency_caps_per_peer_keep_others_slots():
    lim = ConcurrencyLimiter("StateService", per_peer=2, total=3)
    lim.acquire("flooder")
    lim.acquire("flooder")
    with pytest.raises(LimitExceeded) as ei:
        lim.acquire("flooder")
    assert ei.value.reason == "concurrency_peer"
    with lim.slot("honest"):
        assert lim.in_flight("honest") == 1 and lim.in_flight() == 3
        with pytest.raises(LimitExceeded) as ei:
            lim.acquire("other")
        assert ei.value.reason == "concurrency_service" and ei.value.code_name == "UNAVAILABLE"
    assert lim.in_flight("honest") == 0
    lim.release("flooder")
    lim.acquire("other")
    with pytest.raises(RuntimeError):
        lim.release("nobody")


def test_ban_needs_more_than_threshold_inside_window():
    c = Clock()
    bans = []
    bl = BanList(threshold=20, window_s=60, ban_s=600, clock=c, on_ban=lambda k, r: bans.append((k, r)))
    for _ in range(20):
        assert not bl.record_rejection("p", "unsigned")
        c.t += 2.9  # 20 hits in 58 s
    assert not bl.is_banned("p")
    c.t += 10  # first hits fall out of the window
    assert not bl.record_rejection("p", "unsigned")
    assert not bl.is_banned("p")
    for _ in range(21):
        newly = bl.record_rejection("q", "rate")
    assert newly and bl.is_banned("q") and bans == [("q", "rate")] and bl.bans_total == 1
    with pytest.raises(LimitExceeded) as ei:
        bl.check("q")
    assert ei.value.reason == "banned" and ei.value.code_name == "PERMISSION_DENIED"
    bl.check("p")  # not banned: no raise
    assert set(bl.banned()) == {"q"}
    c.t += 599
    assert bl.is_banned("q") and 0 < bl.ban_remaining_s("q") <= 1
    c.t += 1.01
    assert not bl.is_banned("q") and bl.banned() == {}


def test_ban_threshold_spread_out_never_bans():
    c = Clock()
    bl = BanList(threshold=20, window_s=60, ban_s=600, clock=c)
    for _ in range(200):
        bl.record_rejection("slow", "stale")
        c.t += 3.1  # 19-20 per 60 s
    assert not bl.is_banned("slow") and bl.bans_total == 0
