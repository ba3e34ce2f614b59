"""Shared pieces of the NoLoCo exchange (``optimizers/exchange.py``): wire frames, the mean,
the result type and per-round state.

Wire: ``ExchangeFrame`` messages (``protocol/noloco.proto``) are built and parsed fast: tensor
chunks are serialized by hand with a single copy of the payload (protobuf would copy it twice)
and parsed back into a zero-copy ``protocol.codec.ChunkView`` that ``TensorAssembler`` accepts;
everything else goes through protobuf. Math: ``mean_of`` sums in the order given, blockwise in
numpy (one cache-friendly pass that also checks finiteness; torch's isfinite/add made several
passes with temporaries and were 5-10x slower here). No grpc server or DHT code.

    spec_hash(specs) -> str;  header_frame(wire, **fields);  encode_tensors(...) -> (frame, bytes)
    serialize(frame) / parse_wire(data) / split(item)      # gRPC (de)serializers
    mean_of(parts, owned) -> (mean, finite);  all_finite(t) -> bool
    ExchangeResult, Round (per-call state), Refused / PeerError
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from protocol.varint import encode_varint, read_varint
import xxhash

from protocol import noloco_pb2, tensor_pb2
from protocol.codec import (DEFAULT_CHUNK_BYTES, ChunkView, dtype_name, payload_view, serialize_frame,
                            tensor_header)

__all__ = ["Spec", "spec_hash", "header_frame", "encode_tensors", "serialize", "parse_wire", "split",
           "spec_bytes", "digests", "mean_of", "all_finite", "ExchangeResult", "Round", "Refused", "PeerError"]

Spec = tuple[str, torch.dtype, tuple[int, ...]]
THREAD_BYTES = 8 << 20  # hash/check/average payloads at least this large in a worker thread (numpy and
#                         xxhash drop the GIL), so the event loop keeps serving peers


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


def _chunk_frame(offset: int, part: memoryview, wire: bool) -> bytes | noloco_pb2.ExchangeFrame:
    if not wire:
        return noloco_pb2.ExchangeFrame(tensor=tensor_pb2.TensorFrame(
            chunk=tensor_pb2.TensorChunk(offset=offset, data=bytes(part))))
    n = len(part)
    chunk = (b"\x08" + encode_varint(offset) if offset else b"") + b"\x12" + encode_varint(n)  # TensorChunk fields
    tf_len = len(chunk) + n                        # TensorFrame.chunk (field 2) body
    tf_head = b"\x12" + encode_varint(tf_len)
    return b"".join((b"\x12", encode_varint(len(tf_head) + tf_len), tf_head, chunk, part))  # ExchangeFrame.tensor


def digests(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """xxh3_128 of each tensor's payload (run it in a thread: xxhash drops the GIL)."""
    return [xxhash.xxh3_128(payload_view(t)[1]).digest() for t in tensors]


async def encode_tensors(tensors: Sequence[torch.Tensor], names: Sequence[str], wire: bool,
                         pace: Callable[[int], Awaitable[None]] | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                         precomputed: Awaitable[list[bytes]] | None = None) -> AsyncIterator[tuple[object, int]]:
    """Yield ``(frame, payload_bytes)``: per tensor a header frame (xxh3_128 digest), then chunks.
    ``pace(nbytes)`` (the netem pacer) is awaited before each frame. ``precomputed``: a task
    giving ``digests(tensors)`` started earlier (hashing then leaves the critical path)."""
    known = await precomputed if precomputed is not None else None
    for i, (name, tensor) in enumerate(zip(names, tensors)):
        t, mv = payload_view(tensor)
        if known is not None:
            digest = known[i]
        elif mv.nbytes >= THREAD_BYTES:
            digest = await asyncio.to_thread(lambda: xxhash.xxh3_128(mv).digest())
        else:
            digest = xxhash.xxh3_128(mv).digest()
        head = noloco_pb2.ExchangeFrame(tensor=tensor_header(name, t, mv, digest))
        frame = head.SerializeToString() if wire else head
        if pace is not None:
            await pace(len(frame) if wire else head.ByteSize())
        yield frame, 0
        for off in range(0, mv.nbytes, chunk_bytes):
            part = mv[off:off + chunk_bytes]
            frame = _chunk_frame(off, part, wire)
            if pace is not None:
                await pace(len(frame) if wire else frame.ByteSize())
            yield frame, len(part)


