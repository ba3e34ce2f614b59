"""The node's gRPC aio server: options, standard health service, ``Node`` service, metrics.

Owns creating and binding the server with explicit symmetric message limits
(``protocol/grpc_options.py``), the health servicer that follows the lifecycle (SERVING only
in READY; NOT_SERVING for good once draining), the ``Node`` info service, and an interceptor
that counts every handled call in ``swarmnode_grpc_server_handled_total``. Role services are
added by the daemon from ``Role.services()`` before the server starts.

Every service added with :meth:`GrpcHost.add` (the ``Node`` service and every role's) is
guarded by :class:`CallGuard`, so a new service gets authentication and limits without code of
its own (security.md §5, §6): per call, cheapest first, a ban check on the remote IP and the
claimed peer ID -> a cap on request streams still waiting for their first (signed) message ->
the signed envelope and body (``security.peer_auth``; ``security.peer_auth = "signed"``) -> the
verified caller's request rate, per-service concurrency slot, request bytes and message count
(``security.limits``) -> the handler, under ``limits.max_call_s``. Every refusal is counted in
``swarmnode_rpc_rejected_total{reason}``; a key with ``limits.ban_threshold`` refusals in
``limits.ban_window_s`` is banned for ``limits.ban_s`` (``swarmnode_peer_bans_total``). Bans key
on the verified peer, or on the remote IP when the caller did not authenticate (loopback IPs
are counted but never banned: every local process shares them). Exempt: the standard health
service only. ``Node.Info`` / ``Node.PeerInfo`` are authenticated like every role service:
they give away the run ID and addresses, which only members need (operators use the ops
port's ``/peerinfo``).

:class:`KnownPeers` is the node's cached view of the run's live node cards, refreshed by the
daemon: who may call (``is_known_peer``; in token mode only peers whose card passed the
admission check ever get there) and which peer ID an address belongs to (the target of signed
outgoing calls).
"""

from __future__ import annotations

import asyncio
import ipaddress
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AioHealthServicer
from prometheus_client import Counter, Gauge

from node.lifecycle import State
from node.metrics import GRPC_HANDLED, GRPC_HANDLING_SECONDS, REGISTRY, RPC_REJECTED
from protocol import node_pb2, node_pb2_grpc
from protocol.grpc_options import server_options
from security.config import LimitsConfig
from security.limits import BanList, ConcurrencyLimiter, LimitExceeded, PeerRateLimiter
from security.peer_auth import HDR_PEER, AuthFailure, PeerAuthenticator, current_peer, wrap_method_handler

log = logging.getLogger("swarmnode.grpc")

PEER_BANS = Counter("swarmnode_peer_bans_total", "Peers (or remote IPs) banned by this node for repeated "
                    "rejected calls.", registry=REGISTRY)
PEERS_BANNED = Gauge("swarmnode_peers_banned", "Peers or IPs banned right now.", registry=REGISTRY)
HEALTH_SERVICE = "/grpc.health.v1.Health/"
MAX_BANNED_IDS = 8  # banned keys named on the node card (all of them count in ``banned``)


class GrpcPortInUse(Exception):
    exit_code = 2


def _split(method: str) -> tuple[str, str]:
    parts = method.rsplit("/", 2)
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("unknown", method)


