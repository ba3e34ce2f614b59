"""One node's life from start to exit: start order, readiness, drain.

Start order (docs/architecture.md, 'Node lifecycle'): identity -> hivemind DHT (forks p2pd and its process before any gRPC
object exists) -> gRPC server -> ops HTTP -> joining loop, node card, role. SIGTERM, SIGINT
or a spot-preemption notice start the same drain, once: readiness off and gRPC health
NOT_SERVING, DRAINING card, role drain, gRPC stop with grace, OFFLINE card, DHT shutdown,
exit 0 — within ``drain.budget_s``. A second SIGINT aborts with 130.

Owns the orchestration only; every step's mechanics live in their own module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

from node import metrics, ready_details
from node.card import CARD_NAMESPACE, CardPublisher
from node.coordinator_lease import LEASE_NAMESPACE
from node.config import ConfigError, NodeConfig, redacted
from node.eventbus.service import NodeEventBus
from node.card import read_cards
from node.call_guard import CallGuard
from node.grpc_server import GrpcHost
from node.identity import ensure_identity
from node.known_peers import KnownPeers
from node.lifecycle import Lifecycle, State
from node.logs import emit, set_context
from node.membership import Membership
from node.netem import LinkEmulator
from node.node_service import NodeServicer
from node.ops_http import OpsServer
from node.preemption import PreemptionWatcher
from node.revocation_sync import RevocationSync
from node.roles import NodeContext, load_role
from node.supervisor import Supervisor
from node.version import VERSION
from protocol import node_pb2, node_pb2_grpc
from security.admission import AdmissionRejected, check_own_token, token_check
from security.peer_auth import CallSigner, ClientAuth, PeerAuthenticator, set_client_auth
from security.records import SignedRecordValidator
from security.revocation import REVOKED, RevokedEntry
from security.revocation_record import REVOKED_NAMESPACE

log = logging.getLogger("swarmnode.daemon")

STATE_FETCH_METHOD = "/swarmnode.WeightService/Fetch"  # node/state_sync.py (not imported: it needs torch)

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_BOOTSTRAP_GAVE_UP, EXIT_ABORT = 0, 1, 2, 4, 130


class Node:
    """A running node. Build with :meth:`prepare` (sync, forks the DHT), then ``await run()``."""

    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.role_cls = load_role(cfg.role)
        self.role_cfg = self.role_cls.validate_config(cfg)
        self.started_at = time.time()
        self.lifecycle = Lifecycle()
        self.membership: Membership | None = None
        self.peer_id = ""
        self._exit_code = EXIT_OK
        self._drain_started = False
        self._trigger = ""  # what asked for the drain (request_drain)
        self._stop = None  # asyncio.Event, made on the loop
        self._role_ready = (False, "role_init", "building the role")
        self._sigint_count = 0
        self._was_ready = False

    # ---- synchronous part: before the event loop and before any gRPC object ----
    def prepare(self) -> None:
        key, self.peer_id, key_path = ensure_identity(self.cfg.identity)
        set_context(peer_id=self.peer_id, role=self.cfg.role, run_id=self.cfg.run_id, state="joining")
        emit(log, "config_effective", "effective config", config=redacted(self.cfg), version=VERSION)
        namespaces = [CARD_NAMESPACE, REVOKED_NAMESPACE, LEASE_NAMESPACE,
                      *getattr(self.role_cls, "namespaces", lambda cfg: [])(self.cfg)]
        sec = self.cfg.security
        self.key, self.admission_token = key, None
        self.admission = None  # our own token, checked: without a valid one the swarm refuses our card and calls
        if sec.admission == "token":
            try:
                self.admission_token = sec.token_bytes()
                self.admission = check_own_token(self.admission_token, coordinator_peer_id=sec.coordinator_peer_id,
                                                 run_id=self.cfg.run_id, peer_id=self.peer_id, role=self.cfg.role)
            except (ValueError, OSError) as exc:
                raise ConfigError(f"security.admission_token: {exc}") from None
        validator = SignedRecordValidator(self.cfg.run_id, key, namespaces, **self._admission_args())
        self.key_path = key_path
        self.membership = Membership(self.cfg, key_path, [validator])
        self.membership.start_dht()
        if self.membership.peer_id != self.peer_id:  # hivemind must have used our Ed25519 key
            raise RuntimeError(f"DHT peer ID {self.membership.peer_id} differs from the key's {self.peer_id}")
        metrics.set_identity(self.cfg.run_id, self.cfg.role, VERSION, self.peer_id)
        metrics.REGISTRY.register(metrics.DhtCollector(self.membership.probe))

    def _admission_args(self) -> dict[str, Any]:
        sec = self.cfg.security
        if sec.admission != "token":
            return {}
        return {"coordinator_peer_id": sec.coordinator_peer_id, "admission_token": self.admission_token,
                "require_admission": True}

    def _call_guard(self) -> tuple[CallGuard, KnownPeers]:
        """Authentication and limits for every gRPC service (node/call_guard.py), and the signer
        every outgoing channel of this process uses (protocol/streams.py, node/state_sync.py)."""
        cfg, sec = self.cfg, self.cfg.security
        known = KnownPeers(lambda: read_cards(self.membership.dht, cfg.run_id, timeout=5.0),
                           sec.known_peers_refresh_s, own_peer_id=self.peer_id)
        if sec.peer_auth == "none":
            set_client_auth(None)
            return CallGuard(cfg.limits), known
        check, is_member = None, known.is_known
        if sec.admission == "token":
            token_ok = token_check(coordinator_peer_id=sec.coordinator_peer_id, run_id=cfg.run_id)

            def is_member(peer: str) -> bool:
                """A live card, or a peer on the revocation list (whose card readers drop): it goes on
                to the token check, so it hears that it was revoked rather than 'not a member'."""
                return known.is_known(peer) or REVOKED.peer_entry(peer) is not None

            def check(peer: str, blob: bytes | None):
                tok = token_ok(peer, blob)  # a revoked token is refused here, saying so
                if not known.is_known(peer):  # let in by the revocation hint: a valid token still needs a card
                    raise AdmissionRejected(f"peer ...{peer[-8:]} is not a live member of run {cfg.run_id!r}; join "
                                            "the swarm (publish a node card) first", "missing")
                return tok
        auth = PeerAuthenticator(run_id=cfg.run_id, own_peer_id=self.peer_id, window_s=sec.clock_window_s,
                                 is_known_peer=is_member, check_token=check, await_known=known.wait_known)
        open_auth = PeerAuthenticator(run_id=cfg.run_id, own_peer_id=self.peer_id, window_s=sec.clock_window_s,
                                      nonce_cache=auth.nonces) if sec.public_state else None
        guard = CallGuard(cfg.limits, auth, open_auth=open_auth,
                          public=[STATE_FETCH_METHOD] if sec.public_state else (),
                          on_ban=lambda key, reason: self.card.update(publish=True, **guard.ban_details()))
        set_client_auth(ClientAuth(CallSigner(self.key, cfg.run_id, token=self.admission_token), known.resolve))
        return guard, known

    # ---- helpers read by ops HTTP and gRPC ----
    def peerinfo(self) -> dict[str, Any]:
        assert self.membership is not None
        return {"peer_id": self.peer_id, "maddrs": self.membership.visible_maddrs(),
                "grpc_addr": self.grpc_addr, "run_id": self.cfg.run_id, "role": self.cfg.role,
                "eventbus": self.eventbus.status() if getattr(self, "eventbus", None) else {"state": "starting"}}

    def health(self) -> tuple[bool, str]:
        if self.membership is None or not self.membership.alive():
            return False, "dht_process_exited"
        if not self.supervisor.healthy:
            return False, f"task_failed:{self.supervisor.failed}"
        return True, "ok"

    def info(self) -> node_pb2.NodeInfo:
        state, reason, _ = self.lifecycle.snapshot()
        return node_pb2.NodeInfo(peer_id=self.peer_id, run_id=self.cfg.run_id, role=self.cfg.role, state=state.value,
                                 reason=reason, version=VERSION, started_at=self.started_at, grpc_addr=self.grpc_addr)

    # ---- readiness: membership half + role half ----
    async def _refresh_readiness(self) -> None:
        if self.lifecycle.state in (State.DRAINING, State.OFFLINE):
            return
        assert self.membership is not None
        status = self.membership.status
        if not status.joined:
            if self._was_ready:
                reason = "dht_no_peers"
            else:
                reason = "dht_bootstrap_failed" if status.attempts else "dht_starting"
            await self.lifecycle.move(State.JOINING, reason, status.detail())
            return
        ready, reason, detail = self._role_ready
        if not ready:
            await self.lifecycle.move(State.JOINING, reason, detail)
            return
        self._was_ready = True
        await self.lifecycle.move(State.READY, "ready", "")

    async def set_role_ready(self, ready: bool, reason: str = "ready", detail: str = "") -> None:
        self._role_ready = (ready, reason, detail)
        await self._refresh_readiness()

    async def _join_loop(self) -> None:
        """Join, then watch the routing table; re-bootstrap when it empties (dht_no_peers)."""
        assert self.membership is not None
        while True:
            ok = await self.membership.join(lambda status: self._refresh_readiness())
            if not ok:
                emit(log, "bootstrap_gave_up", "no initial peer answered within dht.bootstrap_deadline_s; giving up "
                     "(exit 4)", level=logging.ERROR)
                self._exit_code = EXIT_BOOTSTRAP_GAVE_UP
                self.request_drain("bootstrap_gave_up")
                return
            if not self.cfg.dht.initial_peers:
                return  # a swarm's first node (the bootstrap) needs no peers to be ready
            last_redial = time.monotonic()
            while True:
                await asyncio.sleep(5.0)
                if time.monotonic() - last_redial >= self.cfg.dht.redial_s:
                    last_redial = time.monotonic()
                    await self._redial()
                if await self.membership.peer_count() == 0:
                    emit(log, "dht_no_peers", "routing table empty: re-bootstrapping", level=logging.WARNING)
                    self.membership.status.joined = False
                    self.membership.status.attempts = 0
                    await self._refresh_readiness()
                    break

    async def _redial(self) -> None:
        """Dial the initial peers missing from the routing table again (``dht.redial_s``): a
        restarted bootstrap is found where it was; said when one answers again."""
        assert self.membership is not None
        try:
            outcomes = await self.membership.redial_missing()
        except Exception as exc:  # noqa: BLE001 - the next period retries
            log.debug("redialling initial peers failed: %r", exc)
            return
        for maddr, outcome in outcomes.items():
            if outcome == "ok":
                emit(log, "initial_peer_back", "initial peer {maddr} answers again: back in the routing table",
                     maddr=maddr)
            else:
                log.debug("initial peer %s still does not answer: %s", maddr, outcome)

    # ---- the async life ----
    async def run(self) -> int:
        assert self.membership is not None
        cfg = self.cfg
        self._stop = asyncio.Event()
        self.supervisor = Supervisor(on_fatal=lambda name, exc: self._fatal(name))
        guard, self.known_peers = self._call_guard()
        self.grpc = GrpcHost(cfg.host, cfg.grpc.port, cfg.grpc.max_message_bytes, cfg.grpc.max_concurrent_rpcs,
                             guard=guard)
        port = self.grpc.bind()
        self.grpc_addr = f"{cfg.grpc_host}:{port}"
        self.known_peers.add(self.peer_id, self.grpc_addr)
        self.card = CardPublisher(self.membership, cfg.card, cfg.run_id, self.peer_id, cfg.role, VERSION,
                                  self.grpc_addr, self.started_at)
        self.netem = LinkEmulator(cfg.netem, self_id=self.grpc_addr)
        self.eventbus = NodeEventBus(cfg, self.key_path, self.card, self.membership, self.peer_id, bans=guard.bans)
        ctx = NodeContext(config=cfg, peer_id=self.peer_id, lifecycle=self.lifecycle, membership=self.membership,
                          card=self.card, server=self.grpc.server, grpc_addr=self.grpc_addr,
                          supervisor=self.supervisor, netem=self.netem, set_role_ready=self.set_role_ready,
                          request_drain=self.request_drain, eventbus=self.eventbus.bus)
        self.role = self.role_cls(ctx, self.role_cfg)
        self.grpc.add(node_pb2_grpc.add_NodeServicer_to_server, NodeServicer(self.info, self.peerinfo),
                      "swarmnode.Node")
        for add_fn, servicer, name in self.role.services():
            self.grpc.add(add_fn, servicer, name)
        try:
            ops_hosts = cfg.ops.bind_hosts(cfg.host)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.ops = OpsServer(ops_hosts, cfg.ops.port, self.lifecycle, self.health, self.peerinfo,
                             details=lambda: {"eventbus": self.eventbus.status(), **ready_details.snapshot()},
                             max_connections=cfg.ops.max_connections, idle_timeout_s=cfg.ops.idle_timeout_s)
        self.lifecycle.subscribe(metrics.follow_lifecycle)
        self.lifecycle.subscribe(lambda s, r, d: set_context(state=s.value))
        self.lifecycle.subscribe(self.grpc.on_state)
        self.lifecycle.subscribe(self.card.on_state)
        metrics.follow_lifecycle(*self.lifecycle.snapshot())
        await self.grpc.start()
        self.ops.start()
        emit(log, "node_listening", "node listening", grpc_addr=self.grpc_addr, ops_port=self.ops.port,
             maddrs=self.membership.visible_maddrs())
        self._install_signals()
        self.supervisor.spawn("card", self.card.run)
        self.supervisor.spawn("known_peers", self.known_peers.run)
        self.supervisor.spawn("bans", lambda: guard.publish_bans(self.card.update))
        self.supervisor.spawn("join", self._join_loop)
        watcher = PreemptionWatcher(cfg.preemption, on_notice=self._on_preemption,
                                    on_count=lambda src: metrics.PREEMPTION_NOTICES.labels(source=src).inc())
        self.supervisor.spawn("preemption", watcher.run)
        self.supervisor.spawn("eventbus", self.eventbus.run, restart=False)  # never fatal: see service.py
        if self.admission is not None:
            self.supervisor.spawn("admission", self._admission_expiry, restart=False)
        if cfg.security.admission == "token":
            sync = RevocationSync(lambda: self.membership.dht, cfg.run_id, cfg.security.coordinator_peer_id,
                                  self.peer_id, self.admission.serial if self.admission is not None else None,
                                  min(cfg.security.revocation_refresh_s, cfg.card.ttl_s / 2), cfg.state_dir,
                                  self._revoked)
            self.supervisor.spawn("revocations", sync.run)
        await self.role.start()
        await self._refresh_readiness()
        await self._stop.wait()
        await self.drain(self._trigger)
        return self._exit_code

    async def _admission_expiry(self) -> None:
        """Token mode: when our admission token expires the swarm drops us (cards and calls are
        refused), so stop cleanly with exit 2 and say how to get a new one."""
        await asyncio.sleep(max(0.0, self.admission.expires_at - time.time()))
        emit(log, "admission_expired", "admission token expired: peers now refuse this node's card and calls; get "
             "a new token (`swarmnode admit --peer-id {peer}`), set security.admission_token_file and restart",
             level=logging.ERROR, peer=self.peer_id, expires_at=self.admission.expires_at)
        self._exit_code = EXIT_CONFIG
        self.request_drain("admission_expired")

    def _revoked(self, entry: RevokedEntry) -> None:
        """Token mode: the coordinator revoked our token; peers now refuse our cards and calls."""
        emit(log, "admission_revoked", "admission revoked: {what}; peers now refuse this node's card and calls. Ask "
             "the coordinator for a new token (`swarmnode admit --peer-id {peer}`) before restarting (exit 2)",
             level=logging.ERROR, what=entry.describe(), peer=self.peer_id, serial=entry.serial, reason=entry.reason)
        self._exit_code = EXIT_CONFIG
        self.request_drain("admission_revoked")

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_drain, "sigterm")
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def _on_sigint(self) -> None:
        self._sigint_count += 1
        if self._sigint_count >= 2:
            emit(log, "abort", "second Ctrl-C: aborting without drain (exit 130)", level=logging.WARNING)
            try:  # best effort: stop p2pd with us; a drain may be shutting it down right now
                if self.membership is not None:
                    self.membership.shutdown()
            except Exception:  # noqa: BLE001 - nothing may keep the abort from exiting
                pass
            finally:
                os._exit(EXIT_ABORT)
        self.request_drain("sigint")

    def request_drain(self, trigger: str) -> None:
        if self._drain_started:
            return  # a later SIGTERM is ignored
        self._drain_started = True
        self._trigger = trigger
        self._stop.set()

    async def _on_preemption(self, source: str) -> None:
        self.request_drain(source)  # the watcher has logged the notice (preemption_notice)

    def _fatal(self, task: str) -> None:
        self._exit_code = EXIT_ERROR
        self.request_drain(f"task_failed:{task}")

    async def _step(self, name: str, coro, limit: float) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(coro, max(0.05, limit))
            overrun = False
        except asyncio.TimeoutError:
            overrun = True
        except Exception as exc:  # noqa: BLE001 - a drain step failing must not stop the drain
            emit(log, "drain_step_failed", "drain step {step} failed: {error}", level=logging.WARNING, step=name,
                 error=repr(exc))
            overrun = False
        dt = time.monotonic() - t0
        emit(log, "drain_step", "drain step {step} took {duration_s:.2f} s" + (" (over its budget)" if overrun else ""),
             level=logging.WARNING if overrun else logging.INFO, step=name, duration_s=round(dt, 3), overrun=overrun)

    async def drain(self, trigger: str) -> None:
        # an AWS notice comes 2 minutes ahead: the role may use the longer budget to hand over work
        budget = self.cfg.preemption.aws_drain_budget_s if trigger == "aws" else self.cfg.drain.budget_s
        t0 = time.monotonic()
        left = lambda: budget - (time.monotonic() - t0)  # noqa: E731
        await self.lifecycle.move(State.DRAINING, "draining", f"trigger: {trigger}")
        await self._step("bus_notice", self.eventbus.announce_drain(trigger), min(1.0, left()))
        await self._step("card_draining", self.card.publish(), min(1.0, left()))
        await self._step("role", self.role.drain(max(0.0, min(budget * 0.5, left() - 5))), min(budget * 0.5, left() - 4))
        await self._step("grpc_stop", self.grpc.stop(min(self.cfg.grpc.grace_s, max(0.0, left() - 3))),
                         min(self.cfg.grpc.grace_s + 1, left() - 2))
        await self.lifecycle.move(State.OFFLINE, "offline", f"trigger: {trigger}")
        await self._step("card_offline", self.card.publish(), min(1.0, left() - 1.5))
        await self.supervisor.cancel_all(timeout=1.0)
        await self._step("bus_stop", self.eventbus.stop(), min(2.0, max(0.5, left())))
        await self._step("dht_shutdown", asyncio.to_thread(self.membership.shutdown), min(3.0, max(0.5, left())))
        self.ops.stop()
        dt = time.monotonic() - t0
        metrics.DRAIN_DURATION.set(dt)
        emit(log, "drained", "drained in {duration_s:.2f} s (trigger {trigger})", duration_s=round(dt, 3),
             trigger=trigger)


def run_node(cfg: NodeConfig) -> int:
    """Start a node and block until it exits; returns the process exit code."""
    import uvloop

    from protocol.grpc_options import tune_allocator

    tune_allocator()  # keep freed 1-32 MiB tensor buffers mapped: streams run ~2x faster (see its doc)
    node = Node(cfg)
    node.prepare()
    try:
        return uvloop.run(node.run())
    finally:
        if node.membership is not None:
            node.membership.shutdown()
