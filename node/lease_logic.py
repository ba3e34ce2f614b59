"""Who is the active coordinator: the pure rules of the coordinator lease (no I/O, no clock).

Every bootstrap keeps one signed entry under the run's lease key (node/coordinator_lease.py does
the DHT side): ``state`` (``standby``, ``claiming`` or ``active``), its gRPC address and the
highest schedule epoch it knows, with a short TTL it refreshes. :class:`LeaseLogic` is one
bootstrap's state machine over the fresh entries of the *others*; it is called every poll:

- ``standby``: while some other bootstrap's entry says ``active`` it waits. When none has been
  seen for ``wait_s`` (``lease_s``; 0 on a first-started primary, which claims at once), and no
  lower peer ID is already claiming, it writes a ``claiming`` entry. Only a first-started primary
  may claim while its DHT has no peer: any other bootstrap (a standby, a restarted primary) with
  an empty routing table cannot see the lease at all, and its "no active entry" means nothing.
- ``claiming``: after ``settle_s`` it reads again (a claimant that lost every peer meanwhile is
  back to ``standby``). It becomes ``active`` only if no ``active``
  entry appeared and no other claimant with a lower peer ID is fresh; otherwise it is back to
  ``standby``. There is no compare-and-swap in a DHT: the settle delay lets every claimant see
  every other claim, and the lowest peer ID among them wins, so two claimants never both win.
- ``active``: it steps down (to ``standby``) as soon as it sees another ``active`` entry with a
  lower peer ID (two actives only after a DHT partition healed; the lower ID keeps it). An
  active coordinator never hands back to a bootstrap that returns: that one finds the fresh
  ``active`` entry and stays a standby.

``max_epoch`` is the highest schedule epoch any entry named: a coordinator that takes over
publishes above it, so the stage nodes adopt its plans (they ignore epochs they already hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

STANDBY, CLAIMING, ACTIVE = "standby", "claiming", "active"
STATES = (STANDBY, CLAIMING, ACTIVE)


@dataclass(frozen=True)
class Seen:
    """One other bootstrap's fresh lease entry, as the rules need it."""

    state: str
    epoch: int = 0


@dataclass(frozen=True)
class Change:
    """A state change :meth:`LeaseLogic.tick` made: ``old`` -> ``new``; ``missing_s`` is how long
    no active entry was seen before this bootstrap became active (0 otherwise)."""

    old: str
    new: str
    why: str
    missing_s: float = 0.0


def active_holder(entries: Mapping[str, Seen]) -> str | None:
    """The peer ID whose entry says ``active`` (the lowest, should there be several); None if none."""
    return min((p for p, e in entries.items() if e.state == ACTIVE), default=None)


class LeaseLogic:
    """One bootstrap's lease state. ``me``: its peer ID; ``lease_s``: how long no active entry
    must be seen before a standby claims; ``settle_s``: how long a claim waits for rival claims;
    ``claim_at_once``: a primary on its first start (claims as soon as it sees no active entry)."""

    def __init__(self, me: str, lease_s: float, settle_s: float, now: float, claim_at_once: bool = False):
        if lease_s <= 0 or settle_s <= 0:
            raise ValueError("lease_s and settle_s must be > 0")
        self.me, self.lease_s, self.settle_s = me, lease_s, settle_s
        self.needs_peers = not claim_at_once     # only a first-started primary claims alone
        self.state = STANDBY
        self.max_epoch = 0
        self.holder: str | None = None           # the other active bootstrap seen at the last tick
        self.absent_since: float | None = now - lease_s if claim_at_once else now
        self.claimed_at: float | None = None
        self.active_since: float | None = None

    def note_epoch(self, epoch: int) -> None:
        self.max_epoch = max(self.max_epoch, int(epoch))

    def tick(self, now: float, others: Mapping[str, Seen], connected: bool = True) -> Change | None:
        """Apply one read of the other bootstraps' fresh entries (never this node's own);
        ``connected``: whether the DHT had at least one peer when it was read."""
        others = {p: e for p, e in others.items() if p != self.me}
        for e in others.values():
            self.note_epoch(e.epoch)
        holder = active_holder(others)
        self.holder = holder
        old = self.state
        if holder is not None:
            self.absent_since = None
        elif self.absent_since is None:
            self.absent_since = now
        if self.state == ACTIVE:
            if holder is not None and holder < self.me:
                return self._to(STANDBY, old, f"{holder} holds the lease too and has the lower peer ID")
            return None
        if self.state == CLAIMING:
            if self.needs_peers and not connected:
                return self._to(STANDBY, old, "the DHT has no peer: the lease cannot be read")
            if holder is not None:
                return self._to(STANDBY, old, f"{holder} became active first")
            rivals = sorted(p for p, e in others.items() if e.state == CLAIMING and p < self.me)
            if rivals:
                return self._to(STANDBY, old, f"{rivals[0]} claims too and has the lower peer ID")
            if now - (now if self.claimed_at is None else self.claimed_at) >= self.settle_s:
                missing = now - self.absent_since if self.absent_since is not None else 0.0
                self.active_since = now
                return self._to(ACTIVE, old, "no active coordinator and no lower claimant", missing_s=missing)
            return None
        # standby
        if holder is not None or now - self.absent_since < self.lease_s:
            return None
        if self.needs_peers and not connected:
            return None                      # blind: an empty DHT shows no lease, live or not
        if any(e.state == CLAIMING and p < self.me for p, e in others.items()):
            return None                      # a lower peer ID claims: let it
        self.claimed_at = now
        return self._to(CLAIMING, old, f"no active coordinator seen for {now - self.absent_since:.1f} s")

    def _to(self, new: str, old: str, why: str, missing_s: float = 0.0) -> Change:
        self.state = new
        if new != CLAIMING:
            self.claimed_at = None
        if new != ACTIVE:
            self.active_since = None
        return Change(old, new, why, round(max(0.0, missing_s), 3))


__all__ = ["ACTIVE", "CLAIMING", "STANDBY", "STATES", "Change", "LeaseLogic", "Seen", "active_holder"]
