"""Link emulation: latency and bandwidth added when THIS node sends over gRPC.

Owns the ``[netem]`` config section, per-destination link lookup, a stream pacer and the
modelled time of a group average (``allreduce_seconds``). It does not own the gRPC client (callers await the
pacer before each frame) and it cannot see hivemind's averager traffic, which goes through
p2pd; for that, ``modelled_allreduce_s`` gives the time an averaging step is padded to.

The kernel here has no ``tc netem`` (docs/architecture.md, 'Transport'), so delays are applied in our own
transport, as the SkipPipe and NoLoCo papers did. Only the sender waits: a link A->B is
emulated by A, so give both directions if both matter.

Config shape (TOML; ``inf`` means unlimited bandwidth, a missing ``bandwidth_mbps`` too)::

    [netem]
    enabled = true
    default = { latency_ms = 20, bandwidth_mbps = 1000 }      # any destination not listed
    [netem.links]
    "12D3KooWQx7..." = { latency_ms = 80, bandwidth_mbps = 100 }  # by peer ID
    "10.0.0.7:50051" = { latency_ms = 150 }                      # or by gRPC "host:port"
    [netem.matrix]                     # optional: a whole swarm's pairwise links
    nodes = ["a:50051", "b:50051", "c:50051"]
    latency_ms = [[0, 40, 90], [40, 0, 60], [90, 60, 0]]
    bandwidth_mbps = [[inf, 100, 50], [100, inf, 200], [50, 200, inf]]

Lookup order for a destination: ``links`` > this node's row of ``matrix`` (needs ``self_id``)
> ``default`` > no delay. Usage::

    emu = LinkEmulator(cfg.netem, self_id=my_grpc_address)
    pace = emu.pacer(dest)
    for chunk in chunks:
        await pace(len(chunk))     # first call: latency + chunk time; later: chunk time only
        await stream.write(chunk)
    link = emu.message_link(dest)  # whole messages on one open stream (the pipeline role)
    await asyncio.sleep(link.release_at(queued_at, nbytes) - time.monotonic()); await stream.send(...)
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_MAX_LATENCY_MS = 60_000.0


def _check_latency(v: float, where: str) -> float:
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}={v} must be a finite number of milliseconds >= 0; use 0 for none")
    if v > _MAX_LATENCY_MS:
        raise ValueError(f"{where}={v} ms is over a minute; latency is in milliseconds, not seconds")
    return v


def _check_bandwidth(v: float | None, where: str) -> float | None:
    if v is None or v == math.inf:
        return None
    if math.isnan(v) or v <= 0:
        raise ValueError(f"{where}={v} must be > 0 Mbit/s; leave it out (or write inf) for unlimited")
    return v


class LinkSpec(BaseModel):
    """One directed link: what a send from this node to one destination experiences."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    latency_ms: float = 0.0
    """One-way latency in milliseconds, added once per message or stream. Take it from a
    ping-time table (half the RTT) for the regions you want to imitate."""

    bandwidth_mbps: float | None = None
    """Link rate in Mbit/s (10^6 bit/s); None or inf = unlimited. Lower it to imitate
    consumer uplinks; the pacer never sends faster than this to the destination."""

    @field_validator("latency_ms")
    @classmethod
    def _latency(cls, v: float) -> float:
        return _check_latency(v, "latency_ms")

    @field_validator("bandwidth_mbps")
    @classmethod
    def _bandwidth(cls, v: float | None) -> float | None:
        return _check_bandwidth(v, "bandwidth_mbps")


