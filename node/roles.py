"""The ``Role`` interface, ``RoleBase`` and the role registry.

A role is the pluggable part of a node (the bootstrap and every training role). Roles register
themselves with :func:`register` when their module is imported; ``node/`` finds the module
through the ``swarmnode.roles`` entry points in ``pyproject.toml`` and never imports a role by
name. Everything a role may use from the daemon comes through :class:`NodeContext`.

A role declares itself on its class (:class:`RoleBase`)::

    class StageSettings(BaseModel):                 # one field per config section it reads
        model_config = ConfigDict(extra="forbid")
        stage: StageConfig
        model: ModelConfig

    @register
    class StageRole(RoleBase):
        name = "stage"
        Settings = StageSettings                    # sections: [stage], [model]
        rendezvous = (STAGE_RECORDS,)               # signed DHT records its nodes write

        @classmethod
        def bootstrap_services(cls, ctx):           # hosted by the bootstrap node
            return [Service(add_ScheduleServicer_to_server, ScheduleServicer(ctx), "swarmnode.Schedule")]

and in ``pyproject.toml`` names its module (``[project.entry-points."swarmnode.roles"]``) and its
own sections (``[project.entry-points."swarmnode.sections"]``, so config checks need no import).

A training role derives from ``node.training.TrainingRole`` (a ``RoleBase``) instead: it brings
the compute thread, the run knobs, the round loop, finish, drain, checkpoints, state serving and
the per-round report, so the role writes only its engine and round policy.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from node.config import ROLE_GROUP, ConfigError, closest, format_validation_error, installed_roles, registered_sections
from node.logs import emit

if TYPE_CHECKING:  # pragma: no cover
    import grpc.aio

    from node.card import CardPublisher
    from node.config import NodeConfig
    from node.lifecycle import Lifecycle
    from node.membership import Membership
    from node.netem import LinkEmulator
    from node.rendezvous import Rendezvous
    from node.supervisor import Supervisor
    from security.records import Namespace

log = logging.getLogger("swarmnode.roles")


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
    coordinator_lease: Any = None
    """On a bootstrap: its ``node.coordinator_lease.CoordinatorLease`` (``active``, ``on_change``,
    ``note_epoch``), set before ``bootstrap_services`` run; a hosted coordinator serves only while
    ``active``. None elsewhere (and a service that finds None serves, as with a single bootstrap)."""
    eventbus: Any = None
    """The swarm event bus (``node.eventbus.client.EventBus``) when ``eventbus.enabled``, else
    None: then use the DHT path. It may still be starting or restarting: check ``eventbus.up``
    (or ``await eventbus.wait_up(t)``); a publish while it is down raises ``EventBusUnavailable``."""


class Service(NamedTuple):
    """One gRPC service to add before the server starts."""

    add_to_server: Callable[[Any, "grpc.aio.Server"], None]
    """The generated ``add_XServicer_to_server`` (or any ``fn(servicer, server)``)."""
    servicer: Any
    name: str
    """Full service name (``swarmnode.NoLoCo``): gRPC health reports it."""


class Role(Protocol):
    name: ClassVar[str]

    @classmethod
    def validate_config(cls, config: "NodeConfig") -> Any:
        """Validate the role's config sections; raise ConfigError naming the field. Runs before any
        key, socket or process is touched (also for ``run --check``)."""
        ...

    @classmethod
    def namespaces(cls, config: "NodeConfig") -> list["Namespace"]:
        """DHT record namespaces this role's nodes write (the node's validator accepts them)."""
        ...

    @classmethod
    def bootstrap_services(cls, ctx: NodeContext) -> list[Service]:
        """gRPC services the bootstrap node hosts for this role's swarm (e.g. a schedule service)."""
        ...

    def __init__(self, ctx: NodeContext, role_config: Any) -> None: ...

    def services(self) -> list[Service]:
        """gRPC services to add before the server starts."""
        ...

    async def start(self) -> None:
        """Start the role's work (as supervised tasks); return quickly."""
        ...

    async def drain(self, budget_s: float) -> None:
        """Finish or abandon work within ``budget_s`` without blocking peers."""
        ...


class NoSettings(BaseModel):
    """A role that reads no config section."""

    model_config = ConfigDict(extra="forbid")