serialize = serialize_frame  # wire bytes pass through; protobuf frames are serialized


def parse_wire(data: bytes) -> noloco_pb2.ExchangeFrame | ChunkView:
    """``ExchangeFrame{tensor{chunk{offset, data}}}`` in canonical layout -> ``ChunkView`` (no
    copy); anything else through protobuf (raises DecodeError on garbage)."""
    n = len(data)
    if n > 4 and data[0] == 0x12:
        l1, p = read_varint(data, 1)
        if l1 == n - p and p < n and data[p] == 0x12:
            l2, p = read_varint(data, p + 1)
            if l2 == n - p:
                offset = 0
                if p < n and data[p] == 0x08:
                    offset, p = read_varint(data, p + 1)
                if offset >= 0 and p < n and data[p] == 0x12:
                    size, p = read_varint(data, p + 1)
                    if size == n - p and size > 0:
                        return ChunkView(offset, memoryview(data)[p:])
    return noloco_pb2.ExchangeFrame.FromString(data)


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
OPEN_WAIT_S = 5.0        # a server waits this long for the "open" header
IDLE_S = 15.0            # longest gap between two frames of a stream
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


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, detail: str):
        super().__init__(detail)
        self.code, self.reason, self.detail = code, reason, detail


class PeerError(Exception):
    """The partner's stream ended, failed or refused mid-way (``reason`` is for the result)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


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


def task(coro) -> asyncio.Task:
    """A task whose exception is always retrieved (no 'never retrieved' noise after a cancel)."""
    t = asyncio.ensure_future(coro)
    t.add_done_callback(lambda t: t.cancelled() or t.exception())
    return t


def remaining(deadline: float) -> float:
    return deadline - asyncio.get_running_loop().time()


_BLOCK = 1 << 18  # elements per cache-sized block; torch's isfinite/add are slow here (temporaries, OMP)


def _flat_np(t: torch.Tensor) -> np.ndarray | None:
    try:
        return t.detach().cpu().contiguous().reshape(-1).numpy()
    except (TypeError, RuntimeError):  # bfloat16 and friends have no numpy dtype
        return None


def all_finite(t: torch.Tensor) -> bool:
    """True if a floating tensor holds no NaN/inf (blockwise numpy: one pass, no big temporaries)."""
    a = _flat_np(t)
    if a is None:
        return bool(torch.isfinite(t).all())
    return all(np.isfinite(a[s:s + _BLOCK]).all() for s in range(0, a.size, _BLOCK))


def mean_of(parts: list[list[torch.Tensor]], owned: set[int] = frozenset()) -> tuple[list[torch.Tensor], bool]:
    """Elementwise mean of ``parts`` (give them in ascending peer-ID order: every member then sums
    alike, left to right, and gets bitwise the same result) and whether it is all finite.
    One blockwise pass per tensor: sum, divide by n, check finiteness. ``owned`` lists indices
    of parts whose buffers we may overwrite (received tensors): the result then reuses one of
    them instead of allocating (elementwise a+b == b+a, so aliasing keeps the order exact)."""
    n, out, finite = len(parts), [], True
    for i in range(len(parts[0])):
        xs = [p[i] for p in parts]
        reuse = next((j for j in (0, 1) if j in owned and j < n), None)
        res = xs[reuse] if reuse is not None and xs[reuse].is_contiguous() else torch.empty(xs[0].shape, dtype=xs[0].dtype)
        arrs, r = [_flat_np(x) for x in xs], _flat_np(res)
        if r is None or any(a is None for a in arrs):
            acc = xs[0].detach().clone()
            for x in xs[1:]:
                acc.add_(x)
            out.append(acc.div_(n))
            finite = finite and bool(torch.isfinite(acc).all())
            continue
        div = r.dtype.type(n)
        for s in range(0, r.size, _BLOCK):
            blk = r[s:s + _BLOCK]
            if n == 1:
                blk[:] = arrs[0][s:s + _BLOCK]
            else:
                np.add(arrs[0][s:s + _BLOCK], arrs[1][s:s + _BLOCK], out=blk)
            for a in arrs[2:]:
                np.add(blk, a[s:s + _BLOCK], out=blk)
            np.divide(blk, div, out=blk)
            if finite and not np.isfinite(blk).all():
                finite = False
        out.append(res)
    return out, finite
