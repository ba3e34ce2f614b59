"""Peer authentication on gRPC: signed call envelopes, client and server side.

Owns the envelope format and its checks; the gRPC host puts :class:`AuthStep` in its call
pipeline (security/call_pipeline.py), between the ban screen and the limits.

Client: :class:`CallSigner` + :func:`client_interceptors` (grpc.aio; unary-unary,
unary-stream, stream-unary, stream-stream) add to every call

* ``x-swarmnode-peer``      base58 peer ID of the caller (``12D3KooW…``)
* ``x-swarmnode-ts``        unix milliseconds
* ``x-swarmnode-nonce-bin`` 16 random bytes
* ``x-swarmnode-token-bin`` the admission token (token mode only)
* ``x-swarmnode-sig-bin``   Ed25519 over :func:`signing_bytes` = ``b"swarmnode/call/v1\\0"`` +
  msgpack ``[run_id, full method, target peer ID, ts, nonce, sha256(request)]``

where ``request`` is the message serialized with ``deterministic=True`` (raw bytes for byte
handlers); for request streams, the first message (the stream header). The target peer ID is
signed, so a captured call cannot be replayed to another node.

Server: :class:`PeerAuthenticator` checks, cheapest first: metadata present and small ->
``|now - ts| <= window_s`` -> Ed25519 peer ID -> peer known (``is_known_peer``) -> admission
token (``check_token``, token mode) -> nonce unseen -> signature. The nonce is recorded only
after the signature verifies, so forged calls cannot fill an honest peer's nonce cache. Since
interceptors do not see the body, checking is a step of the call pipeline (:class:`AuthStep`),
which reads raw request bytes, verifies, then deserializes with the service's own
deserializer, and exposes the verified caller to the handler via :func:`verified_peer`.
Handlers of request streams must consume the request iterator (not ``context.read()``).

Every rejection is an :class:`AuthFailure` with a distinct ``reason`` (:data:`REASON_CODES` maps
it to the gRPC status), counted in ``PeerAuthenticator.rejections`` and passed to ``on_reject``.
Rejections before the signature verified do not prove who sent them: ``AuthFailure.authenticated``
is False there, and a ban list should key those by remote address, not by the claimed peer.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.channels import install_auth
from security.call_pipeline import Call, Step
from security.keys import RecordRejected, peer_id_str, public_key_of, verify

__all__ = [
    "HDR_PEER", "HDR_TS", "HDR_NONCE", "HDR_SIG", "HDR_TOKEN", "REASON_CODES", "AuthFailure", "Envelope",
    "signing_bytes", "body_digest", "CallSigner", "client_interceptors", "NonceCache",
    "PeerAuthenticator", "verified_peer", "current_peer", "AuthStep", "ClientAuth", "set_client_auth", "client_auth", "UnresolvedTarget",
]

HDR_PEER, HDR_TS = "x-swarmnode-peer", "x-swarmnode-ts"
HDR_NONCE, HDR_SIG, HDR_TOKEN = "x-swarmnode-nonce-bin", "x-swarmnode-sig-bin", "x-swarmnode-token-bin"
_DOMAIN = b"swarmnode/call/v1\x00"
NONCE_BYTES, SIG_BYTES = 16, 64
MAX_PEER_ID_CHARS, MAX_TS_CHARS, MAX_TOKEN_BYTES = 128, 20, 2048

_U, _P = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
REASON_CODES: dict[str, grpc.StatusCode] = {
    "missing": _U,            # unsigned call: a header is absent
    "malformed": _U,          # header duplicated, too large, wrong length or not a number
    "skew": _U,               # |now - ts| > window
    "not_ed25519": _U,        # peer ID is not an Ed25519 identity multihash
    "unknown_peer": _P,       # not a live member of the run (is_known_peer)
    "token": _P,              # token mode: admission token missing or invalid
    "replay": _U,             # nonce already seen from this peer
    "nonce_cache_full": grpc.StatusCode.RESOURCE_EXHAUSTED,  # peer sent more calls than the cache holds
    "signature": _U,          # signature does not verify (wrong key, other target/run/method/body)
    "body": grpc.StatusCode.INVALID_ARGUMENT,  # request bytes do not parse as the method's message
    "first_frame_timeout": grpc.StatusCode.DEADLINE_EXCEEDED,  # request stream sent no first message
}

_verified_peer: contextvars.ContextVar[str | None] = contextvars.ContextVar("swarmnode_verified_peer", default=None)


class AuthFailure(Exception):
    def __init__(self, reason: str, message: str, *, peer_id: str | None = None, authenticated: bool = False):
        super().__init__(message)
        self.reason, self.message, self.peer_id, self.authenticated = reason, message, peer_id, authenticated

    @property
    def code(self) -> grpc.StatusCode:
        return REASON_CODES[self.reason]


@dataclasses.dataclass(frozen=True)
class Envelope:
    """A call's envelope after the cheap checks; the signature is not verified yet."""

    method: str
    peer_id: str
    ts_ms: int
    nonce: bytes
    sig: bytes
    token: bytes | None


