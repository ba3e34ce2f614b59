"""The server call pipeline: one wrapper runs a list of steps in front of any gRPC handler.

A step sees each call twice, like a nested ``async with``: :meth:`Step.enter` on the way in
(check the call, refuse it with ``context.abort``, or replace ``call.request``: parse raw bytes,
wrap a request stream to count or verify its messages) and :meth:`Step.exit` on the way out,
innermost first, with the exception the call ended with (release what ``enter`` took, turn a
timeout into a status, count the outcome). An ``exit`` that raises replaces the exception for
the steps outside it. Steps are shared by every call of their methods; what one call needs
between ``enter`` and ``exit`` is the value ``enter`` returns.

:func:`wrap_handler` is the one place that knows the four RPC kinds (unary-unary,
unary-stream, stream-unary, stream-stream): the wrapped behaviour is always a coroutine, and a
streaming response is written with ``context.write``. Handlers may be coroutines, async or
plain generators, or coroutines that write their own responses (the health ``Watch``).
Request-stream handlers must read the request iterator they are given, not ``context.read()``:
the steps see the stream through it.

Which steps a method gets is a function of its full name (``steps_for(method)``), so one
server can hold services with different pipelines. :class:`PipelineServer` is what a generated
``add_*Servicer_to_server`` is given instead of the server, and :class:`PipelineGenericHandler`
wraps a generic handler; both wrap every method they register. The node's pipeline
(node/grpc_server.py): call metrics -> ban screen -> signed envelope -> limits -> call-time cap
-> the handler.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import grpc

__all__ = ["Call", "Step", "StepsFor", "wrap_handler", "PipelineServer", "PipelineGenericHandler", "add_servicer"]

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class Call:
    """One call on its way through the steps. ``request`` is the request message (or raw bytes
    until a parsing step has run) or, for request streams, the iterator the handler will read;
    ``deserializer`` is the method's own request parser when a step parses (None otherwise)."""

    __slots__ = ("method", "context", "request", "request_streaming", "deserializer")

    def __init__(self, method: str, context: grpc.aio.ServicerContext, request: Any, request_streaming: bool,
                 deserializer: Callable[[bytes], Any] | None):
        self.method, self.context, self.request = method, context, request
        self.request_streaming, self.deserializer = request_streaming, deserializer


class Step:
    """One stage of the pipeline. ``parses = True``: the step turns raw request bytes into the
    method's messages itself (gRPC then hands the pipeline bytes, and ``call.deserializer`` is
    the method's parser)."""

    parses = False

    async def enter(self, call: Call) -> Any:
        """Check or transform ``call``; refuse with ``await call.context.abort(...)``. The return
        value comes back to :meth:`exit`."""
        return None

    async def exit(self, call: Call, state: Any, exc: BaseException | None) -> None:
        """The call ended with ``exc`` (None: it succeeded). Raise to replace ``exc``."""


StepsFor = Callable[[str], Sequence[Step]]


def wrap_handler(handler: grpc.RpcMethodHandler, method: str, steps: Sequence[Step]) -> grpc.RpcMethodHandler:
    """``handler`` (any of the four kinds) behind ``steps``, outermost first; unchanged when
    there are none. Serializers and the RPC kind are kept."""
    if not steps:
        return handler
    steps = tuple(steps)
    kind = next(k for k in KINDS if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)
    parses = any(step.parses for step in steps)
    deserializer = handler.request_deserializer if parses else None
    streaming_request = handler.request_streaming
    respond = _write_responses if handler.response_streaming else _response

    async def run(request, context):
        call = Call(method, context, request, streaming_request, deserializer)
        entered: list[tuple[Step, Any]] = []
        try:
            for step in steps:
                entered.append((step, await step.enter(call)))
            result = await respond(behavior, call.request, context)
        except BaseException as exc:  # noqa: BLE001 - every outcome goes through the steps' exits
            raise await _unwind(entered, call, exc)  # noqa: B904 - the exits may replace it
        failure = await _unwind(entered, call, None)
        if failure is not None:
            raise failure
        return result

    replaced = {kind: run}
    if parses:
        replaced["request_deserializer"] = None
    return handler._replace(**replaced)


async def _unwind(entered: list[tuple[Step, Any]], call: Call, exc: BaseException | None) -> BaseException | None:
    for step, state in reversed(entered):
        try:
            await step.exit(call, state, exc)
        except BaseException as replaced:  # noqa: BLE001 - an exit turns the outcome into another
            exc = replaced
    return exc


async def _response(behavior, request, context):
    result = behavior(request, context)
    return await result if inspect.isawaitable(result) else result


async def _write_responses(behavior, request, context) -> None:
    result = behavior(request, context)
    if inspect.isawaitable(result):  # a coroutine that writes with context.write()
        await result
    elif hasattr(result, "__aiter__"):
        try:
            async for item in result:
                await context.write(item)
        finally:
            close = getattr(result, "aclose", None)
            if close is not None:
                await close()  # the handler's own cleanup runs now, not when the generator is collected
    else:
        for item in result:
            await context.write(item)


class PipelineGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose methods run behind ``steps_for(method)``."""

    def __init__(self, inner: grpc.GenericRpcHandler, steps_for: StepsFor):
        self.inner, self.steps_for = inner, steps_for
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details):
        handler = self.inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        hit = self._cache.get(method)
        if hit is None or hit[0] is not handler:
            hit = self._cache[method] = (handler, wrap_handler(handler, method, self.steps_for(method)))
        return hit[1]


class PipelineServer:
    """What a generated ``add_*Servicer_to_server`` sees instead of the server: every method it
    registers (generic and registered-method paths) runs behind ``steps_for(method)``."""

    def __init__(self, server, steps_for: StepsFor):
        self._server, self.steps_for = server, steps_for

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(PipelineGenericHandler(h, self.steps_for) for h in handlers))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        self._server.add_registered_method_handlers(service_name, {
            name: wrap_handler(h, f"/{service_name}/{name}", self.steps_for(f"/{service_name}/{name}"))
            for name, h in method_handlers.items()})


def add_servicer(add_fn: Callable[[Any, Any], None], servicer: Any, server: Any, steps_for: StepsFor) -> None:
    """``add_servicer(node_pb2_grpc.add_NodeServicer_to_server, servicer, server, steps_for)``:
    like the generated adder, with every method behind its steps."""
    add_fn(servicer, PipelineServer(server, steps_for))
