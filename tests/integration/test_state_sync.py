"""Joiner state download over a real gRPC server (N16): exact phi and round, mismatched
config or shapes and tampered streams rejected with a clear error."""

from __future__ import annotations

import grpc
import pytest
import torch

from optimizers.state_sync import Snapshot, StateFetchError, StateServicer, fetch_state
from protocol import weights_pb2_grpc
from protocol.grpc_options import server_options

pytestmark = pytest.mark.timeout(120)

NAMES = ["embed.weight", "layers.0.w"]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 64, generator=g), torch.randn(64, 64, generator=g)]


async def _serve(servicer):
    server = grpc.aio.server(options=server_options())
    weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _expected(tensors):
    return {n: (torch.float32, tuple(t.shape)) for n, t in zip(NAMES, tensors)}


async def test_fetch_returns_exact_state_and_round():
    ts = _tensors()
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: Snapshot(5, NAMES, ts)))
    try:
        rnd, got = await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
        assert rnd == 5
        assert all(torch.equal(got[n], t) for n, t in zip(NAMES, ts))
    finally:
        await server.stop(0)


async def test_mismatched_cfg_run_and_shapes_are_refused():
    ts = _tensors()
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: Snapshot(5, NAMES, ts)))
    try:
        with pytest.raises(StateFetchError, match="cfg_hash"):
            await fetch_state(addr, "run", "me", "other", _expected(ts), timeout=30)
        with pytest.raises(StateFetchError, match="INVALID_ARGUMENT"):
            await fetch_state(addr, "another-run", "me", "cfg1", _expected(ts), timeout=30)
        wrong = {NAMES[0]: (torch.float32, (300, 32)), NAMES[1]: (torch.float32, (64, 64))}
        with pytest.raises(StateFetchError, match="rejected"):
            await fetch_state(addr, "run", "me", "cfg1", wrong, timeout=30)
    finally:
        await server.stop(0)


class _Tampering(StateServicer):
    """A donor that flips one payload byte after the digest was computed."""

    async def Fetch(self, request, context):  # noqa: N802
        flipped = False
        async for frame in super().Fetch(request, context):
            if not flipped and frame.WhichOneof("kind") == "chunk":
                data = bytearray(frame.chunk.data)
                data[10] ^= 0xFF
                frame.chunk.data = bytes(data)
                flipped = True
            yield frame


async def test_tampered_stream_is_rejected():
    ts = _tensors()
    server, addr = await _serve(_Tampering("run", "cfg1", lambda: Snapshot(5, NAMES, ts)))
    try:
        with pytest.raises(StateFetchError, match="checksum"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
    finally:
        await server.stop(0)


async def test_nonfinite_state_is_rejected():
    ts = _tensors()
    ts[1][3, 3] = float("nan")
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: Snapshot(5, NAMES, ts)))
    try:
        with pytest.raises(StateFetchError, match="nonfinite"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
    finally:
        await server.stop(0)