def signing_bytes(run_id: str, method: str, target_peer_id: str, ts_ms: int, nonce: bytes, digest: bytes) -> bytes:
    return _DOMAIN + msgpack.packb([run_id, method, target_peer_id, int(ts_ms), bytes(nonce), bytes(digest)],
                                   use_bin_type=True)


def _serialize(request: Any) -> bytes:
    if isinstance(request, (bytes, bytearray, memoryview)):
        return bytes(request)
    return request.SerializeToString(deterministic=True)


def body_digest(request: Any) -> bytes:
    """sha256 of a protobuf message (``deterministic=True``) or of raw bytes; ``None`` = empty stream."""
    return hashlib.sha256(b"" if request is None else _serialize(request)).digest()


def _method_str(method: str | bytes) -> str:
    return method.decode() if isinstance(method, (bytes, bytearray)) else method


# --- client ---

class CallSigner:
    """Makes the envelope metadata for calls from ``key`` in ``run_id`` (``token``: token mode)."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str, *, token: bytes | None = None,
                 clock: Callable[[], float] = time.time):
        self.key, self.run_id, self.token, self._clock = key, run_id, token, clock
        self.peer_id = peer_id_str(key)

    def metadata(self, method: str | bytes, target_peer_id: str, digest: bytes) -> list[tuple[str, str | bytes]]:
        ts_ms = int(self._clock() * 1000)
        nonce = os.urandom(NONCE_BYTES)
        sig = self.key.sign(signing_bytes(self.run_id, _method_str(method), target_peer_id, ts_ms, nonce, digest))
        md: list[tuple[str, str | bytes]] = [(HDR_PEER, self.peer_id), (HDR_TS, str(ts_ms)), (HDR_NONCE, nonce)]
        if self.token is not None:
            md.append((HDR_TOKEN, self.token))
        md.append((HDR_SIG, sig))
        return md

    def sign_request(self, method: str | bytes, target_peer_id: str, request: Any) -> list[tuple[str, str | bytes]]:
        return self.metadata(method, target_peer_id, body_digest(request))


class _SigningInterceptor:
    """Shared part of the four client interceptors (grpc.aio files an interceptor under the
    first call type it implements only, so each type needs its own class)."""

    def __init__(self, signer: CallSigner, target_peer_id: str | Callable[[], str]):
        if isinstance(target_peer_id, str):
            public_key_of(target_peer_id)  # RecordRejected for a bad target ID
        self.signer, self.target_peer_id = signer, target_peer_id

    def _target(self) -> str:
        t = self.target_peer_id
        return t if isinstance(t, str) else t()

    def _details(self, details: grpc.aio.ClientCallDetails, request: Any) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
        for k, v in self.signer.sign_request(details.method, self._target(), request):
            md.add(k, v)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials,
                                          details.wait_for_ready)

    async def _split(self, request_iterator):
        if request_iterator is None:
            raise ValueError("signed request streams need a request iterator (the first message is signed); "
                             "pass one to the stub instead of using call.write()")
        if hasattr(request_iterator, "__aiter__"):
            it = request_iterator.__aiter__()
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                return None, _empty_async()

            async def chained():
                yield first
                async for item in it:
                    yield item
            return first, chained()
        it = iter(request_iterator)
        first = next(it, _END)
        if first is _END:
            return None, iter(())

        def chained_sync():
            yield first
            yield from it
        return first, chained_sync()


class _UnaryUnary(_SigningInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details, request), request)


class _UnaryStream(_SigningInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details, request), request)


class _StreamUnary(_SigningInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        first, rest = await self._split(request_iterator)
        return await continuation(self._details(client_call_details, first), rest)


class _StreamStream(_SigningInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        first, rest = await self._split(request_iterator)
        return await continuation(self._details(client_call_details, first), rest)


def client_interceptors(signer: CallSigner, target_peer_id: str) -> list:
    """Interceptors that sign every call on a channel to ``target_peer_id``:
    ``grpc.aio.insecure_channel(addr, interceptors=client_interceptors(signer, target))``.
    Request-streaming calls must pass a request iterator (its first message is signed)."""
    return [cls(signer, target_peer_id) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class UnresolvedTarget(ConnectionError):
    """No live node card names the address a call goes to, so there is no peer ID to sign for."""


class ClientAuth:
    """How this process signs its outgoing calls: ``signer`` plus ``resolve(addr) -> peer ID or
    None`` (the node's cached view of the run's cards). Installed once per node process with
    :func:`set_client_auth`; ``protocol.streams.ChannelPool`` and ``node.state_sync.fetch_state``
    pick it up, so roles open signed channels without extra code."""

    def __init__(self, signer: CallSigner, resolve: Callable[[str], str | None]):
        self.signer, self.resolve = signer, resolve

    def target_of(self, addr: str, peer_id: str | None = None) -> str:
        if peer_id:
            return peer_id
        found = self.resolve(addr)
        if not found:
            raise UnresolvedTarget(f"no live node card has gRPC address {addr!r}, so the call cannot be signed "
                                   "for it; wait for the peer's card (or pass its peer ID)")
        return found

    def interceptors(self, addr: str, peer_id: str | None = None) -> list:
        """Signing interceptors for a channel to ``addr``; the target peer ID is ``peer_id`` or
        looked up at each call (so a channel made before the peer's card was seen still works)."""
        if peer_id:
            return client_interceptors(self.signer, peer_id)
        return client_interceptors(self.signer, lambda: self.target_of(addr))


_client_auth: ClientAuth | None = None


def set_client_auth(auth: ClientAuth | None) -> None:
    """Install (or with None remove) the process-wide :class:`ClientAuth` (the daemon does)."""
    global _client_auth
    _client_auth = auth


def client_auth() -> ClientAuth | None:
    return _client_auth


_END = object()


async def _empty_async():
    return
    yield  # pragma: no cover


# --- server ---

class NonceCache:
    """Nonces seen per peer, each kept ``keep_s`` (2x the clock window) after it was accepted.

    Full caches reject (``nonce_cache_full``) instead of evicting, since evicting a live nonce
    would reopen it for replay. ``per_peer`` bounds one peer, ``total`` bounds memory."""

    def __init__(self, keep_s: float = 120.0, *, per_peer: int = 16384, total: int = 262144,
                 clock: Callable[[], float] = time.time):
        self.keep_s, self.per_peer, self.total = keep_s, per_peer, total
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, collections.OrderedDict[bytes, float]] = {}
        self._size = 0

    def _prune_peer(self, peer: str, now: float) -> None:
        d = self._peers.get(peer)
        if d is None:
            return
        while d:
            nonce, expiry = next(iter(d.items()))
            if expiry > now:
                break
            d.popitem(last=False)
            self._size -= 1
        if not d:
            del self._peers[peer]

    def seen(self, peer: str, nonce: bytes) -> bool:
        with self._lock:
            self._prune_peer(peer, self._clock())
            d = self._peers.get(peer)
            return d is not None and nonce in d

    def add(self, peer: str, nonce: bytes) -> None:
        """Record ``nonce``; AuthFailure("replay") if already there, ("nonce_cache_full") if full."""
        now = self._clock()
        with self._lock:
            self._prune_peer(peer, now)
            d = self._peers.get(peer)
            if d is not None and nonce in d:
                raise AuthFailure("replay", "replayed call: this nonce was already used; sign every call afresh",
                                  peer_id=peer)
            if d is not None and len(d) >= self.per_peer:
                raise AuthFailure("nonce_cache_full", f"too many calls from this peer in {self.keep_s:.0f} s "
                                  f"(nonce cache holds {self.per_peer} per peer); slow down", peer_id=peer,
                                  authenticated=True)
            if self._size >= self.total:
                for p in list(self._peers):
                    self._prune_peer(p, now)
                if self._size >= self.total:
                    raise AuthFailure("nonce_cache_full", f"server nonce cache is full ({self.total}); retry shortly",
                                      peer_id=peer, authenticated=True)
            if d is None:
                d = self._peers[peer] = collections.OrderedDict()
            d[nonce] = now + self.keep_s
            self._size += 1

    def __len__(self) -> int:
        return self._size


