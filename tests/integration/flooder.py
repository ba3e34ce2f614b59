"""The flooding member of ``test_attacks.py`` (f), as its own process at the lowest CPU priority.

On a real network the flooder's CPU is not its victims'. On the test machine (2 cores shared by
the whole swarm) the flooder's own gRPC client would take CPU from the workers, and the pace
the test measures would partly be the attacker's load generator. So it runs here, under
``nice 10`` (a tenth of a worker's CPU share when the machine is full; at 19 it got under
2% and, with other load on the machine, sent barely over the limit), and the workers' pace
shows what the node's defenses cost them.

    python -m tests.integration.flooder KEY_FILE RUN_ID HOST:PORT TARGET_PEER_ID RATE WINDOW_S

It sends ``RATE`` signed ``Node.Info`` calls per second and keeps re-opening waves of 16 idle
``NoLoCo.Exchange`` streams (signed metadata, no first frame) for ``WINDOW_S`` seconds. It
prints ``start`` when the flood begins and, at the end, one JSON line: ``{"sent": N,
"codes": {status name: count}, "idle_codes": {...}}``. Imports no hivemind or torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import grpc

from protocol import node_pb2, node_pb2_grpc, noloco_pb2
from security.keys import load_key_file
from security.peer_auth import CallSigner, client_interceptors

IDLE_WAVE = 16
EXCHANGE = f"/{noloco_pb2.DESCRIPTOR.services_by_name['NoLoCo'].full_name}/Exchange"


async def _info(stub) -> str:
    try:
        await stub.Info(node_pb2.InfoRequest(), timeout=2)
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def idle_streams(addr: str, signer: CallSigner, target: str, n: int, hold_s: float) -> list[grpc.StatusCode]:
    """Open ``n`` Exchange streams to ``addr`` that never send a frame (signed metadata, so each
    claims ``signer``'s peer); return each stream's final status."""
    async with grpc.aio.insecure_channel(addr) as ch:
        method = ch.stream_stream(EXCHANGE)
        calls = [method(metadata=signer.metadata(EXCHANGE, target, b"\0" * 32), timeout=hold_s) for _ in range(n)]

        async def end(call):
            try:
                await call.read()
                return await call.code()
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return list(await asyncio.gather(*(end(c) for c in calls)))


async def flood(signer: CallSigner, addr: str, target: str, rate: float, window: float) -> dict:
    codes: dict[str, int] = {}
    idle_codes: dict[str, int] = {}
    inflight: set = set()
    t_start = time.monotonic()
    t_end = t_start + window
    print("start", flush=True)

    async def idle_waves():
        while time.monotonic() < t_end - 1:
            for code in await idle_streams(addr, signer, target, IDLE_WAVE, min(6.0, t_end - time.monotonic())):
                idle_codes[code.name] = idle_codes.get(code.name, 0) + 1

    async with grpc.aio.insecure_channel(addr, interceptors=client_interceptors(signer, target)) as ch:
        stub = node_pb2_grpc.NodeStub(ch)

        async def one():
            code = await _info(stub)
            codes[code] = codes.get(code, 0) + 1
        side = asyncio.ensure_future(idle_waves())
        sent = 0
        while time.monotonic() < t_end:
            due = int((time.monotonic() - t_start) * rate)
            while sent < due and len(inflight) < 256:
                task = asyncio.ensure_future(one())
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                sent += 1
            await asyncio.sleep(0.004)
        await asyncio.gather(*inflight, side)
    return {"sent": sent, "codes": codes, "idle_codes": idle_codes}


def main(argv: list[str]) -> int:
    key_file, run_id, addr, target, rate, window = argv
    os.nice(10)
    signer = CallSigner(load_key_file(key_file), run_id)
    print(json.dumps(asyncio.run(flood(signer, addr, target, float(rate), float(window)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
