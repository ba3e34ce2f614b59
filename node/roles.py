"""The ``Role`` interface and the role registry.

A role is the pluggable part of a node (bootstrap, noloco, stage, grpo). Roles register
themselves with :func:`register` when their module is imported; ``node/`` finds the module
through the ``swarmnode.roles`` entry points in ``pyproject.toml`` and never imports a role by
name. Everything a role may use from the daemon comes through :class:`NodeContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Protocol

from node.config import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import grpc.aio

    from node.card import CardPublisher
    from node.config import NodeConfig
    from node.lifecycle import Lifecycle
    from node.membership import Membership
    from node.netem import LinkEmulator
    from node.supervisor import Supervisor


@dataclass
class NodeContext:
    """What the daemon hands a role: config, identity, swarm membership and transport."""

    config: "NodeConfig"
    peer_id: str
    lifecycle: "Lifecycle"
    membership: "Membership"
    card: "CardPublisher"
    server: "grpc.aio.Server"
    grpc_addr: str
    supervisor: "Supervisor"
    netem: "LinkEmulator"
    set_role_ready: Callable[[bool, str, str], Awaitable[None]]
    """``await set_role_ready(ready, reason, detail)``: the role's half of readiness
    (reason codes from ``node.lifecycle.READINESS_REASONS``, e.g. ``role_init``, ``state_sync``)."""
    request_drain: Callable[[str], None] = lambda trigger: None
    """Ask the node to drain and exit 0 (e.g. a worker that finished its configured steps)."""


class Role(Protocol):
    name: ClassVar[str]

    @classmethod
    def validate_config(cls, config: "NodeConfig") -> Any:
        """Validate the role's config sections; raise ConfigError naming the field. Runs before any
        key, socket or process is touched (also for ``run --check``)."""
        ...

    def __init__(self, ctx: NodeContext, role_config: Any) -> None: ...

    def services(self) -> list[tuple[Callable[[Any, "grpc.aio.Server"], None], Any, str]]:
        """gRPC services to add before the server starts: (add_XServicer_to_server, servicer, full name)."""
        ...

    async def start(self) -> None:
        """Start the role's work (as supervised tasks); return quickly."""
        ...

    async def drain(self, budget_s: float) -> None:
        """Finish or abandon work within ``budget_s`` without blocking peers."""
        ...


_ROLES: dict[str, type] = {}


def register(cls: type) -> type:
    _ROLES[cls.name] = cls
    return cls


def load_role(name: str) -> type:
    if name not in _ROLES:
        for ep in entry_points(group="swarmnode.roles", name=name):
            ep.load()  # importing the module runs its @register
    if name not in _ROLES:
        known = sorted(ep.name for ep in entry_points(group="swarmnode.roles"))
        raise ConfigError(f"role {name!r} is not installed; installed roles: {known}. "
                          "Reinstall swarmnode (pip install -e .) if a role is missing from this list")
    return _ROLES[name]
