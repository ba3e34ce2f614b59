"""Which stage nodes are live, for the coordinator (pipeline/coordinator.py): rules and the probe.

CheckFree detection (docs/pipeline.md, 'Coordinator'): every poll the coordinator probes the
standard gRPC health service of each node of the latest schedule (`LivenessProbe`). A node whose
probe fails `DOWN_AFTER` times in a row (process gone: connection refused or timeout) is taken out
of the membership at once, without waiting for its card to expire, and for good (it must come back
as a replacement); a card that expires or turns `draining` (published at once when a node drains)
drops out the same way. A NOT_SERVING answer alone is not taken as down: a node whose DHT routing
table emptied answers it while its pipeline still runs. A stage of the schedule left with no live
node suspends the schedule: the `stage_down` event names it with the seconds from the last good
probe (`detect_s`, also `swarmnode_checkfree_recovery_seconds{phase="detect"}`), `Schedule.Status`
reports it (`suspended`, `missing_stages`, and `vacancy`: the stage a replacement should take),
and the running nodes keep their state instead of timing out. When a replacement publishes its
card the membership changes and the next plan resumes the run (`schedule_resumed`); the surviving
nodes abort the interrupted iteration on that epoch (pipeline/stage_exec.py) and restart it.

A down node that answers again is readmitted by `readmit_returned` (a thawed process fills its
stage again; a restarted one is readmitted for a re-plan; one far behind is never planned).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node.logs import emit

log = logging.getLogger("swarmnode.pipeline.coordinator")

DOWN_AFTER = 2
"""Consecutive failed health probes (connection refused / timeout) that mark a node gone."""
PROBE_TIMEOUT_S = 1.5


class LivenessProbe:
    """Health probes of the scheduled nodes (`grpc.health.v1`, exempt from call signing)."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S, down_after: int = DOWN_AFTER):
        self.timeout_s, self.down_after = timeout_s, down_after
        self.fails: dict[str, int] = {}
        self.served: set[str] = set()
        self.last_ok: dict[str, float] = {}
        self.down: dict[str, str] = {}          # peer ID -> why
        self.back: set[str] = set()             # down nodes that answered SERVING again (frozen, then resumed)
        self.stale: set[str] = set()            # down nodes that came back far behind (logged once)
        self.started: dict[str, float] = {}     # peer ID -> its card's started_at while it was live
        self.restarted: set[str] = set()        # readmitted as a new process: the caller re-plans
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def _check(self, addr: str):
        """One `grpc.health.v1` Check of `addr` (its channel kept); raises what the call raises."""
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = grpc.aio.insecure_channel(addr)
        return await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=self.timeout_s)

    async def _probe(self, peer_id: str, addr: str, now: float) -> None:
        try:
            reply = await self._check(addr)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.fails[peer_id] = self.fails.get(peer_id, 0) + 1
                if self.fails[peer_id] >= self.down_after:
                    self.down[peer_id] = f"unreachable ({exc.code().name})"
            return
        except Exception as exc:  # noqa: BLE001 - a probe never crashes the planner
            log.debug("health probe of %s failed: %r", addr, exc)
            return
        self.fails[peer_id] = 0
        self.last_ok[peer_id] = now
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            self.served.add(peer_id)
        # NOT_SERVING alone is not "down": a node whose DHT routing table emptied reports it while
        # its pipeline streams still work; a draining node's card turns `draining` at once instead

    async def _recheck(self, peer_id: str, addr: str) -> None:
        """A down node whose card is live again: SERVING -> `back` (the planner decides whether
        it may fill its stage again)."""
        try:
            reply = await self._check(addr)
        except Exception:  # noqa: BLE001 - still down
            return
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            self.back.add(peer_id)

    def readmit(self, peer_id: str, now: float) -> None:
        self.down.pop(peer_id, None)
        self.back.discard(peer_id)
        self.fails[peer_id] = 0
        self.last_ok[peer_id] = now

    async def probe(self, members: list[tuple], now: float) -> None:
        todo = [(m[0], m[2]) for m in members if m[2] and m[0] not in self.down]
        again = [(m[0], m[2]) for m in members if m[2] and m[0] in self.down]
        await asyncio.gather(*(self._probe(p, a, now) for p, a in todo), *(self._recheck(p, a) for p, a in again))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


def stage_replicas(members: list[tuple], stages: int) -> dict[int, int]:
    return {s: sum(1 for m in members if m[1] == s) for s in range(stages)}


def pick_vacancy(replicas: dict[int, int], claimed: set[int] | frozenset = frozenset(),
                 peak: dict[int, int] | None = None) -> int:
    """The stage a replacement node should take: one with no live node that no other replacement
    has claimed first (lowest index); else the transformer stage that lost the most nodes since
    its `peak` (the most it had in a published schedule); else the one with the fewest nodes (it
    will copy a replica)."""
    missing = [s for s, n in sorted(replicas.items()) if n == 0 and s not in claimed]
    if missing:
        return missing[0]
    peak = peak or {}
    return min((s for s in replicas if s > 0),
               key=lambda s: (-(peak.get(s, 0) - replicas[s]), replicas[s], s), default=-1)


