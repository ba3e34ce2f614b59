"""Daemon side of the event bus: spawn and supervise the sidecar, talk to it over gRPC.

Owns :class:`EventBus`, what the daemon and roles use: ``publish(topic, data)``,
``announce(kind, **fields)`` (a signed ``swarm`` notice), ``messages(topics)`` (an async
iterator of :class:`Delivery` that survives sidecar restarts), ``set_peers`` (gossip addresses
from node cards), ``snapshot()`` (peers, mesh, counters, reachability) and ``status()`` (for
``/readyz`` details and the node card). The sidecar runs as ``python -m node.eventbus.sidecar``
(a fresh interpreter, never a fork of this hivemind process); it is restarted with backoff
when it dies, up to ``eventbus.restart_max`` times, after which the bus reports ``failed`` and
roles stay on their DHT fallback. Everything the sidecar hands over is re-verified here
(topic, size, the sender rule of ``gate.py``: a live member allowed on the topic, originator
signature, notice schema): its output carries peers' bytes.

Imports grpc, msgpack, ``security.keys`` / ``security.limits`` and ``node.logs`` only (no
hivemind, no libp2p).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import base58
import grpc

from node.eventbus import metrics as bus_metrics
from node.eventbus.config import TOPICS, EventBusConfig
from node.eventbus.gate import SenderGate
from node.eventbus.wire import Notice, NoticeError, decode_notice, encode_notice, verify_message
from node.logs import emit
from protocol import eventbus_pb2, eventbus_pb2_grpc
from security.limits import BanList

log = logging.getLogger("swarmnode.eventbus")
# = sidecar.READY_PREFIX / ERROR_PREFIX (not imported: the sidecar imports libp2p)
READY_PREFIX, ERROR_PREFIX = "EVENTBUS_READY ", "EVENTBUS_ERROR "
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


#: A sidecar that served this long before dying restarts after the shortest delay, and its death
#: does not count towards ``eventbus.restart_max``.
STABLE_S = 60.0


def restart_delay(failures: int, cap_s: float) -> float:
    """Seconds to wait before the next start after ``failures`` (>= 1) failures in a row:
    0.5, 1, 2, 4 ... up to ``cap_s`` (``eventbus.restart_backoff_max_s``)."""
    return min(cap_s, 0.5 * 2 ** max(0, failures - 1))


class EventBusUnavailable(RuntimeError):
    """The sidecar is not running (starting, restarting, disabled or given up): use the DHT path."""


@dataclass
class Delivery:
    """One message from a peer, its signature checked in this process."""

    topic: str
    data: bytes
    sender: str            # base58 peer ID of the originator (signed)
    seqno: bytes
    received_at: float     # sidecar clock, unix seconds
    forwarder: str = ""
    notice: Notice | None = None   # decoded for the ``swarm`` topic


def _in_own_thread(fn: Callable[[], Any], name: str) -> "asyncio.Future[Any]":
    """Run blocking ``fn`` on a fresh daemon thread and return a future for its result.

    Not ``asyncio.to_thread``: the default executor has ``cpu_count + 4`` threads (6 on a 2-core
    box), and a ``proc.wait()`` per supervised sidecar would hold one each for the sidecar's whole
    life. With 8 sidecars in one process the pool was full of waits, so ``stop()``'s kill (the
    only thing that ends a wait) queued behind them forever: the 8-node benchmark hung."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, False, exc)
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class SidecarProcess:
    """One run of the child process: start, wait until it serves, kill."""

    def __init__(self, spec: dict[str, Any], start_timeout_s: float):
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        """Blocking: spawn and wait for the ready line (run it in a thread)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "node.eventbus.sidecar", json.dumps(self.spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=_REPO_ROOT)
        result: dict[str, Any] = {}
        error: list[str] = []

        def read_ready() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith(READY_PREFIX) and not result:
                    result.update(json.loads(line[len(READY_PREFIX):]))
                    ready_evt.set()
                elif line.startswith(ERROR_PREFIX):
                    error.append(line[len(ERROR_PREFIX):])
            ready_evt.set()  # EOF: the child exited

        ready_evt = threading.Event()
        threading.Thread(target=read_ready, name="eventbus-stdout", daemon=True).start()
        came = ready_evt.wait(self.start_timeout_s)
        if not came or not result:
            code = self.proc.poll()
            if came and code is None:  # its stdout closed: it is exiting
                try:
                    code = self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            self.kill()
            if code is None:
                raise RuntimeError(f"event-bus sidecar did not come up within {self.start_timeout_s:g} s "
                                   "(eventbus.start_timeout_s); see its log lines above")
            reason = error[0] if error else (f"see its log lines above (is port {self.spec['eventbus']['port']} "
                                             "free? eventbus.port)")
            raise RuntimeError(f"event-bus sidecar exited with code {code} during start: {reason}")
        self.ready = result
        return result

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the sidecar's signal to stop
            self.proc.wait(timeout=2.0)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(timeout=5.0)


class EventBus:
    """The daemon's handle on its sidecar. Make it on the event loop; run ``supervise()`` as a
    background task (it starts the sidecar; or ``await start()`` first to see start errors);
    ``await stop()`` on drain. ``expected_peer_id``: refuse a sidecar whose peer ID differs
    (the DHT's). ``members_only``: accept a message only from a live member allowed on its
    topic (``set_members``; node/eventbus/gate.py), what every node does; off only for a bus
    without a swarm (node/eventbus/localbus.py). ``bans``: the node's ban list (strikes and bans
    land there); ``ban``: threshold, window_s and ban_s of the sidecar's own strikes
    (``[limits]``)."""

    def __init__(self, cfg: EventBusConfig, *, run_id: str, key_path: str, listen_host: str,
                 advertise_host: str | None = None, allow_insecure_key: bool = False, verbose: bool = False,
                 expected_peer_id: str = "", members_only: bool = False, bans: BanList | None = None,
                 ban: dict[str, float] | None = None):
        self.cfg, self.run_id = cfg, run_id
        self._own_dir = cfg.socket_dir is None
        sock_dir = Path(tempfile.mkdtemp(prefix="sn-bus-")) if self._own_dir else Path(cfg.socket_dir).expanduser()
        sock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(sock_dir, 0o700)
        self.socket_dir = sock_dir
        self.socket_path = str(sock_dir / "eventbus.sock")
        if len(self.socket_path) > 107:
            raise ValueError(f"eventbus socket path {self.socket_path} is over 107 bytes; set a shorter "
                             "eventbus.socket_dir")
        self._spec = {"run_id": run_id, "key_path": key_path, "allow_insecure_key": allow_insecure_key,
                      "listen_host": listen_host, "advertise_host": advertise_host,
                      "announce_addrs": cfg.announce_addrs, "socket_path": self.socket_path,
                      "eventbus": cfg.model_dump(mode="json"), "verbose": verbose,
                      "members_only": members_only, "ban": ban or {}}
        self.members_only = members_only
        self.gate = SenderGate(cfg, bans=bans, ban=ban)
        self.proc: SidecarProcess | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: eventbus_pb2_grpc.EventBusStub | None = None
        self.peer_id = ""
        self.advertised_addrs: list[str] = []
        self.expected_peer_id = expected_peer_id
        self.restarts = 0
        self.state = "starting"       # starting | up | restarting | failed | stopped
        self.last_error = ""
        self._up = asyncio.Event()
        self._stopping = False
        self._known: dict[str, list[str]] = {}
        self._snapshot: eventbus_pb2.PeersReply | None = None
        self._listeners: list[Callable[[Delivery], Any]] = []
        self.on_up: list[Callable[["EventBus"], None]] = []   # called after every (re)start
        self.notices_seen: dict[str, tuple[str, float]] = {}   # peer -> (kind, when) of its last notice
        self.counters = bus_metrics.BusCounters()
        bus_metrics.register(self)

    # ---- life ----
    async def start(self) -> None:
        """Spawn the sidecar and connect; raises RuntimeError with the reason if it cannot start."""
        if self.state != "restarting":
            self.state = "starting"
        proc = SidecarProcess(self._spec, self.cfg.start_timeout_s)
        try:
            ready = await _in_own_thread(proc.start, "eventbus-start")
        except Exception as exc:
            self.last_error = str(exc)
            raise
        problem = ""
        if self._stopping:
            problem = "event bus stopped while its sidecar was starting"
        elif ready.get("hivemind_loaded"):
            problem = "event-bus sidecar loaded hivemind: it must not (protobuf clash); this is a bug"
        elif self.expected_peer_id and ready.get("peer_id") != self.expected_peer_id:
            problem = (f"event-bus sidecar has peer ID {ready.get('peer_id')}, the DHT {self.expected_peer_id}: "
                       "both must load the same identity.path key file")
        if problem:
            await _in_own_thread(proc.kill, "eventbus-kill")
            self.last_error = problem
            raise RuntimeError(problem)
        self.proc = proc
        self.peer_id = ready["peer_id"]
        self.advertised_addrs = list(ready.get("advertised_addrs") or [])
        if self.channel is not None:
            await self.channel.close()
        self.channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}", options=[
            ("grpc.max_receive_message_length", 4 * max(self.cfg.caps().values()) + 4096),
            ("grpc.max_send_message_length", 4 * max(self.cfg.caps().values()) + 4096)])
        self.stub = eventbus_pb2_grpc.EventBusStub(self.channel)
        if self._known:
            await self._set_peers_rpc(self._known)
        if self.members_only and self.gate.members.known:
            await self._set_members_rpc()
        self.state = "up"
        self.last_error = ""
        self._up.set()
        for cb in list(self.on_up):
            cb(self)
        emit(log, "eventbus_up", "event-bus sidecar up (pid {pid}), gossip at {where}", pid=proc.pid,
             where=", ".join(self.advertised_addrs), addrs=self.advertised_addrs)

    async def supervise(self) -> None:
        """Start the sidecar if it is not up, and restart it with backoff whenever it dies.

        Returns after :meth:`stop`, or when ``eventbus.restart_max`` starts in a row have failed
        or died young (state ``failed``: roles stay on the DHT fallback). A sidecar that served
        for ``STABLE_S`` resets the count, so rare crashes over a long run never add up to a
        give-up."""
        failures = 0   # failed starts and young deaths in a row
        while not self._stopping:
            if not self.up:
                if failures > self.cfg.restart_max:
                    self.state = "failed"
                    emit(log, "eventbus_failed", "event-bus sidecar gave up after {failures} failures in a row "
                         "({error}); roles use the DHT fallback", level=logging.ERROR, failures=failures, error=self.last_error)
                    return
                try:
                    await self.start()
                except Exception as exc:  # noqa: BLE001 - retried with backoff
                    failures += 1
                    self.state = "restarting"
                    emit(log, "eventbus_start_failed", "event-bus sidecar failed to start ({failures}/{limit} in a "
                         "row): {error}", level=logging.WARNING, failures=failures, limit=self.cfg.restart_max + 1, error=str(exc))
                    await asyncio.sleep(restart_delay(failures, self.cfg.restart_backoff_max_s))
                    continue
            proc = self.proc
            assert proc is not None
            born = time.monotonic()
            code = await _in_own_thread(proc.wait, "eventbus-wait")
            if self._stopping:
                return
            self._up.clear()
            self.counters.fold(self._snapshot)   # keep counters monotonic across restarts
            self._snapshot = None
            self.restarts += 1
            bus_metrics.RESTARTS.inc()
            self.state = "restarting"
            self.last_error = f"sidecar (pid {proc.pid}) exited with code {code}"
            failures = 1 if time.monotonic() - born >= STABLE_S else failures + 1
            delay = restart_delay(failures, self.cfg.restart_backoff_max_s)
            emit(log, "eventbus_restart", "event-bus sidecar exited (code {code}); restart {restarts} in {delay_s:.1f} s",
                 level=logging.WARNING, code=code, restarts=self.restarts, delay_s=delay)
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        self._stopping = True
        self._up.clear()
        self.state = "stopped"
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.proc is not None:
            await _in_own_thread(self.proc.kill, "eventbus-kill")
        if self._own_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        bus_metrics.unregister(self)

    @property
    def up(self) -> bool:
        return self.state == "up"

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- calls ----
    def _require(self) -> eventbus_pb2_grpc.EventBusStub:
        if self.state != "up" or self.stub is None:
            raise EventBusUnavailable(f"event bus is {self.state}" + (f" ({self.last_error})" if self.last_error else ""))
        return self.stub

    async def publish(self, topic: str, data: bytes, timeout: float = 5.0) -> eventbus_pb2.PublishReply:
        """Gossip ``data`` on ``topic`` ("swarm" or "rollouts"). Raises :class:`EventBusUnavailable`
        when the sidecar is down and ``ValueError`` for an unknown topic or an oversized message."""
        if topic not in TOPICS:
            raise ValueError(f"unknown topic {topic!r}; topics are {', '.join(TOPICS)}")
        cap = self.cfg.caps()[topic]
        if len(data) > cap:
            raise ValueError(f"message of {len(data)} bytes is over the {topic} topic's cap of {cap} bytes "
                             f"(eventbus.{topic}_max_bytes)")
        stub = self._require()
        try:
            return await stub.Publish(eventbus_pb2.PublishRequest(topic=topic, data=data), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise EventBusUnavailable(f"event bus sidecar unavailable: {exc.details()}") from None
            raise

    async def announce(self, kind: str, timeout: float = 1.0, **fields: Any) -> bool:
        """Publish a signed notice on ``swarm`` (drain, preemption, stage_down, ban). False when the
        bus is down (callers have the DHT path: the node card)."""
        if not self.up:
            return False
        data = encode_notice(kind, self.run_id, self.peer_id, **fields)
        try:
            await self.publish("swarm", data, timeout=timeout)
            return True
        except (EventBusUnavailable, grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            emit(log, "eventbus_notice_failed", "could not gossip a {kind} notice: {error}", level=logging.WARNING, kind=kind,
                 error=str(exc))
            return False

    async def set_peers(self, peers: dict[str, list[str]]) -> None:
        """Tell the sidecar which peers to keep connected and probe (peer ID -> gossip addrs)."""
        peers = {p: a for p, a in peers.items() if p != self.peer_id and a}
        self._known = peers
        if self.up:
            await self._set_peers_rpc(peers)

    async def _set_peers_rpc(self, peers: dict[str, list[str]]) -> None:
        assert self.stub is not None
        req = eventbus_pb2.SetPeersRequest(peers=[eventbus_pb2.PeerAddrs(peer_id=p, addrs=a)
                                                  for p, a in sorted(peers.items())])
        try:
            await self.stub.SetPeers(req, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            emit(log, "eventbus_set_peers_failed", "SetPeers failed: {detail}", level=logging.WARNING, detail=exc.details())

    async def set_members(self, views: list) -> None:
        """A fresh read of the run's node cards (``node.card.CardView``s): who may publish on which
        topic, here and in the sidecar (with the peers this node bans)."""
        self.gate.update(views)
        if self.up and self.members_only:
            await self._set_members_rpc()

    async def _set_members_rpc(self) -> None:
        assert self.stub is not None
        try:
            await self.stub.SetMembers(self.gate.request(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            emit(log, "eventbus_set_members_failed", "SetMembers failed: {detail}", level=logging.WARNING, detail=exc.details())

    async def refresh(self, timeout: float = 3.0) -> eventbus_pb2.PeersReply | None:
        """Ask the sidecar for peers, mesh, counters and reachability; cached for metrics. Bans the
        sidecar made itself join the node's ban list."""
        if not self.up or self.stub is None:
            return None
        try:
            self._snapshot = await self.stub.Peers(eventbus_pb2.PeersRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None
        if self._snapshot.banned:
            self.gate.fold_sidecar_bans(self._snapshot.banned)
        return self._snapshot

    def snapshot(self) -> eventbus_pb2.PeersReply | None:
        return self._snapshot

    @property
    def finished(self) -> bool:
        """Stopped, or given up after too many failures: nothing will bring it back."""
        return self._stopping or self.state == "failed"

    async def poll(self, interval_s: float = 2.0) -> None:
        """Background task: keep the snapshot (metrics, /readyz details) fresh."""
        while not self.finished:
            await self.refresh()
            await asyncio.sleep(interval_s)

    def status(self) -> dict[str, Any]:
        """Small JSON-able summary for /readyz details and `swarmnode status`."""
        out: dict[str, Any] = {"state": self.state, "restarts": self.restarts, "peer_id": self.peer_id,
                               "pid": self.proc.pid if self.proc is not None and self.up else None}
        if self.last_error and self.state != "up":
            out["error"] = self.last_error[:200]
        snap = self._snapshot
        if snap is not None:
            out["mesh_peers"] = {t.topic: t.mesh_peers for t in snap.topics}
            out["reachable_peers"] = sum(1 for p in snap.probes if p.reachable)
            out["probed_peers"] = len(snap.probes)
            sr = snap.self_reachability
            out["reached_by"] = f"{sr.reached_by}/{sr.reporters}"
            out["reporters"] = [p[-8:] for p in sr.reporter_ids][:16]
            if sr.hint:
                out["hint"] = sr.hint
        return out

    # ---- receiving ----
    def on_delivery(self, callback: Callable[[Delivery], Any]) -> None:
        """Call ``callback(delivery)`` (sync or async) for every verified message (see ``listen``)."""
        self._listeners.append(callback)

    async def listen(self) -> None:
        """Background task: feed ``on_delivery`` listeners and track peers' notices."""
        async for d in self.messages():
            if d.notice is not None:
                self.notices_seen[d.sender] = (d.notice.kind, time.time())
                bus_metrics.NOTICES.labels(kind=d.notice.kind).inc()
                if d.notice.kind in ("drain", "preemption"):
                    emit(log, "peer_notice", "peer {peer} is {what} ({trigger})", peer=d.sender, kind=d.notice.kind,
                         what="draining" if d.notice.kind == "drain" else "preempted",
                         trigger=d.notice.fields.get("trigger", ""))
            for cb in list(self._listeners):
                try:
                    r = cb(d)
                    if asyncio.iscoroutine(r):
                        await r
                except Exception as exc:  # noqa: BLE001 - one bad listener must not stop the others
                    emit(log, "eventbus_listener_failed", "event-bus listener failed: {error}", level=logging.WARNING, error=repr(exc))

    async def messages(self, topics: tuple[str, ...] = ()) -> AsyncIterator[Delivery]:
        """Verified deliveries on ``topics`` (short names; empty = all), across sidecar restarts.
        Ends when the bus is stopped or has given up."""
        for t in topics:
            if t not in TOPICS:
                raise ValueError(f"unknown topic {t!r}; topics are {', '.join(TOPICS)}")
        caps = self.cfg.caps()
        while not self.finished:
            if not self.up:
                await self.wait_up(1.0)
                continue
            stub = self.stub
            assert stub is not None
            call = stub.Subscribe(eventbus_pb2.SubscribeRequest(topics=list(topics)))
            try:
                async for m in call:
                    d = self._check(m, caps)
                    if d is not None:
                        yield d
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    emit(log, "eventbus_subscribe_failed", "event-bus subscription failed: {detail}", level=logging.WARNING,
                         detail=exc.details())
                await asyncio.sleep(0.1)
            finally:
                call.cancel()

    def _check(self, m: eventbus_pb2.BusMessage, caps: dict[str, int]) -> Delivery | None:
        """Re-verify what the sidecar handed over, cheapest first (topic, size, sender rule,
        signature, notice schema); count and drop what fails."""
        topic = m.topic
        if topic not in caps or m.full_topic != f"swarmnode/{self.run_id}/{topic}":
            self.counters.local_drop(topic or "unknown", "wrong_topic")
            return None
        if len(m.data) > caps[topic]:
            self.counters.local_drop(topic, "oversize")
            return None
        sender = base58.b58encode(bytes(m.from_peer)).decode()
        if self.members_only:  # the sender rule before any work on the payload
            reason = self.gate.refusal(sender, topic, lambda: verify_message(
                m.from_peer, m.data, m.seqno, m.full_topic, m.signature))
            if reason is not None:
                self.counters.local_drop(topic, reason)
                return None
        if not verify_message(m.from_peer, m.data, m.seqno, m.full_topic, m.signature):
            self.counters.local_drop(topic, "bad_signature")
            return None
        d = Delivery(topic=topic, data=bytes(m.data), sender=sender, seqno=bytes(m.seqno),
                     received_at=m.received_at, forwarder=m.forwarder)
        if topic == "swarm":
            try:
                d.notice = decode_notice(d.data, self.run_id, caps["swarm"])
            except NoticeError:
                self.counters.local_drop(topic, "invalid")
                return None
            if d.notice.sender != sender:
                self.counters.local_drop(topic, "invalid")
                return None
        return d


def gossip_peers_from_cards(views: list, self_peer_id: str) -> dict[str, list[str]]:
    """Peer ID -> gossip addresses from node cards' ``gossip_addr`` detail (comma-separated)."""
    out: dict[str, list[str]] = {}
    for v in views:
        if v.peer_id == self_peer_id or v.card.state in ("offline",):
            continue
        raw = v.card.details.get("gossip_addr")
        if isinstance(raw, str) and raw:
            addrs = [a.strip() for a in raw.split(",") if a.strip().startswith("/")][:4]
            if addrs:
                out[v.peer_id] = addrs
    return out