class LinkMatrix(BaseModel):
    """Pairwise links of a whole swarm; row i holds the links from ``nodes[i]``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    nodes: list[str]
    """Destination keys (peer IDs or "host:port"), in row/column order. The node finds its
    own row by the ``self_id`` it is started with."""

    latency_ms: list[list[float]]
    """N x N one-way latencies in ms; the diagonal is ignored."""

    bandwidth_mbps: list[list[float]] | None = None
    """N x N rates in Mbit/s (``inf`` = unlimited); leave out for unlimited everywhere."""

    @model_validator(mode="after")
    def _square(self) -> "LinkMatrix":
        n = len(self.nodes)
        if len(set(self.nodes)) != n:
            raise ValueError("netem.matrix.nodes has duplicates; list every node once")
        for name, m in (("latency_ms", self.latency_ms), ("bandwidth_mbps", self.bandwidth_mbps)):
            if m is not None and (len(m) != n or any(len(row) != n for row in m)):
                raise ValueError(f"netem.matrix.{name} must be {n} x {n} to match "
                                 f"netem.matrix.nodes; fix the row or column count")
        for i, row in enumerate(self.latency_ms):
            for j, v in enumerate(row):
                _check_latency(v, f"netem.matrix.latency_ms[{i}][{j}]")
        for i, row in enumerate(self.bandwidth_mbps or []):
            for j, v in enumerate(row):
                _check_bandwidth(v, f"netem.matrix.bandwidth_mbps[{i}][{j}]")
        return self

    def link(self, src: str, dst: str) -> LinkSpec | None:
        """The link src -> dst, or None if either is not in ``nodes`` (or src == dst)."""
        if src == dst or src not in self.nodes or dst not in self.nodes:
            return None
        i, j = self.nodes.index(src), self.nodes.index(dst)
        bw = self.bandwidth_mbps[i][j] if self.bandwidth_mbps else None
        return LinkSpec(latency_ms=self.latency_ms[i][j], bandwidth_mbps=bw)


class NetemConfig(BaseModel):
    """``[netem]``: emulated latency/bandwidth on this node's gRPC sends."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Turn emulation on. Only for benchmarks and demos: it slows real swarms down."""

    default: LinkSpec | None = None
    """Link used for destinations not found in ``links`` or ``matrix``; None = no delay."""

    links: dict[str, LinkSpec] = Field(default_factory=dict)
    """Per-destination links, keyed by peer ID or gRPC "host:port" exactly as the caller
    names the destination."""

    matrix: LinkMatrix | None = None
    """Optional swarm-wide matrix (benchmarks); this node uses its own row."""

    @model_validator(mode="after")
    def _something_to_emulate(self) -> "NetemConfig":
        if any(not k for k in self.links):
            raise ValueError("netem.links has an empty key; use a peer ID or 'host:port'")
        if self.enabled and self.default is None and not self.links and self.matrix is None:
            raise ValueError("netem.enabled = true but no default, links or matrix is given; "
                             "add [netem.default] latency_ms/bandwidth_mbps or set enabled = false")
        return self


def transfer_s(link: LinkSpec | None, nbytes: int, first: bool = True) -> float:
    """Seconds a send of ``nbytes`` takes on ``link``: latency (if first) + serialisation."""
    if link is None:
        return 0.0
    t = link.latency_ms / 1000.0 if first else 0.0
    if link.bandwidth_mbps is not None:
        t += nbytes * 8 / (link.bandwidth_mbps * 1e6)
    return t


def modelled_allreduce_s(nbytes: int, n: int, links: list[LinkSpec]) -> float:
    """Modelled time of a ring all-reduce of ``nbytes`` among ``n`` peers:
    ``2*max_latency + 2*(n-1)/n * bytes / min_bandwidth``. Unlimited links add no
    bandwidth term; n < 2 or no links costs nothing. Label results that use it *modelled*."""
    if n < 2 or not links:
        return 0.0
    t = 2 * max(link.latency_ms for link in links) / 1000.0
    bws = [link.bandwidth_mbps for link in links if link.bandwidth_mbps is not None]
    if bws:
        t += 2 * (n - 1) / n * nbytes * 8 / (min(bws) * 1e6)
    return t


async def _no_wait(nbytes: int) -> None:
    return None


