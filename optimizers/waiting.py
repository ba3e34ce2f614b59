"""NoLoCo's waiting policy (issue 8): how long a worker waits for a partner, and when to stop.

Pure rules, no I/O; the role (``optimizers/noloco_role.py``) measures its pace, reads the node
cards and ends the wait through ``OuterExchange.stop_waiting``.

    wait_bound(step_s, cfg) -> seconds     # wait_fraction x own inner phase, >= min_wait_s, <= round_timeout
    someone_can_meet(ready_peers, rnd) -> bool   # False: stop waiting at once (solo step)

A peer can still meet us at round label ``rnd`` when it is READY (the caller filters), not
finishing (its card's ``finishing`` detail: it took its last round, ``exit_after_steps``), and
its card's round is not past ``rnd`` (a worker behind catches up to the frontier label; one
whose card is past ``rnd`` has done that round). Draining workers publish a DRAINING card and
are not READY.
"""

from __future__ import annotations

from collections.abc import Iterable

from node.card import CardView, card_int
from optimizers.config import NoLoCoConfig

__all__ = ["FINISHING", "wait_bound", "someone_can_meet"]

FINISHING = "finishing"
"""Node-card detail a worker sets (True) with its last round: nobody waits for it afterwards."""


def wait_bound(step_s: float | None, cfg: NoLoCoConfig) -> float:
    """Seconds to wait for a partner: ``wait_fraction`` of the measured inner phase (``step_s``
    seconds per inner step x ``inner_steps``; 0 before any measurement), at least ``min_wait_s``,
    at most ``round_timeout``."""
    phase = max(0.0, step_s or 0.0) * cfg.inner_steps
    return min(cfg.round_timeout, max(cfg.min_wait_s, cfg.wait_fraction * phase))


def someone_can_meet(ready_peers: Iterable[CardView], rnd: int) -> bool:
    """True if one of these READY peers (same role and config, not us) may still reach label
    ``rnd``: not finishing and not past it (a card without a round counts: it is about to start)."""
    for v in ready_peers:
        if v.card.details.get(FINISHING) is True:
            continue
        theirs = card_int(v, "round")
        if theirs is None or theirs <= rnd:
            return True
    return False
