"""How often one partner may pair with us: a cap on any one peer's share of our recent exchanges.

NoLoCo picks a random partner each round, so in a swarm of ``n`` workers each of ours meets any
one other about once in ``n - 1`` rounds. A member that does no inner work is ready at every
moment: it answers every proposal at once and proposes as soon as a round opens, while honest
workers are matched only in the short window in which they exchange. Measured on real processes
(``benchmarks/robust_gossip.py``, 4 honest workers and 1 attacker), such a member was the
partner in 60% of every honest worker's exchanges, 2.4 times its fair share, and each of them
is a contribution the clip (``optimizers/robust.py``) can only bound, not refuse.

The rule: with ``others`` peers we could pair with (the larger of this round's roster, less us,
and the distinct partners of our last ``window`` exchanges), a peer may have taken at most
``ceil(factor * m / others)`` (at least ``min_count``) of our last ``m = max(window, 4 * others)``
exchanges: ``factor`` times its fair share, over a span that holds about four exchanges with
each peer (so the cap is 8 at the default factor 2 once there are four others or more, 11 with
three). Over the cap it is neither proposed to nor accepted this round (the round pairs with
someone else or runs solo); it is not charged, and nothing is remembered beyond the span.
Honest partners chosen at random reach the cap now and then (a binomial tail: about 1.5% of
rounds with four others, 2-3% with eight; tests/unit/test_partner_share.py), and are then
replaced by another; a swarm of two is never capped (one other: the cap exceeds the span).
With four others an always-ready member takes at most half of our exchanges instead of 60%;
with fifty, 8 of 200 instead of most of them.

Pure bookkeeping (no torch, no I/O): ``ExchangeLink`` records each judged pair contribution
and asks :meth:`PartnerShare.over` before proposing and when a proposal comes in.
"""

from __future__ import annotations

import math
from collections import Counter, deque

__all__ = ["PartnerShare"]


class PartnerShare:
    """Our last ``window`` pair partners and the cap on any one's count."""

    def __init__(self, factor: float = 2.0, window: int = 16, min_count: int = 2, span_per_peer: int = 4,
                 max_span: int = 1024):
        if not factor >= 1 or window < 1 or min_count < 1:
            raise ValueError(f"bad partner share settings: factor={factor} (>= 1: a fair share must pass), "
                             f"window={window} (>= 1), min_count={min_count} (>= 1)")
        self.factor, self.window, self.min_count = float(factor), int(window), int(min_count)
        self.span_per_peer, self.max_span = max(1, int(span_per_peer)), max(int(max_span), self.window)
        self.recent: deque[str] = deque(maxlen=self.max_span)

    def record(self, peer: str) -> None:
        """``peer`` was our partner in an exchange we judged."""
        self.recent.append(peer)

    def _others(self, others: int) -> int:
        last = list(self.recent)[-self.window:]
        return max(1, int(others), len(set(last)))

    def span(self, others: int) -> int:
        """How many of our last exchanges the cap counts over (``max(window, 4 * others)``)."""
        return min(self.max_span, max(self.window, self.span_per_peer * self._others(others)))

    def cap(self, others: int) -> int:
        """The most of our last ``span(others)`` exchanges any one peer may have had, for
        ``others`` peers we could pair with (the distinct partners of the last ``window`` count too)."""
        n = self._others(others)
        return max(self.min_count, math.ceil(self.factor * self.span(others) / n))

    def over(self, peer: str, others: int) -> bool:
        """Has ``peer`` had its share (``cap(others)``) of our last ``span(others)`` exchanges?"""
        return self.counts(self.span(others)).get(peer, 0) >= self.cap(others)

    def counts(self, last: int | None = None) -> dict[str, int]:
        """Exchanges per partner among our last ``last`` (default ``window``) exchanges."""
        k = self.window if last is None else last
        return dict(Counter(list(self.recent)[-k:]))
