"""The pipeline's own loss trend as an alarm (docs/pipeline.md, 'What is caught live').

A stage that tampers with what it computes (noise on its activations, a flipped gradient) shows
first in the training loss: it stops falling and rises. The coordinator feeds `LossTrend` the
data nodes' training loss from their cards (detail `loss`, per iteration) and, when the loss
rises, audits every unreplicated stage at once instead of waiting for its random turn
(pipeline/replica_audits.py `audit_now`). The trend only brings audits forward: it attributes
nothing and quarantines nobody (an honest run's loss wobbles too; its audits then pass).

Rule: the mean of the last `window` iterations' losses is compared with the lowest such mean seen
so far; above it by `RISE` (relative) is a rise. It fires once per rise: after it fired, it fires
again only when the mean climbs a further `RISE` above the level it fired at (a loss that keeps
rising), and it is re-armed when the mean makes a new low `RISE` under the old lowest (training
goes on). A loss that wobbles on a plateau thus fires once, not at every wobble (it did, every
1-2 s, with the tiny models of the tests and the chaos soak).
"""

from __future__ import annotations

import math

RISE = 0.02
"""Relative rise of the windowed mean loss over its lowest value that counts as rising."""


class LossTrend:
    """See the module docstring. `window` 0 = off."""

    def __init__(self, window: int, rise: float = RISE):
        self.window, self.rise = window, rise
        self.losses: dict[int, float] = {}
        self.best = math.inf
        self.fired: float | None = None  # the mean it last fired at, until re-armed

    def note(self, iteration: int, loss: float) -> float | None:
        """Add one iteration's loss (a repeat of a known iteration is ignored); the windowed mean
        when this makes the loss count as rising, else None."""
        if self.window <= 0 or not math.isfinite(loss) or iteration in self.losses:
            return None
        self.losses[iteration] = loss
        its = sorted(self.losses)
        for old in its[:-4 * self.window]:
            del self.losses[old]
        recent = [self.losses[i] for i in sorted(self.losses)[-self.window:]]
        if len(recent) < self.window:
            return None
        mean = sum(recent) / len(recent)
        if self.fired is not None:
            if mean < self.best * (1 - self.rise):  # a new low well under the old one: re-armed
                self.best, self.fired = mean, None
                return None
            if mean > self.fired * (1 + self.rise):  # still rising
                self.fired = mean
                return mean
            return None
        if mean > self.best * (1 + self.rise):
            self.fired = mean
            return mean
        self.best = min(self.best, mean)
        return None


__all__ = ["LossTrend", "RISE"]
