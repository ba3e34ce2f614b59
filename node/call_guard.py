"""The call guard: bans, authentication and limits in front of every service the node hosts.

Every service added with ``GrpcHost.add`` (the ``Node`` service and every role's) runs behind
:meth:`CallGuard.steps`, so a new service gets authentication and limits without code of its
own. Per call, cheapest first, as steps of the call pipeline (security/call_pipeline.py):

1. ban screen: the remote IP and the claimed peer ID are checked against the ban list; a
   request stream that claims a known peer holds a "first-frame wait" slot until its first
   (signed) message arrives, so slow or silent openers cannot hold every call slot;
2. signed envelope and body (``security.peer_auth.AuthStep``; ``security.peer_auth = "signed"``);
3. limits (``security.limits``): the verified caller's request rate, a per-service concurrency
   slot, request bytes and message count of request streams;
4. call-time cap: the handler runs at most ``limits.max_call_s``.

Every refusal is counted in ``swarmnode_rpc_rejected_total{reason}``; a key with
``limits.ban_threshold`` refusals in ``limits.ban_window_s`` is banned for ``limits.ban_s``
(``swarmnode_peer_bans_total``). Bans key on the verified peer, or on the remote IP when the
caller did not authenticate (loopback IPs are counted but never banned: every local process
shares them). The standard health service is not guarded (the host registers it outside the
guard). ``Node.Info`` / ``Node.PeerInfo`` are authenticated like every role service: they give
away the run ID and addresses, which only members need (operators use the ops port's
``/peerinfo``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from typing import Any, Callable, Iterable

import grpc
from prometheus_client import Counter, Gauge

from node.logs import emit
from node.metrics import REGISTRY, RPC_REJECTED
from security.call_pipeline import Call, Step
from security.config import LimitsConfig
from security.limits import BanList, ConcurrencyLimiter, LimitExceeded, PeerRateLimiter
from security.peer_auth import HDR_PEER, AuthFailure, AuthStep, PeerAuthenticator, current_peer

log = logging.getLogger("swarmnode.grpc")

PEER_BANS = Counter("swarmnode_peer_bans_total", "Peers (or remote IPs) banned by this node for repeated "
                    "rejected calls.", registry=REGISTRY)
PEERS_BANNED = Gauge("swarmnode_peers_banned", "Peers or IPs banned right now.", registry=REGISTRY)
MAX_BANNED_IDS = 8  # banned keys named on the node card (all of them count in ``banned``)


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
        self._screen, self._call_time = _BanScreen(self), _CallTimeCap(self)
        self._auth_steps: dict[int, AuthStep] = {}
        for a in (auth, open_auth):
            if a is not None:
                a.on_reject = self._auth_rejected
                self._auth_steps[id(a)] = AuthStep(a, first_frame_timeout_s=limits.first_frame_timeout_s)

    # ---- the pipeline ----
    def steps(self, method: str) -> list[Step]:
        """The guard's steps for ``method`` (a full name, ``/package.Service/Method``): ban screen
        -> signed envelope (``open_auth`` for ``public`` methods; none without authentication)
        -> limits -> call-time cap."""
        auth = self.open_auth if method in self.public and self.open_auth is not None else self.auth
        steps: list[Step] = [self._screen]
        if auth is not None:
            steps.append(self._auth_steps[id(auth)])
        steps += [_Limits(self, self._slots_of(method)), self._call_time]
        return steps

    def _slots_of(self, method: str) -> ConcurrencyLimiter:
        service = method.rsplit("/", 2)[-2] if method.count("/") >= 2 else method
        lim = self._slots.get(service)
        if lim is None:
            lim = self._slots[service] = ConcurrencyLimiter(service, per_peer=self.limits.peer_concurrency,
                                                            total=self.limits.service_concurrency)
        return lim

    # ---- counting and banning ----
    def _on_ban(self, key, reason: str) -> None:
        PEER_BANS.inc()
        emit(log, "peer_banned", "banned {key} for {ban_s:.0f} s after repeated rejected calls (last: {reason})",
             level=logging.WARNING, key=str(key), ban_s=self.limits.ban_s, reason=reason)
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

    async def refuse(self, context, exc: LimitExceeded, key) -> None:
        """Count the refusal against ``key`` and end the call with the limit's status."""
        self.count(exc.reason, key, ban=_bannable(key))
        await context.abort(exc.grpc_code, str(exc))

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