class PeerAuthenticator:
    """Verifies envelopes for this node (``own_peer_id``) in ``run_id``.

    ``is_known_peer(peer_id) -> bool``: e.g. "has a live node card in the run" (None = anyone
    with a valid key). ``check_token(peer_id, token_bytes_or_None)``: raise (any exception, its
    message is sent back) to refuse; None = open mode. ``on_reject(failure, remote)``: called for
    every rejection (metrics, ban list); ``remote`` is ``context.peer()`` when known.
    ``await_known(peer_id) -> bool`` (optional, async): asked once before an unknown peer is
    refused, e.g. a bounded, coalesced re-read of the run's node cards, so a node that has just
    published its card (a joiner asking for state) is not turned away by a stale view."""

    def __init__(self, *, run_id: str, own_peer_id: str, window_s: float = 60.0,
                 is_known_peer: Callable[[str], bool] | None = None,
                 check_token: Callable[[str, bytes | None], Any] | None = None,
                 on_reject: Callable[[AuthFailure, str | None], None] | None = None,
                 nonce_cache: NonceCache | None = None, clock: Callable[[], float] = time.time,
                 await_known: Callable[[str], Awaitable[bool]] | None = None):
        self.run_id, self.own_peer_id, self.window_s = run_id, own_peer_id, window_s
        self.await_known = await_known
        self.is_known_peer, self.check_token, self.on_reject = is_known_peer, check_token, on_reject
        self._clock = clock
        self.nonces = nonce_cache if nonce_cache is not None else NonceCache(2 * window_s, clock=clock)
        self.rejections: collections.Counter[str] = collections.Counter()

    # the cheap part: no body needed
    def check_envelope(self, method: str | bytes, metadata: Iterable[tuple[str, Any]] | None) -> Envelope:
        method = _method_str(method)
        found: dict[str, Any] = {}
        for key, value in metadata or ():
            if key in (HDR_PEER, HDR_TS, HDR_NONCE, HDR_SIG, HDR_TOKEN):
                if key in found:
                    raise AuthFailure("malformed", f"header {key} appears more than once")
                found[key] = value
        missing = [h for h in (HDR_PEER, HDR_TS, HDR_NONCE, HDR_SIG) if h not in found]
        if missing:
            raise AuthFailure("missing", f"unsigned call to {method}: missing {', '.join(missing)}; the caller must "
                              "sign calls (security.peer_auth.client_interceptors)")
        peer, ts, nonce, sig, token = (found[HDR_PEER], found[HDR_TS], found[HDR_NONCE], found[HDR_SIG],
                                       found.get(HDR_TOKEN))
        if not isinstance(peer, str) or len(peer) > MAX_PEER_ID_CHARS:
            raise AuthFailure("malformed", f"{HDR_PEER} must be a base58 peer ID of at most {MAX_PEER_ID_CHARS} chars")
        if not isinstance(ts, str) or len(ts) > MAX_TS_CHARS or not ts.isdigit():
            raise AuthFailure("malformed", f"{HDR_TS} must be unix milliseconds (digits only)", peer_id=peer)
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise AuthFailure("malformed", f"{HDR_NONCE} must be {NONCE_BYTES} bytes", peer_id=peer)
        if not isinstance(sig, bytes) or len(sig) != SIG_BYTES:
            raise AuthFailure("malformed", f"{HDR_SIG} must be a {SIG_BYTES}-byte Ed25519 signature", peer_id=peer)
        if token is not None and (not isinstance(token, bytes) or len(token) > MAX_TOKEN_BYTES):
            raise AuthFailure("malformed", f"{HDR_TOKEN} must be at most {MAX_TOKEN_BYTES} bytes", peer_id=peer)
        ts_ms = int(ts)
        off_s = abs(self._clock() * 1000 - ts_ms) / 1000
        if off_s > self.window_s:
            raise AuthFailure("skew", f"timestamp {off_s:.0f} s off (limit {self.window_s:.0f} s); check the "
                              "sender's clock", peer_id=peer)
        try:
            public_key_of(peer)
        except RecordRejected as exc:
            raise AuthFailure("not_ed25519", f"{HDR_PEER}: {exc}", peer_id=peer) from None
        if self.is_known_peer is not None and not self.is_known_peer(peer):
            # "unknown_peer: " leads the text: callers read it as the refusal word (protocol/stream_errors.py
            # refusal_of) and ask again, as a member whose card the callee has not read yet should
            raise AuthFailure("unknown_peer", f"unknown_peer: peer ...{peer[-8:]} is not a live member of run "
                              f"{self.run_id!r}; "
                              "join the swarm (publish a node card) first", peer_id=peer)
        if self.check_token is not None:
            try:
                self.check_token(peer, token)
            except Exception as exc:  # noqa: BLE001 - any refusal from the token check
                raise AuthFailure("token", f"admission refused: {exc}", peer_id=peer) from None
        if self.nonces.seen(peer, nonce):
            raise AuthFailure("replay", "replayed call: this nonce was already used; sign every call afresh",
                              peer_id=peer)
        return Envelope(method, peer, ts_ms, nonce, sig, token)

    async def check_envelope_async(self, method: str | bytes, metadata) -> Envelope:
        """:meth:`check_envelope`, giving ``await_known`` one chance for a peer not yet known."""
        try:
            return self.check_envelope(method, metadata)
        except AuthFailure as failure:
            if failure.reason != "unknown_peer" or self.await_known is None or not failure.peer_id:
                raise
            if not await self.await_known(failure.peer_id):
                raise
        return self.check_envelope(method, metadata)

    # the expensive part: signature over the body digest, then the nonce is spent
    def finish(self, env: Envelope, digests: Iterable[bytes]) -> str:
        """Verify ``env.sig`` against the first matching digest; record the nonce; return the peer."""
        for digest in digests:
            msg = signing_bytes(self.run_id, env.method, self.own_peer_id, env.ts_ms, env.nonce, digest)
            if verify(env.peer_id, msg, env.sig):
                self.nonces.add(env.peer_id, env.nonce)
                return env.peer_id
        raise AuthFailure("signature", f"bad signature from ...{env.peer_id[-8:]} on {env.method}: signed for "
                          "another node, run, method or body, or by another key", peer_id=env.peer_id)

    def verify_call(self, method: str | bytes, metadata, request: Any) -> str:
        """Both steps for a parsed request (tests, non-gRPC uses). Returns the verified peer ID."""
        return self.finish(self.check_envelope(method, metadata), [body_digest(request)])

    def reject(self, failure: AuthFailure, remote: str | None) -> None:
        self.rejections[failure.reason] += 1
        if self.on_reject is not None:
            self.on_reject(failure, remote)