class LinkEmulator:
    """Looks up links and paces sends. Cheap; build one per node and share it."""

    BURST_S = 0.02
    """Credit a paced stream may bank while its producer is idle (token-bucket depth, in
    seconds of link time). It also absorbs sleep overshoot, so errors do not accumulate."""

    def __init__(self, cfg: NetemConfig, self_id: str | None = None) -> None:
        self.cfg, self.self_id = cfg, self_id
        if cfg.enabled and cfg.matrix is not None and self_id not in cfg.matrix.nodes:
            raise ValueError(
                f"netem.matrix.nodes does not list this node ({self_id!r}); add it in the "
                "same form (peer ID or host:port) or drop [netem.matrix]")

    def link_for(self, dest: str) -> LinkSpec | None:
        """The link to ``dest`` (links > matrix row > default), or None for no delay."""
        if not self.cfg.enabled:
            return None
        if dest in self.cfg.links:
            return self.cfg.links[dest]
        if self.cfg.matrix is not None and dest in self.cfg.matrix.nodes:
            return self.cfg.matrix.link(self.self_id or "", dest)
        return self.cfg.default

    def delay_s(self, dest: str, nbytes: int) -> float:
        """Delay for one whole message of ``nbytes`` to ``dest``: latency + serialisation."""
        return transfer_s(self.link_for(dest), nbytes, first=True)

    async def delay(self, dest: str, nbytes: int) -> None:
        """Sleep ``delay_s(dest, nbytes)``; await it before a unary send."""
        d = self.delay_s(dest, nbytes)
        if d > 0:
            await asyncio.sleep(d)

    def pacer(self, dest: str) -> Callable[[int], Awaitable[None]]:
        """A pacer for one stream to ``dest``: await ``pace(len(frame))`` before each frame.

        The schedule is kept against a monotonic clock: frame k may leave at
        ``start + latency + sum(bytes[:k+1]) * 8 / bandwidth``, so the stream takes about
        latency + total_bytes / bandwidth whatever the per-sleep overhead."""
        link = self.link_for(dest)
        if link is None or (link.latency_ms == 0 and link.bandwidth_mbps is None):
            return _no_wait
        next_free: float | None = None  # monotonic time the link is free again

        async def pace(nbytes: int) -> None:
            nonlocal next_free
            now = time.monotonic()
            if next_free is None:
                next_free = now + transfer_s(link, nbytes, first=True)
            else:  # an idle producer banks at most BURST_S of link time
                next_free = max(next_free, now - self.BURST_S) + transfer_s(link, nbytes, first=False)
            wait = next_free - now
            if wait > 0:
                await asyncio.sleep(wait)

        return pace

    def message_link(self, dest: str) -> "MessageLink":
        """Per-message emulation of the link to ``dest`` for a FIFO of whole messages (see
        :class:`MessageLink`); ``dest`` is looked up like :meth:`link_for`."""
        return MessageLink(self.link_for(dest))


class MessageLink:
    """One directed link carrying whole messages in order, as a pipe: a message occupies the
    link for its serialisation time (bandwidth is shared first come, first served) and arrives
    ``latency`` after it has left, so the latencies of back-to-back messages overlap instead of
    adding up (a per-destination sender that slept ``delay_s`` per message would serialise them).
    The caller sleeps until :meth:`release_at` and then sends; the SkipPipe simulator's
    ``c[x][y] = latency + bytes / bandwidth`` is this link's time for one message."""

    def __init__(self, link: LinkSpec | None):
        self.link = link
        self._free = 0.0  # when the link has finished serialising the previous message

    def release_at(self, queued_at: float, nbytes: int) -> float:
        """When a message of ``nbytes`` queued at ``queued_at`` (a monotonic time) reaches the
        far end; call once per message, in send order."""
        if self.link is None:
            return queued_at
        self._free = max(queued_at, self._free) + transfer_s(self.link, nbytes, first=False)
        return self._free + self.link.latency_ms / 1000.0