STALE_SLACK = 2
"""A returning stage node whose card's iteration is more than this behind the live nodes' is not
readmitted (`readmit_returned`)."""


def readmit_returned(probe: LivenessProbe, members: list[tuple], quarantined, now: float,
                     cards: dict[str, tuple[int | None, float]] | None = None) -> list[tuple]:
    """The stage members to plan with: not down, not quarantined. A down node that answers SERVING
    again (frozen past its probes, then resumed: it kept its weights, and a pipeline with its stage
    empty stood still meanwhile) fills its stage again, but only while that stage has no other
    live node: a stage a replacement rebuilt meanwhile keeps the replacement (two replicas with
    different weights would fail each other's audits). `cards` (peer ID -> its card's (iteration,
    started_at)): one that came back more than STALE_SLACK iterations behind the live nodes
    restarted without its state (an older version, or its rebuild failed) and is not planned:
    the pipeline would stall on its initial weights (`stage_node_stale`, once per node). One that
    came back as a new process (another `started_at`: restarted, its stage rebuilt) is readmitted
    into `probe.restarted`: the iteration in flight when it died is lost with it, so the caller
    re-plans (a new epoch restarts that iteration) instead of resuming the plan."""
    live = [m for m in members if m[0] not in probe.down and m[0] not in quarantined]
    cards = cards or {}
    its = {p: c[0] for p, c in cards.items()}
    for m in live:                            # the process each live node runs as
        if m[0] in cards:
            probe.started[m[0]] = cards[m[0]][1]
    run_it = max((its.get(m[0]) or 0 for m in live), default=0)
    for m in members:
        if m[0] in probe.back and m[0] not in quarantined:
            behind = (its.get(m[0]) or 0) + STALE_SLACK < run_it
            if behind:
                probe.back.discard(m[0])
                if m[0] not in probe.stale:
                    probe.stale.add(m[0])
                    emit(log, "stage_node_stale", "stage {stage} node {peer} answers again at iteration {iteration}, "
                         "the live nodes are at {run_iteration}: it restarted without its state and is not planned "
                         "(restart it with stage.checkfree.recover=true to rebuild the stage)", level=logging.WARNING,
                         stage=m[1], peer=m[0][:16], iteration=its.get(m[0]) or 0, run_iteration=run_it)
            elif not any(x[1] == m[1] for x in live):
                probe.stale.discard(m[0])
                why = probe.down.get(m[0], "down")
                before, started = probe.started.get(m[0]), cards.get(m[0], (None, None))[1]
                restarted = before is not None and started is not None and started != before
                probe.readmit(m[0], now)
                if started is not None:
                    probe.started[m[0]] = started
                live.append(m)
                if restarted:
                    probe.restarted.add(m[0])
                emit(log, "stage_node_back", "stage {stage} node {peer} answers again (it was {why}){how}: it fills "
                     "its stage again", level=logging.WARNING, stage=m[1], peer=m[0][:16], why=why,
                     restarted=restarted, iteration=its.get(m[0]),
                     how=f"; restarted, its stage rebuilt at iteration {its.get(m[0])}" if restarted else "")
            else:
                probe.back.discard(m[0])
    return live


def hold_back_late(members: list[tuple], planned: set[str], its: dict[str, int | None], held: set[str]) -> list[tuple]:
    """The members less those never planned that still hold their initial weights (card iteration
    0) while the planned ones are more than STALE_SLACK iterations on: a node started with
    `stage.index` beside a running pipeline whose stage has live nodes builds the stage at
    iteration 0, and planned as a replica it stalled every iteration after (its neighbours waited
    for its messages of iteration 27 while it waited at 0). Such a node is not planned
    (`stage_node_late`, once per node, in `held`). `planned`: every node this coordinator has
    planned; after a takeover (empty) the whole membership is the reference. A rebuilt replacement
    or a hot spare reports the iteration it copied (it re-syncs at the one it is asked to run), so
    it is never held back."""
    ref = [m for m in members if m[0] in planned] or members
    run_it = max((its.get(m[0]) or 0 for m in ref), default=0)
    out = []
    for m in members:
        it = its.get(m[0]) or 0
        if m[0] not in planned and it == 0 and run_it > STALE_SLACK:
            if m[0] not in held:
                held.add(m[0])
                emit(log, "stage_node_late", "stage {stage} node {peer} joined at iteration {iteration} while the "
                     "pipeline is at {run_iteration}: it is not planned (its initial weights would stall every "
                     "iteration); to add a node to a running pipeline start it with stage.checkfree.recover=true "
                     "and stage.checkfree.standby=true (a hot spare: it copies a live replica when a stage loses one)",
                     level=logging.WARNING, stage=m[1], peer=m[0][:16], iteration=it, run_iteration=run_it)
            continue
        out.append(m)
    return out


__all__ = ["DOWN_AFTER", "PROBE_TIMEOUT_S", "STALE_SLACK", "LivenessProbe", "hold_back_late", "pick_vacancy",
           "readmit_returned", "stage_replicas"]
