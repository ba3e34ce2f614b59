"""security.peer_auth: envelope signing and the server-side checks, with an injected clock."""

from __future__ import annotations

import grpc
import pytest

from protocol import node_pb2
from security.keys import generate_key, peer_id_str
from security.peer_auth import (HDR_NONCE, HDR_PEER, HDR_SIG, HDR_TOKEN, HDR_TS, REASON_CODES, AuthFailure,
                                CallSigner, NonceCache, PeerAuthenticator, body_digest)

RUN, METHOD = "run-a", "/swarmnode.Node/Info"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env():
    clock = Clock()
    caller, server = generate_key(), generate_key()
    signer = CallSigner(caller, RUN, clock=clock)
    auth = PeerAuthenticator(run_id=RUN, own_peer_id=peer_id_str(server), clock=clock)
    return clock, signer, auth, peer_id_str(server)


def _fail(auth, md, request=node_pb2.InfoRequest(), method=METHOD) -> AuthFailure:
    with pytest.raises(AuthFailure) as ei:
        auth.verify_call(method, md, request)
    return ei.value


def test_signed_call_verifies_and_returns_caller(env):
    _, signer, auth, target = env
    req = node_pb2.NodeInfo(peer_id="x", run_id="y")
    md = signer.sign_request(METHOD, target, req)
    assert {k for k, _ in md} == {HDR_PEER, HDR_TS, HDR_NONCE, HDR_SIG}
    assert auth.verify_call(METHOD, md, req) == signer.peer_id
    assert len(auth.nonces) == 1


def test_unsigned_call_rejected(env):
    _, signer, auth, target = env
    f = _fail(auth, [("user-agent", "x")])
    assert f.reason == "missing" and f.code == grpc.StatusCode.UNAUTHENTICATED and HDR_SIG in str(f)
    md = [kv for kv in signer.sign_request(METHOD, target, node_pb2.InfoRequest()) if kv[0] != HDR_SIG]
    assert _fail(auth, md).reason == "missing"


def test_malformed_headers_rejected(env):
    _, signer, auth, target = env
    md = signer.sign_request(METHOD, target, node_pb2.InfoRequest())
    for key, bad in [(HDR_NONCE, b"short"), (HDR_SIG, b"x" * 63), (HDR_TS, "12a"), (HDR_PEER, "1" * 500),
                     (HDR_TOKEN, b"t" * 5000)]:
        mutated = [(k, v) for k, v in md if k != key] + [(key, bad)]
        f = _fail(auth, mutated)
        assert f.reason == "malformed" and f.code == grpc.StatusCode.UNAUTHENTICATED, key
    assert _fail(auth, md + [(HDR_NONCE, b"n" * 16)]).reason == "malformed"  # duplicated header


@pytest.mark.parametrize("mutate", ["body", "method", "target", "run", "key", "ts"])
def test_wrongly_signed_rejected(env, mutate):
    clock, signer, auth, target = env
    req = node_pb2.NodeInfo(peer_id="a")
    method = METHOD
    if mutate == "target":
        target = peer_id_str(generate_key())
    if mutate == "run":
        signer = CallSigner(signer.key, "run-b", clock=clock)
    md = signer.sign_request(method, target, req)
    if mutate == "key":  # signed by another key but claiming the caller's ID
        other = CallSigner(generate_key(), RUN, clock=clock).sign_request(method, target, req)
        md = [(k, v) if k != HDR_SIG else (k, dict(other)[HDR_SIG]) for k, v in md]
    if mutate == "ts":
        md = [(k, v) if k != HDR_TS else (k, str(int(v) + 1)) for k, v in md]
    if mutate == "body":
        req = node_pb2.NodeInfo(peer_id="b")
    if mutate == "method":
        method = "/swarmnode.Node/PeerInfo"
    f = _fail(auth, md, req, method)
    assert f.reason == "signature" and f.code == grpc.StatusCode.UNAUTHENTICATED
    assert len(auth.nonces) == 0  # a forged call does not spend a nonce


def test_replay_rejected(env):
    _, signer, auth, target = env
    md = signer.sign_request(METHOD, target, node_pb2.InfoRequest())
    auth.verify_call(METHOD, md, node_pb2.InfoRequest())
    f = _fail(auth, md)
    assert f.reason == "replay" and f.code == grpc.StatusCode.UNAUTHENTICATED


def test_replay_after_window_is_skew_not_accepted(env):
    clock, signer, auth, target = env
    md = signer.sign_request(METHOD, target, node_pb2.InfoRequest())
    auth.verify_call(METHOD, md, node_pb2.InfoRequest())
    clock.t += 59.9
    assert _fail(auth, md).reason == "replay"
    clock.t += 0.2
    assert _fail(auth, md).reason == "skew"
    clock.t += 100  # nonce expired from the cache (2x window) and the ts is stale
    assert _fail(auth, md).reason == "skew" and len(auth.nonces) <= 1


@pytest.mark.parametrize("offset_s", [-74, 74])
def test_clock_skew_rejected(env, offset_s):
    clock, signer, auth, target = env
    skewed = CallSigner(signer.key, RUN, clock=lambda: clock.t + offset_s)
    f = _fail(auth, skewed.sign_request(METHOD, target, node_pb2.InfoRequest()))
    assert f.reason == "skew" and f.code == grpc.StatusCode.UNAUTHENTICATED
    assert "74 s off (limit 60 s)" in f.message


def test_skew_inside_window_accepted(env):
    clock, signer, auth, target = env
    skewed = CallSigner(signer.key, RUN, clock=lambda: clock.t - 59)
    assert auth.verify_call(METHOD, skewed.sign_request(METHOD, target, b"raw"), b"raw") == signer.peer_id


