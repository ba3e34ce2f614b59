"""Tensor frames (``protocol/stream_wire.py``) over a real grpc.aio WeightService on 127.0.0.1.

Both wirings are exercised: the generated stub/servicer (protobuf ``StreamFrame`` messages,
which must interoperate with hand-built frames) and the fast path (frames pass as bytes).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from protocol import stream_pb2, weights_pb2, weights_pb2_grpc
from protocol.codec import TensorRejected
from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES, channel_options, server_options
from protocol.stream_wire import DIGEST_BYTES, StreamAssembler, parse, tensor_frames

MiB = 1 << 20
TENSORS = {
    "phi.w": torch.randn(20 * MiB // 4, generator=torch.Generator().manual_seed(1)),  # 20 MiB
    "phi.b": torch.arange(7, dtype=torch.bfloat16),
}


async def _fetch_frames(request, corrupt: bool, wire: bool):
    """Serve ``TENSORS`` (or the one named by ``want``); optionally flip a byte in chunk 1."""
    named = {k: v for k, v in TENSORS.items() if request.want in ("", "phi") or k == request.want}
    n = 0
    for seq, (name, tensor) in enumerate(named.items()):
        for frame in tensor_frames(seq, name, tensor):
            n += 1
            if corrupt and n == 2:  # head + chunk 0, chunk 1 <- corrupt this one
                data = bytearray(frame)
                data[-1000 - (2 + DIGEST_BYTES if parse(frame).digest is not None else 0)] ^= 0xFF
                frame = bytes(data)
            yield frame if wire else stream_pb2.StreamFrame.FromString(frame)


class _Servicer(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, corrupt: bool):
        self.corrupt = corrupt

    async def Fetch(self, request, context):
        async for frame in _fetch_frames(request, self.corrupt, wire=False):
            yield frame


@pytest.fixture(params=["stub", "wire"])
async def server(request):
    """Yields (address, wiring, corrupt_flag_setter)."""
    state = {"corrupt": False}
    srv = grpc.aio.server(options=server_options(DEFAULT_MAX_MESSAGE_BYTES))
    if request.param == "stub":
        servicer = _Servicer(False)
        weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, srv)

        def set_corrupt(v):
            servicer.corrupt = v
    else:
        async def fetch(req, context):
            async for frame in _fetch_frames(req, state["corrupt"], wire=True):
                yield frame

        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("swarmnode.WeightService", {
            "Fetch": grpc.unary_stream_rpc_method_handler(
                fetch, request_deserializer=weights_pb2.FetchRequest.FromString)}),))

        def set_corrupt(v):
            state["corrupt"] = v
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", request.param, set_corrupt
    await srv.stop(0)


def _method(channel, wiring):
    if wiring == "stub":
        return weights_pb2_grpc.WeightServiceStub(channel).Fetch
    return channel.unary_stream("/swarmnode.WeightService/Fetch",
                                request_serializer=weights_pb2.FetchRequest.SerializeToString)


async def _decode(call, max_tensor_bytes: int, expected=None):
    """(name, tensor) for each tensor of a Fetch call, stub messages or raw bytes alike."""
    asm = StreamAssembler(max_tensor_bytes, "limits.max_state_bytes", expected)
    async for msg in call:
        got = asm.feed(parse(msg if isinstance(msg, bytes) else msg.SerializeToString()))
        if got is not None:
            yield got.name, got.tensor
    asm.finish()


async def test_fetch_20mib_bit_exact(server):
    addr, wiring, _ = server
    async with grpc.aio.insecure_channel(addr, options=channel_options(DEFAULT_MAX_MESSAGE_BYTES)) as ch:
        call = _method(ch, wiring)(weights_pb2.FetchRequest(run_id="r", want="phi", round=3,
                                                            sender_peer_id="peer"), timeout=30)
        expected = {k: (v.dtype, tuple(v.shape)) for k, v in TENSORS.items()}
        got = {n: t async for n, t in _decode(call, max_tensor_bytes=32 * MiB, expected=expected)}
    assert list(got) == ["phi.w", "phi.b"]
    for k, v in TENSORS.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))


async def test_corrupted_chunk_raises_checksum(server):
    addr, wiring, set_corrupt = server
    set_corrupt(True)
    async with grpc.aio.insecure_channel(addr, options=channel_options()) as ch:
        call = _method(ch, wiring)(weights_pb2.FetchRequest(run_id="r", want="phi.w"), timeout=30)
        with pytest.raises(TensorRejected) as ei:
            async for _ in _decode(call, max_tensor_bytes=32 * MiB):
                pass
        call.cancel()
    assert ei.value.reason == "checksum" and "'phi.w'" in ei.value.message


async def test_cap_hit_before_download(server):
    addr, wiring, _ = server
    async with grpc.aio.insecure_channel(addr, options=channel_options()) as ch:
        call = _method(ch, wiring)(weights_pb2.FetchRequest(run_id="r", want="phi.w"), timeout=30)
        with pytest.raises(TensorRejected) as ei:
            async for _ in _decode(call, max_tensor_bytes=MiB):
                pass
        call.cancel()
    assert ei.value.reason == "size" and "limits.max_state_bytes" in ei.value.message


def test_options_are_symmetric_and_keepalive_compatible():
    s, c = dict(server_options()), dict(channel_options())
    for opts in (s, c):
        assert opts["grpc.max_send_message_length"] == opts["grpc.max_receive_message_length"] == 8 * MiB
        assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert (c["grpc.keepalive_time_ms"], c["grpc.keepalive_timeout_ms"]) == (30000, 10000)
    assert c["grpc.http2.max_pings_without_data"] == 0
    assert s["grpc.http2.min_ping_interval_without_data_ms"] <= c["grpc.keepalive_time_ms"]
    assert dict(server_options(16 * MiB))["grpc.max_receive_message_length"] == 16 * MiB
    with pytest.raises(ValueError, match="grpc.max_message_bytes"):
        server_options(MiB)
    with pytest.raises(ValueError, match="GOAWAY"):
        server_options(min_ping_interval_ms=60000)
