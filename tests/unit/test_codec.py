"""Unit tests for protocol/codec.py, the tensor rules every frame on the wire obeys: every
allowed dtype bit-exact through the tensor frames, every head rejection (dtype, shape, size,
expected specs), chunk order, truncation at a download's end, finiteness. Frame layout and the
digest trailer itself are tests/unit/test_stream_wire.py's."""

from __future__ import annotations

import pytest
import torch
import xxhash

from protocol import codec, stream_pb2
from protocol.codec import ALLOWED_DTYPES, TensorRejected, check_finite, validate_header
from protocol.stream_wire import StreamAssembler, parse, tensor_frames

MiB = 1 << 20


def _frames(t=None, name="w", chunk_bytes=MiB, seq=0) -> list[bytes]:
    t = torch.arange(3 * MiB // 4, dtype=torch.float32) if t is None else t  # 3 MiB, 3 frames
    return list(tensor_frames(seq, name, t, None, chunk_bytes))


def _decode(frames, cap=1 << 30, cap_key="limits.max_state_bytes", expected=None, finish=True):
    asm, out = StreamAssembler(cap, cap_key, expected), []
    for f in frames:
        got = asm.feed(parse(f) if isinstance(f, bytes) else f)
        if got is not None:
            out.append((got.name, got.tensor))
    if finish:
        asm.finish()
    return out


def _roundtrip(name, t, **kw):
    out = _decode(_frames(t, name), **kw)
    assert len(out) == 1
    return out[0]


def _reject(frames, **kw) -> TensorRejected:
    with pytest.raises(TensorRejected) as ei:
        _decode(frames, **kw)
    return ei.value


def _with_head(frame: bytes, **changes) -> bytes:
    pb = stream_pb2.StreamFrame.FromString(frame)
    for k, v in changes.items():
        if k == "shape":
            del pb.head.shape[:]
            pb.head.shape.extend(v)
        else:
            setattr(pb.head, k, v)
    return pb.SerializeToString()


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
    frames = _frames(t, "w")
    h = stream_pb2.StreamFrame.FromString(frames[0]).head
    assert (h.name, h.dtype, list(h.shape), h.total_bytes) == ("w", name, [7, 5], 35 * t.element_size())
    assert h.checksum_alg == "xxh3_128"
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
    frames = _frames(t, "s")
    head = stream_pb2.StreamFrame.FromString(frames[0]).head
    assert len(frames) == 1 and list(head.shape) == [] and head.total_bytes == 4
    n, r = _roundtrip("s", t)
    assert r.shape == () and r.item() == 3.25


def test_empty_tensor_is_head_and_digest_only():
    t = torch.empty(0, 3, dtype=torch.int64)
    frames = _frames(t, "e")
    pb = stream_pb2.StreamFrame.FromString(frames[0])
    assert len(frames) == 1 and pb.head.total_bytes == 0 and not pb.data
    assert pb.digest == xxhash.xxh3_128(b"").digest()
    n, r = _roundtrip("e", t)
    assert r.shape == (0, 3) and r.dtype == torch.int64


def test_multi_chunk_tensor_offsets_and_sizes():
    t = torch.arange(5 * MiB // 4 + 3, dtype=torch.float32)  # 5 MiB + 12 bytes
    pbs = [stream_pb2.StreamFrame.FromString(f) for f in _frames(t, "big", chunk_bytes=2 * MiB)]
    assert [p.offset for p in pbs] == [0, 2 * MiB, 4 * MiB]
    assert [len(p.data) for p in pbs] == [2 * MiB, 2 * MiB, MiB + 12]
    assert [bool(p.digest) for p in pbs] == [False, False, True]  # the trailer ends the tensor
    _, r = _roundtrip("big", t)
    assert torch.equal(r, t)
    assert len(_frames(t, "big", chunk_bytes=4 * MiB)) == 2  # 4 MiB chunks


def test_non_contiguous_input():
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    t = base.t()[1:, ::2]
    assert not t.is_contiguous()
    _, r = _roundtrip("nc", t)
    assert r.shape == (5, 2) and torch.equal(r, t) and r.is_contiguous()


# ----------------------------------------------------------------------------- rejections

def test_missing_last_chunk_is_truncated_at_the_end_of_a_download():
    e = _reject(_frames()[:-1])
    assert e.reason == "truncated" and f"after {2 * MiB} of {3 * MiB} bytes" in e.message
    assert _decode(_frames()[:-1], finish=False) == []  # an open stream just waits for the rest


def test_cap_key_named_in_message():
    e = _reject(_frames(), cap=MiB, cap_key="limits.max_activation_bytes")
    assert e.reason == "size" and "limits.max_activation_bytes" in e.message


def test_total_bytes_not_numel_times_itemsize():
    f = _frames(torch.zeros(10))
    e = _reject([_with_head(f[0], total_bytes=41)])
    assert e.reason == "size" and "total_bytes=41" in e.message and "needs 40" in e.message


def test_huge_shape_with_small_total_bytes_is_size_rejection():
    f = _frames(torch.zeros(0, 2))
    assert _reject([_with_head(f[0], shape=[0, 1 << 62, 1 << 62])], cap=MiB).reason == "size"


def test_negative_dim_is_shape_rejection():
    f = _frames(torch.zeros(2, 2))
    assert _reject([_with_head(f[0], shape=[-2, -2])]).reason == "shape"


@pytest.mark.parametrize("bad", ["complex64", "object", "float8_e4m3fn", "torch.float32", ""])
def test_disallowed_dtype(bad):
    f = _frames(torch.zeros(2))
    e = _reject([_with_head(f[0], dtype=bad)])
    assert e.reason == "dtype" and "allowlist" in e.message


def test_encoder_refuses_disallowed_dtype():
    with pytest.raises(ValueError, match="cannot travel"):
        list(tensor_frames(0, "c", torch.zeros(2, dtype=torch.complex64)))


def test_expected_shape_and_dtype_mismatch_and_unknown_name():
    frames = _frames(torch.zeros(2, 3))
    e = _reject(frames, expected={"w": (torch.float32, (3, 2))})
    assert e.reason == "shape" and "expected [3, 2]" in e.message
    e = _reject(frames, expected={"w": ("float16", [2, 3])})
    assert e.reason == "dtype" and "expected float16" in e.message
    e = _reject(frames, expected={"other": (torch.float32, (2, 3))})
    assert e.reason == "shape" and "unexpected tensor 'w'" in e.message
    assert _decode(frames, expected={"w": (torch.float32, (2, 3)), "v": ("int8", ())})[0][0] == "w"


def test_expected_any_length_admits_one_dimension_only():
    ok = _decode(_frames(torch.arange(5, dtype=torch.uint8), "ids"), expected={"ids": (torch.uint8, None)})
    assert torch.equal(ok[0][1], torch.arange(5, dtype=torch.uint8))
    e = _reject(_frames(torch.zeros(2, 2, dtype=torch.uint8), "ids"), expected={"ids": (torch.uint8, None)})
    assert e.reason == "shape" and "one dimension" in e.message


def test_expected_is_checked_before_allocating(monkeypatch):
    allocs = []
    real = codec.np.empty
    monkeypatch.setattr(codec.np, "empty", lambda *a, **k: allocs.append(a) or real(*a, **k))
    from protocol import stream_wire
    monkeypatch.setattr(stream_wire.np, "empty", lambda *a, **k: allocs.append(a) or real(*a, **k))
    frames = _frames(torch.zeros(3 * MiB // 4), "w")  # a multi-frame tensor: it would allocate
    assert _reject(frames, expected={"w": (torch.float32, (7,))}).reason == "shape"
    assert allocs == []
    _decode(frames, expected={"w": (torch.float32, (3 * MiB // 4,))})
    assert allocs == [(3 * MiB,)]  # the spy works: a valid head allocates exactly once


def test_chunk_before_head():
    e = _reject(_frames()[1:])
    assert e.reason == "malformed" and "no head" in e.message


def test_chunk_past_total_bytes():
    f = stream_pb2.StreamFrame(seq=0, offset=0, data=b"\0" * 20)
    head_only = stream_pb2.StreamFrame.FromString(_frames(torch.zeros(4))[0])
    head_only.ClearField("data")
    head_only.ClearField("digest")
    assert _reject([head_only.SerializeToString(), f.SerializeToString()]).reason == "size"


def test_head_while_tensor_incomplete():
    a = _frames(name="a")
    b = _frames(name="b", seq=0)
    e = _reject([a[0], a[1], b[0]])
    assert e.reason == "malformed" and "incomplete" in e.message


@pytest.mark.parametrize("bad", [0, MiB - 1, 4 * MiB + 1, 8 * MiB, 2.5 * MiB])
def test_bad_chunk_bytes(bad):
    with pytest.raises(ValueError, match="grpc.chunk_bytes"):
        list(tensor_frames(0, "x", torch.zeros(2), None, bad))


def test_validate_header_returns_the_torch_dtype_and_shape():
    assert validate_header("x", "bfloat16", [2, 3], 12, 64) == (torch.bfloat16, (2, 3))
    with pytest.raises(TensorRejected) as ei:
        validate_header("", "float32", [], 4, 64)
    assert ei.value.reason == "malformed"


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
