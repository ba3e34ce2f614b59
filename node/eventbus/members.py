"""Who may publish on the event bus: the run's live members and the topics each may send.

Owns the sender rule (docs/security.md, 'Event-bus membership') both ends of the bus apply
before any other work on a message (the sidecar before it delivers or forwards, the daemon
before it decodes): the originator must hold a live node card in the run (state not ``offline``; in
token mode a card exists only with a valid admission token for its role, which the DHT validator
checks, security/records.py), and its card's role must be one that may send on the topic
(``eventbus.publishers``). Refusal reasons: ``not_member``, ``role_not_allowed``, and
``members_unknown`` while no member list has been read yet (dropped, never charged).

A peer missing from one card read stays a member for at most ``MEMBER_GRACE_S`` (and never past
its card's expiration), so one incomplete DHT read does not drop an honest peer's messages.

Pure: no hivemind, libp2p or grpc import (the sidecar uses it too).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

#: Seconds a member absent from a card read keeps its membership (bounded by its card's expiration).
MEMBER_GRACE_S = 15.0
REASONS = ("members_unknown", "not_member", "role_not_allowed")


def topics_for_role(role: str, topics: Iterable[str], publishers: Mapping[str, list[str]]) -> frozenset[str]:
    """The topics a node of ``role`` may publish on: every topic not in ``publishers``, and those
    whose list names ``role``."""
    return frozenset(t for t in topics if t not in publishers or role in publishers[t])


class BusMembers:
    """peer ID -> topics it may send, as last read from the node cards (``update``), or as handed
    over by the daemon (``replace``, in the sidecar). ``refusal(peer, topic)`` is the check."""

    def __init__(self, clock=time.time):
        self._clock = clock
        self._topics: dict[str, frozenset[str]] = {}
        self._until: dict[str, float] = {}
        self.known = False   # False until the first member list: everything is refused, uncharged

    def update(self, views: Iterable[Any], topics: Iterable[str], publishers: Mapping[str, list[str]],
               grace_s: float = MEMBER_GRACE_S) -> None:
        """Merge a card read (``node.card.CardView``s: ``peer_id``, ``card.role``, ``card.state``,
        ``expiration``). Offline cards end membership at once; absent peers fade after ``grace_s``."""
        now, topics = self._clock(), tuple(topics)
        seen: set[str] = set()
        for v in views:
            seen.add(v.peer_id)
            if v.card.state == "offline":
                self._topics.pop(v.peer_id, None)
                self._until.pop(v.peer_id, None)
                continue
            self._topics[v.peer_id] = topics_for_role(v.card.role, topics, publishers)
            self._until[v.peer_id] = float(v.expiration)
        for peer in list(self._topics):
            if peer not in seen:
                self._until[peer] = min(self._until[peer], now + grace_s)
        self._expire(now)
        self.known = True

    def replace(self, members: Mapping[str, Iterable[str]]) -> None:
        """Take the daemon's list as is (peer -> topics), in the sidecar."""
        self._topics = {p: frozenset(t) for p, t in members.items()}
        self._until = {}
        self.known = True

    def _expire(self, now: float) -> None:
        for peer in [p for p, until in self._until.items() if until < now]:
            self._topics.pop(peer, None)
            self._until.pop(peer, None)

    def refusal(self, peer: str, topic: str) -> str | None:
        """None when ``peer`` may publish on ``topic``, else the reason (:data:`REASONS`)."""
        if not self.known:
            return "members_unknown"
        allowed = self._topics.get(peer)
        if allowed is None:
            return "not_member"
        until = self._until.get(peer)
        if until is not None and until < self._clock():
            return "not_member"
        return None if topic in allowed else "role_not_allowed"

    def snapshot(self) -> dict[str, frozenset[str]]:
        """peer -> topics, for the sidecar (``SetMembers``)."""
        self._expire(self._clock())
        return dict(self._topics)

    def __contains__(self, peer: str) -> bool:
        return self.known and peer in self._topics

    def __len__(self) -> int:
        return len(self._topics)
