"""The node's life: one state object that /readyz, gRPC health, ``swarmnode_state`` and the
node card all follow.

``JOINING -> READY -> DRAINING -> OFFLINE``, plus READY -> JOINING when the node must resync
(routing table emptied, role lost its state). Listeners are notified on every change (state or
reason); they must not block. Owns nothing else: who moves the state is the daemon's business.
"""

from __future__ import annotations

import logging
import threading
import time
from enum import StrEnum
from typing import Awaitable, Callable

from node.logs import emit

log = logging.getLogger("swarmnode.lifecycle")


class State(StrEnum):
    JOINING = "joining"
    READY = "ready"
    DRAINING = "draining"
    OFFLINE = "offline"


ALLOWED: dict[State, set[State]] = {
    State.JOINING: {State.JOINING, State.READY, State.DRAINING},
    State.READY: {State.JOINING, State.DRAINING},
    State.DRAINING: {State.OFFLINE},
    State.OFFLINE: set(),
}

READINESS_REASONS = ("dht_starting", "dht_start_failed", "dht_bootstrap_failed", "dht_no_peers",
                     "role_init", "state_sync", "awaiting_assignment", "awaiting_coordinator", "recovering", "ready",
                     "draining", "offline")
# "recovering": the role rolled back a bad update (non-finite or out-of-bound) and is not ready
# until a good step or a fresh state download (optimizers/noloco_role.py).
# "awaiting_coordinator": the role cannot start before its coordinator (the bootstrap's service
# that plans for it) answers, and it does not (node/coordinator_wait.py; the stage role).


class LifecycleError(RuntimeError):
    pass


Listener = Callable[["State", str, str], Awaitable[None] | None]


class Lifecycle:
    """Current state, a reason code from :data:`READINESS_REASONS` and a human detail sentence."""

    def __init__(self) -> None:
        self.state, self.reason, self.detail = State.JOINING, "dht_starting", "starting the DHT"
        self.since = time.time()
        self._lock = threading.Lock()  # the ops HTTP thread reads a consistent snapshot
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def snapshot(self) -> tuple[State, str, str]:
        with self._lock:
            return self.state, self.reason, self.detail

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    async def move(self, new: State, reason: str, detail: str = "") -> None:
        with self._lock:
            if (new, reason, detail) == (self.state, self.reason, self.detail):
                return  # no change (e.g. READY -> READY on a repeated readiness refresh): not an error
            if new not in ALLOWED[self.state]:
                raise LifecycleError(f"{self.state} -> {new} is not a legal transition")
            old = self.state
            self.state, self.reason, self.detail = new, reason, detail
            if new is not old:
                self.since = time.time()
        if new is not old:
            level = logging.WARNING if (old is State.READY and new is State.JOINING) else logging.INFO
            emit(log, "state_changed", "state {from} -> {to} ({reason})", level=level,
                 **{"from": str(old), "to": str(new), "reason": reason, "detail": detail, "state": str(new)})
        for notify in list(self._listeners):
            result = notify(new, reason, detail)
            if result is not None:
                await result
