"""Client channels every role shares: one ``grpc.aio`` channel per peer, signed when the process
signs its calls, plus the two small asyncio helpers the stream code uses everywhere.

Owns how a node reaches a peer, not what it says (``protocol/streams.py``) nor how calls are
signed and verified (the security layer, which sits above ``protocol`` and plugs itself in with
:func:`install_auth`; protocol never imports it). Until something installs them, channels are
plain and no caller is verified: what tests with bare servers and ``peer_auth = "none"`` want.

    install_auth(client_auth, verified_peer)     # security.peer_auth calls it at import
    signed_channel(addr, options, peer_id=None)  # plain or signed grpc.aio channel
    ChannelPool(max_message_bytes).get(addr, peer_id=None);  await pool.close()
    verified_peer() -> str | None                # the signed caller inside a server handler
    task(coro);  remaining(deadline)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES, channel_options

__all__ = ["install_auth", "signed_channel", "ChannelPool", "verified_peer", "task", "remaining"]

_client_auth: Callable[[], Any] = lambda: None            # noqa: E731 - () -> ClientAuth | None
_verified_peer: Callable[[], str | None] = lambda: None   # noqa: E731 - () -> peer ID | None


def install_auth(client_auth: Callable[[], Any], verified_peer: Callable[[], str | None]) -> None:
    """Plug in call signing and caller verification. ``client_auth()`` returns the process's
    client signer (an object with ``interceptors(addr, peer_id) -> list``) or None;
    ``verified_peer()`` returns the verified caller of the handler it runs in, or None where
    calls are not authenticated. Both are read at each use, so installing early is enough."""
    global _client_auth, _verified_peer
    _client_auth, _verified_peer = client_auth, verified_peer


def verified_peer() -> str | None:
    """The signed caller of the current server handler, or None (no authentication here)."""
    return _verified_peer()


def task(coro) -> asyncio.Task:
    """A task whose exception is always retrieved (no 'never retrieved' noise after a cancel)."""
    t = asyncio.ensure_future(coro)
    t.add_done_callback(lambda t: t.cancelled() or t.exception())
    return t


def remaining(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``loop.time()`` value)."""
    return deadline - asyncio.get_running_loop().time()


_DEFAULT_AUTH = object()


def signed_channel(addr: str, options, *, peer_id: str | None = None, auth=_DEFAULT_AUTH) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``addr`` whose calls are signed when this process has a client
    signer (the daemon installs one when ``security.peer_auth = "signed"``) or ``auth`` is given;
    plain otherwise. The target peer ID is ``peer_id`` or the one whose live node card names
    ``addr``."""
    if auth is _DEFAULT_AUTH:
        auth = _client_auth()
    interceptors = auth.interceptors(addr, peer_id) if auth is not None else None
    return grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)


class ChannelPool:
    """One ``grpc.aio`` channel per peer address, reused across calls and streams (a channel
    multiplexes any number of calls; opening one per call costs a TCP and HTTP/2 handshake).

    Channels are signed as :func:`signed_channel` says (``auth``: a client signer, None for
    plain channels, default the process's). Request-streaming calls on a signed channel must pass
    a request iterator (its first message is signed); ``open_stream`` does."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, options=None, auth=_DEFAULT_AUTH):
        self.options = list(options) if options is not None else channel_options(max_message_bytes)
        self._auth = auth
        self._channels: dict[tuple[str, str | None], grpc.aio.Channel] = {}

    def get(self, addr: str, peer_id: str | None = None) -> grpc.aio.Channel:
        ch = self._channels.get((addr, peer_id))
        if ch is None:
            ch = self._channels[(addr, peer_id)] = signed_channel(addr, self.options, peer_id=peer_id,
                                                                  auth=self._auth)
        return ch

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            try:
                await ch.close(grace=None)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
