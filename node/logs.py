"""JSON-lines logging on stdout, written off the hot path.

Owns the ``[log]`` config section, the root handler (a ``QueueHandler`` whose listener thread
formats and writes), the per-node log context and ``emit``. Does not own event names (each
module picks stable ones: ``state_changed``, ``drain_step`` ...) nor metrics.

    setup_logging(cfg.log)                            # once, in `swarmnode run`
    set_context(run_id=cfg.run_id, role=cfg.role, peer_id=peer_id, state="joining")
    emit(log, "drain_step", "drain step {step} took {duration_s:.2f} s", step="grpc_stop", duration_s=0.41)
    # {"ts":"2026-05-01T12:00:00.123Z","level":"info","logger":"node.drain","event":"drain_step",
    #  "msg":"drain step grpc_stop took 0.41 s","run_id":"demo-0","peer_id":"12D3KooW…","role":"noloco",
    #  "state":"draining","round":null,"step":"grpc_stop","duration_s":0.41}

hivemind's loggers propagate into the root handler (their own colored handler is switched off),
p2pd lines arrive through hivemind with their original timestamp. Processes forked after setup
(hivemind's DHT and averagers) write directly, since the listener thread does not survive a fork.
The queue is bounded: if stdout stalls, records are dropped rather than blocking training, and
the next record written carries ``dropped_before``.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import os
import queue
import sys
import time
from typing import Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict

CONTEXT_KEYS = ("run_id", "peer_id", "role", "state", "round")
_CORE_KEYS = ("ts", "level", "logger", "event", "msg")
_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
           logging.ERROR: "error", logging.CRITICAL: "critical"}
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName", "event", "_ctx", "_fields", "origin_created",
    "caller_block", "levelcolor", "bold", "reset"}
QUEUE_SIZE = 10_000

_CONTEXT: dict[str, Any] = {}


class LogConfig(BaseModel):
    """``[log]``: level and format of the node's log lines."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written. Use "debug" to see p2pd and per-request detail while chasing a
    join or averaging problem; it is verbose."""

    format: Literal["json", "text"] = "json"
    """"json" (one object per line, for log shippers and `jq`) or "text" for a human at a
    terminal. Keep json in containers."""


def set_context(**fields: Any) -> None:
    """Set fields stamped on every later record (None removes one), e.g. after a state change."""
    global _CONTEXT
    merged = {**_CONTEXT, **fields}
    _CONTEXT = {k: v for k, v in merged.items() if v is not None}


def get_context() -> dict[str, Any]:
    return dict(_CONTEXT)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x) for x in v]
    return str(v)


def _fields(record: logging.LogRecord) -> tuple[dict[str, Any], dict[str, Any]]:
    """(context, extra fields) of a record; context as captured when it was logged."""
    ctx = record.__dict__.get("_ctx")
    extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
    extras.update(record.__dict__.get("_fields") or {})
    return (_CONTEXT if ctx is None else ctx), extras


def _message(record: logging.LogRecord) -> str:
    try:
        msg = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad %-format must not lose the record
        msg = f"{record.msg!r} % {record.args!r}"
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    return msg


def _ts(record: logging.LogRecord) -> str:
    created = getattr(record, "origin_created", record.created)  # p2pd lines keep their time
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: core keys, context keys (null if unset), then extras."""

    def format(self, record: logging.LogRecord) -> str:
        ctx, extras = _fields(record)
        out: dict[str, Any] = {"ts": _ts(record), "level": _LEVELS.get(record.levelno, record.levelname.lower()),
                               "logger": record.name, "event": getattr(record, "event", None) or "log",
                               "msg": _message(record)}
        out.update({k: ctx.get(k) for k in CONTEXT_KEYS})
        for k, v in ctx.items():
            out.setdefault(k, v)
        for k, v in extras.items():  # a call's own fields win over the context (round=7)
            out[k if k not in _CORE_KEYS else f"x_{k}"] = v
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        try:
            return json.dumps(out, default=str, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError):
            return json.dumps(_jsonable(out), ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg [event] key=value …`` for humans."""

    def format(self, record: logging.LogRecord) -> str:
        ctx, extras = _fields(record)
        level = _LEVELS.get(record.levelno, record.levelname).upper()
        line = f"{_ts(record)} {level:<7} {record.name}: {_message(record)}"
        event = getattr(record, "event", None)
        if event and event != record.msg:
            line += f" [{event}]"
        pairs = {**{k: ctx[k] for k in CONTEXT_KEYS if k in ctx}, **extras}
        line += "".join(f" {k}={v}" for k, v in pairs.items())
        return line + (f"\n{record.exc_text}" if record.exc_text else "")


class _Handler(logging.handlers.QueueHandler):
    """Captures message and context in the caller's thread; never blocks on a full queue."""

    dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        msg = _message(record)
        record = logging.makeLogRecord(record.__dict__)
        record.msg, record.args, record.exc_info, record.message = msg, None, None, msg
        record._ctx = _CONTEXT
        if self.dropped:
            n, self.dropped = self.dropped, 0
            record.dropped_before = n
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Listener(logging.handlers.QueueListener):
    def enqueue_sentinel(self) -> None:
        self.queue.put(self._sentinel, timeout=5)  # waits for room instead of raising Full


_state: dict[str, Any] = {}


def setup_logging(cfg: LogConfig, stream: TextIO | None = None, hivemind: bool = True) -> None:
    """Route the root logger (and hivemind's) through one queue to ``stream`` (default
    stdout). Safe to call again: the previous handler is flushed and replaced.

    ``hivemind=True`` imports hivemind (seconds: it pulls in torch) to reroute its loggers.
    Pass False in the py-libp2p sidecar, which must never import hivemind (docs/architecture.md),
    and in light tools; ``route_hivemind_logs()`` can still be called later."""
    shutdown_logging()
    stream = stream if stream is not None else sys.stdout
    os.environ.setdefault("GOLOG_LOG_FMT", "json")
    formatter = JsonFormatter() if cfg.format == "json" else TextFormatter()
    out = logging.StreamHandler(stream)
    out.setFormatter(formatter)
    q: queue.Queue = queue.Queue(QUEUE_SIZE)
    handler, listener = _Handler(q), _Listener(q, out)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(cfg.level.upper())
    listener.start()
    _state.update(handler=handler, listener=listener, out=out)
    if not _state.get("hooks"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        atexit.register(shutdown_logging)
        _state["hooks"] = True
    if hivemind:
        route_hivemind_logs()


def route_hivemind_logs() -> bool:
    """Send hivemind's (and p2pd's) records to the root handler; False if hivemind is absent."""
    try:  # lazily: hivemind is heavy and node/logs.py must stay cheap to import
        from hivemind.utils.logging import use_hivemind_log_handler
    except ImportError:
        return False
    # "nowhere" = hivemind's own colored handler off, its loggers propagate to our root handler.
    # ("in_root_logger" would put hivemind's stderr handler on the root logger next to ours.)
    use_hivemind_log_handler("nowhere")
    return True


def _after_fork_in_child() -> None:
    """A forked child has no listener thread: write directly through the same formatter."""
    handler, out = _state.pop("handler", None), _state.pop("out", None)
    _state.pop("listener", None)
    if handler is not None:
        root = logging.getLogger()
        root.removeHandler(handler)
        root.addHandler(out)


def shutdown_logging() -> None:
    """Write out every queued record and detach the handler (call last in drain step 6)."""
    handler, listener, out = (_state.pop(k, None) for k in ("handler", "listener", "out"))
    if handler is None:
        return
    logging.getLogger().removeHandler(handler)
    listener.stop()
    out.flush()


def emit(logger: logging.Logger | str, event: str, msg: str | None = None, /, *, level: int = logging.INFO,
         exc_info: Any = None, **fields: Any) -> None:
    """Write the structured event ``event`` with ``fields``: the way every event is logged.

    ``msg`` is the human line, a ``str.format`` template over the same fields, so each value is
    written once::

        emit(log, "round_done", "round {round}: loss {loss:.4f}, {peers} peers", round=r, loss=x, peers=n)

    (no ``msg``: the line is the event name). Units go in the field names (``duration_s``,
    ``bytes``); field names may shadow LogRecord attributes (``name``, ``module`` ...). A
    template that does not fit its fields (a None where ``:.3f`` wants a number) still logs,
    with the fields. ``exc_info`` as in ``logging`` (an exception or True)."""
    lg = logging.getLogger(logger) if isinstance(logger, str) else logger
    if not lg.isEnabledFor(level):
        return
    text = event if msg is None else _format(msg, fields)
    fn, lno, func, _ = lg.findCaller(stacklevel=2)
    if exc_info is True:
        exc_info = sys.exc_info()
    elif isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    record = lg.makeRecord(lg.name, level, fn, lno, text, (), exc_info or None, func)
    record.event, record._fields = event, fields
    lg.handle(record)


def _format(template: str, fields: dict[str, Any]) -> str:
    try:
        return template.format_map(fields)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return template  # the fields are in the record anyway
