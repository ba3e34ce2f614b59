"""Shared pieces of the NoLoCo exchange (``optimizers/exchange.py``): ExchangeFrame wire helpers,
the result type, per-round state and the protocol's constants.

Wire: ``ExchangeFrame`` messages (``protocol/noloco.proto``) wrap the codec's ``TensorFrame``
as field 2; tensor frames come from ``protocol.codec.aencode_frames(wrap=(2,))`` (chunks
serialized by hand with a single copy) and parse back with ``protocol.codec.parse_chunk`` into
a zero-copy ``ChunkView``; headers go through protobuf. Frame building, digests, finiteness and
the thread threshold are the codec's; means are ``node/averaging.py``'s; stream plumbing and
peer errors are ``protocol/streams.py``'s. No grpc server or DHT code.

    spec_hash(specs) -> str;  header_frame(wire, **fields);  encode_tensors(...) -> (frame, bytes)
    serialize(frame) / parse_wire(data) / split(item)      # gRPC (de)serializers
    ExchangeResult, Round (per-call state); constants (timeouts, refusal classes, outcomes)
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from protocol import noloco_pb2
from protocol.codec import DEFAULT_CHUNK_BYTES, ChunkView, aencode_frames, dtype_name, parse_chunk, serialize_frame

__all__ = ["Spec", "spec_hash", "header_frame", "encode_tensors", "serialize", "parse_wire", "split",
           "spec_bytes", "ExchangeResult", "Round"]

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def spec_hash(specs: Sequence[Spec]) -> str:
    """Digest of names, dtypes and shapes in order; peers with different specs never exchange."""
    text = ";".join(f"{n}:{dtype_name(d)}:{','.join(str(int(x)) for x in s)}" for n, d, s in specs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_bytes(spec: Spec) -> int:
    n = 1
    for x in spec[2]:
        n *= int(x)
    return n * spec[1].itemsize


def header_frame(wire: bool, **fields) -> bytes | noloco_pb2.ExchangeFrame:
    frame = noloco_pb2.ExchangeFrame(header=noloco_pb2.ExchangeHeader(**fields))
    return frame.SerializeToString() if wire else frame


async def encode_tensors(tensors: Sequence[torch.Tensor], names: Sequence[str], wire: bool,
                         pace: Callable[[int], Awaitable[None]] | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                         precomputed: Awaitable[list[bytes]] | None = None) -> AsyncIterator[tuple[object, int]]:
    """Yield ``(ExchangeFrame, payload_bytes)``: per tensor a header frame (xxh3_128 digest), then
    chunks. ``pace(nbytes)`` (the netem pacer) is awaited before each frame. ``precomputed``: a
    task giving ``digests(tensors)`` started earlier (hashing then leaves the critical path)."""
    async for frame, n in aencode_frames(zip(names, tensors), chunk_bytes, pace, wire=wire,
                                         known_digests=precomputed, wrap=(2,)):
        yield (frame if wire else noloco_pb2.ExchangeFrame(tensor=frame)), n


serialize = serialize_frame  # wire bytes pass through; protobuf frames are serialized


def parse_wire(data: bytes) -> noloco_pb2.ExchangeFrame | ChunkView:
    """``ExchangeFrame{tensor{chunk{offset, data}}}`` in canonical layout -> ``ChunkView`` (no
    copy); anything else through protobuf (raises DecodeError on garbage)."""
    view = parse_chunk(data, (2,))
    return view if view is not None else noloco_pb2.ExchangeFrame.FromString(data)


def split(item) -> tuple[str, object]:
    """-> ("header", ExchangeHeader) | ("tensor", TensorFrame | ChunkView) | ("empty", None)."""
    if isinstance(item, ChunkView):
        return "tensor", item
    kind = item.WhichOneof("kind")
    if kind == "header":
        return "header", item.header
    if kind == "tensor":
        return "tensor", item.tensor
    return "empty", None


SERVICE = "swarmnode.NoLoCo"
METHOD = f"/{SERVICE}/Exchange"
LOCK_WAIT_S = 0.5        # callee waits this long for its match lock, then answers "busy"
HANDSHAKE_S = 3.5        # caller waits this long for the reply header (> LOCK_WAIT_S)
# OPEN_WAIT_S (a server waits this long for the "open" header) and IDLE_S (longest gap between
# two frames) are protocol.streams'.
GRACE_S = 1.0            # extra wait for an exchange already in flight at the deadline
PUBLISH_WAIT_S = 0.5     # pair mode: wait at most this long for our roster entry before the first read
RETRY = frozenset({"busy"})
COUNTED = frozenset({"run", "cfg_hash", "specs", "sender", "order", "mode", "stale", "future", "malformed"})
OK, SOLO, FAILED = "ok", "solo", "failed"


@dataclass
class ExchangeResult:
    mean: list[torch.Tensor] | None  # verified and finite whenever outcome == "ok"
    n: int
    partners: list[str]
    outcome: str                 # "ok" | "solo" | "failed"
    reason: str = ""             # "" | no_partner | timeout | partner_error | nonfinite | rejected | ...
    sent_bytes: int = 0
    received_bytes: int = 0
    blocked_s: float = 0.0
    exchange_s: float = 0.0      # time spent streaming once the group was formed (0 if never)


@dataclass(eq=False)
class Round:
    round: int
    mode: str                                   # "pair" | "group"
    tensors: list[torch.Tensor]
    deadline: float                             # loop.time()
    collect_end: float = 0.0
    matched: str | None = None
    closed: bool = False                        # no more accepts (solo decided / closing)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    incoming: asyncio.Future | None = None      # result of an exchange served by the handler
    digests: asyncio.Task | None = None         # digests(tensors), started on entry
    mean_digests: asyncio.Task | None = None    # root: digests(mean), shared by every reply
    root: str | None = None                     # group: decided root
    contribs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    arriving: set[str] = field(default_factory=set)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    mean: list[torch.Tensor] | None = None
    members: list[str] = field(default_factory=list)
    sends: dict[str, asyncio.Future] = field(default_factory=dict)
    received: int = 0
