"""``[eventbus]``: the event-bus sidecar's settings (gossipsub over py-libp2p, reachability prober).

Owns the section's schema and the checks between its fields. Imports only pydantic: the sidecar
reads this module too, and it must stay free of hivemind (docs/security.md, 'Process separation').
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KiB = 1024
TOPICS: tuple[str, ...] = ("swarm", "rollouts")
_ADDR = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[^/]+/tcp/\d{1,5}$")


class EventBusConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    enabled: bool = False
    """Run the event-bus sidecar (a child process with a py-libp2p gossipsub host). Off: roles use
    the DHT for everything the bus would carry (drain notices are seen when the card changes,
    GRPO rollouts through the DHT index + Fetch). Turn on for fast notices and rollout sharing."""

    port: int = Field(31338, ge=0, le=65535)
    """TCP port of the sidecar's libp2p host (gossip and reachability probes). 0 picks a free one
    (tests). Open it in the firewall next to ``dht.host_port``."""

    announce_addrs: list[str] = Field(default_factory=list)
    """Addresses other nodes should dial for gossip when behind NAT, e.g.
    ``["/ip4/203.0.113.5/tcp/31338"]`` (no ``/p2p/`` suffix). Empty: the listen address, with
    0.0.0.0 replaced by the node's ``advertise_host``. Set it when peers report this node
    unreachable."""

    swarm_max_bytes: int = Field(4 * KiB, ge=256, le=64 * KiB)
    """Largest message on the ``swarm`` topic (drain, preemption, stage-down notices, bans). Larger
    ones are refused on publish and dropped (and their sender penalised) on receipt."""

    rollouts_max_bytes: int = Field(64 * KiB, ge=1 * KiB, le=1024 * KiB)
    """Largest message on the ``rollouts`` topic (one GRPO prompt group per shard; gossip is
    capped at 64 KiB: docs/security.md, 'Process separation'). Bigger batches go through the DHT index + Fetch instead."""

    degree: int = Field(6, ge=1, le=32)
    """Gossipsub mesh degree D (peers each message is pushed to). Larger: lower latency, more
    duplicate traffic. ``degree_low`` / ``degree_high`` bound it during mesh maintenance."""

    degree_low: int = Field(4, ge=1, le=32)
    """Graft more mesh peers below this (gossipsub D_lo)."""

    degree_high: int = Field(12, ge=1, le=64)
    """Prune mesh peers above this (gossipsub D_hi)."""

    heartbeat_s: float = Field(1.0, ge=0.1, le=60)
    """Gossipsub heartbeat: mesh maintenance, gossip (IHAVE) and score decay run this often."""

    max_messages_per_peer_per_s: float = Field(500.0, gt=0)
    """Messages per second accepted from one neighbour per topic (py-libp2p's spam guard, also
    applied to our own publishes). Raise it only if a fast rollout producer gets throttled."""

    invalid_message_penalty: float = Field(10.0, ge=0)
    """Score taken from a neighbour for each dropped message it sent (oversize, unsigned, forged,
    invalid); it decays by 10% per heartbeat. 0 turns the penalty off."""

    publish_threshold: float = Field(-50.0, le=0)
    """Below this score a neighbour's messages on a topic are ignored (after 6 bad messages there
    at the default penalty, until the penalty decays)."""

    graylist_threshold: float = Field(-80.0, le=0)
    """Below this score a neighbour is graylisted (all its RPCs ignored). Keep it below
    ``publish_threshold``."""

    probe_interval_s: float = Field(30.0, ge=1)
    """How often the sidecar dials every known peer's gossip address (ping + identify) and
    gossips which peers it reached on ``swarm``."""

    probe_timeout_s: float = Field(5.0, gt=0)
    """Per-dial timeout of a reachability probe."""

    start_timeout_s: float = Field(30.0, gt=0)
    """Seconds the sidecar may take to come up (import py-libp2p, listen, open its socket)."""

    restart_max: int = Field(10, ge=0)
    """Restarts after a sidecar crash before the daemon gives up on the bus (it then runs on the
    DHT fallback and reports ``eventbus: failed`` in /readyz details; the node stays up)."""

    restart_backoff_max_s: float = Field(30.0, gt=0)
    """Cap of the restart backoff (0.5 s, 1 s, 2 s ...)."""

    subscriber_queue: int = Field(4096, ge=16)
    """Messages buffered per local subscriber before the oldest are dropped (counted as
    ``slow_subscriber``)."""

    outbound_queue: int = Field(1024, ge=32, le=65536)
    """RPCs queued per neighbour before py-libp2p drops new ones (counted as ``queue_full``;
    py-libp2p's own default of 32 lost a quarter of a 100-message burst). Raise it if
    ``queue_full`` drops show up under rollout bursts; each slot may hold one topic-cap message."""

    publishers: dict[str, list[str]] = Field(default_factory=lambda: {"rollouts": ["grpo"]})
    """Which roles may publish on a topic (short topic name -> role names); a topic not listed
    accepts every member of the run. Messages from a member of another role are dropped before
    any work (``swarmnode_eventbus_messages_dropped_total{reason="role_not_allowed"}``). Add a
    role here when a new role publishes on that topic; every node of the run needs the same list."""

    socket_dir: str | None = None
    """Folder for the sidecar's unix socket (mode 0700). None: a fresh private temp folder.
    Keep the path short: unix socket paths are limited to 107 bytes."""

    @field_validator("announce_addrs")
    @classmethod
    def _addrs(cls, v: list[str]) -> list[str]:
        for a in v:
            if not _ADDR.match(a.strip()):
                raise ValueError(f"{a!r} is not a gossip address; expected /ip4/<public ip>/tcp/<port> "
                                 "(no /p2p/ suffix)")
        return [a.strip() for a in v]

    @field_validator("publishers")
    @classmethod
    def _publishers(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for topic, roles in v.items():
            if topic not in TOPICS:
                raise ValueError(f"eventbus.publishers: unknown topic {topic!r}; topics are {', '.join(TOPICS)}")
            if not roles:
                raise ValueError(f"eventbus.publishers[{topic!r}] is empty: name at least one role, or drop the "
                                 "entry to let every member publish there")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "EventBusConfig":
        if not self.degree_low <= self.degree <= self.degree_high:
            raise ValueError(f"eventbus: need degree_low <= degree <= degree_high, got "
                             f"{self.degree_low} <= {self.degree} <= {self.degree_high}")
        if self.graylist_threshold > self.publish_threshold:
            raise ValueError(f"eventbus.graylist_threshold={self.graylist_threshold} must not be above "
                             f"eventbus.publish_threshold={self.publish_threshold}")
        return self

    def caps(self) -> dict[str, int]:
        """Short topic name -> byte cap."""
        return {"swarm": self.swarm_max_bytes, "rollouts": self.rollouts_max_bytes}
