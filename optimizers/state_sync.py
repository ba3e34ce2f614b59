"""State for joiners: serve this worker's slow weights over ``WeightService.Fetch`` and fetch a
live peer's.

The server streams a consistent snapshot (taken right after an outer step) as codec frames;
the round and ``cfg_hash`` travel in the response's initial metadata. The joiner checks the
run, the cfg hash, every name, dtype and shape (the codec refuses anything else before
allocating) and finiteness; a tampered or mismatched stream is rejected with a clear error.
A donor serves at most ``max_concurrent`` downloads at once (RESOURCE_EXHAUSTED beyond).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from protocol import weights_pb2, weights_pb2_grpc
from protocol.codec import TensorAssembler, TensorRejected, aencode_tensors, check_finite
from protocol.grpc_options import channel_options

log = logging.getLogger("swarmnode.noloco.state")

META_ROUND, META_CFG = "x-swarmnode-round", "x-swarmnode-cfg-hash"


@dataclass
class Snapshot:
    round: int
    names: list[str]
    tensors: list[torch.Tensor]


class StateServicer(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, run_id: str, cfg_hash: str, get_snapshot, netem=None, max_concurrent: int = 2):
        self.run_id, self.cfg_hash, self._get = run_id, cfg_hash, get_snapshot
        self._netem = netem
        self._slots = asyncio.Semaphore(max_concurrent)
        self.max_concurrent = max_concurrent

    async def Fetch(self, request, context):  # noqa: N802 - gRPC API
        if request.run_id != self.run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"this worker serves run {self.run_id!r}, not {request.run_id!r}")
        snap: Snapshot | None = self._get()
        if snap is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no state yet (still initialising); try another peer")
        if self._slots.locked():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"already serving {self.max_concurrent} state downloads; try another peer")
        async with self._slots:
            await context.send_initial_metadata(((META_ROUND, str(snap.round)), (META_CFG, self.cfg_hash)))
            pace = self._netem.pacer(context.peer()) if self._netem is not None else None
            async for frame in aencode_tensors(list(zip(snap.names, snap.tensors)), pace=pace):
                yield frame


class StateFetchError(Exception):
    pass


async def fetch_state(addr: str, run_id: str, sender: str, cfg_hash: str,
                      expected: dict[str, tuple[torch.dtype, tuple[int, ...]]], timeout: float = 60.0,
                      max_message_bytes: int = 8 << 20) -> tuple[int, dict[str, torch.Tensor]]:
    """Download (round, {name: tensor}) from the worker at ``addr``; raises StateFetchError."""
    cap = max(int(torch.empty((), dtype=d).element_size() * torch.Size(s).numel()) for d, s in expected.values())
    async with grpc.aio.insecure_channel(addr, options=channel_options(max_message_bytes)) as channel:
        stub = weights_pb2_grpc.WeightServiceStub(channel)
        call = stub.Fetch(weights_pb2.FetchRequest(run_id=run_id, want="phi", sender_peer_id=sender), timeout=timeout)
        try:
            meta = dict(await call.initial_metadata() or ())
            if META_CFG not in meta:  # refused before streaming: report the server's reason
                code = await call.code()
                raise StateFetchError(f"state download from {addr} refused: {code.name}: {await call.details()}")
            if meta.get(META_CFG) != cfg_hash:
                raise StateFetchError(f"peer {addr} runs cfg_hash {meta.get(META_CFG)!r}, ours is {cfg_hash!r}: "
                                      "its [noloco]/[model] settings differ; fix the config so all workers match")
            rnd = int(meta.get(META_ROUND, "-1"))
            if rnd < 0:
                raise StateFetchError(f"peer {addr} sent no round in its state header")
            asm = TensorAssembler(cap, expected=expected)
            out: dict[str, torch.Tensor] = {}
            async for frame in call:
                done = asm.feed(frame)
                if done is not None:
                    name, tensor = done
                    check_finite(name, tensor)
                    out[name] = tensor
            asm.finish()
        except TensorRejected as exc:
            call.cancel()
            raise StateFetchError(f"state from {addr} rejected ({exc.reason}): {exc}") from None
        except grpc.aio.AioRpcError as exc:
            raise StateFetchError(f"state download from {addr} failed: {exc.code().name}: {exc.details()}") from None
    missing = sorted(set(expected) - set(out))
    if missing:
        raise StateFetchError(f"state from {addr} lacks {missing[:5]}")
    return rnd, out
