"""Spot preemption watchers: poll the cloud metadata server, fire the drain once (docs/operations.md, 'Drain and preemption').

Owns the ``[preemption]`` config section and the polling. Does not own the drain itself
(node/lifecycle) nor the metric: the caller passes ``on_count`` to increment
``swarmnode_preemption_notices_total{source}`` and ``on_notice`` to start the drain.

    watcher = PreemptionWatcher(cfg.preemption, on_notice=drain.start, on_count=count_notice)
    supervisor.spawn("preemption", watcher.run)   # a factory; run() returns after one notice, or at once for "none"

- **aws**: IMDSv2. ``PUT aws_token_url`` for a token, then ``GET aws_url`` with it every
  ``poll_interval_s``; 404 = no notice, 200 + ``{"action": "terminate"|"stop", "time": ...}`` =
  notice (about 2 minutes ahead, best effort). Inside Docker's bridge network the token PUT
  times out unless the instance allows two hops:
  ``aws ec2 modify-instance-metadata-options --instance-id I --http-put-response-hop-limit 2``.
- **gcp**: ``GET gcp_url`` with ``Metadata-Flavor: Google``, then long polls with
  ``wait_for_change=true``; body ``TRUE`` = notice. Spot VMs get 30 s, so keep drain.budget_s <= 25.
- **auto**: probe both once (0.5 s) and use the one that answers; none answers -> no watcher.

HTTP is stdlib urllib without proxies, run in daemon threads so a long poll never holds up the
process exit. Network errors never stop the watcher: they are logged on the first failure and
then every ``LOG_EVERY`` failures, and polling continues.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Awaitable, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from node.logs import emit

log = logging.getLogger(__name__)

LOG_EVERY = 12          # failed polls between two error logs (1 min at the default 5 s)
PROBE_TIMEOUT_S = 0.5   # "auto" probe, per metadata server
HTTP_TIMEOUT_S = 2.0    # one AWS request; metadata servers answer in milliseconds
GCP_WAIT_S = 30         # server-side hang of one GCP wait_for_change request
AWS_TOKEN_TTL_S = 21600
_NOTICE_ACTIONS = ("terminate", "stop", "hibernate")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via HTTP_PROXY


class PreemptionConfig(BaseModel):
    """``[preemption]``: which cloud's spot notice starts a drain."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    provider: Literal["none", "aws", "gcp", "auto"] = "none"
    """Where notices come from. Set "aws" or "gcp" on spot VMs, "auto" if one image runs on
    both; "none" elsewhere (a laptop, bare metal): SIGTERM still drains."""

    aws_url: str = "http://169.254.169.254/latest/meta-data/spot/instance-action"
    """IMDSv2 spot instance-action URL. Change only for a test double."""

    aws_token_url: str = "http://169.254.169.254/latest/api/token"
    """IMDSv2 session-token URL. Change only for a test double."""

    gcp_url: str = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
    """GCP metadata ``instance/preempted`` URL. Change only for a test double."""

    poll_interval_s: float = Field(5.0, gt=0)
    """Seconds between AWS polls (AWS advises 5), and the shortest gap between GCP long
    polls. Raising it eats into the 2-minute AWS notice."""

    aws_drain_budget_s: float = Field(90.0, gt=0)
    """Drain budget used instead of drain.budget_s after an AWS notice, so a stage can hand
    over its weights. Keep it below the 120 s notice minus poll_interval_s."""

    @field_validator("poll_interval_s")
    @classmethod
    def _poll(cls, v: float) -> float:
        if v > 30:
            raise ValueError(f"preemption.poll_interval_s={v} would miss most of AWS's 120 s "
                             "notice; use 30 or less (5 is AWS's advice)")
        return v

    @field_validator("aws_drain_budget_s")
    @classmethod
    def _aws_budget(cls, v: float) -> float:
        if v > 110:
            raise ValueError(f"preemption.aws_drain_budget_s={v} does not fit AWS's 120 s "
                             "notice after polling delay; use 110 or less (default 90)")
        return v

    @field_validator("aws_url", "aws_token_url", "gcp_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL; give the metadata server's full URL")
        return v


def _http(method: str, url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes, Any]:
    """One request; HTTP error statuses are returned, network errors raised."""
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=b"" if method == "PUT" else None)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read(65536), resp.headers
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read(65536), err.headers


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a daemon thread (unlike asyncio.to_thread, exit never waits for it)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            ok, value = False, exc
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # loop closed while we waited
            pass

    threading.Thread(target=work, name="preemption-http", daemon=True).start()
    return await fut


