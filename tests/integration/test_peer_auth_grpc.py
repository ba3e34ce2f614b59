"""Signed gRPC calls over a real grpc.aio server on 127.0.0.1.

The server runs the generated ``Node`` service through ``call_pipeline.add_servicer``
(registered-method path) and a generic byte-stream echo service through
``PipelineGenericHandler`` (generic path), each behind one ``peer_auth.AuthStep``; the client
signs with ``client_interceptors``. Nothing here is timing-based.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protocol import node_pb2, node_pb2_grpc
from security.keys import generate_key, peer_id_str
from security.call_pipeline import PipelineGenericHandler, add_servicer
from security.peer_auth import AuthStep, CallSigner, PeerAuthenticator, client_interceptors, verified_peer

RUN = "run-auth"
INFO = "/swarmnode.Node/Info"
ECHO = "/test.Echo/Chat"


class NodeServicer(node_pb2_grpc.NodeServicer):
    async def Info(self, request, context):
        return node_pb2.NodeInfo(peer_id=verified_peer(context), run_id=RUN)


async def chat(request_iterator, context):
    peer = verified_peer(context)
    n = 0
    async for msg in request_iterator:
        n += 1
        yield msg + b"|" + peer.encode()
    yield f"count={n}".encode()


async def fan(request, context):  # unary-stream with protobuf (de)serializers
    for _ in range(2):
        yield node_pb2.NodeInfo(peer_id=verified_peer(context), role=type(request).__name__)


async def total(request_iterator, context):  # stream-unary over raw bytes
    return b"%d|%s" % (sum([len(m) async for m in request_iterator]), verified_peer(context).encode())


@pytest.fixture
async def node():
    server_key = generate_key()
    known: set[str] = set()
    rejected = []
    auth = PeerAuthenticator(run_id=RUN, own_peer_id=peer_id_str(server_key),
                             is_known_peer=lambda p: p in known,
                             on_reject=lambda f, remote: rejected.append((f.reason, remote)))
    server = grpc.aio.server()
    steps, slow_steps = [AuthStep(auth)], [AuthStep(auth, first_frame_timeout_s=0.3)]
    add_servicer(node_pb2_grpc.add_NodeServicer_to_server, NodeServicer(), server, lambda method: steps)
    echo = grpc.method_handlers_generic_handler("test.Echo", {
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
        "Fan": grpc.unary_stream_rpc_method_handler(fan, request_deserializer=node_pb2.InfoRequest.FromString,
                                                    response_serializer=node_pb2.NodeInfo.SerializeToString),
        "Total": grpc.stream_unary_rpc_method_handler(total)})
    slow = grpc.method_handlers_generic_handler("test.Slow", {"Chat": grpc.stream_stream_rpc_method_handler(chat)})
    server.add_generic_rpc_handlers((PipelineGenericHandler(echo, lambda method: steps),
                                     PipelineGenericHandler(slow, lambda method: slow_steps)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", peer_id_str(server_key), auth, known, rejected
    finally:
        await server.stop(None)


def _signed_channel(addr, target, signer):
    return grpc.aio.insecure_channel(addr, interceptors=client_interceptors(signer, target))


async def test_signed_unary_call_sees_verified_peer(node):
    addr, target, auth, known, _ = node
    signer = CallSigner(generate_key(), RUN)
    known.add(signer.peer_id)
    async with _signed_channel(addr, target, signer) as ch:
        reply = await node_pb2_grpc.NodeStub(ch).Info(node_pb2.InfoRequest(), timeout=10)
    assert reply.peer_id == signer.peer_id
    assert sum(auth.rejections.values()) == 0


async def test_signed_stream_call_sees_verified_peer(node):
    addr, target, _, known, _ = node
    signer = CallSigner(generate_key(), RUN)
    known.add(signer.peer_id)

    async def frames():
        for i in range(3):
            yield f"m{i}".encode()

    async with _signed_channel(addr, target, signer) as ch:
        call = ch.stream_stream(ECHO)(frames(), timeout=10)
        out = [m async for m in call]
    assert out == [f"m{i}|{signer.peer_id}".encode() for i in range(3)] + [b"count=3"]


async def test_unsigned_call_unauthenticated(node):
    addr, _, auth, _, rejected = node
    async with grpc.aio.insecure_channel(addr) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await node_pb2_grpc.NodeStub(ch).Info(node_pb2.InfoRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "x-swarmnode-sig-bin" in ei.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            # no request message: the server refuses on the metadata alone, and a client write
            # racing that refusal would end as INTERNAL ("execute_batch") on the client side
            await ch.stream_stream(ECHO)(iter(()), timeout=10).read()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert auth.rejections["missing"] == 2 and rejected[0][1].startswith("ipv4:127.0.0.1")


async def test_replayed_metadata_unauthenticated(node):
    addr, target, auth, known, _ = node
    signer = CallSigner(generate_key(), RUN)
    known.add(signer.peer_id)
    captured = signer.sign_request(INFO, target, node_pb2.InfoRequest())
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = node_pb2_grpc.NodeStub(ch)
        assert (await stub.Info(node_pb2.InfoRequest(), metadata=captured, timeout=10)).peer_id == signer.peer_id
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Info(node_pb2.InfoRequest(), metadata=captured, timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in ei.value.details()
    assert auth.rejections["replay"] == 1


async def test_call_signed_for_another_node_unauthenticated(node):
    addr, _, auth, known, _ = node
    signer = CallSigner(generate_key(), RUN)
    known.add(signer.peer_id)
    async with _signed_channel(addr, peer_id_str(generate_key()), signer) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await node_pb2_grpc.NodeStub(ch).Info(node_pb2.InfoRequest(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and auth.rejections["signature"] == 1


async def test_skewed_call_unauthenticated(node):
    addr, target, auth, known, _ = node
    key = generate_key()
    skewed = CallSigner(key, RUN, clock=lambda: time.time() - 120)
    known.add(skewed.peer_id)
    async with _signed_channel(addr, target, skewed) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await node_pb2_grpc.NodeStub(ch).Info(node_pb2.InfoRequest(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "check the sender's clock" in ei.value.details() and auth.rejections["skew"] == 1


async def test_unknown_peer_permission_denied(node):
    addr, target, auth, _, _ = node
    stranger = CallSigner(generate_key(), RUN)
    async with _signed_channel(addr, target, stranger) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await node_pb2_grpc.NodeStub(ch).Info(node_pb2.InfoRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            # no request message: the server refuses on the metadata alone, and a client write
            # racing that refusal would end as INTERNAL ("execute_batch") on the client side
            await ch.stream_stream(ECHO)(iter(()), timeout=10).read()
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert auth.rejections["unknown_peer"] == 2


async def test_signed_unary_stream_and_stream_unary(node):
    addr, target, _, known, _ = node
    signer = CallSigner(generate_key(), RUN)
    known.add(signer.peer_id)
    async with _signed_channel(addr, target, signer) as ch:
        fan_call = ch.unary_stream("/test.Echo/Fan", request_serializer=node_pb2.InfoRequest.SerializeToString,
                                   response_deserializer=node_pb2.NodeInfo.FromString)
        replies = [r async for r in fan_call(node_pb2.InfoRequest(), timeout=10)]
        assert [(r.peer_id, r.role) for r in replies] == [(signer.peer_id, "InfoRequest")] * 2
        reply = await ch.stream_unary("/test.Echo/Total")(iter([b"ab", b"cde"]), timeout=10)
        assert reply == b"5|" + signer.peer_id.encode()
        reply = await ch.stream_unary("/test.Echo/Total")(iter([]), timeout=10)  # empty stream is signed too
        assert reply == b"0|" + signer.peer_id.encode()


async def test_stream_without_first_frame_is_cut(node):
    addr, target, auth, known, _ = node
    signer = CallSigner(generate_key(), RUN)
    known.add(signer.peer_id)
    never = asyncio.Event()

    async def silent():
        await never.wait()
        yield b"late"

    md = signer.sign_request("/test.Slow/Chat", target, b"late")
    async with grpc.aio.insecure_channel(addr) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await ch.stream_stream("/test.Slow/Chat")(silent(), metadata=md, timeout=10).read()
    never.set()
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and auth.rejections["first_frame_timeout"] == 1