def _code_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    code = None
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc: no code() on aio contexts
        pass
    if code is None or code == grpc.StatusCode.OK:
        if exc is None:
            return "OK"
        return "CANCELLED" if type(exc).__name__ == "CancelledError" else "UNKNOWN"
    return code.name if hasattr(code, "name") else str(code)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts handled calls by (service, method, code) and their duration."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)

        def record(context, exc, t0):
            GRPC_HANDLED.labels(service=service, method=method, code=_code_of(context, exc)).inc()
            GRPC_HANDLING_SECONDS.labels(service=service, method=method).observe(time.perf_counter() - t0)

        if handler.unary_unary or handler.stream_unary:
            inner = handler.unary_unary or handler.stream_unary

            async def wrapped(request, context):
                t0, exc = time.perf_counter(), None
                try:
                    return await inner(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, exc, t0)

            factory = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        else:
            inner = handler.unary_stream or handler.stream_stream

            async def wrapped(request, context):  # a streaming response
                t0, exc = time.perf_counter(), None
                try:
                    async for item in inner(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, exc, t0)

            if not inspect.isasyncgenfunction(inner):  # writes with context.write (health Watch)
                async def wrapped(request, context):  # noqa: F811
                    t0, exc = time.perf_counter(), None
                    try:
                        return await inner(request, context)
                    except BaseException as e:
                        exc = e
                        raise
                    finally:
                        record(context, exc, t0)

            factory = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return factory(wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


class NodeServicer(node_pb2_grpc.NodeServicer):
    def __init__(self, info: Callable[[], node_pb2.NodeInfo], peerinfo: Callable[[], dict]):
        self._info, self._peerinfo = info, peerinfo

    async def Info(self, request, context):  # noqa: N802 - gRPC API
        return self._info()

    async def PeerInfo(self, request, context):  # noqa: N802 - gRPC API
        p = self._peerinfo()
        return node_pb2.PeerInfoReply(peer_id=p["peer_id"], maddrs=p["maddrs"], grpc_addr=p["grpc_addr"])


def _remote_ip(context) -> str | None:
    """``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` -> the IP; None when unknown."""
    try:
        peer = context.peer()
    except Exception:  # noqa: BLE001
        return None
    return _ip_of(peer)


def _ip_of(peer: str | None) -> str | None:
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest[1:rest.find("]")] if rest.startswith("[") else rest.rsplit(":", 1)[0]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


def _is_loopback(ip: str | None) -> bool:
    try:
        return ip is None or ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip.startswith("unix")


def _bannable(key: Any) -> bool:
    """A verified peer ID or a non-loopback IP may be banned; a loopback IP never is."""
    if not isinstance(key, str):
        return False
    try:
        return not ipaddress.ip_address(key).is_loopback
    except ValueError:
        return True


class KnownPeers:
    """The run's live node cards as this node last read them (``read() -> list[CardView]``,
    refreshed every ``refresh_s`` by :meth:`run`, and soon after a miss). Cards in state
    ``offline`` do not count."""

    def __init__(self, read: Callable[[], Awaitable[list]] | None = None, refresh_s: float = 5.0,
                 own_peer_id: str | None = None, own_addr: str | None = None):
        self._read, self.refresh_s = read, refresh_s
        self._peers: dict[str, Any] = {}
        self._addrs: dict[str, str] = {}
        self._own = (own_peer_id, own_addr)
        if own_peer_id and own_addr:
            self._addrs[own_addr] = own_peer_id
        self._miss = asyncio.Event()
        self._lock = asyncio.Lock()
        self._waiters = 0
        self.max_waiters = 8
        self.last_refresh = 0.0

    def update(self, views: Iterable[Any]) -> None:
        peers, addrs = {}, {}
        for v in views:
            if v.card.state == "offline":
                continue
            peers[v.peer_id] = v
            addrs.setdefault(v.card.grpc_addr, v.peer_id)  # read_cards' order: bootstrap first, then by ID
        own_id, own_addr = self._own
        if own_id and own_addr:
            addrs[own_addr] = own_id
        self._peers, self._addrs = peers, addrs
        self.last_refresh = time.monotonic()

    def add(self, peer_id: str, addr: str | None = None) -> None:
        """Tests and benchmarks: admit ``peer_id`` by hand."""
        self._peers[peer_id] = None
        if addr:
            self._addrs[addr] = peer_id

    def is_known(self, peer_id: str) -> bool:
        if peer_id in self._peers:
            return True
        self._miss.set()  # a new peer: refresh soon rather than in refresh_s
        return False

    async def wait_known(self, peer_id: str, timeout: float = 2.0, min_interval_s: float = 0.5) -> bool:
        """Is ``peer_id`` a live member, re-reading the cards now if the view is older than
        ``min_interval_s``? Re-reads are serialised and spaced, so unknown callers (strangers
        included) cost at most one DHT read per ``min_interval_s``; waits at most ``timeout``.
        At most ``max_waiters`` calls wait at once; beyond that an unknown caller is refused at
        once, so a flood of strangers cannot hold the server's call slots while they wait."""
        if peer_id in self._peers:
            return True
        if self._waiters >= self.max_waiters:
            return False
        self._waiters += 1
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:
                    if peer_id not in self._peers and time.monotonic() - self.last_refresh >= min_interval_s:
                        await self.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a slow or failing DHT read: refuse, as before
            log.debug("known peers re-read for %s failed: %r", peer_id[-8:], exc)
        finally:
            self._waiters -= 1
        return peer_id in self._peers

    def resolve(self, addr: str) -> str | None:
        found = self._addrs.get(addr)
        if found is None:
            self._miss.set()
        return found

    def __len__(self) -> int:
        return len(self._peers)

    async def refresh(self) -> None:
        if self._read is not None:
            self.update(await self._read())

    async def run(self) -> None:
        """Refresh loop (supervised by the daemon); errors keep the last view."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - DHT hiccups: keep the last good view
                log.debug("known peers refresh failed: %r", exc)
            await asyncio.sleep(min(1.0, self.refresh_s))  # misses refresh at most about once a second
            self._miss.clear()
            try:
                await asyncio.wait_for(self._miss.wait(), max(0.0, self.refresh_s - 1.0))
            except asyncio.TimeoutError:
                pass


class CallGuard:
    """Authentication, limits and bans in front of every guarded method (see the module doc).

    ``auth``: the authenticator (None = ``peer_auth = "none"``: limits key on the remote IP);
    ``open_auth``: the authenticator for methods in ``public`` (signed, any key, no card or token
    needed: ``security.public_state``); ``on_ban(key, reason)`` e.g. updates the node card."""

    def __init__(self, limits: LimitsConfig, auth: PeerAuthenticator | None = None, *,
                 open_auth: PeerAuthenticator | None = None, public: Iterable[str] = (),
                 on_ban: Callable[[Any, str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits, self.auth, self.open_auth = limits, auth, open_auth
        self.public = frozenset(public)
        self._on_ban_cb = on_ban
        self.bans = BanList(threshold=limits.ban_threshold, window_s=limits.ban_window_s, ban_s=limits.ban_s,
                            clock=clock, on_ban=self._on_ban)
        self.rates = PeerRateLimiter(requests_per_s=limits.peer_rps, bytes_per_s=limits.peer_bytes_per_s, clock=clock)
        self._slots: dict[str, ConcurrencyLimiter] = {}
        # request streams not yet past their first (signed) message, per claimed peer / IP
        self.pending = ConcurrencyLimiter("first-frame wait", per_peer=max(1, limits.peer_concurrency // 2),
                                          total=max(2, limits.service_concurrency // 2))
        self.rejected: dict[str, int] = {}
        PEERS_BANNED.set_function(lambda: len(self.bans.banned()))
        for a in (auth, open_auth):
            if a is not None:
                a.on_reject = self._auth_rejected

    # ---- counting and banning ----
    def _on_ban(self, key, reason: str) -> None:
        PEER_BANS.inc()
        log.warning("banned %s for %.0f s after repeated rejected calls (last: %s)", key, self.limits.ban_s, reason,
                    extra={"event": "peer_banned", "key": str(key), "reason": reason})
        if self._on_ban_cb is not None:
            try:
                self._on_ban_cb(key, reason)
            except Exception:  # noqa: BLE001 - a card update must not break the call path
                log.exception("on_ban callback failed")

    def count(self, reason: str, key: Any = None, *, ban: bool = True) -> None:
        RPC_REJECTED.labels(reason=reason).inc()
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if ban and key is not None and reason != "banned":
            self.bans.record_rejection(key, reason)

    def _auth_rejected(self, failure: AuthFailure, remote: str | None) -> None:
        if failure.authenticated and failure.peer_id:
            self.count(failure.reason, failure.peer_id)
        else:
            ip = _ip_of(remote)
            self.count(failure.reason, ip, ban=not _is_loopback(ip))

    def banned(self) -> dict[str, float]:
        """Banned keys (peer IDs, IPs) -> seconds left."""
        return {str(k): round(v, 1) for k, v in self.bans.banned().items()}

    def ban_details(self) -> dict[str, Any]:
        """Node-card details that show this node's bans in ``swarmnode status``: ``banned`` (how
        many) and ``banned_ids`` (the last 8 characters of up to 8 banned peer IDs or IPs)."""
        keys = sorted(self.banned())
        return {"banned": len(keys), "banned_ids": ",".join(k[-8:] for k in keys[:MAX_BANNED_IDS])}

    async def publish_bans(self, update: Callable[..., None], period_s: float = 5.0) -> None:
        """Keep the card's ban details current (new bans and expired ones); supervised by the daemon."""
        last: dict[str, Any] = {}
        while True:
            details = self.ban_details()
            if details != last:
                update(publish=True, **details)
                last = details
            await asyncio.sleep(period_s)

    # ---- wrapping ----
    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if method.startswith(HEALTH_SERVICE):
            return handler
        inner = self._limited(handler, method)
        auth = self.open_auth if method in self.public and self.open_auth is not None else self.auth
        if auth is not None:
            inner = wrap_method_handler(inner, method, auth, first_frame_timeout_s=self.limits.first_frame_timeout_s)
        return self._screened(inner, method)

    def _slots_of(self, method: str) -> ConcurrencyLimiter:
        service = method.rsplit("/", 2)[-2] if method.count("/") >= 2 else method
        lim = self._slots.get(service)
        if lim is None:
            lim = self._slots[service] = ConcurrencyLimiter(service, per_peer=self.limits.peer_concurrency,
                                                            total=self.limits.service_concurrency)
        return lim

    async def _refuse(self, context, exc: LimitExceeded, key) -> None:
        self.count(exc.reason, key, ban=_bannable(key))
        await context.abort(exc.grpc_code, str(exc))

    def _screened(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """Outermost: refuse banned IPs / claimed peers at once; cap the request streams of each
        (claimed known peer, remote IP) still awaiting their first, signed, frame. Streams that
        claim no known peer hold no such slot: the envelope check refuses them before any wait
        (or admits a peer whose card just appeared), so strangers cannot take members' slots,
        and an impostor claiming a member's ID only takes the slots of its own IP."""
        guard = self

        def screen(context) -> Any:
            ip = _remote_ip(context)
            claimed = next((v for k, v in (context.invocation_metadata() or ()) if k == HDR_PEER), None)
            for key in (claimed, ip):
                if key is not None:
                    guard.bans.check(key)
            known = guard.auth is not None and guard.auth.is_known_peer is not None and \
                isinstance(claimed, str) and len(claimed) <= 128 and guard.auth.is_known_peer(claimed)
            return (claimed, ip) if known else None

        return _rewrap(handler, lambda behavior, streaming_request: _screen_behavior(
            guard, behavior, screen, streaming_request and guard.auth is not None))

    def _limited(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """Innermost: rate, concurrency, bytes, message count and the call time cap, per verified peer."""
        guard, slots = self, self._slots_of(method)
        return _rewrap(handler, lambda behavior, streaming_request: _limit_behavior(
            guard, behavior, slots, streaming_request))


def _rewrap(handler: grpc.RpcMethodHandler, make) -> grpc.RpcMethodHandler:
    """``handler`` with its one behaviour replaced by ``make(behavior, request_streaming)``,
    keeping the (de)serializers and the coroutine / async-generator kind."""
    for name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, name)
        if behavior is not None:
            return handler._replace(**{name: make(behavior, handler.request_streaming)})
    return handler


def _key_of(context) -> str:
    return current_peer() or _remote_ip(context) or "unknown"


def _wire_size(msg: Any) -> int:
    """Bytes a parsed request message took on the wire: raw bytes, a protobuf message, or a
    zero-copy chunk view (``protocol.codec.ChunkView``: its payload)."""
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return len(msg)
    byte_size = getattr(msg, "ByteSize", None)
    if byte_size is not None:
        return byte_size()
    data = getattr(msg, "data", None)
    return len(data) if data is not None else 0


def _is_gen(behavior) -> bool:
    return inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior)


