"""The daemon's sender gate on the event bus: membership, bans and strikes for every delivery.

Owns the daemon side of the sender rule (``node/eventbus/members.py``; docs/security.md,
'Event-bus membership'): which peers may publish on which topic as this node last read the
cards, the message the sidecar gets so it applies the same rule first (``SetMembers``), the
check of every delivery the sidecar hands over (its output is untrusted: it re-checks), and the
strikes that ban a sender. Bans go into the node's own ban list (``security.limits.BanList``,
the call guard's, so a peer banned on the bus is refused on gRPC too and shows on the node card),
and bans the sidecar made itself are folded into it.

Does not own the transport (``client.py``) nor reading the cards (``service.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from node.eventbus.config import TOPICS, EventBusConfig
from node.eventbus.members import BusMembers
from node.logs import emit
from protocol import eventbus_pb2
from security.limits import BanList

log = logging.getLogger("swarmnode.eventbus")
#: A refused sender is logged at most once per this many seconds (all refusals are counted).
LOG_EVERY_S = 30.0


class SenderGate:
    """``refusal(sender, topic, verified)`` for each delivery; ``update(views)`` per card read.

    ``bans``: the node's ban list (None: a private one with ``ban``'s threshold, window and
    length). ``verified()`` is called only for a refused message: a strike is charged only when
    the message's signature is the sender's, so nobody gets a peer banned by naming it."""

    def __init__(self, cfg: EventBusConfig, *, bans: BanList | None = None, ban: dict[str, float] | None = None):
        self.cfg = cfg
        self.members = BusMembers()
        ban = ban or {}
        self.bans = bans if bans is not None else BanList(
            threshold=int(ban.get("threshold", 20)), window_s=float(ban.get("window_s", 60.0)),
            ban_s=float(ban.get("ban_s", 600.0)))
        self._logged: dict[tuple[str, str], float] = {}

    def update(self, views: Iterable[Any]) -> None:
        """Merge a read of the run's node cards (``node.card.CardView``s)."""
        self.members.update(views, TOPICS, self.cfg.publishers)

    def refusal(self, sender: str, topic: str, verified: Callable[[], bool]) -> str | None:
        """None when ``sender`` may publish on ``topic``; else the reason (counted by the caller):
        ``banned``, ``members_unknown``, ``not_member``, ``role_not_allowed``."""
        if self.bans.is_banned(sender):
            return "banned"
        reason = self.members.refusal(sender, topic)
        if reason is None or reason == "members_unknown":
            return reason
        if verified():
            self._log(sender, topic, reason)
            if self.bans.record_rejection(sender, f"bus_{reason}"):
                emit(log, "eventbus_sender_banned", "banned {peer} for {ban_s:.0f} s: repeated {topic} messages "
                     "while {reason}", level=logging.WARNING, peer=sender, topic=topic, reason=reason,
                     ban_s=self.bans.ban_s)
        return reason

    def _log(self, sender: str, topic: str, reason: str) -> None:
        now = time.monotonic()
        key = (sender, reason)
        if now - self._logged.get(key, -1e9) < LOG_EVERY_S:
            return
        if len(self._logged) > 4096:
            self._logged.clear()
        self._logged[key] = now
        emit(log, "eventbus_sender_refused", "dropped a {topic} message from {peer}: {reason} (only live members "
             "of the run may publish; see docs/security.md, 'Event-bus membership')", level=logging.WARNING,
             peer=sender, topic=topic, reason=reason)

    def fold_sidecar_bans(self, banned: Iterable[str]) -> None:
        """Bans the sidecar made itself become the node's (once each)."""
        for peer in banned:
            if self.bans.ban(peer, "bus_not_member"):
                emit(log, "eventbus_sender_banned", "banned {peer} for {ban_s:.0f} s: the event-bus sidecar saw "
                     "repeated messages from a peer that may not publish", level=logging.WARNING, peer=peer,
                     reason="sidecar", ban_s=self.bans.ban_s)

    def request(self) -> eventbus_pb2.SetMembersRequest:
        """What the sidecar needs to apply the rule first: members and their topics, banned peers."""
        members = [eventbus_pb2.BusMember(peer_id=p, topics=sorted(t))
                   for p, t in sorted(self.members.snapshot().items())]
        banned = sorted(str(k) for k in self.bans.banned() if str(k).startswith(("12D3", "Qm")))
        return eventbus_pb2.SetMembersRequest(members=members, banned=banned)
