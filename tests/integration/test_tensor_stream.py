"""The open tensor stream (protocol/streams.py) over a real grpc.aio server on 127.0.0.1: many
tensors both ways on one stream, metadata in order, corruption ends the stream cleanly on both
ends, a slow consumer applies backpressure, an oversize tensor is refused before allocation."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from protocol import stream_wire
from protocol.codec import MiB
from protocol.grpc_options import server_options
from protocol.streams import (ChannelPool, StreamClosed, StreamError, TensorStreamService, add_tensor_stream_to_server,
                              open_stream)

RUN = "run-stream-test"


class Server:
    def __init__(self):
        self.rejects: list[str] = []
        self.svc = TensorStreamService(run_id=RUN, peer_id="server", max_tensor_bytes=2 * MiB, window=4,
                                       on_reject=self.rejects.append)
        self.ended: list[BaseException | None] = []  # how each handler's stream ended
        self.release = asyncio.Event()
        self.got: list = []


@pytest.fixture
async def srv():
    s = Server()

    async def chat(stream):  # receives n tensors while sending n of its own, concurrently
        n = int(stream.peer.meta["n"])

        async def produce():
            for i in range(n):
                await stream.send(f"s{i}", torch.full((1000 + i,), float(i)), {"i": str(i), "from": "server"})

        prod = asyncio.ensure_future(produce())
        try:
            async for got in stream:
                s.got.append(got)
            await prod
            s.ended.append(None)
        except StreamError as exc:
            s.ended.append(exc)
            prod.cancel()
            raise

    async def slow(stream):  # reads nothing until released
        await s.release.wait()
        try:
            async for got in stream:
                s.got.append(got)
            s.ended.append(None)
        except StreamError as exc:
            s.ended.append(exc)

    async def push_corrupt(stream):  # the server's own sends are corrupted in transit
        write = stream._write

        async def corrupting(frame):
            b = bytearray(frame)
            b[len(b) // 2] ^= 0xFF
            await write(bytes(b))
        stream._write = corrupting
        try:
            await stream.send("x", torch.ones(4096))
            await stream.recv(timeout=10)
            s.ended.append(None)
        except StreamError as exc:
            s.ended.append(exc)

    s.svc.register("chat", chat)
    s.svc.register("slow", slow)
    s.svc.register("push_corrupt", push_corrupt)
    server = grpc.aio.server(options=server_options())
    add_tensor_stream_to_server(s.svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ChannelPool()
    s.channel = pool.get(f"127.0.0.1:{port}")
    yield s
    await pool.close()
    await server.stop(0)


async def _open(s, channel, **kw):
    return await open_stream(s.channel, run_id=RUN, sender="client", channel_name=channel,
                             max_tensor_bytes=2 * MiB, **kw)


async def _until(cond, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_many_tensors_both_ways_in_order(srv):
    n = 60
    stream = await _open(srv, "chat", meta={"n": str(n)}, window=4)
    g = torch.Generator().manual_seed(1)
    mine = [torch.rand(int(torch.randint(1, 300_000, (1,), generator=g)), generator=g) for _ in range(n)]

    async def produce():
        for i, t in enumerate(mine):
            await stream.send(f"c{i}", t, {"i": str(i), "mb": str(i % 7)})

    prod = asyncio.ensure_future(produce())
    theirs = [await stream.recv(timeout=20) for _ in range(n)]
    await prod
    await stream.close()
    await _until(lambda: srv.ended)
    assert srv.ended == [None]
    assert [r.meta["i"] for r in theirs] == [str(i) for i in range(n)] and [r.seq for r in theirs] == list(range(n))
    assert all(torch.equal(r.tensor, torch.full((1000 + i,), float(i))) for i, r in enumerate(theirs))
    assert [r.meta for r in srv.got] == [{"i": str(i), "mb": str(i % 7)} for i in range(n)]
    assert all(torch.equal(r.tensor, t) and r.name == f"c{i}" for i, (r, t) in enumerate(zip(srv.got, mine)))
    with pytest.raises(StreamClosed):
        await stream.send("late", torch.ones(1))


async def test_corrupted_frame_from_the_client_ends_both_ends_cleanly(srv):
    stream = await _open(srv, "chat", meta={"n": "0"})
    await stream.send("ok", torch.ones(10), {"i": "0"})
    write = stream._write

    async def corrupting(frame):
        b = bytearray(frame)
        b[len(b) - 20] ^= 0x01  # a payload byte of the one-frame tensor
        await write(bytes(b))
    stream._write = corrupting
    await stream.send("bad", torch.ones(1000), {"i": "1"})
    with pytest.raises(StreamError) as e:
        await stream.recv(timeout=10)
    assert e.value.reason == "checksum" and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    await _until(lambda: srv.ended)
    assert isinstance(srv.ended[0], StreamError) and srv.ended[0].reason == "checksum"
    assert srv.rejects == ["checksum"] and [r.name for r in srv.got] == ["ok"]
    with pytest.raises(StreamError):
        await stream.send("after", torch.ones(1))
    await stream.close()


async def test_corrupted_frame_from_the_server_ends_both_ends_cleanly(srv):
    rejects = []
    stream = await _open(srv, "push_corrupt", on_reject=rejects.append)
    with pytest.raises(StreamError) as e:
        await stream.recv(timeout=10)
    assert e.value.reason in ("checksum", "malformed") and rejects == [e.value.reason]
    await _until(lambda: srv.ended)
    assert isinstance(srv.ended[0], StreamError), srv.ended  # the server learned why, no crash
    await stream.close()


async def test_slow_consumer_backpressures_the_producer(srv):
    stream = await _open(srv, "slow")
    assert stream.peer.window == 4
    t = torch.ones(256 * 1024)  # 1 MiB
    for i in range(4):
        await stream.send("t", t, {"i": str(i)}, timeout=5)
    with pytest.raises(TimeoutError, match="credit"):  # the 5th waits: at most `window` in flight
        await stream.send("t", t, {"i": "4"}, timeout=0.5)
    assert stream.sent == 4 and srv.got == []
    srv.release.set()
    for i in range(4, 12):
        await stream.send("t", t, {"i": str(i)}, timeout=5)
    await stream.close()
    await _until(lambda: srv.ended)
    assert srv.ended == [None] and [r.meta["i"] for r in srv.got] == [str(i) for i in range(12)]


async def test_oversize_tensor_refused_before_allocation(srv, monkeypatch):
    sizes = []
    real = np.empty
    monkeypatch.setattr(stream_wire.np, "empty", lambda n, *a, **k: sizes.append(n) or real(n, *a, **k))
    stream = await _open(srv, "chat", meta={"n": "0"})
    await stream.send("big", torch.ones(3 * MiB // 4))  # 3 MiB: above the server's 2 MiB cap
    with pytest.raises(StreamError) as e:
        await stream.recv(timeout=10)
    assert e.value.reason == "size" and "max_activation_bytes" in e.value.detail
    await _until(lambda: srv.ended)
    assert srv.rejects == ["size"] and all(n < 2 * MiB for n in sizes), sizes
    await stream.close()


async def test_refused_hello(srv):
    with pytest.raises(StreamError) as e:
        await open_stream(srv.channel, run_id="another-run", sender="c", channel_name="chat", max_tensor_bytes=MiB)
    assert e.value.reason == "refused" and "another-run" in e.value.detail
    with pytest.raises(StreamError) as e:
        await _open(srv, "nobody")
    assert e.value.reason == "refused" and "no handler" in e.value.detail


async def test_own_method_async_accept_handler_refusals_and_expected():
    """A role may serve the protocol under its own method (as NoLoCo.Exchange does): an async
    ``accept`` sees the hello first and refuses with its own status, a handler may end its stream
    with ``Refused`` or ``TensorRejected``, and ``expected`` refuses other tensors before allocation."""
    from protocol.codec import TensorRejected
    from protocol.stream_errors import Refused

    method = "/test.Own/Talk"
    seen: list[str] = []

    async def accept(hello):
        await asyncio.sleep(0)
        seen.append(hello.channel)
        if hello.meta.get("go") != "1":
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "not_in_roster", "publish a roster entry first")

    async def refuse(stream):
        await stream.recv(timeout=10)
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "not_root:peerX", "ask peerX")

    async def reject(stream):
        await stream.recv(timeout=10)
        raise TensorRejected("norm", "too far from ours")

    svc = TensorStreamService(run_id=RUN, peer_id="server", max_tensor_bytes=MiB, accept=accept,
                              expected={"w": (torch.float32, (4,))})
    svc.register("refuse", refuse)
    svc.register("reject", reject)
    server = grpc.aio.server(options=server_options())
    add_tensor_stream_to_server(svc, server, method)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ChannelPool(auth=None)
    ch = pool.get(f"127.0.0.1:{port}")
    try:
        with pytest.raises(StreamError) as e:  # refused by accept: its code and reason word
            await open_stream(ch, run_id=RUN, sender="c", channel_name="refuse", max_tensor_bytes=MiB, method=method)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and e.value.refusal == "not_in_roster"
        assert seen == ["refuse"]
        with pytest.raises(StreamError) as e:  # the default method is not served here
            await open_stream(ch, run_id=RUN, sender="c", channel_name="refuse", max_tensor_bytes=MiB)
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
        pre, bad = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
        for channel, code, refusal, reason in (("refuse", pre, "not_root:peerX", "refused"), ("reject", bad, "", "norm")):
            stream = await open_stream(ch, run_id=RUN, sender="c", channel_name=channel, max_tensor_bytes=MiB,
                                       meta={"go": "1"}, method=method)
            await stream.send("w", torch.ones(4))
            with pytest.raises(StreamError) as e:
                await stream.recv(timeout=10)
            assert (e.value.code, e.value.refusal, e.value.reason) == (code, refusal, reason), e.value
            stream.cancel()
        stream = await open_stream(ch, run_id=RUN, sender="c", channel_name="refuse", max_tensor_bytes=MiB,
                                   meta={"go": "1"}, method=method)
        await stream.send("v", torch.ones(4))  # not in the service's expected tensors
        with pytest.raises(StreamError) as e:
            await stream.recv(timeout=10)
        assert e.value.reason == "shape" and "unexpected tensor 'v'" in e.value.detail
        stream.cancel()
    finally:
        await pool.close()
        await server.stop(0)