def _screen_behavior(guard: CallGuard, behavior, screen, hold_pending: bool):
    """Ban check first; request streams hold a ``pending`` slot until their first message."""
    async def enter(request, context):
        try:
            key = screen(context)
            if hold_pending and key is not None:
                guard.pending.acquire(key)
        except LimitExceeded as exc:
            await guard._refuse(context, exc, _remote_ip(context))
        if not hold_pending or key is None:
            return request, None
        return _ReleaseAfterFirst(request, lambda: guard.pending.release(key)), key

    if _is_gen(behavior):
        async def gen(request, context):
            req, key = await enter(request, context)
            try:
                async for item in behavior(req, context):
                    yield item
            finally:
                if key is not None:
                    req.release()
        return gen

    async def coro(request, context):
        req, key = await enter(request, context)
        try:
            result = behavior(req, context)
            return await result if inspect.isawaitable(result) else result
        finally:
            if key is not None:
                req.release()
    return coro


class _ReleaseAfterFirst:
    """Wraps a request iterator; calls ``release`` once: at its first item, its end, or ``release()``."""

    def __init__(self, inner, release):
        self._it, self._release, self.released = inner.__aiter__(), release, False

    def __aiter__(self):
        return self

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release()

    async def __anext__(self):
        try:
            return await self._it.__anext__()
        finally:
            self.release()


