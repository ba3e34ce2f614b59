"""A stage node's side of the bootstrap's `Schedule` service (the server is pipeline/coordinator.py).

Owns how a stage node finds the coordinator (the bootstrap that holds the coordinator lease,
node/coordinator_lease.py; without a lease entry, a bootstrap's node card), follows
`Schedule.Watch` (calls signed for that bootstrap's peer ID; reconnects after any error), validates every schedule
before handing it on (a violation is refused and logged with the rule), fetches an epoch it has not
seen, and, on data nodes, follows the coordinator's `suspended` / `hold` answer (`running`): while
the published plan names a node that is gone or quarantined no new iteration starts. What a
schedule does to the node (the executor, the streams' addresses) is the role's `on_schedule`.

It also knows whether the coordinator answers (`heartbeat`: `Schedule.Status` every
`HEARTBEAT_S`, and every other call it makes): `wait` (node/coordinator_wait.py) says who the
node waits for and since when, `/readyz` shows it under `details.coordinator`, and the role's
`on_wait` hears every change (a node without a schedule says in its readiness that it waits).
A coordinator that stops answering changes nothing else: the node keeps its last schedule, looks
for the lease holder again at every failed heartbeat (a standby that took over:
`coordinator_switched`), and the watch reconnects (every second; its channel retries the connection at least every
`RECONNECT_MAX_S`) until the coordinator is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from node import ready_details
from node.card import read_cards
from node.coordinator_lease import read_holder
from node.coordinator_wait import RESTART_HINT, CoordinatorWait, short
from node.logs import emit
from pipeline.coordinator import fetch_schedule, parse_reply
from pipeline.recovery import coordinator_status
from pipeline.schedule import Schedule, ScheduleViolation
from protocol import pipeline_pb2, pipeline_pb2_grpc
from protocol.grpc_options import channel_options
from protocol.streams import ChannelPool

log = logging.getLogger("swarmnode.stage")

SUSPEND_POLL_S = 0.5
"""How often a data node asks the coordinator whether the schedule is suspended (one small RPC)."""
HEARTBEAT_S = 2.0
"""How often a stage node asks the coordinator whether it answers (one small RPC): how soon
`/readyz` and `swarmnode status` say that the node waits for it, and that it stopped waiting."""
RECONNECT_MAX_S = 2.0
"""Longest pause between two connection attempts to a coordinator that is gone (gRPC's default
grows to 120 s: a bootstrap restarted after a minute would stay unseen for as long)."""


class CoordinatorLink:
    """One stage node's view of the coordinator. `on_schedule(sched, addrs)` applies a validated
    schedule (and its peers' gRPC addresses) to the node; `have_schedule` is set once a schedule
    names this node; `running` is cleared while the coordinator holds the schedule."""

    def __init__(self, ctx, on_schedule: Callable[[Schedule, dict[str, str]], Awaitable[None]],
                 on_wait: Callable[[], Awaitable[None]] | None = None):
        self.ctx, self.on_schedule, self.on_wait = ctx, on_schedule, on_wait
        self.pool = ChannelPool(options=[*channel_options(), ("grpc.initial_reconnect_backoff_ms", 500),
                                         ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_S * 1000))])
        self.run_id = ctx.config.run_id
        self.addr: tuple[str, str] | None = None     # (gRPC address, peer ID) of the bootstrap
        self.have_schedule = asyncio.Event()
        self.running = asyncio.Event()
        self.running.set()
        self.epoch = 0                               # the newest schedule epoch adopted
        self.wait = CoordinatorWait(ctx.config.security.coordinator_peer_id)
        self.last_status = None                      # the coordinator's last `Schedule.Status` answer
        self._told = False                           # `coordinator_unreachable` logged for this wait
        ready_details.provide("coordinator", self.wait.detail)

    async def find(self) -> None:
        """Wait until the active coordinator is known (read every second)."""
        self.wait.begin()
        await self._changed()                  # `looking`: the role says so until the card is read
        while self.addr is None:
            found = await self.locate()
            if found is not None:
                self.addr = found
                self.wait.found(found[1])      # the heartbeat's first answer says more
                return
            await asyncio.sleep(1.0)

    async def locate(self) -> tuple[str, str] | None:
        """(gRPC address, peer ID) of the active coordinator: the bootstrap the lease names (it must
        have a live bootstrap card: a card's role is what a node trusts today, admitted by token
        where the run uses tokens); with no active lease entry, a bootstrap card that does not
        say `coordinator=standby`; None when there is neither."""
        dht = self.ctx.membership.dht
        try:
            held = await read_holder(dht, self.run_id)
        except Exception as exc:  # noqa: BLE001 - the cards may still tell
            log.debug("reading the coordinator lease: %r", exc)
            held = None
        try:
            boots = {v.peer_id: v for v in await read_cards(dht, self.run_id)
                     if v.card.role == "bootstrap" and v.card.grpc_addr}
        except Exception as exc:  # noqa: BLE001 - retried
            log.debug("reading cards: %r", exc)
            return None
        if held is not None:
            peer = held[0]
            return (boots[peer].card.grpc_addr, peer) if peer in boots else None
        candidates = sorted((v.card.details.get("coordinator") != "active", p) for p, v in boots.items()
                            if v.card.details.get("coordinator") not in ("standby", "claiming"))
        return None if not candidates else (boots[candidates[0][1]].card.grpc_addr, candidates[0][1])

    async def relocate(self) -> None:
        """After a failed call: follow the lease to another coordinator (a standby that took over)."""
        found = await self.locate()
        if found is None or found == self.addr:
            return
        old = self.addr
        self.addr = found
        self.wait.found(found[1])
        emit(log, "coordinator_switched", "the coordinator is now {short} (was {old_short}): following it",
             level=logging.WARNING, short=short(found[1]), peer=found[1], old=old[1] if old else None,
             old_short=short(old[1] if old else None), grpc_addr=found[0])
        await self._changed()

    def channel(self) -> grpc.aio.Channel:
        addr, peer_id = self.addr
        return self.pool.get(addr, peer_id=peer_id)

    async def status(self, timeout: float = 5.0):
        """The coordinator's `Schedule.Status` (raises grpc.aio.AioRpcError when it does not answer;
        the next call then goes to the lease's holder, should a standby have taken over: every
        caller, a replacement waiting for a vacancy as much as the heartbeat, follows it)."""
        try:
            st = await coordinator_status(self.channel(), self.run_id, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            await self._failed(exc)
            await self.relocate()
            raise
        news = self.last_status is None or st.reason != self.last_status.reason
        self.last_status = st
        if not await self._answered() and news:
            await self._changed()              # what the coordinator waits for changed
        return st

    async def heartbeat(self) -> None:
        """Ask the coordinator every HEARTBEAT_S whether it answers (`wait`, `on_wait`)."""
        while True:
            try:
                await self.status(timeout=max(HEARTBEAT_S, 2.0))
            except grpc.aio.AioRpcError:
                pass                                   # noted by status(), which follows a takeover
            await asyncio.sleep(HEARTBEAT_S)

    async def _answered(self) -> bool:
        """Note an answer; True (and `on_wait` told) when it ends a wait."""
        waited = self.wait.waited_s()
        if not self.wait.answered():
            return False
        if self._told:
            self._told = False
            emit(log, "coordinator_back", "the coordinator {short} answers again after {waited_s:.0f} s",
                 short=short(self.wait.peer_id), peer=self.wait.peer_id, waited_s=round(waited, 1))
        await self._changed()
        return True

    async def _failed(self, exc: grpc.aio.AioRpcError) -> None:
        why = f"{exc.code().name}: {(exc.details() or '')[:120]}"
        before = self.wait.error
        started = self.wait.failed(why)
        if not self._told:                       # once per wait, whether it ever answered or not
            self._told = True
            running = self.have_schedule.is_set()
            emit(log, "coordinator_unreachable", "the coordinator {short} does not answer ({error}); "
                 + ("this node trains on with its last schedule (epoch {epoch}) and follows the coordinator again "
                    "when it is back; " if running else "this node cannot train before it answers; ")
                 + RESTART_HINT, level=logging.WARNING, short=short(self.wait.peer_id), peer=self.wait.peer_id,
                 error=why, epoch=self.epoch, running=running)
        if started or why != before:
            await self._changed()

    async def _changed(self) -> None:
        if self.on_wait is not None:
            await self.on_wait()

    async def watch(self) -> None:
        """Follow Schedule.Watch; reconnect on errors."""
        while True:
            try:
                stub = pipeline_pb2_grpc.ScheduleStub(self.channel())
                async for reply in stub.Watch(pipeline_pb2.GetScheduleRequest(run_id=self.run_id)):
                    await self._answered()
                    try:
                        sched, addrs = parse_reply(reply)
                    except ScheduleViolation as exc:
                        emit(log, "schedule_refused", "refused schedule epoch {epoch}: {error}", level=logging.ERROR,
                             epoch=reply.epoch, error=str(exc), rule=exc.rule)
                        continue
                    await self.adopt(sched, addrs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect
                # said once by the heartbeat (`coordinator_unreachable`) when the coordinator is gone
                log.log(logging.INFO if not self.wait.waiting else logging.DEBUG,
                        "schedule watch ended (%r); reconnecting", exc)
            await asyncio.sleep(1.0)

    async def adopt(self, sched: Schedule, addrs: dict[str, str]) -> None:
        await self.on_schedule(sched, addrs)
        self.epoch = max(self.epoch, sched.epoch)
        emit(log, "schedule_adopted", "schedule epoch {epoch} adopted ({paths} paths, predicted "
             "{expected_makespan:.3f} s)", epoch=sched.epoch, paths=len(sched.paths), expected_makespan=sched.expected_makespan,
             method=sched.method)
        if self.ctx.peer_id in sched.names:
            self.have_schedule.set()

    async def fetch_epoch(self, ep: int) -> None:
        """Fetch and adopt schedule epoch `ep` (a message or the replicas' agreement named it)."""
        try:
            sched, addrs = await fetch_schedule(self.channel(), self.run_id, ep)
            await self.adopt(sched, addrs)
        except (ScheduleViolation, grpc.aio.AioRpcError) as exc:
            log.warning("could not fetch schedule epoch %d: %r", ep, exc)

    async def watch_suspension(self, done: Callable[[], bool]) -> None:
        """Data nodes: follow the coordinator's `suspended` and `hold` (polled every SUSPEND_POLL_S)
        until `done()`. While the published plan names a node that is gone or quarantined, no new
        iteration starts: an iteration in flight when a stage node was quarantined (alive, so the
        pipeline would run on through it) ends, the next waits for the re-plan, and a rebuilt stage
        joins a pipeline at rest."""
        while not done():
            try:
                st = await self.status(timeout=SUSPEND_POLL_S * 4)
                if st.suspended or st.hold:
                    self.running.clear()
                else:
                    self.running.set()
            except grpc.aio.AioRpcError:
                pass                                   # keep the last answer; the next poll retries
            await asyncio.sleep(SUSPEND_POLL_S)

    async def close(self) -> None:
        await self.pool.close()


__all__ = ["CoordinatorLink", "HEARTBEAT_S", "RECONNECT_MAX_S", "SUSPEND_POLL_S"]
