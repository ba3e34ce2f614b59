"""NoLoCo's waiting policy (issue 8): how long a worker waits for a partner, and when to stop.

Pure rules, no I/O; the role (``optimizers/noloco_role.py``) measures its pace, reads the node
cards and ends the wait through ``OuterExchange.stop_waiting``.

    wait_bound(step_s, cfg) -> seconds     # wait_fraction x own inner phase, >= min_wait_s, <= round_timeout
    someone_can_meet(ready_peers, rnd, by) -> bool   # False: do not wait (solo step at once)
    steps_to_wait(ready_peers, rnd, now, bound, step_s, max_steps, idle_s) -> int   # compute while waiting

A peer can still meet us at round label ``rnd`` when it is READY (the caller filters), not
finishing (its card's ``finishing`` detail: it took its last round, ``exit_after_steps``), its
card's round is not past ``rnd`` (a worker behind catches up to the frontier label; one whose
card is past ``rnd`` has done that round), and it reaches its next exchange by ``by`` (its
card's ``next_exchange_at``: wall-clock time it expects to start its next exchange, from its
own measured pace; a peer already waiting has a time in the past). Draining workers publish a
DRAINING card and are not READY. Cards without these details count as able to meet (a peer
just starting); a wrong prediction costs at most the wait bound or one missed pair. Clocks of
the machines are assumed roughly in sync (NTP); a skew larger than the wait bound only turns
some pairs into solo rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from node.card import CardView, card_int
from optimizers.config import NoLoCoConfig

__all__ = ["FINISHING", "NEXT_EXCHANGE_AT", "wait_bound", "someone_can_meet", "steps_to_wait"]

FINISHING = "finishing"
"""Node-card detail a worker sets (True) with its last round: nobody waits for it afterwards."""

NEXT_EXCHANGE_AT = "next_exchange_at"
"""Node-card detail: the wall-clock time (unix seconds) the worker expects its next exchange."""


def wait_bound(step_s: float | None, cfg: NoLoCoConfig) -> float:
    """Seconds to wait for a partner: ``wait_fraction`` of the measured inner phase (``step_s``
    seconds per inner step x ``inner_steps``; 0 before any measurement), at least ``min_wait_s``,
    at most ``round_timeout``."""
    phase = max(0.0, step_s or 0.0) * cfg.inner_steps
    return min(cfg.round_timeout, max(cfg.min_wait_s, cfg.wait_fraction * phase))


def someone_can_meet(ready_peers: Iterable[CardView], rnd: int, by: float | None = None) -> bool:
    """True if one of these READY peers (same role and config, not us) may still reach label
    ``rnd``, by wall-clock time ``by`` when given: not finishing, not past the label, and not
    expected later than ``by`` (a card without a round or a time counts: it is about to start)."""
    for v in ready_peers:
        if v.card.details.get(FINISHING) is True:
            continue
        theirs = card_int(v, "round")
        if theirs is not None and theirs > rnd:
            continue
        expected = _expected_at(v)
        if by is None or expected is None or expected <= by:
            return True
    return False


def _expected_at(v: CardView) -> float | None:
    at = v.card.details.get(NEXT_EXCHANGE_AT)
    return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at) else None


def steps_to_wait(ready_peers: Sequence[CardView], rnd: int, now: float, bound: float, step_s: float | None,
                  max_steps: int, idle_s: float | None = None) -> int:
    """Keep computing while waiting: 0 when a peer can meet us at ``rnd`` within the idle window
    (pair now; the window is ``min(bound, idle_s)``, ``bound`` when ``idle_s`` is None) or none is
    expected within ``max_steps`` inner steps (solo now, or wait up to ``bound``); else the inner
    steps (>= 1) to run until the earliest expected peer reaches its exchange. The round then
    continues with those extra steps and pairs at the frontier label instead of idling or a solo
    step. Without it, workers of equal pace lock into the same pairs and the odd one goes solo
    every round (measured: tests/integration/test_noloco_waiting.py); with a short idle window a
    worker no longer sits idle for most of its wait bound for a partner a few steps away."""
    window = bound if idle_s is None else min(bound, max(0.0, idle_s))
    if not step_s or step_s <= 0 or max_steps <= 0 or someone_can_meet(ready_peers, rnd, by=now + window):
        return 0
    due = [at for v in ready_peers if v.card.details.get(FINISHING) is not True
           and (at := _expected_at(v)) is not None and at > now]
    if not due:
        return 0
    steps = max(1, math.ceil((min(due) - now) / step_s))
    return steps if steps <= max_steps else 0
