"""The persistent bidirectional tensor stream every role shares (``protocol/stream.proto``).

Owns how tensors move between two peers over one gRPC call; not what they mean. The pipeline
(activations/gradients) opens it as ``TensorStream.Open``; the NoLoCo exchange speaks the same
protocol under its own method (``/swarmnode.NoLoCo/Exchange``, see ``optimizers/exchange.py``).
Frame bytes are in ``protocol/stream_wire.py`` (pure, unit-tested); channels in
``protocol/channels.py``, errors in ``protocol/stream_errors.py`` (both re-exported here).

Open tensor stream (``swarmnode.TensorStream/Open``)::

    # server (one service per gRPC server; channels pick the consumer)
    svc = TensorStreamService(run_id=..., peer_id=..., max_tensor_bytes=limits.max_activation_bytes)
    svc.register("activations", on_stream)         # async def on_stream(stream: TensorStream)
    add_tensor_stream_to_server(svc, server)
    # client
    stream = await open_stream(pool.get(addr), run_id=..., sender=..., channel_name="activations",
                               max_tensor_bytes=...)
    await stream.send("x", tensor, {"mb": "3", "path": "1", "hop": "2"})
    got = await stream.recv()                      # Received(name, tensor, meta, seq)
    await stream.close()

Flow control: each side announces a ``window`` (tensors it buffers for its peer) in its hello;
``send`` waits for credit, so a slow consumer slows its producer instead of growing memory
(at most ``window`` unread tensors per stream; the receiver grants credit back in batches of
window/2 as ``recv`` consumes). Ordering: tensors arrive in send order, one direction
independent of the other. Errors: a bad frame (caps, digest, framing, flow) ends the stream:
the server answers the gRPC status INVALID_ARGUMENT with ``[reason] message``, the client
sends an ``error`` frame and cancels; either way both ends' ``send``/``recv`` raise
``StreamError`` whose ``reason`` is a ``TensorRejected`` reason (count it) or
peer_error/timeout/refused. A clean end raises ``StreamClosed`` from ``recv`` (``async for``
stops). ``close()`` on the client half-closes and waits for the server to end the call; on the
server, returning from the handler ends it.

Measured by ``benchmarks/transport.py`` (stream mode) against raw gRPC streaming of the same
bytes and a plain socket.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc

from protocol import stream_pb2
from protocol.channels import ChannelPool, remaining, signed_channel, task, verified_peer
from protocol.codec import MAX_CHUNK_BYTES, Expected, TensorRejected, check_chunk_bytes
from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES
from protocol.stream_errors import PeerError, Refused, StreamClosed, StreamError, error_of, refusal_of
from protocol.stream_wire import (Received, StreamAssembler, credit_frame, error_frame, hello_frame, parse,
                                  parse_hello, tensor_frames)

__all__ = ["PeerError", "Refused", "StreamError", "StreamClosed", "ChannelPool", "signed_channel", "task",
           "remaining", "TensorStream", "TensorStreamService", "open_stream", "add_tensor_stream_to_server",
           "Received", "STREAM_SERVICE", "OPEN_METHOD", "OPEN_WAIT_S", "DEFAULT_WINDOW"]

log = logging.getLogger("swarmnode.streams")

OPEN_WAIT_S = 5.0        # a server waits this long for a stream's first frame (the hello)
DEFAULT_WINDOW = 8       # tensors buffered per stream direction (1-8 MiB each: <= 64 MiB)
STREAM_SERVICE = "swarmnode.TensorStream"
OPEN_METHOD = f"/{STREAM_SERVICE}/Open"

Pace = Callable[[int], Awaitable[None]]


# ----------------------------------------------------------------------------- open tensor stream

class TensorStream:
    """One end of an open stream (``open_stream`` makes the client's, the service hands the
    server's to its handler). ``send`` and ``recv`` may run in different tasks at once; several
    senders are served one tensor at a time. See the module docstring."""

    def __init__(self, *, read, write, peer: stream_pb2.StreamHello, window: int, max_tensor_bytes: int,
                 cap_key: str, chunk_bytes: int, pace: Pace | None, on_reject: Callable[[str], None] | None,
                 call=None, done_writing=None, expected: Expected | None = None):
        self.peer = peer                      # the peer's hello: sender, channel, window, meta
        self._read, self._write, self._call = read, write, call
        self._done_writing = done_writing or (call.done_writing if call is not None else None)
        self._asm = StreamAssembler(max_tensor_bytes, cap_key, expected)
        self._chunk, self._pace, self._on_reject = chunk_bytes, pace, on_reject
        self._window = window
        self._granted = window                # tensors the peer may start, in total
        self._started = 0                     # tensors the peer has started
        self._ungranted = 0                   # consumed since the last credit frame
        self._credit = int(peer.window)       # tensors we may still start
        self._seq = 0
        self._queue: collections.deque[Received] = collections.deque()
        self._ready, self._credit_ev = asyncio.Event(), asyncio.Event()
        self._send_lock, self._write_lock = asyncio.Lock(), asyncio.Lock()
        self._error: StreamError | None = None
        self._eof = self._closing = False
        self.rejected = asyncio.Event()       # we found a bad frame (the server aborts on it)
        self.sent = self.received = 0         # tensors
        self.bytes_sent = self.bytes_received = 0
        self._reader = task(self._read_loop())

    # ------------------------------------------------------------------ public
    @property
    def error(self) -> StreamError | None:
        return self._error

    async def send(self, name: str, tensor, meta: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> None:
        """Send one tensor with its ``meta`` map; waits for credit (backpressure) up to ``timeout``
        (None = forever, TimeoutError after). Raises StreamError/StreamClosed if the stream ended."""
        async with self._send_lock:
            while self._credit <= 0:
                self._check_open_for_send()
                if self._eof:
                    raise StreamClosed("the peer ended the stream; it grants no more credit")
                self._credit_ev.clear()
                try:
                    async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                        await self._credit_ev.wait()
                except TimeoutError:
                    raise TimeoutError(f"no credit from {self.peer.sender[:16]} for {timeout} s: the peer "
                                       f"has {self.peer.window} unread tensors; it consumes too slowly") from None
            self._check_open_for_send()
            self._credit -= 1
            seq, self._seq = self._seq, self._seq + 1
            for frame in tensor_frames(seq, name, tensor, meta, self._chunk):
                if self._pace is not None:
                    await self._pace(len(frame))
                await self._send_frame(frame)
                self.bytes_sent += len(frame)
            self.sent += 1

    async def recv(self, timeout: float | None = None) -> Received:
        """The next verified tensor, in send order. Raises StreamClosed at a clean end,
        StreamError when the stream failed, TimeoutError after ``timeout`` seconds."""
        while not self._queue:
            if self._error is not None:
                raise self._error
            if self._eof or self._closing:
                raise StreamClosed("the peer ended the stream" if self._eof else "the stream is closed")
            self._ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                raise TimeoutError(f"no tensor from {self.peer.sender[:16]} in {timeout} s") from None
        item = self._queue.popleft()
        self._ungranted += 1
        if self._ungranted >= max(1, self._window // 2) and not self._eof and self._error is None:
            n, self._ungranted = self._ungranted, 0
            self._granted += n
            try:
                await self._send_frame(credit_frame(n))
            except Exception as exc:  # noqa: BLE001 - the reader reports why the stream ended
                log.debug("credit frame not sent: %r", exc)
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> Received:
        try:
            return await self.recv()
        except StreamClosed:
            raise StopAsyncIteration from None

    async def close(self, timeout: float = 5.0) -> None:
        """End the stream. Client: half-close, then wait up to ``timeout`` for the server to end
        the call (cancel after). Server: no more sends; the call ends when the handler returns."""
        if self._closing:
            return
        self._closing = True
        if self._call is None:
            return
        try:
            async with self._write_lock:
                await asyncio.wait_for(self._done_writing(), timeout)
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Drop the stream at once (client: cancels the call)."""
        self._closing = True
        if self._call is not None and not self._call.done():
            self._call.cancel()
        self._reader.cancel()
        self._wake()

    # ------------------------------------------------------------------ internals
    def _check_open_for_send(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing:
            raise StreamClosed("the stream is closed; open a new one")

    async def _send_frame(self, frame: bytes) -> None:
        async with self._write_lock:
            try:
                await self._write(frame)
            except grpc.aio.AioRpcError as exc:
                raise self._fail(error_of(exc)) from None
            except (asyncio.InvalidStateError, RuntimeError) as exc:  # the call is already over
                raise self._fail(StreamError("peer_error", f"the stream ended: {exc!r}")) from None

    def _wake(self) -> None:
        self._ready.set()
        self._credit_ev.set()

    def _fail(self, err: StreamError) -> StreamError:
        if self._error is None:
            self._error = err
        self._wake()
        return self._error

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._read()
                if data is grpc.aio.EOF:
                    self._eof = True
                    return
                f = parse(data)
                if f.credit:
                    self._credit += f.credit
                    self._credit_ev.set()
                if f.error is not None:
                    err = stream_pb2.StreamError.FromString(f.error)
                    self._fail(StreamError(err.reason or "peer_error", f"the peer ended the stream: {err.message}"))
                    return
                if f.hello is not None:
                    raise TensorRejected("malformed", "a second hello on an open stream")
                if f.is_tensor:
                    if f.head is not None:
                        self._started += 1
                        if self._started > self._granted:
                            raise TensorRejected("malformed", f"flow control: the peer started tensor "
                                                 f"{self._started} with credit for {self._granted}; it "
                                                 "ignores the window")
                    out = self._asm.feed(f)
                    self.bytes_received += len(data)
                    if out is not None:
                        self._queue.append(out)
                        self.received += 1
                        self._ready.set()
        except TensorRejected as exc:
            if self._on_reject is not None:
                try:
                    self._on_reject(exc.reason)
                except Exception:  # noqa: BLE001 - metrics must not break the stream
                    log.exception("on_reject callback failed")
            log.warning("tensor stream from %s dropped: %s", self.peer.sender[:16], exc)
            self._fail(StreamError(exc.reason, str(exc), grpc.StatusCode.INVALID_ARGUMENT))
            self.rejected.set()
            if self._call is not None:  # client: tell the server why, then drop the call
                try:
                    async with self._write_lock:
                        await asyncio.wait_for(self._write(error_frame(exc.reason, exc.message)), 1.0)
                except Exception:  # noqa: BLE001 - best effort
                    pass
                self._call.cancel()
        except grpc.aio.AioRpcError as exc:
            self._fail(error_of(exc))
        except asyncio.CancelledError:
            self._fail(StreamClosed())
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the server call was cancelled by the client
            self._fail(StreamError("peer_error", f"the stream ended: {exc!r}"))
        finally:
            self._wake()


def _window(window: int) -> int:
    if not isinstance(window, int) or not 1 <= window <= 1024:
        raise ValueError(f"window={window!r} must be an int in 1..1024 (tensors buffered per stream); "
                         "raise it if senders wait for credit while the receiver is idle")
    return window


def _chunk_for(chunk_bytes: int, max_message_bytes: int) -> int:
    check_chunk_bytes(chunk_bytes)
    return min(chunk_bytes, max_message_bytes - 64 * 1024)  # room for head + meta + trailer


async def open_stream(channel: grpc.aio.Channel, *, run_id: str, sender: str, channel_name: str,
                      max_tensor_bytes: int, cap_key: str = "limits.max_activation_bytes",
                      window: int = DEFAULT_WINDOW, chunk_bytes: int = MAX_CHUNK_BYTES,
                      max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, meta: Mapping[str, str] | None = None,
                      pace: Pace | None = None, on_reject: Callable[[str], None] | None = None,
                      timeout: float = OPEN_WAIT_S, method: str = OPEN_METHOD,
                      expected: Expected | None = None) -> TensorStream:
    """Open ``method`` (``TensorStream.Open``, or a role's own method speaking this protocol,
    e.g. ``NoLoCo.Exchange``) on ``channel`` (e.g. ``ChannelPool.get(addr)``), exchange hellos
    and return the client's end; ``expected`` restricts what the peer may send (see
    ``StreamAssembler``). Raises StreamError (reason "refused" with the server's words when it
    refuses the run or channel, its reason word in ``refusal``; "timeout" if it does not answer
    in ``timeout`` s)."""
    chunk = _chunk_for(chunk_bytes, max_message_bytes)
    outbox = _Outbox()  # a request iterator, not call.write: a signed channel signs its first message
    call = channel.stream_stream(method)(outbox)  # bytes in, bytes out: frames are built by hand
    call.add_done_callback(lambda _c: outbox.fail())
    try:
        async with asyncio.timeout(timeout):
            await outbox.put(hello_frame(run_id, sender, channel_name, _window(window), meta))
            data = await call.read()
            if data is grpc.aio.EOF:
                code, details = await call.code(), await call.details()
                raise StreamError("refused", f"{code.name}: {details}", code, refusal_of(details))
            peer = parse_hello(parse(data))
    except grpc.aio.AioRpcError as exc:
        raise error_of(exc) from None
    except (TimeoutError, asyncio.TimeoutError):
        call.cancel()
        raise StreamError("timeout", f"no hello from the server in {timeout} s") from None
    except TensorRejected as exc:
        call.cancel()
        raise StreamError(exc.reason, str(exc)) from None
    except RuntimeError as exc:  # the call ended before the hello went out
        call.cancel()
        raise StreamError("peer_error", f"the stream ended before the hello: {exc}") from None
    return TensorStream(read=call.read, write=outbox.put, peer=peer, window=window,
                        max_tensor_bytes=max_tensor_bytes, cap_key=cap_key, chunk_bytes=chunk, pace=pace,
                        on_reject=on_reject, call=call, done_writing=outbox.close, expected=expected)


class _Outbox:
    """The client's request iterator: ``put`` hands one frame to gRPC and waits while one is
    already queued (the same backpressure as ``call.write``); ``close`` half-closes; ``fail``
    (the call ended) makes every ``put`` raise RuntimeError."""

    def __init__(self):
        self._items: collections.deque[bytes] = collections.deque()
        self._space, self._avail = asyncio.Event(), asyncio.Event()
        self._closed = self._dead = False

    async def put(self, item: bytes) -> None:
        while self._items and not self._dead:
            self._space.clear()
            await self._space.wait()
        if self._dead or self._closed:
            raise RuntimeError("the stream's call is over" if self._dead else "the stream is half-closed")
        self._items.append(item)
        self._avail.set()

    async def close(self) -> None:
        self._closed = True
        self._avail.set()

    def fail(self) -> None:
        self._dead = True
        self._space.set()
        self._avail.set()

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        while True:
            while not self._items:
                if self._closed or self._dead:
                    return
                self._avail.clear()
                await self._avail.wait()
            item = self._items.popleft()
            self._space.set()
            yield item


Handler = Callable[[TensorStream], Awaitable[None]]


class TensorStreamService:
    """The server side of ``TensorStream.Open``: checks each hello (run, channel, ``accept``),
    answers with its own, and runs the channel's handler with the server's ``TensorStream``.

    ``accept(hello)`` (plain or async) sees every hello first and may raise ``Refused`` (e.g. an
    unknown or stale sender) with its own status: the client's ``open_stream`` then raises
    StreamError with the detail. Then the signed caller must be the hello's sender, the run
    this node's and the channel registered (an ``accept`` that claims anything checks
    ``protocol.channels.verified_peer()`` itself first, as the NoLoCo exchange does). A handler
    may end its stream with ``Refused`` or ``TensorRejected`` (INVALID_ARGUMENT,
    ``[reason] message``): the client reads either.
    ``expected`` restricts what peers may send (see ``StreamAssembler``).
    """

    def __init__(self, *, run_id: str, peer_id: str, max_tensor_bytes: int,
                 cap_key: str = "limits.max_activation_bytes", window: int = DEFAULT_WINDOW,
                 chunk_bytes: int = MAX_CHUNK_BYTES, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 accept: Callable[[stream_pb2.StreamHello], Awaitable[None] | None] | None = None,
                 pace: Callable[[str], Pace | None] | None = None,
                 on_reject: Callable[[str], None] | None = None, expected: Expected | None = None):
        self.run_id, self.peer_id = run_id, peer_id
        self.max_tensor_bytes, self.cap_key, self.window = int(max_tensor_bytes), cap_key, _window(window)
        self.chunk = _chunk_for(chunk_bytes, max_message_bytes)
        self.accept, self.pace, self.on_reject, self.expected = accept, pace, on_reject, expected
        self._handlers: dict[str, Handler] = {}
        self.open_streams: set[TensorStream] = set()

    def register(self, channel: str, handler: Handler) -> None:
        """Serve streams whose hello names ``channel`` with ``handler(stream)``."""
        if channel in self._handlers:
            raise ValueError(f"tensor stream channel {channel!r} already has a handler")
        self._handlers[channel] = handler

    async def Open(self, request_iterator, context) -> None:  # noqa: N802 - gRPC API
        read = _reader(request_iterator)  # the iterator, not context.read(): the auth wrapper owns it
        try:
            data = await asyncio.wait_for(read(), OPEN_WAIT_S)
            if data is grpc.aio.EOF:
                return
            hello = parse_hello(parse(data))
            if self.accept is not None:
                pending = self.accept(hello)
                if pending is not None:
                    await pending
            verified = verified_peer()
            if verified is not None and hello.sender != verified:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "sender",
                              f"hello names sender ...{hello.sender[-8:]} but the call is signed by "
                              f"...{verified[-8:]}; a peer speaks only for itself")
            if hello.run_id != self.run_id:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "run",
                              f"run {hello.run_id[:40]!r} is not this node's run {self.run_id!r}")
            handler = self._handlers.get(hello.channel)
            if handler is None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "channel",
                              f"no handler for channel {hello.channel[:40]!r} here (serving "
                              f"{sorted(self._handlers)}): is the peer the role you meant?")
            await context.write(hello_frame(self.run_id, self.peer_id, hello.channel, self.window))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no hello in {OPEN_WAIT_S} s")
            return
        except TensorRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        except Refused as r:
            await context.abort(r.code, f"{r.reason}: {r.detail}")
            return
        stream = TensorStream(read=read, write=context.write, peer=hello, window=self.window,
                              max_tensor_bytes=self.max_tensor_bytes, cap_key=self.cap_key, chunk_bytes=self.chunk,
                              pace=self.pace(hello.sender) if self.pace else None, on_reject=self.on_reject,
                              expected=self.expected)
        self.open_streams.add(stream)
        app, bad = task(handler(stream)), task(stream.rejected.wait())
        try:
            await asyncio.wait({app, bad}, return_when=asyncio.FIRST_COMPLETED)
            failed = app.exception() if app.done() and not app.cancelled() else None
            if stream.rejected.is_set():
                app.cancel()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(stream.error))
            elif isinstance(failed, Refused):
                await context.abort(failed.code, f"{failed.reason}: {failed.detail}")
            elif isinstance(failed, TensorRejected):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(failed))
            elif failed is not None and not isinstance(failed, StreamError):
                log.error("tensor stream handler for %r failed", hello.channel, exc_info=app.exception())
                await context.abort(grpc.StatusCode.INTERNAL, f"handler failed: {app.exception()!r}")
        finally:
            self.open_streams.discard(stream)
            bad.cancel()
            if not app.done():
                app.cancel()
            stream._closing = True
            stream._reader.cancel()


def _reader(request_iterator):
    """``context.read()``-like reads (EOF at the end) over a request iterator."""
    it = request_iterator.__aiter__()

    async def read():
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF
    return read


def add_tensor_stream_to_server(service: TensorStreamService, server: grpc.aio.Server,
                                method: str = OPEN_METHOD) -> None:
    """Register ``service`` as ``method`` (default ``swarmnode.TensorStream/Open``; a role may
    serve the same protocol under its own method, e.g. ``/swarmnode.NoLoCo/Exchange``, so its
    calls keep their own limits). Frames pass as bytes: stream_wire builds and parses them."""
    svc, name = method.strip("/").rsplit("/", 1)
    handler = grpc.stream_stream_rpc_method_handler(service.Open)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(svc, {name: handler}),))
