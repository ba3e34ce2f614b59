"""Extra facts a component adds to the node's ``/readyz`` body (under ``details``).

Owns the registry only: a component (a role, a service the bootstrap hosts) calls
``provide(name, fn)`` once; the ops HTTP thread calls every ``fn()`` at each ``/readyz`` and puts
the result under ``details[name]``. ``fn`` runs on that thread, so it must only read a plain value
its owner replaces whole (never iterate a dict the event loop mutates) and must not block. What
``/readyz`` answers and when a node is ready stay with node/ops_http.py and node/lifecycle.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("swarmnode.ops")

_PROVIDERS: dict[str, Callable[[], Any]] = {}


def provide(name: str, fn: Callable[[], Any]) -> None:
    """Add (or replace) the ``/readyz`` detail ``name``."""
    _PROVIDERS[name] = fn


def snapshot() -> dict[str, Any]:
    """Every provided detail; one that fails is reported as its error, never breaks ``/readyz``."""
    out: dict[str, Any] = {}
    for name, fn in list(_PROVIDERS.items()):
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a probe answers even when one detail cannot
            out[name] = {"error": repr(exc)[:200]}
    return out


__all__ = ["provide", "snapshot"]