class PreemptionWatcher:
    """Polls one metadata server until a notice, then calls ``on_notice(source)`` once."""

    def __init__(self, cfg: PreemptionConfig,
                 on_notice: Callable[[str], Awaitable[None] | None],
                 on_count: Callable[[str], None] | None = None) -> None:
        self.cfg, self._on_notice, self._on_count = cfg, on_notice, on_count
        self.source: str | None = None        # resolved provider once run() starts polling
        self.notice: dict[str, Any] | None = None
        self.errors = 0                       # consecutive failed polls
        self._token: str | None = None
        self._token_at = 0.0
        self._etag: str | None = None

    async def run(self) -> str | None:
        """Poll until a notice; return its source ("aws"/"gcp"), or None with no provider."""
        source = self.cfg.provider
        if source == "auto":
            source = await self._probe()
        if source == "none":
            return None
        self.source = source
        once = self._aws_once if source == "aws" else self._gcp_once
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                self.notice = await _in_thread(once)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a watcher must never crash the node
                self.errors += 1
                if self.errors == 1 or self.errors % LOG_EVERY == 0:
                    emit(log, "preemption_poll_failed", "{source} metadata poll failed ({failures} in a row): "
                         "{error}; still polling", level=logging.WARNING, source=source, failures=self.errors,
                         error=str(exc))
            else:
                if self.errors:
                    emit(log, "preemption_poll_recovered", "{source} metadata answers again after {failures} "
                         "failed polls", source=source, failures=self.errors)
                self.errors = 0
                if self.notice is not None:
                    break
            await asyncio.sleep(max(0.0, self.cfg.poll_interval_s - (loop.time() - started)))
        emit(log, "preemption_notice", "spot preemption notice from {source}: {notice}", level=logging.WARNING,
             source=source, notice=self.notice)
        if self._on_count is not None:
            try:
                self._on_count(source)
            except Exception:  # noqa: BLE001 - a metric must not stop the drain
                emit(log, "preemption_count_failed", "preemption on_count hook failed", level=logging.ERROR,
                     exc_info=True)
        result = self._on_notice(source)
        if inspect.isawaitable(result):
            await result
        return source

    async def _probe(self) -> str:
        """'auto': ask both metadata servers once and keep the one that answers."""
        def aws() -> bool:
            st, _, _ = _http("PUT", self.cfg.aws_token_url,
                             {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, PROBE_TIMEOUT_S)
            return st == 200

        def gcp() -> bool:
            st, _, hdr = _http("GET", self.cfg.gcp_url, {"Metadata-Flavor": "Google"}, PROBE_TIMEOUT_S)
            return st == 200 and hdr.get("Metadata-Flavor", "Google") == "Google"

        async def answers(fn: Callable[[], bool]) -> bool:
            try:  # the outer timeout also covers slow DNS, which urllib's timeout does not
                return await asyncio.wait_for(_in_thread(fn), PROBE_TIMEOUT_S + 0.5)
            except Exception:  # noqa: BLE001 - no answer is the common case
                return False

        got_aws, got_gcp = await asyncio.gather(answers(aws), answers(gcp))
        source = "aws" if got_aws else "gcp" if got_gcp else "none"
        emit(log, "preemption_probe", "preemption provider auto -> {source} (aws answered: {aws}, gcp answered: "
             "{gcp})", source=source, aws=got_aws, gcp=got_gcp)
        return source

    def _aws_once(self) -> dict[str, Any] | None:
        """One IMDSv2 poll (blocking): the notice dict, None for no notice, raise on failure."""
        if self._token is None or time.monotonic() - self._token_at > AWS_TOKEN_TTL_S - 60:
            try:
                st, body, _ = _http("PUT", self.cfg.aws_token_url,
                                    {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                                    HTTP_TIMEOUT_S)
            except (TimeoutError, urllib.error.URLError) as exc:
                if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                    raise RuntimeError("IMDSv2 token PUT timed out; inside a container set the "
                                       "instance's http-put-response-hop-limit to 2") from exc
                raise
            if st != 200:
                raise RuntimeError(f"IMDSv2 token request returned HTTP {st}; is "
                                   f"{self.cfg.aws_token_url} an EC2 metadata server?")
            self._token, self._token_at = body.decode().strip(), time.monotonic()
        st, body, _ = _http("GET", self.cfg.aws_url,
                            {"X-aws-ec2-metadata-token": self._token}, HTTP_TIMEOUT_S)
        if st == 404:
            return None
        if st == 401:
            self._token = None
            raise RuntimeError("IMDSv2 token rejected (HTTP 401); fetching a new one next poll")
        if st != 200:
            raise RuntimeError(f"spot instance-action returned HTTP {st}")
        data = json.loads(body)
        if not isinstance(data, dict) or "action" not in data:
            raise ValueError(f"spot instance-action body has no 'action': {body[:200]!r}")
        return data if data["action"] in _NOTICE_ACTIONS else None

    def _gcp_once(self) -> dict[str, Any] | None:
        """One GCP poll (blocking): the first asks at once, later ones wait for a change."""
        url = self.cfg.gcp_url
        timeout = HTTP_TIMEOUT_S
        if self._etag is not None:
            query = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": GCP_WAIT_S}
            url += ("&" if "?" in url else "?") + urllib.parse.urlencode(query)
            timeout = GCP_WAIT_S + 5
        st, body, hdr = _http("GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if st != 200:
            raise RuntimeError(f"GCP metadata instance/preempted returned HTTP {st}")
        self._etag = hdr.get("ETag") or self._etag or "0"
        value = body.decode(errors="replace").strip().upper()
        return {"preempted": value} if value == "TRUE" else None
