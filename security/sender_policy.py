"""Per-sender rejection-rate bans and per-round token budgets for peers' rollouts (docs/grpo.md,
'Defenses').

- :class:`RejectionRatePolicy`: per sender, a window of its last ``window`` completions that
  reached a content check (logit check or judge). The sender is banned (security.limits.BanList,
  for ``ban_s``) when at least ``min_checked`` were checked and the rejected share exceeds
  ``ban_rate``; a WARNING above ``warn_rate`` flags a bad floor or drift. Never a raw strike
  count: honest peers fail content checks at a small, steady rate, so any fixed count is
  eventually reached by every honest peer.
- :class:`TokenBudget`: at most ``per_sender`` completion tokens from one sender per round
  (the rest is dropped as ``quota``), bounding what a verbose-but-correct sender costs.

Pure Python, thread-safe, no method-package import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from security.limits import BanList

__all__ = ["RejectionRatePolicy", "SenderRate", "TokenBudget"]

log = logging.getLogger("swarmnode.security")


@dataclass(frozen=True)
class SenderRate:
    checked: int          # completions in the window
    rejected: int
    total_checked: int    # since start
    total_rejected: int

    @property
    def rate(self) -> float:
        return self.rejected / self.checked if self.checked else 0.0


class RejectionRatePolicy:
    """Ban on a sustained rejection *rate* (see the module doc)."""

    def __init__(self, *, window: int = 256, min_checked: int = 32, ban_rate: float = 0.5,
                 warn_rate: float = 0.2, ban_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 on_ban: Callable[[Hashable, str], None] | None = None):
        if not (window >= min_checked >= 1) or not (0 < ban_rate <= 1):
            raise ValueError("RejectionRatePolicy needs window >= min_checked >= 1 and 0 < ban_rate <= 1")
        self.window, self.min_checked, self.ban_rate, self.warn_rate = window, min_checked, ban_rate, warn_rate
        self.bans = BanList(threshold=1, window_s=1.0, ban_s=ban_s, clock=clock, on_ban=on_ban)
        self._lock = threading.Lock()
        self._win: dict[Hashable, deque[bool]] = defaultdict(lambda: deque(maxlen=window))
        self._totals: dict[Hashable, list[int]] = defaultdict(lambda: [0, 0])
        self._warned: set[Hashable] = set()

    def record(self, sender: Hashable, rejected: bool, reason: str = "content") -> bool:
        """Count one checked completion; True iff this one got ``sender`` banned."""
        with self._lock:
            w = self._win[sender]
            w.append(bool(rejected))
            t = self._totals[sender]
            t[0] += 1
            t[1] += int(rejected)
            n, bad = len(w), sum(w)
        rate = bad / n
        if n >= self.min_checked and rate > self.warn_rate and sender not in self._warned and rate <= self.ban_rate:
            self._warned.add(sender)
            log.warning("rollouts from %s: %.0f%% of the last %d checked completions rejected (a bad floor or drift "
                        "if this peer is honest; raise grpo.defense.eps_lp or lower min_token_prob)", sender,
                        100 * rate, n, extra={"event": "grpo_sender_rejection_rate", "sender": str(sender),
                                              "rate": round(rate, 3), "checked": n})
        if n >= self.min_checked and rate > self.ban_rate:
            if self.bans.ban(sender, f"{reason}: {bad}/{n} checked completions rejected"):
                with self._lock:
                    self._win.pop(sender, None)
                return True
        return False

    def is_banned(self, sender: Hashable) -> bool:
        return self.bans.is_banned(sender)

    def rate(self, sender: Hashable) -> SenderRate:
        with self._lock:
            w = self._win.get(sender, ())
            t = self._totals.get(sender, [0, 0])
            return SenderRate(len(w), sum(w), t[0], t[1])

    def senders(self) -> dict[Hashable, SenderRate]:
        with self._lock:
            keys = list(self._totals)
        return {k: self.rate(k) for k in keys}

    def banned(self) -> dict[Hashable, float]:
        return self.bans.banned()


class TokenBudget:
    """At most ``per_sender`` tokens per sender per round."""

    def __init__(self, per_sender: int):
        if per_sender < 1:
            raise ValueError("TokenBudget needs per_sender >= 1")
        self.per_sender = per_sender
        self._round: Hashable = None
        self._used: dict[Hashable, int] = defaultdict(int)
        self._lock = threading.Lock()

    def take(self, round_: Hashable, sender: Hashable, n_tokens: int) -> bool:
        """Charge ``n_tokens`` to ``sender`` in ``round_``; False (nothing charged) when over budget."""
        with self._lock:
            if round_ != self._round:
                self._round, self._used = round_, defaultdict(int)
            if self._used[sender] + n_tokens > self.per_sender:
                return False
            self._used[sender] += n_tokens
            return True

    def used(self, sender: Hashable) -> int:
        with self._lock:
            return self._used.get(sender, 0)
