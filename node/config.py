"""Typed node configuration: defaults < TOML (``--config``) < ``SWARMNODE_*`` env < CLI.

Owns the top-level :data:`NodeConfig`, the sections the daemon itself uses (identity, dht,
grpc, ops, drain, card) and the loader that turns any mistake into a :class:`ConfigError`
naming the field and what is allowed. Sections owned by other modules (netem, preemption,
log) are imported from them.

Roles and their sections are not named here: ``role`` must be one of the installed roles (the
``swarmnode.roles`` entry points) and every other top-level table is a section some installed
package registers in the ``swarmnode.sections`` entry-point group (``name = "pkg.mod:Model"``).
Both are read from package metadata without importing anything, so checking a config stays
cheap (no torch). Role sections are kept as raw tables here and validated by the role that
reads them (``RoleBase.Settings``, ``node/roles.py``); an unregistered table is refused like
any unknown key, with the closest valid name.

Env: ``SWARMNODE_OPS__PORT=9500``, lists as JSON
(``SWARMNODE_DHT__INITIAL_PEERS='["/ip4/…/p2p/12D3KooW…"]'``). CLI: named flags and
``--set dht.host_port=31338`` (JSON if it parses, else a string).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import socket
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from node.device import DeviceConfig
from node.errors import ConfigError
from node.eventbus.config import EventBusConfig
from node.logs import LogConfig
from node.netem import NetemConfig
from node.preemption import PreemptionConfig
from security.config import LimitsConfig, SecurityConfig, is_loopback_host, is_loopback_maddr

ENV_PREFIX = "SWARMNODE_"
ROLE_GROUP = "swarmnode.roles"
SECTION_GROUP = "swarmnode.sections"

_MADDR = re.compile(
    r"^/(ip4|ip6|dns|dns4|dns6)/[^/]+/(tcp/\d{1,5}|udp/\d{1,5}/quic(-v1)?)(/p2p/[1-9A-HJ-NP-Za-km-z]{40,60})$")


def installed_roles() -> list[str]:
    """Names of the installed roles (``swarmnode.roles`` entry points), sorted; imports nothing."""
    return sorted({ep.name for ep in entry_points(group=ROLE_GROUP)})


def registered_sections() -> dict[str, str]:
    """``{section: "pkg.mod:Model"}`` from the ``swarmnode.sections`` entry points; imports nothing."""
    return {ep.name: ep.value for ep in sorted(entry_points(group=SECTION_GROUP), key=lambda ep: ep.name)}


def closest(name: str, choices: list[str] | set[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


@functools.cache
def own_address() -> str:
    """The IPv4 address this machine's hostname resolves to (in a container: its IP on the Docker
    network), or 127.0.0.1 when it resolves to a loopback address or not at all."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    return "127.0.0.1" if addr.startswith("127.") else addr


def check_peer_maddr(value: str) -> str:
    """Validate one initial-peer multiaddr (must end in ``/p2p/<peer id>``)."""
    if not isinstance(value, str) or not _MADDR.match(value.strip()):
        raise ValueError(
            f"{value!r} is not a peer multiaddr; expected /ip4/<ip>/tcp/<port>/p2p/<peer id>, as printed "
            "by `swarmnode bootstrap` or served at http://<bootstrap>:<ops port>/peerinfo")
    return value.strip()


class IdentityConfig(_Section):
    path: str = "~/.local/share/swarmnode/identity.key"
    """Ed25519 key file (go-libp2p format). The peer ID derives from it: keep it on a volume so a
    restarted node keeps its ID. Never key material here, only a path."""

    create_if_missing: bool = True
    """Write a new Ed25519 key at ``path`` on first start. Set false in production images where a
    missing key means a missing volume (then the node exits 3 instead of taking a new ID)."""

    allow_insecure_mode: bool = False
    """Accept a key file readable by group/others. Only for the public demo key in ``deploy/``."""


