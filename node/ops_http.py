"""Ops HTTP on the metrics port: ``/metrics``, ``/healthz``, ``/readyz``, ``/peerinfo``, and on a
bootstrap node ``/metrics/swarm`` (the whole run from its node cards, ``node/swarm_metrics.py``).

Runs its own small asyncio loop in one background thread, so a busy event loop or a training
step never delays a probe, and a probe never waits on the node's loop: handlers read plain
snapshots (lifecycle state, a health flag, the peer info dict). No I/O in ``/healthz``.

Bounded by design (docs/security.md, 'The ops port'): one thread whatever the number of
connections; a connection must deliver its request within ``ops.idle_timeout_s``; at most
``ops.max_connections`` are open at once, and a new one beyond that closes the connection that
has waited longest for its request, so idle sockets opened by anyone cannot keep Prometheus or
a probe out. One request per connection (``Connection: close``), request heads capped at 8 KiB,
GET only. Closed connections are counted in ``swarmnode_ops_connections_closed_total{reason}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections import OrderedDict
from typing import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node.lifecycle import Lifecycle, State
from node.logs import emit
from node.metrics import OPS_CONNECTIONS, OPS_CONNECTIONS_CLOSED, REGISTRY
from node.swarm_metrics import CENSUS, SWARM_REGISTRY

log = logging.getLogger("swarmnode.ops")

MAX_HEAD_BYTES = 8192
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


class PortInUse(Exception):
    exit_code = 2


class OpsServer:
    """The node's ops endpoints.

    ``host``: one IP or several (e.g. a private address and 127.0.0.1 for the container
    healthcheck), all on ``port``. ``health`` returns ``(ok, reason)`` for liveness;
    ``peerinfo`` returns the JSON-able dict served at ``/peerinfo``. Both must be cheap and
    thread-safe. ``max_connections`` and ``idle_timeout_s``: see ``node/config.py: OpsConfig``.
    """

    def __init__(self, host: str | Iterable[str], port: int, lifecycle: Lifecycle,
                 health: Callable[[], tuple[bool, str]], peerinfo: Callable[[], dict],
                 details: Callable[[], dict] | None = None, *, max_connections: int = 64,
                 idle_timeout_s: float = 10.0):
        self.lifecycle, self._health, self._peerinfo = lifecycle, health, peerinfo
        self._details = details  # extra /readyz facts (e.g. the event bus), cheap and thread-safe
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self.hosts = [host] if isinstance(host, str) else list(host)
        self._socks: list[socket.socket] = []
        try:
            for h in self.hosts:
                self._socks.append(self._listen(h, port if not self._socks else self._socks[0].getsockname()[1]))
        except OSError as exc:
            for s in self._socks:
                s.close()
            raise PortInUse(f"ops HTTP cannot listen on {h}:{port} ({exc.strerror}); another process holds "
                            "the port: pick a free one with --metrics-port or ops.port (0 = any)") from None
        self.port = self._socks[0].getsockname()[1]
        self._waiting: OrderedDict[asyncio.Task, asyncio.StreamWriter] = OrderedDict()  # no request yet
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ops-http", daemon=True)

    @staticmethod
    def _listen(host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    @property
    def open_connections(self) -> int:
        return self._open

    # ---- the loop thread ----
    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            for sock in self._socks:
                self._servers.append(loop.run_until_complete(asyncio.start_server(self._on_connect, sock=sock, limit=MAX_HEAD_BYTES)))
        finally:
            self._ready.set()
        try:
            loop.run_forever()
        finally:
            for srv in self._servers:
                srv.close()
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._open += 1
        OPS_CONNECTIONS.set(self._open)
        self._waiting[task] = writer
        if self._open > self.max_connections:  # make room: the one that has waited longest goes
            oldest, old_writer = next(iter(self._waiting.items()))
            self._waiting.pop(oldest)
            old_writer.transport.abort()
            oldest.cancel()
            OPS_CONNECTIONS_CLOSED.labels(reason="evicted").inc()
        try:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    head = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError:
                OPS_CONNECTIONS_CLOSED.labels(reason="idle_timeout").inc()
                return
            except asyncio.LimitOverrunError:
                await self._reply(writer, 400, {"error": f"request head over {MAX_HEAD_BYTES} bytes"})
                OPS_CONNECTIONS_CLOSED.labels(reason="bad_request").inc()
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                OPS_CONNECTIONS_CLOSED.labels(reason="client_closed").inc()
                return
            self._waiting.pop(task, None)
            await self._answer(writer, head)
            OPS_CONNECTIONS_CLOSED.labels(reason="answered").inc()
        except asyncio.CancelledError:
            pass  # evicted, or the server stops
        except Exception as exc:  # noqa: BLE001 - one bad connection must never stop the server
            log.debug("ops connection failed: %r", exc)
        finally:
            self._waiting.pop(task, None)
            self._open -= 1
            OPS_CONNECTIONS.set(self._open)
            writer.transport.abort()

    async def _reply(self, writer: asyncio.StreamWriter, code: int, body: bytes | dict,
                     ctype: str = "application/json") -> None:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        head = (f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
        writer.write(head + body)
        async with asyncio.timeout(self.idle_timeout_s):  # a reader that never reads is dropped too
            await writer.drain()

    async def _answer(self, writer: asyncio.StreamWriter, head: bytes) -> None:
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await self._reply(writer, 400, {"error": "malformed request line"})
            return
        if parts[0] != "GET":
            await self._reply(writer, 405, {"error": f"{parts[0]} is not served; the ops port is read-only (GET)"})
            return
        code, body, ctype = self.route(parts[1].split("?", 1)[0])
        await self._reply(writer, code, body, ctype)

    def route(self, path: str) -> tuple[int, bytes, str]:
        """-> (status, body, content type) for a GET of ``path``."""
        js = "application/json"
        if path == "/metrics":
            return 200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST
        if path == "/metrics/swarm":
            if CENSUS.active:
                return 200, generate_latest(SWARM_REGISTRY), CONTENT_TYPE_LATEST
            return 404, json.dumps({"error": "this node serves no swarm view: scrape /metrics/swarm on a "
                                             "bootstrap node"}).encode(), js
        if path == "/healthz":
            ok, reason = self._health()
            return (200 if ok else 500), json.dumps({"ok": ok, "reason": reason}).encode(), js
        if path == "/readyz":
            state, reason, detail = self.lifecycle.snapshot()
            ready = state is State.READY
            body = {"ready": ready, "state": state.value, "reason": reason, "detail": detail}
            if self._details is not None:
                body["details"] = self._details()
            return (200 if ready else 503), json.dumps(body).encode(), js
        if path == "/peerinfo":
            return 200, json.dumps(self._peerinfo()).encode(), js
        return 404, json.dumps({"error": f"no such endpoint {path}; try /metrics, /metrics/swarm, /healthz, "
                                         "/readyz or /peerinfo"}).encode(), js

    # ---- control, from the node's thread ----
    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10.0)
        emit(log, "ops_http_started", "ops HTTP on {where} port {port}", where=",".join(self.hosts),
             port=self.port, hosts=self.hosts, max_connections=self.max_connections)

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(5.0)
        for sock in self._socks:
            sock.close()
