"""The node's gRPC aio server: options, standard health service, ``Node`` service, metrics.

Owns creating and binding the server with explicit symmetric message limits
(``protocol/grpc_options.py``), the health servicer that follows the lifecycle (SERVING only
in READY; NOT_SERVING for good once draining), the ``Node`` info service, and an interceptor
that counts every handled call in ``swarmnode_grpc_server_handled_total``. Role services are
added by the daemon from ``Role.services()`` before the server starts.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AioHealthServicer

from node.lifecycle import State
from node.metrics import GRPC_HANDLED, GRPC_HANDLING_SECONDS
from protocol import node_pb2, node_pb2_grpc
from protocol.grpc_options import server_options

log = logging.getLogger("swarmnode.grpc")


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


class GrpcHost:
    """Creates the server; ``bind`` then ``start``; health follows the lifecycle."""

    def __init__(self, host: str, port: int, max_message_bytes: int, max_concurrent_rpcs: int):
        self.server = grpc.aio.server(options=server_options(max_message_bytes),
                                      maximum_concurrent_rpcs=max_concurrent_rpcs,
                                      interceptors=[MetricsInterceptor()])
        self.health = AioHealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._services = [health.SERVICE_NAME]
        self.host, self.requested_port = host, port
        self.port = 0

    def add(self, add_fn, servicer, full_name: str) -> None:
        add_fn(servicer, self.server)
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
