"""The node's gRPC aio server host: creates and binds the server, hosts its services.

Owns the server with explicit symmetric message limits (``protocol/grpc_options.py``), the
health service that follows the lifecycle (node/grpc_health.py), and the call pipeline every
hosted method runs behind (security/call_pipeline.py):

    call metrics -> [guard: ban screen -> signed envelope -> limits -> call-time cap] -> handler

:class:`CallMetrics` counts every call, refused ones included, in
``swarmnode_grpc_server_handled_total{service, method, code}`` and times it. Services added with
:meth:`GrpcHost.add` (the ``Node`` service, every role's) get the guard's steps
(node/call_guard.py); the health service gets none (anyone may probe) but parses its own
requests (:class:`ParseRequests`), so garbage bytes get INVALID_ARGUMENT instead of gRPC's
UNKNOWN. Role services are added by the daemon from ``Role.services()`` before the server starts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node.grpc_health import LifecycleHealth
from node.lifecycle import State
from node.metrics import GRPC_HANDLED, GRPC_HANDLING_SECONDS, RPC_REJECTED
from protocol.grpc_options import server_options
from security.call_pipeline import Call, PipelineServer, Step

if TYPE_CHECKING:
    from node.call_guard import CallGuard


class GrpcPortInUse(Exception):
    exit_code = 2


class CallMetrics(Step):
    """Outermost step: counts each call by (service, method, status code) and times it."""

    async def enter(self, call: Call) -> float:
        return time.perf_counter()

    async def exit(self, call: Call, t0: float, exc: BaseException | None) -> None:
        service, method = _split(call.method)
        GRPC_HANDLED.labels(service=service, method=method, code=_code_of(call.context, exc)).inc()
        GRPC_HANDLING_SECONDS.labels(service=service, method=method).observe(time.perf_counter() - t0)


class ParseRequests(Step):
    """Parse requests in the pipeline: bytes that are not the method's message end the call with
    INVALID_ARGUMENT (counted as ``body`` in ``swarmnode_rpc_rejected_total``) instead of gRPC's
    UNKNOWN "Unexpected DecodeError". For services outside the guard, whose parsing nobody
    else does (the guard's envelope check parses requests itself)."""

    parses = True

    async def enter(self, call: Call) -> None:
        if call.deserializer is None:
            return
        if not call.request_streaming:
            call.request = await _parse(call, call.request)
            return
        raw_stream = call.request

        async def parsed():
            async for raw in raw_stream:
                yield await _parse(call, raw)
        call.request = parsed()


async def _parse(call: Call, raw: bytes) -> Any:
    try:
        return call.deserializer(raw)
    except Exception:  # noqa: BLE001 - DecodeError and friends
        RPC_REJECTED.labels(reason="body").inc()
        await call.context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request to {call.method} is not a valid message")


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


class GrpcHost:
    """Creates the server; ``bind`` then ``start``; health follows the lifecycle. ``guard``
    (a :class:`~node.call_guard.CallGuard`) protects every service added with :meth:`add`."""

    def __init__(self, host: str, port: int, max_message_bytes: int, max_concurrent_rpcs: int,
                 guard: CallGuard | None = None):
        self.server = grpc.aio.server(options=server_options(max_message_bytes),
                                      maximum_concurrent_rpcs=max_concurrent_rpcs)
        self.guard = guard
        self._metrics = CallMetrics()
        self.health = LifecycleHealth()
        health_steps = (self._metrics, ParseRequests())
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer,
                                                     PipelineServer(self.server, lambda method: health_steps))
        self.host, self.requested_port = host, port
        self.port = 0

    def steps(self, method: str) -> list[Step]:
        """The pipeline of a method added with :meth:`add`: metrics, then the guard's steps."""
        return [self._metrics, *(self.guard.steps(method) if self.guard is not None else ())]

    def add(self, add_fn, servicer, full_name: str) -> None:
        """Register a service (``add_fn(servicer, server)``, e.g. a generated adder); with a guard
        every one of its methods is authenticated and limited."""
        add_fn(servicer, PipelineServer(self.server, self.steps))
        self.health.add(full_name)

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
        await self.health.set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def on_state(self, state: State, reason: str, detail: str) -> None:
        """Lifecycle listener: health follows the node's state."""
        await self.health.on_state(state, reason, detail)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
