"""Per-peer rate limits, per-service concurrency caps and the local ban list (docs/security.md, 'Limits and bans').

Owns the accounting, not the transport: the gRPC host calls these before doing work and maps a
:class:`LimitExceeded` to its gRPC status (``exc.code_name``).

* :class:`PeerRateLimiter`: a token bucket of requests/s and one of bytes/s per peer
  (``limits.peer_rps``, ``limits.peer_bytes_per_s``). The bytes bucket may go into debt, so one
  message larger than the burst still passes, and the peer then waits for the debt to refill.
* :class:`ConcurrencyLimiter`: in-flight calls of one service, capped per peer and in total, so
  one peer cannot take the slots of the others (``slot(peer)`` context manager; never blocks).
* :class:`BanList`: a key with more than ``threshold`` transport-level rejections (malformed,
  oversize, unsigned, stale, rate) inside ``window_s`` is banned for ``ban_s`` (defaults 20 in
  60 s, 10 min). Keys are any hashable: the verified peer ID when the caller authenticated,
  otherwise the remote address (an unauthenticated claim of a peer ID must never get that
  peer banned).

Every class takes ``clock`` (a zero-argument function returning seconds; ``time.monotonic`` by
default) so tests drive time by hand. Pure Python, thread-safe, no grpc import.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator

__all__ = ["LimitExceeded", "TokenBucket", "PeerRateLimiter", "ConcurrencyLimiter", "BanList"]

Clock = Callable[[], float]


class LimitExceeded(Exception):
    """A call broke a limit. ``reason``: ``rate_requests``, ``rate_bytes``, ``concurrency_peer``,
    ``concurrency_service`` or ``banned``; ``code_name``: the grpc.StatusCode name to answer with;
    ``retry_after_s``: when trying again can succeed (0 if unknown)."""

    def __init__(self, message: str, reason: str, code_name: str = "RESOURCE_EXHAUSTED",
                 retry_after_s: float = 0.0):
        super().__init__(message)
        self.reason, self.code_name, self.retry_after_s = reason, code_name, retry_after_s

    @property
    def grpc_code(self):
        import grpc
        return getattr(grpc.StatusCode, self.code_name)


class TokenBucket:
    """``rate`` tokens/s up to ``burst``; starts full. ``allow_debt``: a take succeeds whenever the
    level is positive and may leave it negative (for byte counts larger than the burst)."""

    def __init__(self, rate: float, burst: float, *, clock: Clock = time.monotonic, allow_debt: bool = False):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0, got rate={rate} burst={burst}")
        self.rate, self.burst, self.allow_debt = float(rate), float(burst), allow_debt
        self._clock = clock
        self._level = float(burst)
        self._t = clock()

    def _refill(self) -> float:
        now = self._clock()
        if now > self._t:
            self._level = min(self.burst, self._level + (now - self._t) * self.rate)
        self._t = max(self._t, now)
        return self._level

    def level(self) -> float:
        return self._refill()

    def try_take(self, n: float = 1.0) -> bool:
        level = self._refill()
        if level >= n or (self.allow_debt and level > 0):
            self._level = level - n
            return True
        return False

    def wait_s(self, n: float = 1.0) -> float:
        """Seconds until ``try_take(n)`` can succeed (0 if it can now)."""
        level = self._refill()
        need = (min(n, 1e-9) if self.allow_debt else n) - level
        return max(0.0, need / self.rate) if need > 0 else 0.0

    def is_full(self) -> bool:
        return self._refill() >= self.burst


class PeerRateLimiter:
    """Request and byte token buckets per peer. ``check_request(peer)`` at call start;
    ``check_bytes(peer, n)`` for each received message. Idle (full) buckets are dropped once
    more than ``max_peers`` are tracked."""

    def __init__(self, *, requests_per_s: float, bytes_per_s: float, request_burst: float | None = None,
                 bytes_burst: float | None = None, max_peers: int = 4096, clock: Clock = time.monotonic):
        self.requests_per_s, self.bytes_per_s = requests_per_s, bytes_per_s
        self.request_burst = request_burst if request_burst is not None else max(1.0, 2 * requests_per_s)
        self.bytes_burst = bytes_burst if bytes_burst is not None else 2 * bytes_per_s
        self.max_peers = max_peers
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: collections.OrderedDict[Hashable, tuple[TokenBucket, TokenBucket]] = collections.OrderedDict()

    def _buckets(self, peer: Hashable) -> tuple[TokenBucket, TokenBucket]:
        b = self._peers.get(peer)
        if b is None:
            if len(self._peers) >= self.max_peers:
                self._prune()
            b = (TokenBucket(self.requests_per_s, self.request_burst, clock=self._clock),
                 TokenBucket(self.bytes_per_s, self.bytes_burst, clock=self._clock, allow_debt=True))
            self._peers[peer] = b
        self._peers.move_to_end(peer)
        return b

    def _prune(self) -> None:
        for key in [k for k, (r, by) in self._peers.items() if r.is_full() and by.is_full()]:
            del self._peers[key]
        while len(self._peers) >= self.max_peers:  # all busy: drop the least recently seen
            self._peers.popitem(last=False)

    def check_request(self, peer: Hashable) -> None:
        with self._lock:
            bucket = self._buckets(peer)[0]
            if not bucket.try_take(1):
                wait = bucket.wait_s(1)
                raise LimitExceeded(f"peer {_short(peer)} exceeds {self.requests_per_s:g} requests/s "
                                    f"(limits.peer_rps); retry in {wait:.2f} s", "rate_requests", retry_after_s=wait)

    def check_bytes(self, peer: Hashable, nbytes: int) -> None:
        with self._lock:
            bucket = self._buckets(peer)[1]
            if not bucket.try_take(nbytes):
                wait = bucket.wait_s(nbytes)
                raise LimitExceeded(f"peer {_short(peer)} exceeds {self.bytes_per_s:g} bytes/s "
                                    f"(limits.peer_bytes_per_s); retry in {wait:.2f} s", "rate_bytes",
                                    retry_after_s=wait)

    def tracked_peers(self) -> int:
        return len(self._peers)


class ConcurrencyLimiter:
    """In-flight calls of one service: at most ``per_peer`` per peer and ``total`` overall."""

    def __init__(self, service: str, *, per_peer: int, total: int):
        if per_peer <= 0 or total <= 0:
            raise ValueError(f"{service}: concurrency caps must be > 0, got per_peer={per_peer} total={total}")
        self.service, self.per_peer, self.total = service, per_peer, total
        self._lock = threading.Lock()
        self._in_flight: dict[Hashable, int] = {}
        self._sum = 0

    def acquire(self, peer: Hashable) -> None:
        with self._lock:
            mine = self._in_flight.get(peer, 0)
            if mine >= self.per_peer:
                raise LimitExceeded(f"peer {_short(peer)} already has {mine} calls in flight on {self.service} "
                                    f"(cap {self.per_peer} per peer)", "concurrency_peer")
            if self._sum >= self.total:
                raise LimitExceeded(f"{self.service} has {self._sum} calls in flight (cap {self.total}); "
                                    "retry shortly", "concurrency_service", code_name="UNAVAILABLE")
            self._in_flight[peer] = mine + 1
            self._sum += 1

    def release(self, peer: Hashable) -> None:
        with self._lock:
            mine = self._in_flight.get(peer, 0)
            if mine <= 0:
                raise RuntimeError(f"{self.service}: release without acquire for {_short(peer)}")
            if mine == 1:
                del self._in_flight[peer]
            else:
                self._in_flight[peer] = mine - 1
            self._sum -= 1

    @contextlib.contextmanager
    def slot(self, peer: Hashable) -> Iterator[None]:
        self.acquire(peer)
        try:
            yield
        finally:
            self.release(peer)

    def in_flight(self, peer: Hashable | None = None) -> int:
        return self._sum if peer is None else self._in_flight.get(peer, 0)


class BanList:
    """Ban a key with more than ``threshold`` rejections within ``window_s``, for ``ban_s``."""

    def __init__(self, *, threshold: int = 20, window_s: float = 60.0, ban_s: float = 600.0,
                 max_tracked: int = 65536, clock: Clock = time.monotonic,
                 on_ban: Callable[[Hashable, str], None] | None = None):
        if threshold < 1 or window_s <= 0 or ban_s <= 0:
            raise ValueError("BanList needs threshold >= 1, window_s > 0, ban_s > 0")
        self.threshold, self.window_s, self.ban_s = threshold, window_s, ban_s
        self.max_tracked = max_tracked
        self._clock, self._on_ban = clock, on_ban
        self._lock = threading.Lock()
        self._hits: collections.OrderedDict[Hashable, collections.deque[float]] = collections.OrderedDict()
        self._banned: dict[Hashable, tuple[float, str]] = {}  # key -> (until, last reason)
        self.bans_total = 0

    def record_rejection(self, key: Hashable, reason: str) -> bool:
        """Count one rejection; True iff this one got ``key`` banned."""
        now = self._clock()
        with self._lock:
            if self._is_banned(key, now):
                return False
            hits = self._hits.get(key)
            if hits is None:
                if len(self._hits) >= self.max_tracked:
                    self._hits.popitem(last=False)
                hits = self._hits[key] = collections.deque(maxlen=self.threshold + 1)
            self._hits.move_to_end(key)
            hits.append(now)
            while hits and hits[0] <= now - self.window_s:
                hits.popleft()
            if len(hits) <= self.threshold:
                return False
            del self._hits[key]
            self._banned[key] = (now + self.ban_s, reason)
            self.bans_total += 1
        if self._on_ban is not None:
            self._on_ban(key, reason)
        return True

    def ban(self, key: Hashable, reason: str, ban_s: float | None = None) -> bool:
        """Ban ``key`` now (a decision taken elsewhere, e.g. a rejection-rate policy), for ``ban_s``
        (default: this list's). True iff it was not banned already."""
        now = self._clock()
        with self._lock:
            if self._is_banned(key, now):
                return False
            self._hits.pop(key, None)
            self._banned[key] = (now + (self.ban_s if ban_s is None else ban_s), reason)
            self.bans_total += 1
        if self._on_ban is not None:
            self._on_ban(key, reason)
        return True

    def _is_banned(self, key: Hashable, now: float) -> bool:
        entry = self._banned.get(key)
        if entry is None:
            return False
        if now >= entry[0]:
            del self._banned[key]
            return False
        return True

    def is_banned(self, key: Hashable) -> bool:
        with self._lock:
            return self._is_banned(key, self._clock())

    def check(self, key: Hashable) -> None:
        """Raise LimitExceeded(reason="banned", PERMISSION_DENIED) while ``key`` is banned."""
        left = self.ban_remaining_s(key)
        if left > 0:
            raise LimitExceeded(f"{_short(key)} is banned for {left:.0f} s more after repeated rejected calls",
                                "banned", code_name="PERMISSION_DENIED", retry_after_s=left)

    def ban_remaining_s(self, key: Hashable) -> float:
        now = self._clock()
        with self._lock:
            return self._banned[key][0] - now if self._is_banned(key, now) else 0.0

    def banned(self) -> dict[Hashable, float]:
        """Currently banned keys -> seconds left (for metrics and ``swarmnode status``)."""
        now = self._clock()
        with self._lock:
            for key in [k for k, (until, _) in self._banned.items() if now >= until]:
                del self._banned[key]
            return {k: until - now for k, (until, _) in self._banned.items()}


def _short(key: Hashable) -> str:
    s = str(key)
    return f"...{s[-8:]}" if len(s) > 16 and s.startswith("12D3") else s
