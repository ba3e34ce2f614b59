"""Unit tests for protocol/codec.py: round trips, wire fast path, and every rejection."""

from __future__ import annotations

import asyncio

import pytest
import torch
import xxhash

from protocol import tensor_pb2
from protocol import codec
from protocol.codec import (
    ALLOWED_DTYPES, ChunkView, TensorAssembler, TensorRejected, adecode_tensors, aencode_tensors,
    check_finite, chunk_frame_bytes, decode_tensors, encode_tensor, encode_tensors, parse_frame,
    serialize_frame,
)

MiB = 1 << 20


def _roundtrip(name, t, **kw):
    out = list(decode_tensors(encode_tensor(name, t), max_tensor_bytes=1 << 30, **kw))
    assert len(out) == 1
    return out[0]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(7, 5, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(7, 5, generator=g, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (7, 5), generator=g).to(dtype)


@pytest.mark.parametrize("name", list(ALLOWED_DTYPES))
def test_roundtrip_every_allowed_dtype(name):
    t = _sample(ALLOWED_DTYPES[name])
    frames = list(encode_tensor("w", t))
    h = frames[0].header
    assert (h.name, h.dtype, list(h.shape), h.total_bytes) == ("w", name, [7, 5], 35 * t.element_size())
    assert h.checksum_alg == "xxh3_128" and len(h.checksum) == 16
    n, r = _roundtrip("w", t)
    assert n == "w" and r.dtype == t.dtype and r.shape == (7, 5)
    # bit-exact, including bfloat16 / NaN payloads
    assert torch.equal(r.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_bfloat16_bits_exact_including_nan():
    t = torch.tensor([1.5, -0.0, float("inf"), float("nan"), 3.0e38], dtype=torch.bfloat16)
    _, r = _roundtrip("b", t)
    assert r.view(torch.int16).tolist() == t.view(torch.int16).tolist()


def test_zero_dim_tensor():
    t = torch.tensor(3.25, dtype=torch.float32)
    frames = list(encode_tensor("s", t))
    assert len(frames) == 2 and list(frames[0].header.shape) == [] and frames[0].header.total_bytes == 4
    n, r = _roundtrip("s", t)
    assert r.shape == () and r.item() == 3.25


def test_empty_tensor_is_header_only():
    t = torch.empty(0, 3, dtype=torch.int64)
    frames = list(encode_tensor("e", t))
    assert len(frames) == 1 and frames[0].header.total_bytes == 0
    assert frames[0].header.checksum == xxhash.xxh3_128(b"").digest()
    n, r = _roundtrip("e", t)
    assert r.shape == (0, 3) and r.dtype == torch.int64


def test_multi_chunk_tensor_offsets_and_sizes():
    t = torch.arange(5 * MiB // 4 + 3, dtype=torch.float32)  # 5 MiB + 12 bytes
    frames = list(encode_tensor("big", t, chunk_bytes=2 * MiB))
    chunks = [f.chunk for f in frames[1:]]
    assert [c.offset for c in chunks] == [0, 2 * MiB, 4 * MiB]
    assert [len(c.data) for c in chunks] == [2 * MiB, 2 * MiB, MiB + 12]
    _, r = _roundtrip("big", t)
    assert torch.equal(r, t)
    assert len(list(encode_tensor("big", t))) == 1 + 2  # default 4 MiB chunks


def test_non_contiguous_input():
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    t = base.t()[1:, ::2]
    assert not t.is_contiguous()
    _, r = _roundtrip("nc", t)
    assert r.shape == (5, 2) and torch.equal(r, t) and r.is_contiguous()


def test_several_tensors_in_one_stream_and_wire_fast_path():
    ts = {"a": torch.randn(3), "b": torch.arange(MiB, dtype=torch.int64), "c": torch.tensor(True)}
    wire = list(encode_tensors(ts, chunk_bytes=MiB, wire=True))
    pb = list(encode_tensors(ts, chunk_bytes=MiB))
    # hand-built wire bytes are byte-identical to protobuf's serialization
    assert wire == [f.SerializeToString() for f in pb]
    assert [serialize_frame(f) for f in pb] == wire and serialize_frame(wire[1]) is wire[1]
    parsed = [parse_frame(b) for b in wire]
    assert isinstance(parsed[0], tensor_pb2.TensorFrame) and isinstance(parsed[1], ChunkView)
    out = dict(decode_tensors(parsed, max_tensor_bytes=8 * MiB))
    assert list(out) == ["a", "b", "c"]
    assert all(torch.equal(out[k], ts[k]) for k in ts)
    assert dict(decode_tensors(wire, max_tensor_bytes=8 * MiB)).keys() == ts.keys()  # raw bytes too


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 2**40, 2**64 - 1])
def test_chunk_frame_bytes_matches_protobuf(offset):
    data = bytes(range(200))
    want = tensor_pb2.TensorFrame(chunk=tensor_pb2.TensorChunk(offset=offset, data=data)).SerializeToString()
    assert chunk_frame_bytes(offset, memoryview(data)) == want
    v = parse_frame(want)
    assert v.offset == offset and bytes(v.data) == data


def test_parse_frame_falls_back_to_protobuf_and_rejects_garbage():
    # non-canonical but valid: data field before offset -> protobuf path, same content
    odd = b"\x12\x07" + b"\x12\x03abc" + b"\x08\x05"
    f = parse_frame(odd)
    assert isinstance(f, tensor_pb2.TensorFrame) and (f.chunk.offset, f.chunk.data) == (5, b"abc")
    with pytest.raises(TensorRejected) as ei:
        parse_frame(b"\x12\xff\xff")
    assert ei.value.reason == "malformed"


async def test_async_encode_paces_every_frame_and_decodes():
    paced = []

    async def pace(n):
        paced.append(n)

    t = torch.randn(MiB // 2)  # 2 MiB
    frames = [f async for f in aencode_tensors({"x": t}, chunk_bytes=MiB, pace=pace)]
    assert paced == [f.ByteSize() for f in frames] and len(frames) == 3
    wire = [f async for f in aencode_tensors([("x", t)], chunk_bytes=MiB, pace=pace, wire=True)]
    assert wire == [f.SerializeToString() for f in frames]

    async def agen():
        for f in frames:
            await asyncio.sleep(0)
            yield f

    got = [(n, r) async for n, r in adecode_tensors(agen(), max_tensor_bytes=4 * MiB)]
    assert len(got) == 1 and got[0][0] == "x" and torch.equal(got[0][1], t)


# ----------------------------------------------------------------------------- rejections

def _frames(t=None, name="w", chunk_bytes=MiB):
    t = torch.arange(3 * MiB // 4, dtype=torch.float32) if t is None else t  # 3 MiB, 3 chunks
    return list(encode_tensor(name, t, chunk_bytes=chunk_bytes))


def _reject(frames, cap=1 << 30, **kw) -> TensorRejected:
    with pytest.raises(TensorRejected) as ei:
        list(decode_tensors(frames, max_tensor_bytes=cap, **kw))
    return ei.value


def test_flipped_byte_is_checksum_rejection():
    frames = _frames()
    data = bytearray(frames[2].chunk.data)
    data[123] ^= 0x01
    frames[2] = tensor_pb2.TensorFrame(chunk=tensor_pb2.TensorChunk(offset=frames[2].chunk.offset, data=bytes(data)))
    e = _reject(frames)
    assert e.reason == "checksum" and "digest mismatch" in e.message


def test_missing_last_chunk_is_truncated():
    e = _reject(_frames()[:-1])
    assert e.reason == "truncated" and f"after {2 * MiB} of {3 * MiB} bytes" in e.message


def test_oversized_header_rejected_before_any_allocation(monkeypatch):
    h = tensor_pb2.TensorHeader(name="huge", dtype="uint8", shape=[1 << 40], total_bytes=1 << 40,
                                checksum=b"\0" * 16, checksum_alg="xxh3_128")
    allocs = []
    real_empty = codec.np.empty  # the receive buffer is a numpy allocation (huge pages)
    monkeypatch.setattr(codec.np, "empty", lambda *a, **k: allocs.append(a) or real_empty(*a, **k))
    e = _reject([tensor_pb2.TensorFrame(header=h)], cap=64 * MiB)
    assert e.reason == "size" and "limits.max_state_bytes" in e.message and str(1 << 40) in e.message
    assert allocs == []
    # a valid header does allocate exactly once, total_bytes long: the spy works
    list(decode_tensors(_frames(torch.zeros(4)), max_tensor_bytes=64))
    assert allocs == [(16,)]


def test_cap_key_named_in_message():
    e = _reject(_frames(), cap=MiB, cap_key="limits.max_activation_bytes")
    assert e.reason == "size" and "limits.max_activation_bytes" in e.message


def test_total_bytes_not_numel_times_itemsize():
    f = _frames(torch.zeros(10))
    f[0].header.total_bytes = 41
    e = _reject(f)
    assert e.reason == "size" and "total_bytes=41" in e.message and "needs 40" in e.message


def test_huge_shape_with_small_total_bytes_is_size_rejection():
    f = _frames(torch.zeros(0, 2))
    del f[0].header.shape[:]
    f[0].header.shape.extend([0, 1 << 62, 1 << 62])
    assert _reject(f, cap=MiB).reason == "size"


def test_negative_dim_is_shape_rejection():
    f = _frames(torch.zeros(2, 2))
    f[0].header.shape[0] = -2
    f[0].header.shape[1] = -2
    assert _reject(f).reason == "shape"


@pytest.mark.parametrize("bad", ["complex64", "object", "float8_e4m3fn", "torch.float32", ""])
def test_disallowed_dtype(bad):
    f = _frames(torch.zeros(2))
    f[0].header.dtype = bad
    e = _reject(f)
    assert e.reason == "dtype" and "allowlist" in e.message


def test_encoder_refuses_disallowed_dtype():
    with pytest.raises(ValueError, match="cannot travel"):
        list(encode_tensor("c", torch.zeros(2, dtype=torch.complex64)))


def test_expected_shape_and_dtype_mismatch_and_unknown_name():
    frames = _frames(torch.zeros(2, 3))
    e = _reject(frames, expected={"w": (torch.float32, (3, 2))})
    assert e.reason == "shape" and "expected [3, 2]" in e.message
    e = _reject(frames, expected={"w": ("float16", [2, 3])})
    assert e.reason == "dtype" and "expected float16" in e.message
    e = _reject(frames, expected={"other": (torch.float32, (2, 3))})
    assert e.reason == "shape" and "unexpected tensor 'w'" in e.message
    asm = TensorAssembler(1 << 20, expected={"w": (torch.float32, (2, 3)), "v": ("int8", ())})
    for f in frames:
        asm.feed(f)
    asm.finish()
    assert asm.missing() == ["v"]


def test_chunk_before_header():
    e = _reject(_frames()[1:])
    assert e.reason == "malformed" and "no header" in e.message


def test_overlapping_and_gapped_chunks():
    f = _frames()
    e = _reject([f[0], f[1], f[1]])
    assert e.reason == "malformed" and "overlaps" in e.message
    e = _reject([f[0], f[2]])
    assert e.reason == "malformed" and "gap" in e.message


def test_chunk_past_total_bytes():
    f = _frames(torch.zeros(4))
    f[1].chunk.data = b"\0" * 20
    assert _reject(f).reason == "size"


def test_header_while_tensor_incomplete_and_duplicate_name():
    a, b = _frames(name="a"), _frames(name="b")
    e = _reject([a[0], a[1], b[0]])
    assert e.reason == "malformed" and "incomplete" in e.message
    assert _reject(a + a).reason == "malformed"


def test_unknown_checksum_algorithm_and_bad_digest_length():
    f = _frames(torch.zeros(2))
    f[0].header.checksum_alg = "md5"
    assert _reject(f).reason == "checksum"
    f = _frames(torch.zeros(2))
    f[0].header.checksum = b"\0" * 8
    assert _reject(f).reason == "checksum"


def test_compression_rejected_and_invalid_bool_bytes():
    f = _frames(torch.zeros(2))
    f[0].header.compression = "gzip"
    assert _reject(f).reason == "malformed"
    raw = bytes([0, 1, 2])
    h = tensor_pb2.TensorHeader(name="b", dtype="bool", shape=[3], total_bytes=3,
                                checksum=xxhash.xxh3_128(raw).digest(), checksum_alg="xxh3_128")
    frames = [tensor_pb2.TensorFrame(header=h), tensor_pb2.TensorFrame(chunk=tensor_pb2.TensorChunk(data=raw))]
    assert _reject(frames).reason == "malformed"


def test_assembler_is_poisoned_after_rejection():
    asm = TensorAssembler(1 << 20)
    f = _frames(torch.zeros(2))
    with pytest.raises(TensorRejected):
        asm.feed(f[1])
    with pytest.raises(TensorRejected) as ei:
        asm.feed(f[0])
    assert ei.value.reason == "malformed"


@pytest.mark.parametrize("bad", [0, MiB - 1, 4 * MiB + 1, 8 * MiB, 2.5 * MiB])
def test_bad_chunk_bytes(bad):
    with pytest.raises(ValueError, match="grpc.chunk_bytes"):
        list(encode_tensor("x", torch.zeros(2), chunk_bytes=bad))


def test_check_finite():
    check_finite("ok", torch.ones(3))
    check_finite("ints", torch.tensor([1, 2]))
    check_finite("empty", torch.empty(0))
    with pytest.raises(TensorRejected) as ei:
        check_finite("bad", torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))
    assert ei.value.reason == "nonfinite" and "'bad'" in ei.value.message
    with pytest.raises(TensorRejected):
        check_finite("inf", torch.tensor(float("-inf")))


def test_rejection_reason_is_validated():
    with pytest.raises(ValueError):
        TensorRejected("oops", "x")


def test_grpc_options_mirror_the_codec_chunk_cap():
    from protocol import grpc_options
    assert grpc_options.MAX_CHUNK_BYTES == codec.MAX_CHUNK_BYTES
