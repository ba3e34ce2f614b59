"""How a stream between two peers fails, as exceptions both ends share.

Owns the error vocabulary of ``protocol/streams.py`` (and of the roles above it): a server
refuses with :class:`Refused` (a gRPC status plus ``"reason: detail"``), a client sees any
failed or refused stream as :class:`StreamError` whose ``reason`` it can count and whose
``refusal`` is the server's own reason word, e.g. ``busy`` or ``not_root:<peer>``.

    PeerError(reason, detail)  >  StreamError(reason, detail, code, refusal)  >  StreamClosed
    Refused(code, reason, detail)            # raise in a server: answer the status, end the call
    error_of(grpc.aio.AioRpcError) -> StreamError;  refusal_of(details) -> reason word | ""
"""

from __future__ import annotations

import re

import grpc

__all__ = ["PeerError", "Refused", "StreamError", "StreamClosed", "error_of", "refusal_of"]


class PeerError(Exception):
    """The peer's stream ended, failed or refused mid-way; ``reason`` is a short label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason, self.detail = reason, detail or reason


class Refused(Exception):
    """A server-side refusal: answer ``code`` with ``"{reason}: {detail}"`` and end the call."""

    def __init__(self, code: grpc.StatusCode, reason: str, detail: str):
        super().__init__(detail)
        self.code, self.reason, self.detail = code, reason, detail


class StreamError(PeerError):
    """An open tensor stream failed. ``reason``: a TensorRejected reason (``checksum``, ``size``,
    ``malformed``, ...) when a frame was bad, else ``peer_error``/``timeout``/``refused``/``closed``.
    ``code``: the gRPC status the call ended with, when there was one; ``refusal``: the reason
    word of the server's :class:`Refused` ("" when it ended otherwise)."""

    def __init__(self, reason: str, detail: str = "", code: grpc.StatusCode | None = None, refusal: str = ""):
        super().__init__(reason, detail)
        self.code, self.refusal = code, refusal


class StreamClosed(StreamError):
    """The peer ended the stream cleanly (or we closed it): nothing more will arrive."""

    def __init__(self, detail: str = "the stream is closed"):
        super().__init__("closed", detail)


_REASON_RE = re.compile(r"^\[(\w+)\]")
_REFUSAL_RE = re.compile(r"^(\S+): ")  # Refused's "reason: detail" (a reason may hold a colon: not_root:<peer>)


def error_of(exc: grpc.aio.AioRpcError) -> StreamError:
    """The StreamError of a failed call: ``[reason]`` details (a rejected frame) name the
    reason; FAILED_PRECONDITION is "refused", DEADLINE_EXCEEDED "timeout", anything else
    "peer_error"."""
    code, details = exc.code(), exc.details() or ""
    m = _REASON_RE.match(details)
    if m:
        reason = m.group(1)
    elif code == grpc.StatusCode.FAILED_PRECONDITION:
        reason = "refused"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        reason = "timeout"
    else:
        reason = "peer_error"
    return StreamError(reason, f"{code.name}: {details}", code, refusal_of(details))


def refusal_of(details: str | None) -> str:
    """The reason word of a :class:`Refused` status text (``"busy: ..."`` -> ``"busy"``), or ""."""
    m = _REFUSAL_RE.match(details or "")
    return m.group(1) if m else ""