def _limit_behavior(guard: CallGuard, behavior, slots: ConcurrencyLimiter, streaming_request: bool):
    lim = guard.limits

    async def enter(context):
        key = _key_of(context)
        try:
            guard.bans.check(key)
            guard.rates.check_request(key)
            slots.acquire(key)
        except LimitExceeded as exc:
            await guard._refuse(context, exc, key)
        return key

    def counted(request, key, context):
        if not streaming_request:
            return request

        async def it():
            n = 0
            async for msg in request:
                n += 1
                if n > lim.max_request_messages:
                    await guard._refuse(context, LimitExceeded(
                        f"request stream sent more than {lim.max_request_messages} messages "
                        "(limits.max_request_messages)", "stream_messages"), key)
                size = _wire_size(msg)
                try:
                    guard.rates.check_bytes(key, size)
                except LimitExceeded as exc:
                    await guard._refuse(context, exc, key)
                yield msg
        return it()

    if _is_gen(behavior):
        async def gen(request, context):
            key = await enter(context)
            try:
                async with asyncio.timeout(lim.max_call_s):
                    async for item in behavior(counted(request, key, context), context):
                        yield item
            except TimeoutError:
                guard.count("call_time", None, ban=False)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"call ran past limits.max_call_s={lim.max_call_s:g} s")
            finally:
                slots.release(key)
        return gen

    async def coro(request, context):
        key = await enter(context)
        try:
            async with asyncio.timeout(lim.max_call_s):
                result = behavior(counted(request, key, context), context)
                return await result if inspect.isawaitable(result) else result
        except TimeoutError:
            guard.count("call_time", None, ban=False)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"call ran past limits.max_call_s={lim.max_call_s:g} s")
        finally:
            slots.release(key)
    return coro


