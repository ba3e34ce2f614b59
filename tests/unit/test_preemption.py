"""node/preemption.py against fake AWS (IMDSv2) and GCP metadata servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from node import preemption
from node.preemption import PreemptionConfig, PreemptionWatcher

POLL = 0.05
pytestmark = pytest.mark.timeout(20)


class FakeMetadata:
    """AWS and GCP metadata endpoints in one server; notice after ``quiet`` polls."""

    def __init__(self, quiet: int = 2) -> None:
        self.quiet, self.polls, self.token_puts, self.bad_token, self.queries = quiet, 0, 0, 0, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.token_puts += 1
                    return self._send(200, b"tok-123")
                self._send(400)

            def do_GET(self):
                url = urlsplit(self.path)
                if url.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                        fake.bad_token += 1
                        return self._send(401)
                    fake.polls += 1
                    if fake.polls <= fake.quiet:
                        return self._send(404, b"Not Found")
                    body = json.dumps({"action": "terminate", "time": "2026-01-01T00:02:00Z"})
                    return self._send(200, body.encode(), {"Content-Type": "application/json"})
                if url.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403)
                    fake.queries.append(parse_qs(url.query))
                    fake.polls += 1
                    value = b"FALSE" if fake.polls <= fake.quiet else b"TRUE"
                    return self._send(200, value, {"Metadata-Flavor": "Google", "ETag": f"e{fake.polls}"})
                self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    f = FakeMetadata()
    yield f
    f.close()


def _dead_url(path: str) -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                   # nothing listens: connection refused
    return f"http://127.0.0.1:{port}{path}"


def _cfg(provider: str, base: str, **kw) -> PreemptionConfig:
    return PreemptionConfig(provider=provider, poll_interval_s=POLL,
                            aws_url=f"{base}/latest/meta-data/spot/instance-action",
                            aws_token_url=f"{base}/latest/api/token",
                            gcp_url=f"{base}/computeMetadata/v1/instance/preempted", **kw)


class Recorder:
    def __init__(self) -> None:
        self.notices, self.counts = [], []

    async def on_notice(self, source: str) -> None:
        self.notices.append(source)

    def on_count(self, source: str) -> None:
        self.counts.append(source)


async def test_aws_notice_fires_once_with_imdsv2_token(fake):
    rec = Recorder()
    w = PreemptionWatcher(_cfg("aws", fake.base), rec.on_notice, rec.on_count)
    t0 = time.monotonic()
    assert await asyncio.wait_for(w.run(), 5) == "aws"
    assert time.monotonic() - t0 < 10 * POLL + 1
    assert rec.notices == ["aws"] and rec.counts == ["aws"]
    assert fake.polls == 3 and fake.bad_token == 0
    assert fake.token_puts == 1                  # token cached between polls
    assert w.notice["action"] == "terminate"


async def test_gcp_notice_fires_once_and_long_polls(fake):
    rec = Recorder()
    w = PreemptionWatcher(_cfg("gcp", fake.base), rec.on_notice, rec.on_count)
    assert await asyncio.wait_for(w.run(), 5) == "gcp"
    assert rec.notices == ["gcp"] and rec.counts == ["gcp"]
    assert fake.queries[0] == {}                 # first: current value at once
    assert all(q["wait_for_change"] == ["true"] and "timeout_sec" in q for q in fake.queries[1:])
    assert fake.queries[2]["last_etag"] == ["e2"]


async def test_sync_callback_is_accepted(fake):
    seen = []
    w = PreemptionWatcher(_cfg("aws", fake.base), seen.append)   # returns None, not awaitable
    assert await asyncio.wait_for(w.run(), 5) == "aws" and seen == ["aws"]


async def test_server_down_keeps_polling_and_logs_sparingly(caplog):
    cfg = PreemptionConfig(provider="aws", poll_interval_s=0.01,
                           aws_url=_dead_url("/spot"), aws_token_url=_dead_url("/token"))
    rec = Recorder()
    w = PreemptionWatcher(cfg, rec.on_notice, rec.on_count)
    with caplog.at_level(logging.WARNING, logger="node.preemption"):
        task = asyncio.create_task(w.run())
        await asyncio.sleep(0.6)
        assert not task.done(), "watcher must keep polling while the server is down"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert w.errors >= 2 * preemption.LOG_EVERY and rec.notices == []
    failed = [r for r in caplog.records if getattr(r, "event", "") == "preemption_poll_failed"]
    assert 1 <= len(failed) <= w.errors // preemption.LOG_EVERY + 1


async def test_recovers_when_server_comes_back(fake):
    cfg = _cfg("aws", fake.base)
    w = PreemptionWatcher(cfg.model_copy(update={"aws_token_url": _dead_url("/token")}), lambda s: None)
    task = asyncio.create_task(w.run())
    await asyncio.sleep(5 * POLL)
    assert w.errors >= 2
    w.cfg = cfg                                  # the metadata server is reachable again
    assert await asyncio.wait_for(task, 5) == "aws" and w.errors == 0


async def test_none_returns_at_once():
    rec = Recorder()
    t0 = time.monotonic()
    assert await PreemptionWatcher(PreemptionConfig(), rec.on_notice, rec.on_count).run() is None
    assert time.monotonic() - t0 < 0.05 and rec.notices == [] and rec.counts == []


async def test_auto_picks_the_server_that_answers(fake, caplog):
    cfg = _cfg("auto", fake.base).model_copy(update={"gcp_url": _dead_url("/preempted")})
    rec = Recorder()
    with caplog.at_level(logging.INFO, logger="node.preemption"):
        assert await asyncio.wait_for(PreemptionWatcher(cfg, rec.on_notice).run(), 5) == "aws"
    assert rec.notices == ["aws"]
    assert any(getattr(r, "event", "") == "preemption_probe" for r in caplog.records)


async def test_auto_with_no_metadata_server_is_none():
    cfg = PreemptionConfig(provider="auto", aws_token_url=_dead_url("/t"), gcp_url=_dead_url("/p"))
    rec = Recorder()
    t0 = time.monotonic()
    assert await PreemptionWatcher(cfg, rec.on_notice).run() is None
    assert time.monotonic() - t0 < 1.5 and rec.notices == []


@pytest.mark.parametrize("bad, match", [
    ({"provider": "azure"}, "'none', 'aws', 'gcp' or 'auto'"),
    ({"poll_interval_s": 0}, "greater than 0"),
    ({"poll_interval_s": 60}, "use 30 or less"),
    ({"aws_drain_budget_s": 115}, "use 110 or less"),
    ({"gcp_url": "metadata.google.internal/x"}, "not an http"),
    ({"pol_interval_s": 5}, "Extra inputs are not permitted"),
])
def test_bad_config_is_rejected(bad, match):
    with pytest.raises(ValidationError, match=match):
        PreemptionConfig.model_validate(bad)


def test_fields_are_documented():
    for name, field in PreemptionConfig.model_fields.items():
        assert field.description, name
