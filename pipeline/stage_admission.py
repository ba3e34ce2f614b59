"""Which stage nodes the coordinator plans with (docs/pipeline.md, 'Admission probes and stalls').

Owns two decisions of the coordinator (pipeline/coordinator.py), both made from what a node does,
never from what its card claims:

- **admission**: a stage node with a live card enters a plan only after it answered a stage probe
  (pipeline/stage_probe.py: a forward of a probe microbatch over its real tensor stream, the
  output's shape and finiteness checked). A node that fails is retried with backoff
  (`schedule.probe_timeout_s` per try, `RETRY_S` doubling up to `RETRY_MAX_S`) and stays out of
  every plan meanwhile; the `stage_probe_failed` event says why.
- **stalls**: when no node of the published schedule has stepped for `schedule.stall_s` (their
  cards' `iteration`), the pipeline is stalled. Every planned node is probed again at once; those
  that fail are dropped from the plan for good (`stage_dropped`), like a node whose health probes
  fail, and the coordinator re-plans at once. A stall that no probe explains is reported
  (`pipeline_stalled`, `unattributed`) and watched again. A suspended schedule (a stage with no
  live node) is not a stall: CheckFree handles it.

Counts go to `swarmnode_pipeline_probes_total{outcome}` and `swarmnode_pipeline_stalls_total`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from node.card import CardView, card_int
from node.logs import emit
from pipeline import stage_metrics as M
from pipeline.stage_probe import ProbeSpec, probe_stage
from protocol.channels import ChannelPool

log = logging.getLogger("swarmnode.pipeline.coordinator")

RETRY_S = 2.0
"""First pause before a node that failed its admission probe is probed again (then doubled)."""
RETRY_MAX_S = 60.0


class StageAdmission:
    """The coordinator's admission probes and stall watch. `admitted(members, now)` every poll."""

    def __init__(self, ctx: Any, spec: ProbeSpec, timeout_s: float, stall_s: float):
        self.ctx, self.spec, self.timeout_s, self.stall_s = ctx, spec, timeout_s, stall_s
        self.pool = ChannelPool()
        self.passed: set[str] = set()
        self.failed: dict[str, dict] = {}          # peer -> {"why", "fails", "retry_at"}
        self.dropped: dict[str, str] = {}          # peer -> why (stalled a plan and failed its probe: for good)
        self._tasks: dict[str, asyncio.Task] = {}
        self._progress: tuple | None = None
        self._since = 0.0

    # ------------------------------------------------------------------ admission
    def admitted(self, members: list[tuple], now: float) -> list[tuple]:
        """The members that passed their probe; probes the others in the background."""
        for m in members:
            peer = m[0]
            if peer in self.passed or peer in self.dropped or peer in self._tasks:
                continue
            if now < self.failed.get(peer, {}).get("retry_at", 0.0):
                continue
            self._tasks[peer] = asyncio.get_running_loop().create_task(self._admit(m), name=f"probe_{peer[:16]}")
        return [m for m in members if m[0] in self.passed and m[0] not in self.dropped]

    def claims(self, members: list[tuple]) -> dict[str, int]:
        """peer -> stage of members whose first probe has not answered yet: a replacement that just
        published its rebuilt stage holds that stage, so no second replacement is sent to rebuild it
        too. A node that failed a probe holds nothing (a fake card cannot block a vacancy)."""
        return {m[0]: m[1] for m in members
                if m[0] not in self.passed and m[0] not in self.dropped and m[0] not in self.failed}

    async def probe(self, m: tuple) -> str | None:
        return await probe_stage(self.pool, run_id=self.ctx.config.run_id, me=self.ctx.peer_id, peer_id=m[0],
                                 addr=m[2], stage=m[1], spec=self.spec, timeout_s=self.timeout_s)

    async def _admit(self, m: tuple) -> None:
        peer = m[0]
        try:
            why = await self.probe(m)
        finally:
            self._tasks.pop(peer, None)
        loop = asyncio.get_running_loop()
        if why is None:
            M.PROBES.labels(outcome="passed").inc()
            self.passed.add(peer)
            self.failed.pop(peer, None)
            emit(log, "stage_admitted", "stage {stage} node {short} answered its probe: it may join the plan",
                 stage=m[1], peer=peer, short=peer[:16])
            return
        M.PROBES.labels(outcome="failed").inc()
        fails = self.failed.get(peer, {}).get("fails", 0) + 1
        pause = min(RETRY_MAX_S, RETRY_S * 2 ** (fails - 1))
        self.failed[peer] = {"why": why, "fails": fails, "retry_at": loop.time() + pause}
        if fails == 1 or fails % 10 == 0:
            emit(log, "stage_probe_failed", "stage {stage} node {short} at {addr} is left out of the plan: {why}; "
                 "probed again in {retry_s:.0f} s", level=logging.WARNING, stage=m[1], peer=peer, short=peer[:16],
                 addr=m[2], why=why, fails=fails, retry_s=pause)

    # ------------------------------------------------------------------ stalls
    def reset(self, now: float) -> None:
        """A new plan was published: its nodes have `stall_s` to step."""
        self._progress, self._since = None, now

    def stalled(self, views: list[CardView], scheduled: list[tuple], now: float) -> bool:
        """True when no scheduled node's card `iteration` changed for `stall_s`."""
        if self.stall_s <= 0 or not scheduled:
            return False
        ids = {m[0] for m in scheduled}
        progress = tuple(sorted((v.peer_id, card_int(v, "iteration") or 0) for v in views if v.peer_id in ids))
        if progress != self._progress:
            self._progress, self._since = progress, now
            return False
        return now - self._since >= self.stall_s

    async def on_stall(self, scheduled: list[tuple], epoch: int, now: float) -> list[str]:
        """Probe every planned node again; drop those that fail. Returns the dropped peer IDs."""
        M.STALLS.inc()
        whys = await asyncio.gather(*(self.probe(m) for m in scheduled))
        dropped = {m[0]: (m[1], why) for m, why in zip(scheduled, whys) if why is not None}
        for m, why in zip(scheduled, whys):
            M.PROBES.labels(outcome="passed" if why is None else "failed").inc()
        for peer, (_, why) in dropped.items():
            self.dropped[peer] = why
            self.passed.discard(peer)
        emit(log, "pipeline_stalled", "schedule epoch {epoch}: no planned node stepped for {stall_s:.0f} s; "
             "{verdict}", level=logging.ERROR, epoch=epoch, stall_s=self.stall_s, unattributed=not dropped,
             dropped={p: {"stage": s, "why": w} for p, (s, w) in dropped.items()},
             verdict=(f"dropped {len(dropped)} node(s) that fail their stage probe, re-planning without them"
                      if dropped else "every planned node answers its probe: not attributable (see its nodes' "
                      "pipeline_stuck lines for the peer they wait on)"))
        for peer, (stage, why) in dropped.items():
            emit(log, "stage_dropped", "stage {stage} node {short} dropped from the plan for good: it stalled "
                 "schedule epoch {epoch} and fails its probe ({why})", level=logging.WARNING, stage=stage,
                 peer=peer, short=peer[:16], epoch=epoch, why=why)
        self._since = now                       # an unattributed stall is watched again from now
        return list(dropped)

    async def close(self) -> None:
        for t in list(self._tasks.values()):
            t.cancel()
        await self.pool.close()


__all__ = ["RETRY_MAX_S", "RETRY_S", "StageAdmission"]
