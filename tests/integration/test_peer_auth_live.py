"""Peer authentication on a LIVE node (docs/security.md, 'Signed calls'; issue 7): real daemon processes on
127.0.0.1, calls made from this test process with plain grpc.aio clients.

A bootstrap (the target) and a second node ("member", whose key file this test signs with:
it has a live node card, so it is a known peer) run as processes. Unsigned, wrongly signed,
replayed, clock-skewed and unknown-peer calls to ``Node.Info`` are refused with the right
status and counted in the target's ``/metrics`` (``swarmnode_rpc_rejected_total{reason}``);
the member's signed call succeeds; a member that floods past ``limits.peer_rps`` is refused
with RESOURCE_EXHAUSTED and then banned (``swarmnode_peer_bans_total``, its card's ``banned``).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from node.localswarm import LocalSwarm
from protocol import node_pb2, node_pb2_grpc
from security.keys import generate_key, load_key_file, peer_id_str
from security.peer_auth import CallSigner, client_interceptors

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN = "authlive"
INFO = "/swarmnode.Node/Info"


def _rejected(node, reason: str) -> float:
    return node.metrics().get(f'swarmnode_rpc_rejected_total{{reason="{reason}"}}', 0.0)


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm(run_id=RUN, common_set=["limits.peer_rps=20", "limits.ban_threshold=10",
                                            "security.known_peers_refresh_s=1"]) as sw:
        target = sw.start("bootstrap", name="target")
        sw.wait_ready([target], timeout=60)
        member = sw.start("bootstrap", name="member")
        sw.wait_ready([member], timeout=60)
        yield sw, target, member


def _info_stub(addr: str, interceptors=None):
    ch = grpc.aio.insecure_channel(addr, interceptors=interceptors)
    return ch, node_pb2_grpc.NodeStub(ch)


async def _until_known(addr: str, signer: CallSigner, target_id: str, timeout: float = 30.0):
    """The target learns the member's card within its refresh interval."""
    ch, stub = _info_stub(addr, client_interceptors(signer, target_id))
    t_end = time.monotonic() + timeout
    try:
        while True:
            try:
                return await stub.Info(node_pb2.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() > t_end:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await ch.close()


async def test_rejections_have_the_right_status_and_are_counted(swarm):
    sw, target, member = swarm
    addr = f"127.0.0.1:{target.grpc_port}"
    signer = CallSigner(load_key_file(member.identity), RUN)
    info = await _until_known(addr, signer, target.peer_id)
    assert info.peer_id == target.peer_id and info.run_id == RUN  # a member's signed call is answered

    before = {r: _rejected(target, r) for r in ("missing", "signature", "replay", "skew", "unknown_peer")}
    req = node_pb2.InfoRequest()

    async def call(md=None, interceptors=None):
        ch, stub = _info_stub(addr, interceptors)
        try:
            await stub.Info(req, metadata=md, timeout=5)
            return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        finally:
            await ch.close()

    # unsigned: a plain client, as an attacker would use
    code, details = await call()
    assert code == grpc.StatusCode.UNAUTHENTICATED and "missing" in details
    # wrongly signed: the member's key, but signed for another node
    code, details = await call(signer.sign_request(INFO, peer_id_str(generate_key()), req))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bad signature" in details
    # replayed: a captured, valid envelope sent again
    captured = signer.sign_request(INFO, target.peer_id, req)
    assert (await call(captured))[0] == grpc.StatusCode.OK
    code, details = await call(captured)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "replayed" in details
    # clock-skewed: 5 minutes in the past
    skewed = CallSigner(load_key_file(member.identity), RUN, clock=lambda: time.time() - 300)
    code, details = await call(skewed.sign_request(INFO, target.peer_id, req))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "timestamp" in details
    # unknown peer: a fresh key with no node card in the run
    stranger = CallSigner(generate_key(), RUN)
    code, details = await call(interceptors=client_interceptors(stranger, target.peer_id))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "node card" in details

    after = {r: _rejected(target, r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {r: 1.0 for r in before}, (before, after)
    assert target.alive() and target.readyz()["ready"]


async def test_flooding_member_is_refused_then_banned(swarm):
    sw, target, member = swarm
    addr = f"127.0.0.1:{target.grpc_port}"
    signer = CallSigner(load_key_file(member.identity), RUN)
    await _until_known(addr, signer, target.peer_id)
    bans0 = target.metrics().get("swarmnode_peer_bans_total", 0.0)
    ch, stub = _info_stub(addr, client_interceptors(signer, target.peer_id))
    codes = []
    try:
        for _ in range(200):  # 10x the 20/s limit within about a second
            try:
                await stub.Info(node_pb2.InfoRequest(), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes[:50]
        assert codes[-1] == grpc.StatusCode.PERMISSION_DENIED, codes[-20:]  # banned by now
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Info(node_pb2.InfoRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED and "banned" in ei.value.details()
    finally:
        await ch.close()
    m = target.metrics()
    assert m.get("swarmnode_peer_bans_total", 0.0) == bans0 + 1
    assert m.get('swarmnode_rpc_rejected_total{reason="rate_requests"}', 0.0) >= 10
    # health stays answerable for everyone, and the node stays READY
    async with grpc.aio.insecure_channel(addr) as hc:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        r = await health_pb2_grpc.HealthStub(hc).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    assert target.readyz()["ready"]