class _GuardedServer:
    """What a generated ``add_*Servicer_to_server`` sees: registers through the guard."""

    def __init__(self, server, guard: CallGuard):
        self._server, self._guard = server, guard

    def add_generic_rpc_handlers(self, handlers):
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h, self._guard) for h in handlers))

    def add_registered_method_handlers(self, service_name, method_handlers):
        self._server.add_registered_method_handlers(service_name, {
            name: self._guard.wrap(h, f"/{service_name}/{name}") for name, h in method_handlers.items()})


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, guard: CallGuard):
        self.inner, self.guard = inner, guard
        self._cache: dict[str, tuple[Any, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        handler = self.inner.service(handler_call_details)
        if handler is None:
            return None
        hit = self._cache.get(method)
        if hit is None or hit[0] is not handler:
            hit = self._cache[method] = (handler, self.guard.wrap(handler, method))
        return hit[1]


def _parse_guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` (unary request) parsing its own request: bytes that are not the method's
    message get INVALID_ARGUMENT (counted as "body") instead of gRPC's UNKNOWN "Unexpected
    DecodeError". For the services outside the guard (health), whose parsing nobody else does."""
    deser = handler.request_deserializer
    if deser is None or handler.request_streaming:
        return handler

    async def parse(raw: bytes, context):
        try:
            return deser(raw)
        except Exception:  # noqa: BLE001 - DecodeError and friends
            RPC_REJECTED.labels(reason="body").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request to {method} is not a valid message")

    def make(behavior, _streaming):
        if _is_gen(behavior):
            async def gen(raw, context):
                async for item in behavior(await parse(raw, context), context):
                    yield item
            return gen

        async def coro(raw, context):
            result = behavior(await parse(raw, context), context)
            return await result if inspect.isawaitable(result) else result
        return coro
    return _rewrap(handler, make)._replace(request_deserializer=None)


class _ParseGuarded:
    """What a generated adder sees for an unguarded service: its handlers parse their own requests."""

    def __init__(self, server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers):
        self._server.add_generic_rpc_handlers(tuple(_ParseGuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service_name, method_handlers):
        self._server.add_registered_method_handlers(service_name, {
            name: _parse_guarded(h, f"/{service_name}/{name}") for name, h in method_handlers.items()})


class _ParseGuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self.inner = inner

    def service(self, handler_call_details):
        handler = self.inner.service(handler_call_details)
        return None if handler is None else _parse_guarded(handler, handler_call_details.method)


class GrpcHost:
    """Creates the server; ``bind`` then ``start``; health follows the lifecycle. ``guard``
    (a :class:`CallGuard`) protects every service added with :meth:`add`."""

    def __init__(self, host: str, port: int, max_message_bytes: int, max_concurrent_rpcs: int,
                 guard: CallGuard | None = None):
        self.server = grpc.aio.server(options=server_options(max_message_bytes),
                                      maximum_concurrent_rpcs=max_concurrent_rpcs,
                                      interceptors=[MetricsInterceptor()])
        self.health = AioHealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, _ParseGuarded(self.server))
        self._services = [health.SERVICE_NAME]
        self.host, self.requested_port = host, port
        self.port = 0
        self.guard = guard

    def add(self, add_fn, servicer, full_name: str) -> None:
        """Register a service (``add_fn(servicer, server)``, e.g. a generated adder); with a guard
        every one of its methods is authenticated and limited."""
        add_fn(servicer, _GuardedServer(self.server, self.guard) if self.guard is not None else self.server)
        self._services.append(full_name)

    def bind(self) -> int:
        addr = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            self.port = self.server.add_insecure_port(addr)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise GrpcPortInUse(f"gRPC cannot listen on {addr}: the port is in use or the address is not local; "
                                "pick a free port with --grpc-port or grpc.port (0 = any)")
        return self.port

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def _set_all(self, status) -> None:
        for name in ["", *self._services]:
            await self.health.set(name, status)

    async def on_state(self, state: State, reason: str, detail: str) -> None:
        """Lifecycle listener."""
        if state is State.READY:
            await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        elif state is State.JOINING:
            await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
