"""A stage node's side of the bootstrap's `Schedule` service (the server is pipeline/coordinator.py).

Owns how a stage node finds the coordinator (the bootstrap's node card), follows `Schedule.Watch`
(calls signed for the bootstrap's peer ID; reconnects after any error), validates every schedule
before handing it on (a violation is refused and logged with the rule), fetches an epoch it has not
seen, and, on data nodes, follows the coordinator's `suspended` / `hold` answer (`running`): while
the published plan names a node that is gone or quarantined no new iteration starts. What a
schedule does to the node (the executor, the streams' addresses) is the role's `on_schedule`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from node.card import read_cards
from node.logs import emit
from pipeline.coordinator import fetch_schedule, parse_reply
from pipeline.recovery import coordinator_status
from pipeline.schedule import Schedule, ScheduleViolation
from protocol import pipeline_pb2, pipeline_pb2_grpc
from protocol.streams import ChannelPool

log = logging.getLogger("swarmnode.stage")

SUSPEND_POLL_S = 0.5
"""How often a data node asks the coordinator whether the schedule is suspended (one small RPC)."""


class CoordinatorLink:
    """One stage node's view of the coordinator. `on_schedule(sched, addrs)` applies a validated
    schedule (and its peers' gRPC addresses) to the node; `have_schedule` is set once a schedule
    names this node; `running` is cleared while the coordinator holds the schedule."""

    def __init__(self, ctx, pool: ChannelPool,
                 on_schedule: Callable[[Schedule, dict[str, str]], Awaitable[None]]):
        self.ctx, self.pool, self.on_schedule = ctx, pool, on_schedule
        self.run_id = ctx.config.run_id
        self.addr: tuple[str, str] | None = None     # (gRPC address, peer ID) of the bootstrap
        self.have_schedule = asyncio.Event()
        self.running = asyncio.Event()
        self.running.set()

    async def find(self) -> None:
        """Wait until a bootstrap's card names its gRPC address (read every second)."""
        while self.addr is None:
            try:
                for v in await read_cards(self.ctx.membership.dht, self.run_id):
                    if v.card.role == "bootstrap" and v.card.grpc_addr:
                        self.addr = (v.card.grpc_addr, v.peer_id)
                        return
            except Exception as exc:  # noqa: BLE001 - retried
                log.debug("reading cards: %r", exc)
            await asyncio.sleep(1.0)

    def channel(self) -> grpc.aio.Channel:
        addr, peer_id = self.addr
        return self.pool.get(addr, peer_id=peer_id)

    async def status(self, timeout: float = 5.0):
        """The coordinator's `Schedule.Status` (raises grpc.aio.AioRpcError when it does not answer)."""
        return await coordinator_status(self.channel(), self.run_id, timeout=timeout)

    async def watch(self) -> None:
        """Follow Schedule.Watch; reconnect on errors."""
        while True:
            try:
                stub = pipeline_pb2_grpc.ScheduleStub(self.channel())
                async for reply in stub.Watch(pipeline_pb2.GetScheduleRequest(run_id=self.run_id)):
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
                log.info("schedule watch ended (%r); reconnecting", exc)
            await asyncio.sleep(1.0)

    async def adopt(self, sched: Schedule, addrs: dict[str, str]) -> None:
        await self.on_schedule(sched, addrs)
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


__all__ = ["CoordinatorLink", "SUSPEND_POLL_S"]
