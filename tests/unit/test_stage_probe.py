"""The stage probe (pipeline/stage_probe.py) over a real gRPC tensor stream on 127.0.0.1: a real
stage answers; a server that only answers health checks, one that echoes, one that answers
garbage shapes or NaN all fail with a reason the coordinator logs (issue 33, finding 3)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from models.config import ModelConfig
from models.stages import build_stage
from pipeline.stage_probe import PROBE_CHANNEL, ProbeServer, ProbeSpec, check_output, probe_input, probe_stage
from protocol.streams import ChannelPool, TensorStreamService, add_tensor_stream_to_server

CFG = ModelConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=32)
SPEC = ProbeSpec(d_model=16, vocab_size=CFG.vocab_size, seq_len=32)
PEER = "12D3KooWAsAmemTtNfmdqcPJDiXoXqyh88gQoaSLYVifaQ4kQ4HX"


async def _run(fn, *args):
    return await asyncio.to_thread(fn, *args)


@contextlib.asynccontextmanager
async def server(handler=None):
    srv = grpc.aio.server()
    health = HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, srv)
    if handler is not None:
        svc = TensorStreamService(run_id="r", peer_id=PEER, max_tensor_bytes=1 << 20)
        svc.register(PROBE_CHANNEL, handler)
        add_tensor_stream_to_server(svc, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    pool = ChannelPool()
    try:
        yield lambda stage, timeout=5.0: probe_stage(pool, run_id="r", me="coord", peer_id=PEER,
                                                     addr=f"127.0.0.1:{port}", stage=stage, spec=SPEC,
                                                     timeout_s=timeout)
    finally:
        await pool.close()
        await srv.stop(0)


def stage_server(stage: int) -> ProbeServer:
    mod = build_stage(CFG, 0, stage, 2)
    return ProbeServer(lambda: mod, _run, lambda: torch.device("cpu"), contextlib.nullcontext)


@pytest.mark.parametrize("stage", [0, 1])
async def test_a_real_stage_answers_its_probe(stage):
    ps = stage_server(stage)
    async with server(ps.on_stream) as probe:
        assert await probe(stage) is None
        assert await probe(stage) is None          # probes are rate-limited, not refused
    assert ps.answered == 2


async def test_a_stage_not_built_yet_refuses_and_says_so():
    ps = ProbeServer(lambda: None, _run, lambda: torch.device("cpu"), contextlib.nullcontext)
    async with server(ps.on_stream) as probe:
        why = await probe(1)
    assert why == "refused the stage probe: not built yet", why


async def test_a_health_only_server_fails_the_probe():
    async with server() as probe:
        why = await probe(1)
    assert why is not None and "probe failed" in why, why


async def test_a_silent_or_garbage_stage_fails_the_probe():
    async def silent(stream):
        async for _ in stream:
            await asyncio.sleep(30)

    async def echo(stream):
        async for r in stream:
            await stream.send("probe_out", r.tensor, {}, timeout=5)

    async def nan(stream):
        async for r in stream:
            await stream.send("probe_out", torch.full((1, SPEC.tokens, 16), float("nan")), {}, timeout=5)

    async with server(silent) as probe:
        assert "no answer" in await probe(1, timeout=1.0)
    async with server(echo) as probe:
        assert "echoed" in await probe(1)
        assert "hidden states" in await probe(0)       # token ids back where hidden states belong
    async with server(nan) as probe:
        assert "non-finite" in await probe(1)


def test_check_output_names_what_is_wrong():
    x = probe_input(SPEC, 1, 3)
    assert check_output(SPEC, x, "probe_out", x + 1) is None
    assert "instead of probe_out" in check_output(SPEC, x, "err", x)
    assert "(1, 8, 16)" in check_output(SPEC, x, "probe_out", torch.zeros(1, 8, 15))


def test_a_stage_being_probed_is_claimed_and_a_failed_one_claims_nothing():
    """A replacement that just published its rebuilt stage holds it while its first probe runs (no
    second replacement is sent to the same stage); a node that failed a probe holds nothing."""
    from types import SimpleNamespace

    from pipeline.stage_admission import StageAdmission

    adm = StageAdmission(SimpleNamespace(), SPEC, 5.0, 0.0)
    members = [("new", 2, "a:1"), ("ok", 1, "b:1"), ("fake", 3, "c:1")]
    adm.passed.add("ok")
    adm.failed["fake"] = {"why": "no answer", "fails": 1, "retry_at": 0.0}
    assert adm.claims(members) == {"new": 2}