class DhtConfig(_Section):
    initial_peers: list[str] = Field(default_factory=list)
    """Multiaddrs of live peers (usually the bootstrap), e.g. ``/ip4/203.0.113.10/tcp/31337/p2p/12D3KooW…``.
    Empty means this node starts a new swarm (a bootstrap does)."""

    host_port: int = Field(31337, ge=0, le=65535)
    """TCP port for libp2p. 0 picks a free one (tests); fixed ports are easier to open in firewalls."""

    announce_maddrs: list[str] = Field(default_factory=list)
    """Addresses others should dial, when behind NAT: ``["/ip4/<public ip>/tcp/31337"]``."""

    startup_timeout_s: float = Field(30.0, gt=0)
    """Seconds p2pd may take to start. Raise on slow disks if logs show `Daemon failed to start`."""

    bootstrap_timeout_s: float = Field(5.0, gt=0)
    """Per-attempt timeout for dialling and pinging one initial peer."""

    retry_max_s: float = Field(60.0, gt=0)
    """Cap of the exponential backoff (1 s, 2 s, 4 s …) between bootstrap attempts."""

    bootstrap_deadline_s: float | None = Field(None, gt=0)
    """Give up (exit 4) when no initial peer answered for this long. None retries forever, which is
    right under an orchestrator that restarts on failure anyway."""

    redial_s: float = Field(10.0, gt=0)
    """Once joined, how often the node dials again those initial peers that are not in its routing
    table (one dial each; none while they are there): a bootstrap that died and was restarted at
    the same address is found again within this many seconds, and it finds the swarm through the
    nodes that dial it. Lower it where the swarm must see a restarted bootstrap sooner; raise it
    where many nodes list a bootstrap that is gone for good (each dials it this often)."""

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        return [check_peer_maddr(p) for p in v]


class GrpcConfig(_Section):
    port: int = Field(50051, ge=0, le=65535)
    """gRPC listen port for role-to-role calls. 0 picks a free one."""

    max_message_bytes: int = Field(8 * 1024 * 1024, ge=1024 * 1024, le=64 * 1024 * 1024)
    """Largest single gRPC message, both directions, server and channels. Tensors are streamed in
    chunks below this, so raising it is rarely the fix for a large model."""

    max_concurrent_rpcs: int = Field(64, ge=1)
    """Concurrent RPCs this server accepts; beyond it callers get RESOURCE_EXHAUSTED."""

    grace_s: float = Field(5.0, ge=0)
    """Seconds in-flight RPCs get to finish during drain."""


class OpsConfig(_Section):
    port: int = Field(9400, ge=0, le=65535)
    """HTTP port for /metrics, /healthz, /readyz and /peerinfo. 0 picks a free one."""

    host: str = "127.0.0.1"
    """Where the ops port listens; it serves metrics and peer info, so it is private by default,
    whatever ``host`` the node's DHT and gRPC use. An IP (``127.0.0.1``; an interface's private
    IP for a Prometheus on your network), ``"private"`` (the address this machine's hostname
    resolves to, e.g. a container's IP on its Docker network, plus 127.0.0.1 for the healthcheck;
    refused at start when that address is public), or ``"host"`` (the node's ``host``, e.g.
    0.0.0.0: only behind a firewall that keeps the port off the internet)."""

    max_connections: int = Field(64, ge=4, le=4096)
    """Ops connections open at once. A new one beyond it closes the connection that has waited
    longest for its request, so idle sockets cannot lock Prometheus out. Raise it only when many
    scrapers share a node and ``swarmnode_ops_connections_closed_total{reason="evicted"}`` grows
    without anyone flooding."""

    idle_timeout_s: float = Field(10.0, gt=0, le=300)
    """Seconds a connection may stay open without delivering a complete request (and to read
    its answer). Prometheus and the healthcheck send at once; raise it only for very slow links."""

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        import ipaddress
        if v in ("private", "host"):
            return v
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"ops.host {v!r} is not an IP address, 'private' or 'host'; use e.g. 127.0.0.1") \
                from None
        return v

    def bind_hosts(self, node_host: str) -> list[str]:
        """The addresses to listen on; ValueError (naming ``ops.host``) when ``private`` would be public."""
        import ipaddress
        if self.host == "host":
            return [node_host]
        if self.host != "private":
            return [self.host]
        addr = own_address()
        if addr == "127.0.0.1":
            return [addr]
        if not ipaddress.ip_address(addr).is_private:
            raise ValueError(f"ops.host = 'private', but this machine's hostname resolves to the public address "
                             f"{addr}; set ops.host to a private interface IP (or 127.0.0.1) so /metrics and "
                             "/peerinfo stay off the internet")
        return [addr, "127.0.0.1"]


class DrainConfig(_Section):
    budget_s: float = Field(20.0, gt=0)
    """Total seconds from SIGTERM to exit. Keep it below the container stop timeout
    (``docker run --stop-timeout``) and below the spot provider's window (GCP: 30 s)."""


class CardConfig(_Section):
    ttl_s: float = Field(30.0, gt=1, le=55)
    """Lifetime of this node's card in the DHT; a vanished node disappears from `status` after it."""

    refresh_s: float = Field(10.0, gt=0)
    """How often the card is re-published. Keep it well below ``ttl_s`` (a third is typical)."""

    @model_validator(mode="after")
    def _refresh_below_ttl(self) -> "CardConfig":
        if self.refresh_s >= self.ttl_s:
            raise ValueError(f"card.refresh_s={self.refresh_s} must be below card.ttl_s={self.ttl_s}; "
                             "use about a third of the TTL")
        return self


