"""security/call_pipeline.py: one wrapper runs the steps around any of the four RPC kinds, and the
node's guard steps (node/call_guard.py) compose in the documented order. No server: the wrapped
behaviours are called with a stand-in context."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from node.call_guard import CallGuard
from node.grpc_server import CallMetrics
from security.call_pipeline import PipelineGenericHandler, Step, wrap_handler
from security.config import LimitsConfig
from security.peer_auth import AuthStep, PeerAuthenticator


class Aborted(Exception):
    pass


class Ctx:
    def __init__(self, fail_write_at: int | None = None):
        self.written, self.aborted, self.fail_write_at = [], None, fail_write_at

    async def write(self, item):
        if self.fail_write_at is not None and len(self.written) == self.fail_write_at:
            raise ConnectionError("client went away")
        self.written.append(item)

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted(details)

    def peer(self):
        return "ipv4:127.0.0.1:5000"

    def invocation_metadata(self):
        return ()

    def code(self):
        return self.aborted[0] if self.aborted else None


class Trace(Step):
    def __init__(self, name: str, log: list, *, refuse: bool = False, replace: BaseException | None = None):
        self.name, self.log, self.refuse, self.replace = name, log, refuse, replace

    async def enter(self, call):
        self.log.append(f"enter {self.name}")
        if self.refuse:
            await call.context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.name} says no")
        return self.name

    async def exit(self, call, state, exc):
        assert state == self.name  # what enter returned comes back
        self.log.append(f"exit {self.name} {type(exc).__name__ if exc else 'ok'}")
        if self.replace is not None:
            raise self.replace


async def _requests(items):
    for item in items:
        yield item


async def uu(request, context):
    return request + b"!"


async def us(request, context):
    for i in range(3):
        yield request + str(i).encode()


async def su(requests, context):
    return b"".join([r async for r in requests])


async def ss(requests, context):
    async for r in requests:
        yield r.upper()


KINDS = {
    "unary_unary": (grpc.unary_unary_rpc_method_handler(uu), b"a", b"a!", []),
    "unary_stream": (grpc.unary_stream_rpc_method_handler(us), b"a", None, [b"a0", b"a1", b"a2"]),
    "stream_unary": (grpc.stream_unary_rpc_method_handler(su), [b"a", b"b"], b"ab", []),
    "stream_stream": (grpc.stream_stream_rpc_method_handler(ss), [b"a", b"b"], None, [b"A", b"B"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_every_kind_runs_its_handler_inside_the_steps(kind):
    handler, request, result, written = KINDS[kind]
    log: list[str] = []
    wrapped = wrap_handler(handler, "/t.T/M", [Trace("outer", log), Trace("inner", log)])
    behavior = getattr(wrapped, kind)
    assert asyncio.iscoroutinefunction(behavior) and wrapped.request_streaming == handler.request_streaming
    ctx = Ctx()
    arg = _requests(request) if isinstance(request, list) else request
    assert await behavior(arg, ctx) == result
    assert ctx.written == written
    assert log == ["enter outer", "enter inner", "exit inner ok", "exit outer ok"]


async def test_a_refusing_step_stops_the_call_and_only_entered_steps_exit():
    log: list[str] = []
    ran = []

    async def handler(request, context):
        ran.append(request)

    wrapped = wrap_handler(grpc.unary_unary_rpc_method_handler(handler), "/t.T/M",
                           [Trace("outer", log), Trace("guard", log, refuse=True), Trace("inner", log)])
    ctx = Ctx()
    with pytest.raises(Aborted):
        await wrapped.unary_unary(b"x", ctx)
    assert ran == [] and ctx.aborted[0] == grpc.StatusCode.PERMISSION_DENIED
    assert log == ["enter outer", "enter guard", "exit outer Aborted"]


async def test_an_exit_that_raises_replaces_the_outcome_for_the_steps_outside_it():
    log: list[str] = []

    async def handler(request, context):
        raise TimeoutError

    wrapped = wrap_handler(grpc.unary_unary_rpc_method_handler(handler), "/t.T/M",
                           [Trace("outer", log), Trace("inner", log, replace=Aborted("converted"))])
    with pytest.raises(Aborted, match="converted"):
        await wrapped.unary_unary(b"x", Ctx())
    assert log == ["enter outer", "enter inner", "exit inner TimeoutError", "exit outer Aborted"]


async def test_a_streaming_handler_is_closed_when_the_client_goes_away():
    closed = []

    async def gen(request, context):
        try:
            for i in range(10):
                yield b"%d" % i
        finally:
            closed.append(True)

    log: list[str] = []
    wrapped = wrap_handler(grpc.unary_stream_rpc_method_handler(gen), "/t.T/M", [Trace("s", log)])
    ctx = Ctx(fail_write_at=2)
    with pytest.raises(ConnectionError):
        await wrapped.unary_stream(b"", ctx)
    assert ctx.written == [b"0", b"1"] and closed == [True]  # cleanup ran now, not at garbage collection
    assert log == ["enter s", "exit s ConnectionError"]


async def test_only_a_parsing_step_takes_over_the_request_deserializer():
    handler = grpc.unary_unary_rpc_method_handler(uu, request_deserializer=bytes.upper)
    assert wrap_handler(handler, "/t.T/M", [Trace("t", [])]).request_deserializer is bytes.upper

    class Parse(Step):
        parses = True

        async def enter(self, call):
            call.request = call.deserializer(call.request)

    wrapped = wrap_handler(handler, "/t.T/M", [Parse()])
    assert wrapped.request_deserializer is None
    assert await wrapped.unary_unary(b"raw", Ctx()) == b"RAW!"
    assert wrap_handler(handler, "/t.T/M", []) is handler  # no steps: untouched


async def test_the_generic_handler_wraps_once_per_method_and_handler():
    inner = grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(uu)})
    asked = []
    generic = PipelineGenericHandler(inner, lambda method: asked.append(method) or [Trace("t", [])])

    class Details:
        method = "/t.T/M"

    first = generic.service(Details())
    assert generic.service(Details()) is first and asked == ["/t.T/M"]
    Details.method = "/t.T/Nope"
    assert generic.service(Details()) is None


def test_the_guard_composes_ban_screen_auth_limits_and_call_time_in_that_order():
    auth = PeerAuthenticator(run_id="r", own_peer_id="me")
    open_auth = PeerAuthenticator(run_id="r", own_peer_id="me")
    guard = CallGuard(LimitsConfig(), auth, open_auth=open_auth, public=["/s.S/Public"])
    names = [type(s).__name__ for s in guard.steps("/s.S/M")]
    assert names == ["_BanScreen", "AuthStep", "_Limits", "_CallTimeCap"]
    assert guard.steps("/s.S/M")[1].auth is auth and guard.steps("/s.S/Public")[1].auth is open_auth
    assert [type(s).__name__ for s in CallGuard(LimitsConfig()).steps("/s.S/M")] == \
        ["_BanScreen", "_Limits", "_CallTimeCap"]  # peer_auth = "none": no envelope step
    assert isinstance(guard.steps("/s.S/M")[1], AuthStep)


async def test_the_call_time_cap_ends_a_slow_call_with_deadline_exceeded_and_frees_its_slot():
    guard = CallGuard(LimitsConfig(max_call_s=0.05))

    async def slow(request, context):
        await asyncio.sleep(5)

    wrapped = wrap_handler(grpc.unary_unary_rpc_method_handler(slow), "/s.S/M",
                           [CallMetrics(), *guard.steps("/s.S/M")])
    ctx = Ctx()
    with pytest.raises(Aborted, match="limits.max_call_s"):
        await wrapped.unary_unary(b"", ctx)
    assert ctx.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED and guard.rejected == {"call_time": 1}
    assert guard._slots["s.S"].in_flight() == 0  # the limits step released the service slot
