"""Wire helpers of the NoLoCo exchange (``protocol/noloco.proto``): frames in, frames out.

Owns how ``ExchangeFrame`` messages are built and parsed fast: tensor chunks are serialized by
hand with a single copy of the payload (protobuf would copy it twice), and parsed back into a
zero-copy ``protocol.codec.ChunkView`` that ``TensorAssembler`` accepts. Everything that is not
a canonical chunk goes through protobuf. Also the tensor-spec digest both sides compare.
The protocol itself lives in ``optimizers/exchange.py``.

    spec_hash(specs) -> str
    header_frame(wire, **ExchangeHeader fields) -> bytes | ExchangeFrame
    encode_tensors(tensors, names, wire, pace) -> AsyncIterator[(frame, payload_bytes)]
    serialize(frame) -> bytes            # gRPC serializer: bytes pass through
    parse_wire(data) -> ExchangeFrame | ChunkView   # gRPC deserializer
    split(item) -> ("header", ExchangeHeader) | ("tensor", TensorFrame | ChunkView)
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import torch
import xxhash

from protocol import noloco_pb2, tensor_pb2
from protocol.codec import CHECKSUM_ALG, DEFAULT_CHUNK_BYTES, ChunkView, dtype_name

__all__ = ["Spec", "spec_hash", "header_frame", "encode_tensors", "serialize", "parse_wire", "split",
           "spec_bytes"]

Spec = tuple[str, torch.dtype, tuple[int, ...]]
_THREAD_BYTES = 8 << 20  # hash tensors at least this large in a worker thread (xxhash drops the GIL)


def spec_hash(specs: Sequence[Spec]) -> str:
    """Digest of names, dtypes and shapes in order; peers with different specs never exchange."""
    text = ";".join(f"{n}:{dtype_name(d)}:{','.join(str(int(x)) for x in s)}" for n, d, s in specs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_bytes(spec: Spec) -> int:
    n = 1
    for x in spec[2]:
        n *= int(x)
    return n * spec[1].itemsize


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(b, pos: int) -> tuple[int, int]:
    result = shift = 0
    for i in range(pos, min(pos + 10, len(b))):
        byte = b[i]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i + 1
        shift += 7
    return -1, pos


def header_frame(wire: bool, **fields) -> bytes | noloco_pb2.ExchangeFrame:
    frame = noloco_pb2.ExchangeFrame(header=noloco_pb2.ExchangeHeader(**fields))
    return frame.SerializeToString() if wire else frame


def _chunk_frame(offset: int, part: memoryview, wire: bool) -> bytes | noloco_pb2.ExchangeFrame:
    if not wire:
        return noloco_pb2.ExchangeFrame(tensor=tensor_pb2.TensorFrame(
            chunk=tensor_pb2.TensorChunk(offset=offset, data=bytes(part))))
    n = len(part)
    chunk = (b"\x08" + _varint(offset) if offset else b"") + b"\x12" + _varint(n)  # TensorChunk fields
    tf_len = len(chunk) + n                        # TensorFrame.chunk (field 2) body
    tf_head = b"\x12" + _varint(tf_len)
    return b"".join((b"\x12", _varint(len(tf_head) + tf_len), tf_head, chunk, part))  # ExchangeFrame.tensor


async def encode_tensors(tensors: Sequence[torch.Tensor], names: Sequence[str], wire: bool,
                         pace: Callable[[int], Awaitable[None]] | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> AsyncIterator[tuple[object, int]]:
    """Yield ``(frame, payload_bytes)``: per tensor a header frame (xxh3_128 digest), then chunks.
    ``pace(nbytes)`` (the netem pacer) is awaited before each frame."""
    for name, tensor in zip(names, tensors):
        t = tensor.detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
        if mv.nbytes >= _THREAD_BYTES:
            digest = await asyncio.to_thread(lambda: xxhash.xxh3_128(mv).digest())
        else:
            digest = xxhash.xxh3_128(mv).digest()
        head = noloco_pb2.ExchangeFrame(tensor=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(
            name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), total_bytes=mv.nbytes,
            checksum=digest, checksum_alg=CHECKSUM_ALG)))
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


def serialize(frame: bytes | noloco_pb2.ExchangeFrame) -> bytes:
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


def parse_wire(data: bytes) -> noloco_pb2.ExchangeFrame | ChunkView:
    """``ExchangeFrame{tensor{chunk{offset, data}}}`` in canonical layout -> ``ChunkView`` (no
    copy); anything else through protobuf (raises DecodeError on garbage)."""
    n = len(data)
    if n > 4 and data[0] == 0x12:
        l1, p = _read_varint(data, 1)
        if l1 == n - p and p < n and data[p] == 0x12:
            l2, p = _read_varint(data, p + 1)
            if l2 == n - p:
                offset = 0
                if p < n and data[p] == 0x08:
                    offset, p = _read_varint(data, p + 1)
                if offset >= 0 and p < n and data[p] == 0x12:
                    size, p = _read_varint(data, p + 1)
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