def test_unknown_peer_permission_denied(env):
    clock, signer, _, target = env
    auth = PeerAuthenticator(run_id=RUN, own_peer_id=target, clock=clock, is_known_peer=lambda p: False)
    f = _fail(auth, signer.sign_request(METHOD, target, node_pb2.InfoRequest()))
    assert f.reason == "unknown_peer" and f.code == grpc.StatusCode.PERMISSION_DENIED
    # the status text leads with the reason word: an exchange caller reads it as a refusal it asks
    # again after (the callee has not read the caller's new node card yet), not a failed partner
    from optimizers.exchange_common import RETRY
    from optimizers.exchange_link import peer_reason
    from protocol.stream_errors import StreamError, refusal_of
    err = StreamError("refused", f"PERMISSION_DENIED: {f.message}", f.code, refusal_of(f.message))
    assert peer_reason(err) == "unknown_peer" and peer_reason(err) in RETRY


def test_non_ed25519_peer_rejected(env):
    _, signer, auth, target = env
    md = [(k, v) if k != HDR_PEER else (k, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
          for k, v in signer.sign_request(METHOD, target, node_pb2.InfoRequest())]
    f = _fail(auth, md)
    assert f.reason == "not_ed25519" and f.code == grpc.StatusCode.UNAUTHENTICATED


def test_token_check_and_reject_callback(env):
    clock, _, _, target = env
    seen = []

    def check_token(peer, token):
        if token != b"good":
            raise ValueError("no token")

    auth = PeerAuthenticator(run_id=RUN, own_peer_id=target, clock=clock, check_token=check_token,
                             on_reject=lambda f, remote: seen.append((f.reason, f.authenticated)))
    key = generate_key()
    bad = CallSigner(key, RUN, clock=clock)
    with pytest.raises(AuthFailure) as ei:
        auth.verify_call(METHOD, bad.sign_request(METHOD, target, b""), b"")
    assert ei.value.reason == "token" and ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    auth.reject(ei.value, "ipv4:127.0.0.1:1")
    assert seen == [("token", False)] and auth.rejections["token"] == 1
    good = CallSigner(key, RUN, clock=clock, token=b"good")
    assert auth.verify_call(METHOD, good.sign_request(METHOD, target, b""), b"") == peer_id_str(key)


def test_nonce_cache_bounded_and_expires():
    clock = Clock()
    cache = NonceCache(120.0, per_peer=3, total=5, clock=clock)
    for i in range(3):
        cache.add("p", bytes([i]) * 16)
    with pytest.raises(AuthFailure) as ei:
        cache.add("p", b"x" * 16)
    assert ei.value.reason == "nonce_cache_full"
    cache.add("q", b"a" * 16)
    cache.add("q", b"b" * 16)
    with pytest.raises(AuthFailure):
        cache.add("r", b"c" * 16)  # total cap
    with pytest.raises(AuthFailure) as ei:
        cache.add("q", b"a" * 16)
    assert ei.value.reason == "replay"
    clock.t += 120.1
    cache.add("r", b"c" * 16)  # everything expired and pruned
    assert len(cache) == 1 and not cache.seen("p", bytes([0]) * 16)


def test_body_digest_is_deterministic_serialization():
    msg = node_pb2.PeerInfoReply(peer_id="a", maddrs=["x", "y"])
    assert body_digest(msg) == body_digest(msg.SerializeToString(deterministic=True))
    assert body_digest(None) == body_digest(b"")
    assert set(REASON_CODES) >= {"missing", "skew", "replay", "signature", "unknown_peer"}


def test_token_mode_with_admission_tokens(env):
    from security.admission import issue_token, token_check

    clock, _, _, target = env
    coord, key = generate_key(), generate_key()
    auth = PeerAuthenticator(run_id=RUN, own_peer_id=target, clock=clock,
                             check_token=token_check(coordinator_peer_id=peer_id_str(coord), run_id=RUN, clock=clock))
    token = issue_token(coord, run_id=RUN, peer_id=peer_id_str(key), expires_at=clock.t + 600, now=clock.t)
    ok = CallSigner(key, RUN, clock=clock, token=token)
    assert auth.verify_call(METHOD, ok.sign_request(METHOD, target, b""), b"") == peer_id_str(key)
    for signer in (CallSigner(key, RUN, clock=clock),  # no token
                   CallSigner(generate_key(), RUN, clock=clock, token=token)):  # someone else's token
        f = _fail(auth, signer.sign_request(METHOD, target, b""), b"")
        assert f.reason == "token" and f.code == grpc.StatusCode.PERMISSION_DENIED
    clock.t += 601
    f = _fail(auth, CallSigner(key, RUN, clock=clock, token=token).sign_request(METHOD, target, b""), b"")
    assert f.reason == "token" and "expired" in f.message


def test_token_mode_admits_the_coordinators_own_signed_calls(env):
    """The coordinator holds no token (it signs them): its own calls, e.g. the stage audits' state
    downloads, pass on its signature; a forger claiming its peer ID still fails the signature."""
    from security.admission import token_check

    clock, _, _, target = env
    coord = generate_key()
    auth = PeerAuthenticator(run_id=RUN, own_peer_id=target, clock=clock,
                             check_token=token_check(coordinator_peer_id=peer_id_str(coord), run_id=RUN, clock=clock))
    signer = CallSigner(coord, RUN, clock=clock)
    assert auth.verify_call(METHOD, signer.sign_request(METHOD, target, b""), b"") == peer_id_str(coord)
    forged = [(k, peer_id_str(coord)) if k == HDR_PEER else (k, v)
              for k, v in CallSigner(generate_key(), RUN, clock=clock).sign_request(METHOD, target, b"")]
    assert _fail(auth, forged, b"").reason == "signature"
