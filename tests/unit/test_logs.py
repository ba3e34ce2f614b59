"""node/logs.py: JSON lines with context and extras, text format, queue flush, forks, hivemind."""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from node import logs
from node.logs import LogConfig, emit, set_context, setup_logging, shutdown_logging

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("swarmnode.test")


@pytest.fixture(autouse=True)
def _clean_logging():
    root = logging.getLogger()
    level = root.level
    yield
    shutdown_logging()
    root.setLevel(level)
    set_context(**{k: None for k in logs.get_context()})


def _strict(line: str) -> dict:
    def no_constants(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(line, parse_constant=no_constants)


def _run(cfg: LogConfig, fn) -> list[str]:
    buf = io.StringIO()
    setup_logging(cfg, stream=buf, hivemind=False)
    fn()
    shutdown_logging()
    return buf.getvalue().splitlines()


def test_json_line_has_core_context_and_extra_fields():
    lines = _run(LogConfig(), lambda: log.info("fetched %d tensors", 3, extra={
        "event": "state_sync", "bytes": 1024, "duration_s": 0.25}))
    [rec] = [_strict(x) for x in lines]
    assert list(rec)[:10] == ["ts", "level", "logger", "event", "msg",
                              "run_id", "peer_id", "role", "state", "round"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["ts"])
    assert rec["level"] == "info" and rec["logger"] == "swarmnode.test"
    assert rec["event"] == "state_sync" and rec["msg"] == "fetched 3 tensors"
    assert rec["bytes"] == 1024 and rec["duration_s"] == 0.25
    assert rec["peer_id"] is None


def test_context_is_stamped_as_of_the_log_call():
    def body():
        set_context(run_id="demo-0", peer_id="12D3KooWabc", role="noloco", state="ready", round=4)
        log.warning("first")
        set_context(state="draining", round=None, stage=2)
        log.warning("second", extra={"round": 9})
    first, second = [_strict(x) for x in _run(LogConfig(), body)]
    assert first["level"] == "warning" and first["event"] == "log"
    assert (first["run_id"], first["peer_id"], first["role"], first["state"], first["round"]) == \
        ("demo-0", "12D3KooWabc", "noloco", "ready", 4)
    assert second["state"] == "draining" and second["stage"] == 2
    assert second["round"] == 9                     # a call's own field wins over context


def test_text_format():
    def body():
        set_context(role="stage")
        log.info("hello %s", "world", extra={"event": "greet", "bytes": 5})
    [line] = _run(LogConfig(format="text"), body)
    assert re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z INFO +swarmnode\.test: hello world \[greet\]", line)
    assert "role=stage" in line and "bytes=5" in line


def test_non_serialisable_extras_do_not_crash():
    class Thing:
        def __repr__(self):
            return "<thing>"
    lines = _run(LogConfig(), lambda: log.error("odd", extra={
        "obj": Thing(), "nan": float("nan"), "tuple_keys": {(1, 2): 3}, "raw": b"\x00"}))
    [rec] = [_strict(x) for x in lines]
    assert rec["obj"] == "<thing>" and rec["nan"] == "nan" and rec["tuple_keys"] == {"(1, 2)": 3}


def test_exception_and_bad_format_args():
    def body():
        try:
            1 / 0
        except ZeroDivisionError:
            log.exception("boom")
    [boom] = [_strict(x) for x in _run(LogConfig(), body)]
    assert boom["level"] == "error" and "ZeroDivisionError" in boom["exc"]
    # pytest's own capture handler raises on a bad %-format, so check the formatter directly
    bad = logging.makeLogRecord({"msg": "%d items", "args": ("not-a-number",), "levelno": 20})
    assert "not-a-number" in _strict(logs.JsonFormatter().format(bad))["msg"]


def test_emit_event_fields_may_shadow_record_attributes():
    def body():
        set_context(peer_id="12D3KooWxyz")
        emit(log, "drain_step", step="grpc_stop", duration_s=0.41, name="weights", module="x")
        emit("swarmnode.other", "debug_thing", level=logging.DEBUG, n=1)   # below level: dropped
    [rec] = [_strict(x) for x in _run(LogConfig(), body)]
    assert rec["event"] == rec["msg"] == "drain_step"
    assert rec["step"] == "grpc_stop" and rec["name"] == "weights" and rec["module"] == "x"
    assert rec["peer_id"] == "12D3KooWxyz"


def test_emit_writes_each_value_once_the_message_is_a_template_over_the_fields():
    def body():
        emit(log, "round_done", "round {round}: loss {loss:.3f} from {peers} peers", round=7, loss=0.12345, peers=2)
        emit(log, "odd", "loss {loss:.3f} of {missing}", loss=None)            # does not fit: still logged
        emit(log, "warned", "value {v}", level=logging.WARNING, v=1)
        try:
            1 / 0
        except ZeroDivisionError as exc:
            emit(log, "failed", "step failed: {error}", level=logging.ERROR, exc_info=exc, error=repr(exc))
    done, odd, warned, failed = [_strict(x) for x in _run(LogConfig(), body)]
    assert done["msg"] == "round 7: loss 0.123 from 2 peers" and done["event"] == "round_done"
    assert done["round"] == 7 and done["loss"] == 0.12345 and done["peers"] == 2
    assert odd["msg"] == "loss {loss:.3f} of {missing}" and odd["loss"] is None
    assert warned["level"] == "warning" and warned["msg"] == "value 1"
    assert failed["level"] == "error" and "ZeroDivisionError" in failed["exc"] and failed["error"].startswith("Zero")
    text = _run(LogConfig(format="text"), lambda: emit(log, "round_done", "round {round}", round=3))
    assert text[0].endswith("round 3 [round_done] round=3")


def test_level_filter():
    lines = _run(LogConfig(level="warning"), lambda: (log.info("no"), log.warning("yes")))
    assert [_strict(x)["msg"] for x in lines] == ["yes"]


def test_shutdown_flushes_every_queued_record():
    lines = _run(LogConfig(), lambda: [log.info("n=%d", i) for i in range(3000)])
    assert len(lines) == 3000 and _strict(lines[-1])["msg"] == "n=2999"


def test_full_queue_drops_instead_of_blocking(monkeypatch):
    monkeypatch.setattr(logs, "QUEUE_SIZE", 5)
    gate = threading.Event()

    class Stalled(io.StringIO):
        def write(self, s):
            gate.wait(5)
            return super().write(s)

    buf = Stalled()
    setup_logging(LogConfig(), stream=buf, hivemind=False)
    for i in range(50):                 # must return at once although stdout is stalled
        log.info("r%d", i)
    gate.set()
    time.sleep(0.2)
    log.info("after")
    shutdown_logging()
    recs = [_strict(x) for x in buf.getvalue().splitlines()]
    assert len(recs) < 51 and recs[-1]["msg"] == "after" and recs[-1]["dropped_before"] > 0


def test_reconfigure_replaces_handler():
    a, b = io.StringIO(), io.StringIO()
    setup_logging(LogConfig(), stream=a, hivemind=False)
    setup_logging(LogConfig(format="text"), stream=b, hivemind=False)
    log.info("once")
    shutdown_logging()
    assert a.getvalue() == "" and b.getvalue().count("once") == 1


def test_sets_golog_fmt(monkeypatch):
    monkeypatch.delenv("GOLOG_LOG_FMT", raising=False)
    _run(LogConfig(), lambda: None)
    assert os.environ["GOLOG_LOG_FMT"] == "json"


def _child_logs():
    logging.getLogger("swarmnode.child").warning("from the forked child", extra={"event": "child"})


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_forked_child_writes_directly(tmp_path):
    path = tmp_path / "out.log"
    with open(path, "w") as f:
        setup_logging(LogConfig(), stream=f, hivemind=False)
        p = multiprocessing.get_context("fork").Process(target=_child_logs)
        p.start()
        p.join(10)
        if p.is_alive():  # a hung child is stopped by its PID before the assert reports it
            p.kill()
            p.join()
        shutdown_logging()
    recs = [_strict(x) for x in path.read_text().splitlines()]
    assert p.exitcode == 0 and [r["event"] for r in recs] == ["child"]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_import_is_cheap():
    r = _python("import sys, node.logs; bad = {'hivemind', 'torch', 'grpc'} & set(sys.modules); "
                "assert not bad, bad; "
                "node.logs.setup_logging(node.logs.LogConfig(), hivemind=False); "
                "assert 'hivemind' not in sys.modules")
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(120)
def test_hivemind_logs_reach_the_root_handler_once():
    """In a subprocess: hivemind must not share a process with py-libp2p (docs/architecture.md, 'Processes')."""
    pytest.importorskip("hivemind")
    r = _python(
        "import logging, sys\n"
        "from node.logs import LogConfig, setup_logging, shutdown_logging\n"
        "setup_logging(LogConfig())\n"
        "from hivemind.utils.logging import get_logger\n"
        "get_logger('hivemind.dht.node').warning('hello from hivemind')\n"
        "shutdown_logging()\n")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if "hello from hivemind" in x]
    assert len(lines) == 1 and lines[0]["level"] == "warning" and lines[0]["logger"] == "hivemind.dht.node"
    assert "hello from hivemind" not in r.stderr      # hivemind's own colored handler is off


def test_config_validation():
    with pytest.raises(ValidationError, match="'debug', 'info', 'warning' or 'error'"):
        LogConfig(level="verbose")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        LogConfig.model_validate({"fmt": "json"})
    for name, field in LogConfig.model_fields.items():
        assert field.description, name
