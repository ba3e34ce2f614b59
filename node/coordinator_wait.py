"""Whether this node's coordinator answers: who it is, and since when the node waits for it.

Owns one node's record of its contact with the swarm's coordinator (the bootstrap that plans
for it) and how that record is shown: in ``/readyz`` under ``details.coordinator``
(node/ready_details.py), as the readiness detail sentence of a node that waits, and as the card
detail ``coordinator_wait`` (``"<coordinator peer ID or ?>@<unix seconds it waits since>"``),
which ``swarmnode status`` turns into a line under the table (:func:`status_hint`).

States: ``looking`` (no coordinator found yet: no bootstrap card in the DHT), ``unreachable``
(found, its service does not answer), ``answering``. ``since`` is when the current wait began:
it survives ``looking -> unreachable`` and is reset only by an answer. How the coordinator is
found and asked is the role's business (pipeline/coordinator_link.py); this module does no I/O.
The ops HTTP thread reads :meth:`CoordinatorWait.detail`: every attribute is replaced whole.
"""

from __future__ import annotations

import time
from typing import Any

CARD_DETAIL = "coordinator_wait"
"""The card detail a waiting node publishes (absent while its coordinator answers)."""

RESTART_HINT = ("restart the bootstrap with its key file (the same --identity; the same --dht-port and "
                "--grpc-port let the nodes find it at once)")
"""What an operator does about a coordinator that is gone (a sentence fragment)."""


def short(peer_id: str | None) -> str:
    return f"{peer_id[:16]}…" if peer_id else "(not known yet)"


class CoordinatorWait:
    """One node's contact with its coordinator. ``peer_id``: the coordinator's, when known in
    advance (``security.coordinator_peer_id``); :meth:`found` sets it from its card."""

    def __init__(self, peer_id: str | None = None, now: float | None = None):
        self.peer_id = peer_id or None
        self.state = "looking"
        self.since = time.time() if now is None else now
        self.error = ""
        self.answered_once = False

    @property
    def waiting(self) -> bool:
        return self.state != "answering"

    def waited_s(self, now: float | None = None) -> float:
        """Seconds the node has waited (0 while the coordinator answers)."""
        return max(0.0, (time.time() if now is None else now) - self.since) if self.waiting else 0.0

    def begin(self, now: float | None = None) -> None:
        """The node starts waiting for its coordinator now (its own start-up before that is not a
        wait for the coordinator); a no-op once it answered."""
        if not self.answered_once and self.waiting:
            self.since = time.time() if now is None else now

    def found(self, peer_id: str) -> None:
        """The coordinator's card was read: it is known, not yet answering."""
        self.peer_id = peer_id
        if self.state == "looking":
            self.state = "unreachable"
            self.error = "its card was read; not asked yet"

    def answered(self, now: float | None = None) -> bool:
        """Its service answered; True when that ends a wait."""
        self.error, self.answered_once = "", True
        if self.state == "answering":
            return False
        self.state, self.since = "answering", time.time() if now is None else now
        return True

    def failed(self, error: str, now: float | None = None) -> bool:
        """Its service did not answer (``error`` says how); True when that starts a wait."""
        self.error = error[:200]
        if self.state != "answering":
            if self.state == "looking":
                self.state = "unreachable"
            return False
        self.state, self.since = "unreachable", time.time() if now is None else now
        return True

    def detail(self, now: float | None = None) -> dict[str, Any]:
        """The ``/readyz`` ``details.coordinator`` value."""
        now = time.time() if now is None else now
        out: dict[str, Any] = {"state": self.state, "peer_id": self.peer_id, "since": round(self.since, 3)}
        if self.waiting:
            out["waiting_s"] = round(self.waited_s(now), 1)
            out["error"] = self.error
        return out

    def sentence(self) -> str:
        """Why a node that waits waits, and what to do (its readiness detail; static: it names
        the wall-clock time the wait began, ``/readyz`` ``details.coordinator.waiting_s`` the seconds)."""
        began = time.strftime("%H:%M:%S UTC", time.gmtime(self.since))
        if self.state == "looking":
            who = "" if not self.peer_id else f" {short(self.peer_id)}"
            return (f"waiting for the coordinator{who} since {began}: no bootstrap card in the DHT; start the "
                    f"bootstrap (or {RESTART_HINT})")
        return (f"waiting for the coordinator {short(self.peer_id)} since {began}: it does not answer "
                f"({self.error or 'no answer'}); {RESTART_HINT}")

    def card_value(self) -> str | None:
        """The ``coordinator_wait`` card detail: set while the node waits, None (removed) otherwise."""
        return f"{self.peer_id or '?'}@{self.since:.0f}" if self.waiting else None


def parse_card_value(value: Any) -> tuple[str | None, float] | None:
    """``(coordinator peer ID or None, unix seconds since)`` of a ``coordinator_wait`` detail;
    None for anything else (a peer's card may carry junk)."""
    if not isinstance(value, str):
        return None
    peer, sep, since = value.rpartition("@")
    if not sep or not peer:
        return None
    try:
        t = float(since)
    except ValueError:
        return None
    return (None if peer == "?" else peer), t


def status_hint(details: dict[str, Any], now: float | None = None) -> str:
    """The ``swarmnode status`` line for a node whose card says it waits for its coordinator; "" otherwise."""
    parsed = parse_card_value(details.get(CARD_DETAIL))
    if parsed is None:
        return ""
    peer, since = parsed
    waited = max(0.0, (time.time() if now is None else now) - since)
    return f"WAITING for the coordinator {peer or '(not found yet)'} for {waited:.0f} s; {RESTART_HINT}"


__all__ = ["CARD_DETAIL", "CoordinatorWait", "RESTART_HINT", "parse_card_value", "status_hint"]