def verified_peer(context: Any = None) -> str:
    """The caller's verified peer ID inside a handler behind an :class:`AuthStep`."""
    peer = _verified_peer.get()
    if peer is None:
        raise RuntimeError("no verified peer: this handler is not wrapped by security.peer_auth")
    return peer


def current_peer() -> str | None:
    """The verified caller inside a wrapped handler, or None where calls are not authenticated
    (``security.peer_auth = "none"``, tests with bare servers)."""
    return _verified_peer.get()


install_auth(client_auth, current_peer)  # protocol's channels sign calls and its streams check callers through these


def _digests(raw: bytes | None, deserializer, parsed) -> Iterable[bytes]:
    """Fast path: sha256 of the bytes as received; fallback: the deterministic re-serialization
    (differs only for messages with maps, or non-canonical senders)."""
    raw_digest = hashlib.sha256(raw or b"").digest()
    yield raw_digest
    if parsed is not None and deserializer is not None:
        d = body_digest(parsed)
        if d != raw_digest:
            yield d


class AuthStep(Step):
    """The signed envelope as a step of the call pipeline (security/call_pipeline.py): the
    handler behind it gets parsed requests from a verified caller (:func:`verified_peer`), or
    the call is refused with the failure's status. The step parses requests itself (it needs
    the raw bytes to check the signature), so a request that is not the method's message is an
    ``AuthFailure("body")``. A request stream must send its first (signed) message within
    ``first_frame_timeout_s`` (None: wait as long as the call lasts)."""

    parses = True

    def __init__(self, auth: PeerAuthenticator, *, first_frame_timeout_s: float | None = 10.0):
        self.auth, self.first_frame_timeout_s = auth, first_frame_timeout_s

    async def enter(self, call: Call) -> None:
        try:
            if call.request_streaming:
                call.request = await self._authenticate_stream(call)
            else:
                call.request = await self._authenticate_unary(call)
        except AuthFailure as failure:
            await self._fail(call.context, failure)

    async def _fail(self, context, failure: AuthFailure) -> None:
        self.auth.reject(failure, _remote(context))
        await context.abort(failure.code, failure.message)

    @staticmethod
    def _parse(call: Call, raw: bytes, peer: str | None):
        if call.deserializer is None:
            return raw
        try:
            return call.deserializer(raw)
        except Exception:  # noqa: BLE001 - DecodeError and friends
            raise AuthFailure("body", f"request to {call.method} is not a valid message", peer_id=peer,
                              authenticated=_verified_peer.get() is not None) from None

    async def _authenticate_unary(self, call: Call):
        env = await self.auth.check_envelope_async(call.method, call.context.invocation_metadata())
        req = self._parse(call, call.request, env.peer_id)
        _verified_peer.set(self.auth.finish(env, _digests(call.request, call.deserializer, req)))
        return req

    async def _authenticate_stream(self, call: Call):
        env = await self.auth.check_envelope_async(call.method, call.context.invocation_metadata())
        it, timeout_s = call.request.__aiter__(), self.first_frame_timeout_s
        try:
            first_raw = await (it.__anext__() if timeout_s is None else asyncio.wait_for(it.__anext__(), timeout_s))
        except StopAsyncIteration:
            first_raw = None
        except asyncio.TimeoutError:
            raise AuthFailure("first_frame_timeout", f"request stream to {call.method} sent no first message "
                              f"within {timeout_s:g} s", peer_id=env.peer_id) from None
        first = None if first_raw is None else self._parse(call, first_raw, env.peer_id)
        peer = self.auth.finish(env, _digests(first_raw, call.deserializer, first))
        _verified_peer.set(peer)

        async def requests():
            if first_raw is None:
                return
            yield first
            async for raw in it:
                try:
                    yield self._parse(call, raw, peer)
                except AuthFailure as failure:
                    await self._fail(call.context, failure)
        return requests()


def _remote(context) -> str | None:
    try:
        return context.peer()
    except Exception:  # noqa: BLE001
        return None
