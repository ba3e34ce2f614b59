"""State download over a real gRPC server (N16), on the generic node/state_sync API: exact
weights and metadata, weights plus optimizer state on request, mismatched config, run or shapes
and tampered or non-finite streams rejected with a clear error; the per-donor cap holds."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from node.state_sync import (StateFetchError, StateServicer, StateSnapshot, add_state_service, fetch_state,
                             meta_int, split_optimizer)
from protocol.stream_wire import DIGEST_BYTES, parse, tensor_frames
from protocol.grpc_options import server_options

pytestmark = pytest.mark.timeout(120)

NAMES = ["embed.weight", "layers.0.w"]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 64, generator=g), torch.randn(64, 64, generator=g)]


def _snap(ts, rnd=5, optimizer=None):
    return StateSnapshot({"round": rnd, "stage": 0}, dict(zip(NAMES, ts)), optimizer)


async def _serve(servicer):
    server = grpc.aio.server(options=server_options())
    add_state_service(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _expected(tensors):
    return {n: (torch.float32, tuple(t.shape)) for n, t in zip(NAMES, tensors)}


async def test_fetch_returns_exact_state_and_round():
    ts = _tensors()
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: _snap(ts)))
    try:
        meta, got = await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
        assert meta_int(meta, "round") == 5 and meta["stage"] == "0" and "cfg_hash" not in meta
        assert sorted(got) == sorted(NAMES)
        assert all(torch.equal(got[n], t) for n, t in zip(NAMES, ts))
    finally:
        await server.stop(0)


async def test_weights_plus_optimizer_on_request_only():
    ts = _tensors()
    opt = {"adam.m.0": torch.full((4,), 0.5), "adam.step": torch.tensor([7], dtype=torch.int64)}
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: _snap(ts, optimizer=opt)))
    try:
        o_exp = {n: (t.dtype, tuple(t.shape)) for n, t in opt.items()}
        _, got = await fetch_state(addr, "run", "me", "cfg1", _expected(ts), optimizer=o_exp, timeout=30)
        w, o = split_optimizer(got)
        assert sorted(w) == sorted(NAMES) and sorted(o) == sorted(opt)
        assert all(torch.equal(o[n], t) for n, t in opt.items())
        _, plain = await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
        assert sorted(plain) == sorted(NAMES)  # want=weights: no optimizer tensors sent
    finally:
        await server.stop(0)


async def test_wrong_stage_and_weights_only_donor_are_refused():
    ts = _tensors()
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: _snap(ts)))
    try:
        with pytest.raises(StateFetchError, match="FAILED_PRECONDITION.*stage 0, not 3"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), stage=3, timeout=30)
        with pytest.raises(StateFetchError, match="FAILED_PRECONDITION.*weights only"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30,
                              optimizer={"adam.m.0": (torch.float32, (4,))})
        meta, _ = await fetch_state(addr, "run", "me", "cfg1", _expected(ts), stage=0, timeout=30)
        assert meta_int(meta, "round") == 5
    finally:
        await server.stop(0)


async def test_a_copy_of_another_stage_is_served_when_that_stage_is_asked_for():
    """CheckFree+ embedding copy: a stage-1 donor keeps stage 0's weights and serves them (with their
    own meta, not its own) to a request for stage 0; its own stage and unknown stages as before."""
    own, copy = _tensors(1), _tensors(2)
    own_snap = StateSnapshot({"iteration": 30, "stage": 1}, dict(zip(NAMES, own)), None)
    copy_snap = StateSnapshot({"iteration": 20, "stage": 0, "holder_iteration": 30}, dict(zip(NAMES, copy)), None)
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: own_snap,
                                              copies=lambda s: copy_snap if s == 0 else None))
    try:
        meta, got = await fetch_state(addr, "run", "me", "cfg1", _expected(copy), stage=0, timeout=30)
        assert meta["stage"] == "0" and meta_int(meta, "iteration") == 20 and meta_int(meta, "holder_iteration") == 30
        assert all(torch.equal(got[n], t) for n, t in zip(NAMES, copy))
        meta, got = await fetch_state(addr, "run", "me", "cfg1", _expected(own), stage=1, timeout=30)
        assert meta["stage"] == "1" and all(torch.equal(got[n], t) for n, t in zip(NAMES, own))
        with pytest.raises(StateFetchError, match="stage 1, not 2"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(own), stage=2, timeout=30)
    finally:
        await server.stop(0)


async def test_mismatched_cfg_run_and_shapes_are_refused():
    ts = _tensors()
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: _snap(ts)))
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


async def test_per_donor_cap_refuses_beyond_max_concurrent():
    ts = _tensors()
    gate = asyncio.Event()

    class _Slow(StateServicer):
        async def Fetch(self, request, context):  # noqa: N802
            async for frame in super().Fetch(request, context):
                await gate.wait()
                yield frame

    server, addr = await _serve(_Slow("run", "cfg1", lambda: _snap(ts), max_concurrent=1))
    try:
        first = asyncio.ensure_future(fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30))
        await asyncio.sleep(0.5)
        with pytest.raises(StateFetchError, match="RESOURCE_EXHAUSTED"):
            await fetch_state(addr, "run", "me2", "cfg1", _expected(ts), timeout=30)
        gate.set()
        meta, _ = await first
        assert meta_int(meta, "round") == 5
    finally:
        await server.stop(0)


class _Tampering(StateServicer):
    """A donor that flips one payload byte after the digest was computed."""

    async def Fetch(self, request, context):  # noqa: N802
        flipped = False
        async for frame in super().Fetch(request, context):
            if not flipped and parse(frame).data is not None:
                data = bytearray(frame)
                data[-2 - DIGEST_BYTES - 10] ^= 0xFF  # a payload byte (the digest trailer is last)
                frame = bytes(data)
                flipped = True
            yield frame


async def test_tampered_stream_is_rejected():
    ts = _tensors()
    server, addr = await _serve(_Tampering("run", "cfg1", lambda: _snap(ts)))
    try:
        with pytest.raises(StateFetchError, match="checksum"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
    finally:
        await server.stop(0)


async def test_nonfinite_state_is_rejected():
    ts = _tensors()
    ts[1][3, 3] = float("nan")
    server, addr = await _serve(StateServicer("run", "cfg1", lambda: _snap(ts)))
    try:
        with pytest.raises(StateFetchError, match="nonfinite"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
    finally:
        await server.stop(0)


async def test_a_tensor_sent_twice_is_rejected():
    ts = _tensors()

    class _Repeating(StateServicer):
        async def Fetch(self, request, context):  # noqa: N802
            async for frame in super().Fetch(request, context):
                yield frame
            for frame in tensor_frames(len(NAMES), NAMES[0], ts[0]):  # the first tensor again, next seq
                yield frame

    server, addr = await _serve(_Repeating("run", "cfg1", lambda: _snap(ts)))
    try:
        with pytest.raises(StateFetchError, match="sent twice"):
            await fetch_state(addr, "run", "me", "cfg1", _expected(ts), timeout=30)
    finally:
        await server.stop(0)
