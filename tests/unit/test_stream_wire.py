"""protocol/stream_wire.py: frame layout, digest trailer, caps before allocation, flow-control
frames and metadata, frame by frame (no network)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from protocol import stream_pb2, stream_wire
from protocol.codec import MiB, TensorRejected
from protocol.stream_wire import (StreamAssembler, credit_frame, error_frame, hello_frame, parse, parse_hello,
                                  tensor_frames)


def _roundtrip(tensors, chunk=MiB, cap=64 * MiB):
    asm, out = StreamAssembler(cap), []
    for seq, (name, t, meta) in enumerate(tensors):
        for data in tensor_frames(seq, name, t, meta, chunk):
            got = asm.feed(parse(data))
            if got is not None:
                out.append(got)
    return out


def test_small_tensor_is_one_frame_matching_protobuf():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    frames = list(tensor_frames(3, "x", t, {"mb": "1"}))
    assert len(frames) == 1
    pb = stream_pb2.StreamFrame.FromString(frames[0])  # our hand layout is valid protobuf
    assert pb.seq == 3 and pb.head.name == "x" and list(pb.head.shape) == [2, 3]
    assert pb.head.total_bytes == 24 and dict(pb.head.meta) == {"mb": "1"} and len(pb.digest) == 16
    assert bytes(pb.data) == t.numpy().tobytes()


def test_many_tensors_roundtrip_exact_with_meta_in_order():
    g = torch.Generator().manual_seed(0)
    ins = [("a", torch.rand(3 * MiB // 4 + 5, generator=g), {"i": "0"}),   # 3 frames at 1 MiB chunks
           ("b", torch.randn(4, 5, generator=g).to(torch.bfloat16), {"i": "1", "path": "2"}),
           ("c", torch.empty(0, 3), {}),
           ("d", torch.tensor(True), {"i": "3"}),
           ("e", torch.arange(12, dtype=torch.int64).reshape(3, 4).t(), None)]  # non-contiguous
    out = _roundtrip(ins)
    assert [o.name for o in out] == ["a", "b", "c", "d", "e"] and [o.seq for o in out] == [0, 1, 2, 3, 4]
    for (name, t, meta), o in zip(ins, out):
        assert o.tensor.dtype == t.dtype and o.tensor.shape == t.shape and torch.equal(o.tensor, t)
        assert o.meta == (meta or {})


def test_frames_parse_in_any_field_order_and_unknown_fields_are_skipped():
    t = torch.ones(4)
    pb = stream_pb2.StreamFrame.FromString(next(tensor_frames(0, "x", t)))
    # protobuf's own serialization orders fields differently from ours; add an unknown field 15
    data = pb.SerializeToString() + b"\x78\x05"
    got = StreamAssembler(MiB).feed(parse(data))
    assert torch.equal(got.tensor, t)


def _corrupt(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


def test_corrupted_payload_fails_the_digest_and_poisons_the_assembler():
    frames = list(tensor_frames(0, "x", torch.rand(3 * MiB // 4), None, MiB))
    asm = StreamAssembler(16 * MiB)
    asm.feed(parse(frames[0]))
    asm.feed(parse(_corrupt(frames[1], len(frames[1]) // 2)))  # a byte in the middle chunk
    with pytest.raises(TensorRejected) as e:
        asm.feed(parse(frames[2]))
    assert e.value.reason == "checksum"
    with pytest.raises(TensorRejected):  # poisoned: nothing more is accepted
        asm.feed(parse(next(tensor_frames(1, "y", torch.ones(1)))))


def test_corrupted_trailer_is_rejected():
    data = next(tensor_frames(0, "x", torch.ones(8)))
    with pytest.raises(TensorRejected) as e:
        StreamAssembler(MiB).feed(parse(_corrupt(data, len(data) - 1)))
    assert e.value.reason == "checksum"


def test_trailer_before_the_last_byte_is_truncated():
    frames = list(tensor_frames(0, "x", torch.rand(2 * MiB // 4), None, MiB))
    first = stream_pb2.StreamFrame.FromString(frames[0])
    first.digest = b"\0" * 16  # claims the tensor ends after one of two chunks
    with pytest.raises(TensorRejected) as e:
        StreamAssembler(16 * MiB).feed(parse(first.SerializeToString()))
    assert e.value.reason == "truncated"


def test_cap_is_checked_before_allocating(monkeypatch):
    allocs = []
    real = np.empty
    monkeypatch.setattr(stream_wire.np, "empty", lambda *a, **k: allocs.append(a) or real(*a, **k))
    head = stream_pb2.StreamTensorHead(name="big", dtype="float32", shape=[1 << 30], total_bytes=4 << 30,
                                       checksum_alg="xxh3_128")
    f = stream_pb2.StreamFrame(seq=0, head=head, data=b"\0" * 16)
    with pytest.raises(TensorRejected) as e:
        StreamAssembler(8 * MiB, cap_key="limits.max_activation_bytes").feed(parse(f.SerializeToString()))
    assert e.value.reason == "size" and "limits.max_activation_bytes" in str(e.value)
    assert allocs == []  # refused before any buffer was made
    lying = stream_pb2.StreamTensorHead(name="x", dtype="float32", shape=[4], total_bytes=8, checksum_alg="xxh3_128")
    with pytest.raises(TensorRejected) as e:
        StreamAssembler(MiB).feed(parse(stream_pb2.StreamFrame(seq=0, head=lying).SerializeToString()))
    assert e.value.reason == "size" and allocs == []


@pytest.mark.parametrize("mutate, reason", [
    (lambda h: setattr(h, "dtype", "complex64"), "dtype"),
    (lambda h: h.shape.append(-1), "shape"),
    (lambda h: setattr(h, "checksum_alg", "md5"), "checksum"),
    (lambda h: h.meta.update({f"k{i}": "v" for i in range(40)}), "malformed"),
])
def test_bad_heads_are_refused(mutate, reason):
    pb = stream_pb2.StreamFrame.FromString(next(tensor_frames(0, "x", torch.ones(2))))
    mutate(pb.head)
    with pytest.raises(TensorRejected) as e:
        StreamAssembler(MiB).feed(parse(pb.SerializeToString()))
    assert e.value.reason == reason


def test_out_of_order_gap_and_repeated_fields_are_malformed():
    frames = list(tensor_frames(0, "x", torch.rand(3 * MiB // 4), None, MiB))
    asm = StreamAssembler(16 * MiB)
    asm.feed(parse(frames[0]))
    with pytest.raises(TensorRejected, match="gap"):
        asm.feed(parse(frames[2]))
    with pytest.raises(TensorRejected, match="seq 1, expected 0"):
        StreamAssembler(MiB).feed(parse(next(tensor_frames(1, "x", torch.ones(1)))))
    with pytest.raises(TensorRejected, match="twice"):
        parse(b"\x08\x01\x08\x02")
    with pytest.raises(TensorRejected, match="past the end"):
        parse(b"\x22\x10abc")


def test_flow_control_and_error_frames():
    assert parse(credit_frame(5)).credit == 5 and not parse(credit_frame(5)).is_tensor
    err = stream_pb2.StreamError.FromString(parse(error_frame("checksum", "bad")).error)
    assert (err.reason, err.message) == ("checksum", "bad")
    h = parse_hello(parse(hello_frame("run", "peer", "activations", 8, {"stage": "1"})))
    assert (h.run_id, h.sender, h.channel, h.window, dict(h.meta)) == ("run", "peer", "activations", 8, {"stage": "1"})
    with pytest.raises(TensorRejected, match="window"):
        parse_hello(parse(hello_frame("run", "peer", "c", 0)))
    with pytest.raises(TensorRejected, match="hello"):
        parse_hello(parse(credit_frame(1)))


def test_sender_checks_meta():
    with pytest.raises(TypeError, match="str"):
        list(tensor_frames(0, "x", torch.ones(1), {"mb": 3}))
    with pytest.raises(TensorRejected):
        list(tensor_frames(0, "x", torch.ones(1), {"k": "v" * 300}))


@pytest.mark.parametrize("name,meta,shape,dtype", [
    ("x", {}, (5,), torch.float32), ("longer-name", {"mb": "12", "path": "3"}, (2, 3, 4), torch.bfloat16),
    ("s", {"k": "v" * 200}, (), torch.int64), ("e", None, (0, 7), torch.float16)])
def test_single_frame_payload_is_aligned_and_head_matches_protobuf(name, meta, shape, dtype):
    t = torch.ones(shape, dtype=dtype)
    (frame,) = list(tensor_frames(9, name, t, meta))
    pb = stream_pb2.StreamFrame.FromString(frame)  # pad field included: still valid protobuf
    want = stream_pb2.StreamTensorHead(name=name, dtype=pb.head.dtype, shape=list(shape),
                                       total_bytes=t.numel() * t.element_size(), checksum_alg="xxh3_128",
                                       meta=meta or {})
    assert pb.head == want
    f = parse(frame)
    if t.numel():
        assert f.data.obj is frame  # a view into the received bytes, starting aligned
        assert np.frombuffer(f.data, np.uint8).ctypes.data % stream_wire.PAYLOAD_ALIGN == 0


def test_single_frame_tensor_is_handed_out_over_the_frame_without_a_copy():
    t = torch.arange(1000, dtype=torch.float32)
    (frame,) = list(tensor_frames(0, "x", t, {"i": "0"}))
    got = StreamAssembler(MiB).feed(parse(frame)).tensor
    base = np.frombuffer(frame, np.uint8).ctypes.data
    assert base <= got.data_ptr() < base + len(frame)  # a view into the frame
    assert torch.equal(got, t)
    got += 1  # the receiver owns it: writing works
    assert torch.equal(got, t + 1)


def test_misaligned_single_frame_payload_is_copied_not_misread():
    t = torch.arange(64, dtype=torch.float64)
    (frame,) = list(tensor_frames(0, "x", t))
    shifted = memoryview(bytearray(len(frame) + 1))[1:]  # the same frame at an odd address
    shifted[:] = frame
    f = parse(shifted)
    got = StreamAssembler(MiB).feed(f).tensor
    assert torch.equal(got, t) and got.data_ptr() % stream_wire.PAYLOAD_ALIGN == 0


def test_chunked_and_single_frame_paths_agree_and_bool_bytes_are_checked_on_both():
    g = torch.Generator().manual_seed(1)
    t = torch.rand(MiB // 2 + 3, generator=g)  # 2 MiB + 12 bytes: 3 frames at 1 MiB chunks, 1 at 4 MiB
    assert len(list(tensor_frames(0, "x", t, None, MiB))) == 3
    one, many = _roundtrip([("x", t, None)], chunk=4 * MiB), _roundtrip([("x", t, None)], chunk=MiB)
    assert torch.equal(one[0].tensor, t) and torch.equal(many[0].tensor, t)
    for n in (16, MiB + 16):  # one frame / two frames; the digest is right, only the bool check can catch it
        raw = torch.ones(n, dtype=torch.uint8)
        raw[-3] = 2
        with pytest.raises(TensorRejected) as e:
            _roundtrip([("b", raw.view(torch.bool), None)], chunk=MiB)
        assert e.value.reason == "malformed"


def test_varint_fast_paths_agree_with_the_loop():
    from protocol.varint import encode_varint, read_varint
    for n in (0, 1, 127, 128, 300, 2**31, 2**63 - 1):
        enc = encode_varint(n)
        assert read_varint(b"\xff" + enc, 1) == (n, 1 + len(enc))
        assert stream_pb2.StreamFrame.FromString(b"\x08" + enc).seq == n


_SLOTS = ("seq", "head", "offset", "data", "digest", "credit", "hello", "error")


def _fields(f):
    return {k: (bytes(v) if isinstance(v, memoryview) else v) for k in _SLOTS for v in [getattr(f, k)]}


@pytest.mark.parametrize("seq,name,meta,t", [
    (0, "x", None, torch.ones(5)),
    (1, "a" * 100, {"mb": "12", "path": "3", "hop": "1"}, torch.rand(3, 7).to(torch.bfloat16)),
    (300, "s", {"k": "v" * 250}, torch.arange(9, dtype=torch.int64)),
    (2**40, "b", {"i": "7"}, torch.tensor([True, False, True])),
    (5, "m", {f"k{i}": "v" * 100 for i in range(20)}, torch.ones(4, 4, dtype=torch.float16)),  # head > 127 B
])
def test_the_single_frame_fast_path_parses_exactly_as_the_field_walk(seq, name, meta, t):
    (frame,) = list(tensor_frames(seq, name, t, meta))
    fast = stream_wire._parse_single(frame)
    assert fast is not None, "a frame built by tensor_frames must take the fast path"
    walked = parse(bytearray(frame))  # not bytes: the general walk
    assert _fields(fast) == _fields(walked) and fast.data.obj is frame
    asm = StreamAssembler(MiB)
    asm.next_seq = seq  # as if seq tensors came before
    got = asm.feed(parse(frame))
    assert got.seq == seq and got.meta == (meta or {}) and torch.equal(got.tensor, t)


def test_frames_off_the_fast_layout_take_the_field_walk_and_its_checks():
    t = torch.arange(8, dtype=torch.float32)
    (frame,) = list(tensor_frames(0, "x", t, {"i": "0"}))
    # a trailing credit field: valid protobuf, not our layout -> the walk parses both
    f = parse(frame + credit_frame(3))
    assert stream_wire._parse_single(frame + credit_frame(3)) is None and f.credit == 3 and f.is_tensor
    # truncated / one byte too many: the walk rejects what the fast path declines
    for bad in (frame[:-1], frame + b"\x00"):
        assert stream_wire._parse_single(bad) is None
        with pytest.raises(TensorRejected):
            parse(bad)
    # a second data field after the digest must not be swallowed by the fast path
    twice = frame + b"\x22\x01\x00"
    assert stream_wire._parse_single(twice) is None
    with pytest.raises(TensorRejected, match="twice"):
        parse(twice)
    # a data length that does not end right at the digest: declined, whatever the bytes around it
    i = frame.index(b"\x22\x20")  # data tag and length (32 bytes)
    short = frame[:i] + b"\x22\x08" + frame[i + 2:]
    assert stream_wire._parse_single(short) is None
    # chunked tensors (offset field) and empty tensors (no data) are not single frames
    chunks = list(tensor_frames(0, "x", torch.rand(MiB // 2), None, MiB))
    assert all(stream_wire._parse_single(c) is None for c in chunks)
    (empty,) = list(tensor_frames(0, "e", torch.empty(0)))
    assert stream_wire._parse_single(empty) is None and parse(empty).head is not None
    # an empty tensor sent with an explicit empty data field (another sender's encoding) still arrives
    head = stream_wire.head_bytes("e", "float32", (0,), 0, {})
    explicit = (b"\x08\x00\x12" + bytes((len(head),)) + head + b"\x22\x00\x2a\x10"
                + xxhash.xxh3_128(b"").digest())
    got = StreamAssembler(MiB).feed(parse(explicit))
    assert got.tensor.shape == (0,) and got.tensor.dtype == torch.float32


def test_a_repeated_head_is_checked_once_and_any_change_is_checked_again():
    asm = StreamAssembler(MiB)
    for seq in range(3):  # the same kind of tensor: the checked (dtype, shape) is reused
        assert torch.equal(asm.feed(parse(next(tensor_frames(seq, "x", torch.ones(4), {"i": str(seq)})))).tensor,
                           torch.ones(4))
    pb = stream_pb2.StreamFrame.FromString(next(tensor_frames(3, "x", torch.ones(4))))
    pb.head.total_bytes, pb.data = 8, bytes(8)  # same name, dtype and shape as the cached head: a lying size
    pb.digest = xxhash.xxh3_128(pb.data).digest()  # whose data and digest agree with it
    with pytest.raises(TensorRejected) as e:
        asm.feed(parse(pb.SerializeToString()))
    assert e.value.reason == "size"
    asm = StreamAssembler(MiB)
    asm.feed(parse(next(tensor_frames(0, "x", torch.ones(4)))))
    pb = stream_pb2.StreamFrame.FromString(next(tensor_frames(1, "x", torch.ones(4))))
    pb.head.checksum_alg = "md5"  # the cached head does not skip the checksum-algorithm check
    with pytest.raises(TensorRejected) as e:
        asm.feed(parse(pb.SerializeToString()))
    assert e.value.reason == "checksum"
