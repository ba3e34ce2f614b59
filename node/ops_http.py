"""Ops HTTP on the metrics port: ``/metrics``, ``/healthz``, ``/readyz``, ``/peerinfo``, and on a
bootstrap node ``/metrics/swarm`` (the whole run from its node cards, ``node/swarm_metrics.py``).

Runs in a background thread (``ThreadingHTTPServer``) so a busy event loop or a training step
never delays a probe, and a probe never waits on the loop: handlers read plain snapshots
(lifecycle state, a health flag, the peer info dict). No I/O in ``/healthz``.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node.lifecycle import Lifecycle, State
from node.metrics import REGISTRY
from node.swarm_metrics import CENSUS, SWARM_REGISTRY

log = logging.getLogger("swarmnode.ops")


class PortInUse(Exception):
    exit_code = 2


class OpsServer:
    """The node's ops endpoints.

    ``health`` returns ``(ok, reason)`` for liveness; ``peerinfo`` returns the JSON-able dict
    served at ``/peerinfo``. Both must be cheap and thread-safe.
    """

    def __init__(self, host: str, port: int, lifecycle: Lifecycle,
                 health: Callable[[], tuple[bool, str]], peerinfo: Callable[[], dict],
                 details: Callable[[], dict] | None = None):
        self.lifecycle, self._health, self._peerinfo = lifecycle, health, peerinfo
        self._details = details  # extra /readyz facts (e.g. the event bus), cheap and thread-safe
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # quiet: probes hit this every few seconds
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                    elif path == "/metrics/swarm":
                        if CENSUS.active:
                            self._send(200, generate_latest(SWARM_REGISTRY), CONTENT_TYPE_LATEST)
                        else:
                            self._send(404, json.dumps({"error": "this node serves no swarm view: scrape "
                                                                 "/metrics/swarm on a bootstrap node"}).encode())
                    elif path == "/healthz":
                        ok, reason = outer._health()
                        self._send(200 if ok else 500, json.dumps({"ok": ok, "reason": reason}).encode())
                    elif path == "/readyz":
                        state, reason, detail = outer.lifecycle.snapshot()
                        ready = state is State.READY
                        body = {"ready": ready, "state": state.value, "reason": reason, "detail": detail}
                        if outer._details is not None:
                            body["details"] = outer._details()
                        self._send(200 if ready else 503, json.dumps(body).encode())
                    elif path == "/peerinfo":
                        self._send(200, json.dumps(outer._peerinfo()).encode())
                    else:
                        self._send(404, json.dumps({"error": f"no such endpoint {path}; try /metrics, /metrics/swarm, "
                                                             "/healthz, /readyz or /peerinfo"}).encode())
                except BrokenPipeError:
                    pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise PortInUse(f"ops HTTP cannot listen on {host}:{port} ({exc.strerror}); another process holds "
                            "the port: pick a free one with --metrics-port or ops.port (0 = any)") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="ops-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("ops HTTP on port %d", self.port, extra={"event": "ops_http_started", "port": self.port})

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