class RoleBase:
    """What a role declares about itself, with the defaults most roles want.

    Subclasses set ``name`` and, as needed, ``Settings``, ``rendezvous``, and override
    :meth:`bootstrap_services`, :meth:`services`, :meth:`start` and :meth:`drain`.
    """

    name: ClassVar[str]
    """The role's name: ``--role``, the card's ``role``, the ``swarmnode.roles`` entry point."""

    Settings: ClassVar[type[BaseModel]] = NoSettings
    """A pydantic model with one field per config section the role reads (field name = the
    section's name, annotation = its schema). Each section name must be registered in the
    ``swarmnode.sections`` entry-point group; sections may be shared (``[model]``)."""

    rendezvous: ClassVar[tuple["Rendezvous", ...]] = ()
    """Per-round signed records this role's nodes write (``node/rendezvous.py``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not (isinstance(cls.Settings, type) and issubclass(cls.Settings, BaseModel)):
            raise TypeError(f"{cls.__name__}.Settings must be a pydantic model (one field per config section)")

    @classmethod
    def sections(cls) -> list[str]:
        """The config sections this role reads."""
        return list(cls.Settings.model_fields)

    @classmethod
    def validate_config(cls, config: "NodeConfig") -> Any:
        """Validate the role's sections into ``Settings``; ConfigError naming the field (and the
        closest valid key for a misspelt one)."""
        raw = {name: getattr(config, name, None) or {} for name in cls.sections()}
        try:
            return cls.Settings.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, model=cls.Settings)) from None

    @classmethod
    def namespaces(cls, config: "NodeConfig") -> list["Namespace"]:
        return [r.namespace for r in cls.rendezvous]

    @classmethod
    def bootstrap_services(cls, ctx: NodeContext) -> list[Service]:
        """Services the bootstrap node hosts for this role (default: none). Called on the
        bootstrap, with the bootstrap's context, before its gRPC server starts; the servicers
        must not need this role's heavy state (they run without the role itself)."""
        return []

    def __init__(self, ctx: NodeContext, settings: Any):
        self.ctx, self.settings = ctx, settings

    def services(self) -> list[Service]:
        return []

    async def drain(self, budget_s: float) -> None:
        return None


_ROLES: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` the role called ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute name = '<role>' to be registered")
    if not inspect.iscoroutinefunction(getattr(cls, "start", None)):
        raise TypeError(f"role {name!r} ({cls.__name__}) needs `async def start(self) -> None`: it begins the "
                        "role's work once the node has joined (RoleBase has no default)")
    _ROLES[name] = cls
    return cls


def _check_sections(cls: type) -> None:
    sections = getattr(cls, "sections", None)
    if sections is None:
        return
    registered = registered_sections()
    missing = [s for s in sections() if s not in registered]
    if missing:
        raise ConfigError(
            f"role {cls.name!r} reads config section(s) {missing} that no package registers; add them to "
            f"pyproject.toml's [project.entry-points.\"swarmnode.sections\"] (e.g. {missing[0]} = "
            f"\"{cls.__module__}:<Model>\") and reinstall (pip install -e .)")


def load_role(name: str | None) -> type:
    """The role class called ``name``, importing its module through the entry points if needed.
    ConfigError (exit 2) when it is not set, not installed, or reads an unregistered section."""
    if not name:
        raise ConfigError(f"no role set: pass --role or set role in the config (installed roles: "
                          f"{', '.join(installed_roles())})")
    if name not in _ROLES:
        for ep in entry_points(group=ROLE_GROUP, name=name):
            ep.load()  # importing the module runs its @register
    if name not in _ROLES:
        known = installed_roles()
        raise ConfigError(f"role {name!r} is not installed{closest(name, known)}; installed roles: {known}. "
                          "Reinstall swarmnode (pip install -e .) if a role is missing from this list")
    cls = _ROLES[name]
    _check_sections(cls)
    return cls


def load_installed_roles(skip: tuple[str, ...] = ()) -> dict[str, type]:
    """Every installed role class (importing each role's module), except ``skip``. A role whose
    module fails to import is left out with an error log naming it and the exception: one
    broken optional role must not stop the swarm's entry point."""
    out: dict[str, type] = {}
    for name in installed_roles():
        if name in skip:
            continue
        try:
            out[name] = load_role(name)
        except Exception as exc:  # noqa: BLE001 - reported; the other roles still load
            emit(log, "role_load_failed", "role {role_name!r} could not be loaded ({error}): its bootstrap services "
                 "and record namespaces are missing on this node; fix its installation", level=logging.ERROR,
                 role_name=name, error=repr(exc))
    return out
