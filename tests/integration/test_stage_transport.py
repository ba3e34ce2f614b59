"""The stage role's transport (pipeline/stage_transport.py) over real grpc.aio servers on 127.0.0.1.

- messages to one peer arrive in order on one open stream, with integer meta, the hop's timing
  stripped off and counted, the emulated link (node/netem.py) applied per message with the
  latencies of back-to-back messages overlapping;
- a message to a peer that is not reachable yet is retried until it arrives, never dropped
  (a lost activation would stall the whole iteration; this was the pipeline swarm's flake);
- `answer_error` reaches the sender of a bad message on its own stream.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from node.netem import LinkEmulator, LinkSpec, NetemConfig
from pipeline.stage_msgs import Out
from pipeline.stage_transport import CHANNEL, StageTransport
from protocol.grpc_options import server_options
from protocol.streams import ChannelPool, add_tensor_stream_to_server, open_stream

RUN = "run-stage-transport"


def _transport(me: str, netem: NetemConfig | None = None) -> StageTransport:
    return StageTransport(run_id=RUN, me=me, netem=LinkEmulator(netem or NetemConfig()), max_tensor_bytes=1 << 20,
                          send_timeout_s=10.0)


async def _serve(t: StageTransport, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=server_options())
    add_tensor_stream_to_server(t.service, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def _fwd(i: int, dest: str = "B") -> Out:
    return Out(dest, "fwd", {"it": 0, "ep": 1, "p": i, "h": 1}, torch.full((2, 4, 8), float(i)))


async def test_in_order_with_per_message_link_emulation():
    link = LinkSpec(latency_ms=60, bandwidth_mbps=8)     # 1 MB/s: each 256-byte tensor ~0.3 ms
    a = _transport("A", NetemConfig(enabled=True, links={"B": link}))
    b = _transport("B")
    server, port = await _serve(b)
    a.addrs["B"] = f"127.0.0.1:{port}"
    try:
        a.send([_fwd(99)])                                # opens the stream (connect + hello)
        await asyncio.wait_for(b.inbox.get(), 10)
        first = b.hops.summary()
        t0 = time.monotonic()
        a.send([_fwd(i) for i in range(5)])
        got = [await asyncio.wait_for(b.inbox.get(), 10) for _ in range(5)]
        took = time.monotonic() - t0
        assert [m.meta["p"] for m, _ in got] == list(range(5))
        assert all(m.sender == "A" and m.kind == "fwd" and "ts" not in m.meta and "lk" not in m.meta for m, _ in got)
        assert torch.equal(got[3][0].tensor, torch.full((2, 4, 8), 3.0))
        assert 0.06 <= took < 0.2, f"5 messages on a 60 ms link took {took:.3f} s (latencies should overlap)"
        stats = b.hops.summary()
        assert stats["hops"] == 6 and 0.06 <= stats["link_s_mean"] < 0.065
        hop_s = (stats["hop_s_mean"] * 6 - first["hop_s_mean"]) / 5      # the five on the open stream
        assert 0.06 <= hop_s < 0.15, hop_s
        assert await a.flush(5.0) and a.retries == 0
    finally:
        await a.close()
        await b.close()
        await server.stop(0)


async def test_a_peer_not_up_yet_gets_the_message_when_it_is():
    a, b = _transport("A"), _transport("B")
    probe, port = await _serve(_transport("probe"))      # reserve a port, then free it
    await probe.stop(0)
    a.addrs["B"] = f"127.0.0.1:{port}"
    server = None
    try:
        a.send([_fwd(0), _fwd(1)])
        await asyncio.sleep(0.5)                          # refused: nothing listens there yet
        assert a.retries >= 1 and b.inbox.empty()
        server, _ = await _serve(b, port)
        got = [await asyncio.wait_for(b.inbox.get(), 15) for _ in range(2)]
        assert [m.meta["p"] for m, _ in got] == [0, 1]
        assert await a.flush(5.0)
    finally:
        await a.close()
        await b.close()
        if server is not None:
            await server.stop(0)


async def test_an_error_answer_reaches_the_sender_on_its_stream():
    b = _transport("B")
    server, port = await _serve(b)
    pool = ChannelPool()
    try:
        stream = await open_stream(pool.get(f"127.0.0.1:{port}"), run_id=RUN, sender="A", channel_name=CHANNEL,
                                   max_tensor_bytes=1 << 20)
        await stream.send("fwd", torch.zeros(3, 3), {"it": "0", "p": "0"})
        msg, reply = await asyncio.wait_for(b.inbox.get(), 10)
        assert msg.tensor.shape == (3, 3) and reply is not None
        await b.answer_error(reply, "shape", "activation of shape (3, 3) where [B, T, d] was expected")
        answer = await stream.recv(timeout=10)
        assert answer.name == "err" and answer.meta["reason"] == "shape" and "(3, 3)" in answer.meta["detail"]
        await stream.send("fwd", torch.zeros(1), {"it": "x"})      # meta that is not an integer: dropped
        await stream.send("fwd", torch.zeros(2, 2, 2), {"it": "0", "p": "1"})
        msg, _ = await asyncio.wait_for(b.inbox.get(), 10)
        assert msg.meta["p"] == 1
        await stream.close()
    finally:
        await pool.close()
        await b.close()
        await server.stop(0)