class _BanScreen(Step):
    """First guard step: refuse banned IPs / claimed peers at once; cap the request streams of
    each (claimed known peer, remote IP) still awaiting their first, signed, frame. Streams that
    claim no known peer hold no such slot: the envelope check refuses them before any wait (or
    admits a peer whose card just appeared), so strangers cannot take members' slots, and an
    impostor claiming a member's ID only takes the slots of its own IP."""

    def __init__(self, guard: CallGuard):
        self.guard = guard

    def _key(self, context) -> tuple[str, str | None] | None:
        guard, ip = self.guard, _remote_ip(context)
        claimed = next((v for k, v in (context.invocation_metadata() or ()) if k == HDR_PEER), None)
        for key in (claimed, ip):
            if key is not None:
                guard.bans.check(key)
        known = guard.auth is not None and guard.auth.is_known_peer is not None and \
            isinstance(claimed, str) and len(claimed) <= 128 and guard.auth.is_known_peer(claimed)
        return (claimed, ip) if known else None

    async def enter(self, call: Call) -> _ReleaseAfterFirst | None:
        guard, context = self.guard, call.context
        hold = call.request_streaming and guard.auth is not None
        try:
            key = self._key(context)
            if hold and key is not None:
                guard.pending.acquire(key)
        except LimitExceeded as exc:
            await guard.refuse(context, exc, _remote_ip(context))
        if not hold or key is None:
            return None
        call.request = _ReleaseAfterFirst(call.request, lambda: guard.pending.release(key))
        return call.request

    async def exit(self, call: Call, held: _ReleaseAfterFirst | None, exc: BaseException | None) -> None:
        if held is not None:
            held.release()


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


class _Limits(Step):
    """Rate, concurrency, bytes and message count, per verified peer (the remote IP when calls
    are not authenticated). One per method: the concurrency slots are the method's service's."""

    def __init__(self, guard: CallGuard, slots: ConcurrencyLimiter):
        self.guard, self.slots = guard, slots

    async def enter(self, call: Call) -> str:
        guard, context = self.guard, call.context
        key = current_peer() or _remote_ip(context) or "unknown"
        try:
            guard.bans.check(key)
            guard.rates.check_request(key)
            self.slots.acquire(key)
        except LimitExceeded as exc:
            await guard.refuse(context, exc, key)
        if call.request_streaming:
            call.request = self._counted(call.request, key, context)
        return key

    async def exit(self, call: Call, key: str, exc: BaseException | None) -> None:
        self.slots.release(key)

    async def _counted(self, requests, key: str, context):
        guard, most = self.guard, self.guard.limits.max_request_messages
        n = 0
        async for msg in requests:
            n += 1
            if n > most:
                await guard.refuse(context, LimitExceeded(
                    f"request stream sent more than {most} messages (limits.max_request_messages)",
                    "stream_messages"), key)
            try:
                guard.rates.check_bytes(key, _wire_size(msg))
            except LimitExceeded as exc:
                await guard.refuse(context, exc, key)
            yield msg


class _CallTimeCap(Step):
    """Innermost guard step: the handler runs at most ``limits.max_call_s``; past it the call
    ends with DEADLINE_EXCEEDED, counted as ``call_time`` (never toward a ban). A handler's own
    ``TimeoutError`` ends the same way."""

    def __init__(self, guard: CallGuard):
        self.guard = guard

    async def enter(self, call: Call) -> asyncio.Timeout:
        timeout = asyncio.timeout(self.guard.limits.max_call_s)
        await timeout.__aenter__()
        return timeout

    async def exit(self, call: Call, timeout: asyncio.Timeout, exc: BaseException | None) -> None:
        try:
            await timeout.__aexit__(type(exc) if exc is not None else None, exc,
                                    exc.__traceback__ if exc is not None else None)
        except TimeoutError as fired:
            exc = fired
        if isinstance(exc, TimeoutError):
            self.guard.count("call_time", None, ban=False)
            await call.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"call ran past limits.max_call_s={self.guard.limits.max_call_s:g} s")


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
