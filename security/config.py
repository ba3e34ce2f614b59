"""The ``[security]`` and ``[limits]`` config sections (docs/security.md), imported by
``node/config.py``.

Owns the knobs of peer authentication, admission and the per-peer limits; the checks
themselves live in ``security/peer_auth.py``, ``security/admission.py``, ``security/limits.py``
and are wired into the gRPC host by ``node/call_guard.py``. Pure pydantic (no grpc import).
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from security.keys import RecordRejected, public_key_of

__all__ = ["SecurityConfig", "LimitsConfig", "is_loopback_host", "is_loopback_maddr"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class SecurityConfig(_Section):
    peer_auth: Literal["signed", "none"] = "signed"
    """``signed``: every gRPC call between nodes carries the caller's peer ID, time, nonce and an
    Ed25519 signature, verified by the receiver (docs/security.md, 'Signed calls'). ``none`` turns that off and is
    accepted only when every listen and peer address is loopback (local demos and tests)."""

    clock_window_s: float = Field(60.0, ge=5, le=600)
    """Largest accepted clock difference of a signed call. Raise only for hosts without NTP;
    nonces are kept twice this long, so a larger window costs memory per peer."""

    known_peers_refresh_s: float = Field(5.0, gt=0, le=60)
    """How often the node re-reads the run's node cards to learn who may call it. A peer whose
    card is younger than this may get one PERMISSION_DENIED 'unknown peer' and retry."""

    admission: Literal["open", "token"] = "open"
    """``open``: any peer with a live node card may take part. ``token``: only peers holding an
    admission token signed by ``coordinator_peer_id`` (``swarmnode admit``); their cards and
    roster entries carry it, records and calls without a valid one are refused."""

    coordinator_peer_id: str | None = None
    """Peer ID (``12D3KooW…``) whose key signs admission tokens, usually the bootstrap's. Required
    with ``admission = "token"``; the public key is inside the ID, nothing else is needed."""

    admission_token: str | None = None
    """This node's own admission token, base64 as printed by ``swarmnode admit`` (token mode).
    Prefer ``admission_token_file`` or the env var ``SWARMNODE_SECURITY__ADMISSION_TOKEN``."""

    admission_token_file: str | None = None
    """File holding this node's admission token (base64). Used when ``admission_token`` is unset."""

    revocation_refresh_s: float = Field(10.0, gt=0, le=60)
    """Token mode: how often the node re-reads the coordinator's revocation list
    (``swarmnode revoke``). A revoked peer is refused everywhere within about this plus
    ``known_peers_refresh_s``. The node uses at most half of ``card.ttl_s``, so a revocation is
    always honoured within one card lifetime. Lower it for faster revocation, at one DHT read
    per period per node."""

    public_state: bool = False
    """Serve the model state (``WeightService.Fetch``) to any authenticated caller. Off: in token
    mode only admitted peers may download it, in open mode only peers with a live card."""

    @field_validator("coordinator_peer_id")
    @classmethod
    def _coordinator(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            public_key_of(v)
        except RecordRejected as exc:
            raise ValueError(f"security.coordinator_peer_id {v[:60]!r} is not an Ed25519 peer ID "
                             f"(12D3KooW…): {exc}") from None
        return v

    @model_validator(mode="after")
    def _token_mode(self) -> "SecurityConfig":
        if self.admission == "token" and not self.coordinator_peer_id:
            raise ValueError("security.admission = 'token' needs security.coordinator_peer_id (the peer ID "
                             "that signs tokens, printed by the bootstrap at start)")
        if self.admission == "token" and self.peer_auth == "none":
            raise ValueError("security.admission = 'token' needs security.peer_auth = 'signed' (tokens are "
                             "checked on signed calls)")
        return self

    def token_bytes(self) -> bytes | None:
        """This node's admission token, decoded (None when none is configured)."""
        from security.admission import decode_b64
        text = self.admission_token
        if text is None and self.admission_token_file:
            import os
            with open(os.path.expanduser(self.admission_token_file), encoding="ascii") as fh:
                text = fh.read()
        return decode_b64(text) if text else None


class LimitsConfig(_Section):
    peer_rps: float = Field(200.0, gt=0)
    """Calls per second one peer may start on this node (token bucket, burst 2x). An honest
    NoLoCo worker makes a few per round; raise it for roles with many small calls."""

    peer_bytes_per_s: float = Field(2 * 1024 ** 3, gt=0)
    """Request bytes per second one peer may send (token bucket with debt, burst 2x). Lower it
    on thin uplinks to keep one peer from filling the link."""

    peer_concurrency: int = Field(8, ge=1)
    """Calls one peer may have in flight per service; beyond it RESOURCE_EXHAUSTED. A NoLoCo
    worker needs 1-2; a pipeline stage keeps one stream per neighbour."""

    service_concurrency: int = Field(48, ge=1)
    """Calls in flight per service over all peers; keep below ``grpc.max_concurrent_rpcs`` so one
    busy service never takes every slot of the server (health and Info stay answerable)."""

    first_frame_timeout_s: float = Field(5.0, gt=0, le=60)
    """A request stream must send its first (signed) message within this; idle streams opened to
    hold slots are ended with DEADLINE_EXCEEDED."""

    max_call_s: float = Field(600.0, gt=0)
    """Longest any call may run on this server, whatever deadline the caller set (or none)."""

    max_request_messages: int = Field(1_000_000, ge=1)
    """Request messages one stream may send (tensor chunks included); a cap on stream length."""

    ban_threshold: int = Field(20, ge=1)
    """Transport-level rejections (unsigned, stale, malformed, over a limit) within
    ``ban_window_s`` after which a peer (or, before it authenticated, its IP) is banned."""

    ban_window_s: float = Field(60.0, gt=0)
    """Window in which ``ban_threshold`` rejections lead to a ban."""

    ban_s: float = Field(600.0, gt=0)
    """How long a ban lasts. Bans are local to this node and visible in ``swarmnode status``."""

    @model_validator(mode="after")
    def _caps(self) -> "LimitsConfig":
        if self.peer_concurrency > self.service_concurrency:
            raise ValueError(f"limits.peer_concurrency={self.peer_concurrency} is above "
                             f"limits.service_concurrency={self.service_concurrency}; lower it")
        return self


def is_loopback_host(host: str | None) -> bool:
    if host is None:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_loopback_maddr(maddr: str) -> bool:
    """``/ip4/127.0.0.1/tcp/…`` or ``/ip6/::1/…`` (a DNS name counts as non-loopback)."""
    parts = maddr.split("/")
    return len(parts) > 2 and parts[1] in ("ip4", "ip6") and is_loopback_host(parts[2])