class DaemonConfig(BaseSettings):
    """The daemon's own part of a node's configuration; :data:`NodeConfig` adds the registered
    role sections to it (``config_class``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid",
        use_attribute_docstrings=True, case_sensitive=False)

    _toml_file: ClassVar[Path | None] = None

    run_id: str = Field("swarmnode", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Name of the training run; nodes only see and talk to nodes of the same run."""

    role: str | None = None
    """What this node does in the swarm: one of the installed roles (``swarmnode run --role``;
    ``bootstrap`` for a swarm's entry point). Required to start a node."""

    host: str = "127.0.0.1"
    """IP this node binds for DHT, gRPC and ops HTTP. The default keeps a node private to this
    host; give ``--host 0.0.0.0`` (or the interface's IP) for a swarm across machines."""

    advertise_host: str | None = None
    """IP peers should use for this node's gRPC address (node card). Defaults to ``host``; when
    ``host`` is 0.0.0.0, to the address this machine's hostname resolves to (a container's IP on
    its Docker network), or 127.0.0.1 when that is a loopback address. Behind NAT set the public IP."""

    state_dir: str = "~/.local/share/swarmnode/state"
    """Folder where the role keeps checkpoints (one node per folder). Put it on a volume to
    survive restarts; with ``resume`` the role continues from its latest checkpoint."""

    resume: bool = False
    """Resume from the latest checkpoint in ``state_dir`` (``--resume``). Without it a node starts
    fresh or, if the run already has peers, downloads their current state."""

    identity: IdentityConfig = Field(default_factory=IdentityConfig)
    dht: DhtConfig = Field(default_factory=DhtConfig)
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    card: CardConfig = Field(default_factory=CardConfig)
    netem: NetemConfig = Field(default_factory=NetemConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    eventbus: EventBusConfig = Field(default_factory=EventBusConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @field_validator("role")
    @classmethod
    def _installed_role(cls, v: str | None) -> str | None:
        if v is None:
            return v
        known = installed_roles()
        if v not in known:
            raise ValueError(f"role {v!r} is not installed{closest(v, known)} (installed roles: "
                             f"{', '.join(known)}); a missing role means its package is not installed "
                             "(pip install -e . in the source tree)")
        return v

    @field_validator("host", "advertise_host")
    @classmethod
    def _ip(cls, v: str | None) -> str | None:
        import ipaddress
        if v is None:
            return v
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address; use e.g. 0.0.0.0 or 127.0.0.1") from None
        return v

    @model_validator(mode="after")
    def _cross(self) -> "DaemonConfig":
        if self.preemption.provider == "gcp" and self.drain.budget_s > 25:
            raise ValueError(f"drain.budget_s={self.drain.budget_s} does not fit GCP's 30 s preemption window; "
                             "use 25 or less")
        if self.security.peer_auth == "none":
            public = [h for h in (self.host, self.advertise_host) if not is_loopback_host(h)]
            public += [m for m in (*self.dht.initial_peers, *self.dht.announce_maddrs) if not is_loopback_maddr(m)]
            if public:
                raise ValueError(f"security.peer_auth = 'none' is allowed only when every listen and peer address is "
                                 f"loopback; {public[0]!r} is not. Use peer_auth = 'signed' (the default)")
        return self

    @property
    def grpc_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return own_address() if self.host in ("0.0.0.0", "::") else self.host

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)


def parse_set(items: list[str]) -> dict[str, Any]:
    """Turn ``["dht.host_port=31338", "noloco.inner_steps=5"]`` into a nested dict."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set dht.host_port=31338")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"--set {item!r}: empty key")
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                raise ConfigError(f"--set {item!r}: {p} is set both as a value and a section")
        cur[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


_CLASSES: dict[tuple[tuple[str, str], ...], type[DaemonConfig]] = {}


def config_class() -> type[DaemonConfig]:
    """The config model for the sections registered now: :class:`DaemonConfig` plus one raw
    table per ``swarmnode.sections`` entry point (validated later by the role that reads it).
    Cached per set of registrations, so installing a package that registers a section is all a
    new role needs; nothing in ``node/`` changes."""
    sections = registered_sections()
    cache_key = tuple(sections.items())
    cls = _CLASSES.get(cache_key)
    if cls is not None:
        return cls
    clash = sorted(set(sections) & set(DaemonConfig.model_fields))
    if clash:
        raise ConfigError(f"the swarmnode.sections entry point(s) {clash} reuse a name of the daemon's own config; "
                          "rename the role's section")
    bad = sorted(n for n in sections if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", n))
    if bad:
        raise ConfigError(f"swarmnode.sections entry point name(s) {bad} are not valid section names "
                          "(lowercase letters, digits, _)")
    fields: dict[str, Any] = {
        name: (dict[str, Any], Field(default_factory=dict, description=(
            f"[{name}] section, validated by the role that reads it (schema: {target})")))
        for name, target in sections.items()}
    cls = create_model("NodeConfig", __base__=DaemonConfig, __module__=__name__, **fields)
    _CLASSES[cache_key] = cls
    return cls


NodeConfig = config_class()
"""The whole effective configuration of one node (the daemon's sections and, as raw tables,
the role sections registered when this module was imported; ``load_config`` re-reads them)."""


def _check_env_names(environ: dict[str, str], cls: type[DaemonConfig]) -> None:
    """pydantic-settings ignores a misspelt top-level SWARMNODE_* variable: refuse it instead."""
    fields = set(cls.model_fields)
    for name in environ:
        if not name.upper().startswith(ENV_PREFIX):
            continue
        top = name[len(ENV_PREFIX):].lower().split("__", 1)[0]
        if top not in fields:
            close = difflib.get_close_matches(top, sorted(fields), n=1)
            hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
            raise ConfigError(f"environment variable {name} matches no config key{hint} "
                              f"(valid sections: {', '.join(sorted(fields))})")


def _known_keys(model: Any, path: tuple) -> set[str] | None:
    """Field names valid at ``path`` inside ``model`` (walking nested pydantic models)."""
    for part in path:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return None
        model = fields[part].annotation
    fields = getattr(model, "model_fields", None)
    return set(fields) if fields is not None else None


def format_validation_error(exc: ValidationError, source: str = "config", model: Any = None) -> str:
    """One line per error: dotted field path, what is wrong and, for an unknown key, the closest
    valid key of ``model`` (the pydantic model that was validated) when one is close."""
    lines = [f"invalid {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            known = _known_keys(model, tuple(err["loc"][:-1])) if model is not None else None
            hint = closest(str(err["loc"][-1]), known) if known else ""
            msg = (f"unknown key{hint} (remove it, or check its spelling against the README's config "
                   "reference)")
        given = err.get("input")
        shown = "" if err["type"] in ("extra_forbidden", "missing") or isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def load_config(config_file: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> DaemonConfig:
    """Build the effective config. Raises :class:`ConfigError` with a readable message."""
    environ = dict(os.environ) if environ is None else environ
    cls = config_class()
    _check_env_names(environ, cls)
    path = None
    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; pass an existing TOML file to --config "
                              "(examples in deploy/configs/)")
        import tomllib
        try:
            tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    saved_env = {k: v for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}
    cls._toml_file = path
    try:
        # pydantic-settings reads os.environ: present exactly `environ`'s SWARMNODE_* names.
        for k in saved_env:
            del os.environ[k]
        os.environ.update({k: v for k, v in environ.items() if k.upper().startswith(ENV_PREFIX)})
        return cls(**(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model=cls)) from None
    except ValueError as exc:  # e.g. env value that is not JSON for a list field
        hint = ""
        m = re.search(r'field "(\w+)" from source "EnvSettingsSource"', str(exc))
        if m:  # name the variable(s): pydantic-settings only names the top-level field
            names = sorted(k for k in environ if k.upper().startswith(f"{ENV_PREFIX}{m.group(1).upper()}"))
            hint = (f" ({', '.join(names)}); list and table values in SWARMNODE_* variables must be JSON, "
                    f"e.g. SWARMNODE_DHT__INITIAL_PEERS='[\"/ip4/…/p2p/12D3KooW…\"]'")
        raise ConfigError(f"invalid config: {exc}{hint}") from None
    finally:
        cls._toml_file = None
        for k in [k for k in os.environ if k.upper().startswith(ENV_PREFIX)]:
            del os.environ[k]
        os.environ.update(saved_env)


_SECRET_WORDS = ("key", "token", "secret", "password")


def redacted(cfg: DaemonConfig) -> dict[str, Any]:
    """The config as a dict with secret-looking values masked (paths are kept: they are not secrets)."""
    def walk(obj: Any, name: str = "") -> Any:
        if isinstance(obj, dict):
            return {k: walk(v, k) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v, name) for v in obj]
        if isinstance(obj, str) and any(w in name.lower() for w in _SECRET_WORDS) and not name.endswith(("path", "_url")):
            return "***"
        return obj
    return walk(cfg.model_dump(mode="json"))
