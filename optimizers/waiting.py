"""NoLoCo's waiting policy (issue 8): how long a worker waits for a partner, and when to stop.

Pure rules on plain data, no I/O: the role (``optimizers/noloco_role.py``) measures its pace,
reads the node cards into :class:`PeerPlan` values and ends the wait through
``OuterExchange.stop_waiting``.

    wait_bound(step_s, cfg) -> seconds     # wait_fraction x own inner phase, >= min_wait_s, <= round_timeout
    someone_can_meet(peer_plans, rnd, by) -> bool   # False: do not wait (solo step at once)
    steps_to_wait(peer_plans, rnd, now, bound, step_s, max_steps, idle_s) -> int   # compute while waiting
    lead_steps(peer_plans, rnd, own_at, step_s, max_steps) -> int   # after a missed pair: arrive first

A peer can still meet us at round label ``rnd`` when it is READY (the caller filters), not
finishing (its card's ``finishing`` detail: it took its last round, ``exit_after``), its
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizers.config import NoLoCoConfig

__all__ = ["FINISHING", "NEXT_EXCHANGE_AT", "PeerPlan", "lead_steps", "wait_bound", "someone_can_meet", "steps_to_wait"]

FINISHING = "finishing"
"""Node-card detail a worker sets (True) with its last round: nobody waits for it afterwards."""

NEXT_EXCHANGE_AT = "next_exchange_at"
"""Node-card detail: the wall-clock time (unix seconds) the worker expects its next exchange."""


@dataclass(frozen=True)
class PeerPlan:
    """What the waiting rules read of one READY peer (same role and config, not us)."""

    round: int | None
    """Its card's round label; None when it has none yet (or the card's value is junk)."""
    finishing: bool = False
    """It took its last round (``FINISHING``): nobody waits for it."""
    next_exchange_at: float | None = None
    """Unix time it expects its next exchange (``NEXT_EXCHANGE_AT``); None when unknown."""

    @classmethod
    def from_details(cls, details: Mapping[str, Any], round: int | None) -> "PeerPlan":
        """From a card's role details and its round label, already range-checked by the reader:
        anything but ``True`` is not finishing, anything but a finite number is no time."""
        at = details.get(NEXT_EXCHANGE_AT)
        finite = isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
        return cls(round, details.get(FINISHING) is True, float(at) if finite else None)


def wait_bound(step_s: float | None, cfg: NoLoCoConfig) -> float:
    """Seconds to wait for a partner: ``wait_fraction`` of the measured inner phase (``step_s``
    seconds per inner step x ``inner_steps``; 0 before any measurement), at least ``min_wait_s``,
    at most ``round_timeout``."""
    phase = max(0.0, step_s or 0.0) * cfg.inner_steps
    return min(cfg.round_timeout, max(cfg.min_wait_s, cfg.wait_fraction * phase))


def someone_can_meet(ready_peers: Iterable[PeerPlan], rnd: int, by: float | None = None) -> bool:
    """True if one of these READY peers may still reach label ``rnd``, by wall-clock time ``by``
    when given: not finishing, not past the label, and not expected later than ``by`` (a peer
    without a round or a time counts: it is about to start)."""
    for p in ready_peers:
        if p.finishing or (p.round is not None and p.round > rnd):
            continue
        if by is None or p.next_exchange_at is None or p.next_exchange_at <= by:
            return True
    return False


def steps_to_wait(ready_peers: Sequence[PeerPlan], rnd: int, now: float, bound: float, step_s: float | None,
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
    due = [p.next_exchange_at for p in ready_peers
           if not p.finishing and p.next_exchange_at is not None and p.next_exchange_at > now]
    if not due:
        return 0
    steps = max(1, math.ceil((min(due) - now) / step_s))
    return steps if steps <= max_steps else 0


def lead_steps(ready_peers: Sequence[PeerPlan], rnd: int, own_at: float, step_s: float | None, max_steps: int,
               missed: bool = False) -> int:
    """After a round this worker spent solo while its peers paired: inner steps to drop from its
    next phase so that it reaches label ``rnd`` (its next) one step before the earliest peer due
    there (``own_at``: when it would start that exchange without dropping any). A worker that
    arrives a little after a pair of lock-stepped peers finds them matched already, every round:
    measured on real processes, a joiner 0.17 s (1.7 steps) late went solo for 200 rounds in a
    row. Arriving first, it waits within its bound and is a candidate when they come. 0 when no
    peer is due at ``rnd``, when it is early already, or when catching up would take more than
    ``max_steps`` (it is then a phase off, and compute-while-waiting handles it). ``missed``: the
    peers paired at our label while we waited, so we came late whatever the cards predict (a
    step's time varies): at least 1, and a worker that keeps missing moves a step earlier each time."""
    if not step_s or step_s <= 0 or max_steps <= 0:
        return 0
    due = [p.next_exchange_at for p in ready_peers
           if not p.finishing and p.round == rnd and p.next_exchange_at is not None]
    if not due:
        return 0
    late = own_at - min(due)
    if late < -step_s / 2:
        return 1 if missed else 0
    steps = math.ceil(late / step_s) + 1
    return steps if steps <= max_steps else 0
