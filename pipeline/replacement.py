"""A replacement `stage` node (CheckFree): from "this node holds no weights" to a built stage.

    swarmnode run --role stage --set stage.checkfree.recover=true --initial-peers /ip4/…/p2p/12D3KooW…

Owns the replacement's side of a recovery, in order: ask the coordinator which stage to take and
claim it (`StageRecovery.vacancy`, `claim_holds`: two replacements never take one stage), rebuild
it by the CheckFree rule (`decide_and_rebuild`), or restore its newest checkpoint when a neighbour
is lost too; build the stage's parts (pipeline/stage_parts.py) and load the rebuilt weights into
them (`apply_recovery`: a replica's optimizer state as is, else a fresh AdamW at `lr_scale` x LR);
then report (`stage_recovered`, the `swarmnode_checkfree_*` metrics). The stage role calls
`Replacement.take()` once, before it publishes a card, and otherwise runs exactly as a node
started with `stage.index`.

The pipeline may have run on meanwhile (a quarantined node is alive until the re-plan): `take()`
also returns a `Resync`, which the role holds until its first step and calls when the first
message of a later iteration shows the pipeline stepped this node's iteration without it; it redoes
the rule from the sources' states at that iteration (`replica_resync`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc

from node.compute import Compute
from node.logs import emit
from pipeline import stage_metrics as M
from pipeline.checkfree import Recovery, RecoveryError
from pipeline.recovery import Rebuilt, StageRecovery, apply_recovery, newest_checkpoint, rebuilt_from_checkpoint
from pipeline.stage_exec import StageExecutor
from pipeline.stage_parts import CHECKPOINT_FORMAT, StageParts, StageSettings, build_module, build_parts, cfg_hash_of
from pipeline.stage_progress import StageCard

log = logging.getLogger("swarmnode.stage")


def stage_recovery(ctx, s: StageSettings, compute: Compute, status: Callable[[], Awaitable]) -> StageRecovery:
    """The `StageRecovery` of a stage node (a replacement's rebuild, stage 1's copy of stage 0):
    torch work offloaded to `compute`, the coordinator asked through `status()`."""
    root = s.stage.checkpoint_dir
    return StageRecovery(
        ctx=ctx, me=ctx.peer_id, n_stages=s.schedule.stages, cfg=s.stage.checkfree,
        build=lambda i: build_module(s, i), cfg_hash_of=lambda i: cfg_hash_of(s, i), offload=compute.run,
        status=status, coordinator_outage_s=s.stage.coordinator_outage_s,
        has_checkpoint=lambda i: bool(root) and newest_checkpoint(root, i, CHECKPOINT_FORMAT,
                                                                  cfg_hash_of(s, i)) is not None)


REJOIN_WATCH_S = 5.0
"""How long a stage node started with `stage.index` watches the coordinator's status for its stage
to show as lost before it builds the stage at its initial weights: its previous incarnation (a
crash, then a restart) is out of the coordinator's members once this process's card replaced the
old one, a poll or two later."""


async def lost_stage_on_start(status: Callable[[], Awaitable], index: int, outage_s: float,
                              watch_s: float = REJOIN_WATCH_S):
    """The coordinator's status when a stage node started with `stage.index` (no weights yet)
    joins a run underway in which stage `index` has no live node: restarted as itself after a
    crash, or started for a lost stage. Such a node must rebuild the stage (CheckFree) instead of
    starting at its initial weights at iteration 0 beside neighbours at iteration N (the pipeline
    stalled on that). None for a fresh run (no schedule yet) or a stage that has live nodes.
    `status()` is the coordinator link's; while the coordinator does not answer this waits, up
    to `outage_s` (stage.coordinator_outage_s), then returns None."""
    t0 = time.monotonic()
    gone: float | None = None
    while True:
        try:
            st = await status()
        except grpc.aio.AioRpcError as exc:
            gone = gone if gone is not None else time.monotonic()
            if time.monotonic() - gone > outage_s:
                return None
            log.info("coordinator status not available yet: %s", exc.details())
            await asyncio.sleep(1.0)
            continue
        if st.epoch == 0:
            return None
        if index in st.missing_stages:
            return st
        if time.monotonic() - t0 >= watch_s:
            return None
        await asyncio.sleep(0.5)


class Resync:
    """A rebuilt stage's one pending re-sync: redo `rule` for `stage` at a later iteration."""

    def __init__(self, stage: int, rule: Recovery, recovery: StageRecovery, s: StageSettings, compute: Compute):
        self.stage, self.rule, self.recovery, self.s, self.compute = stage, rule, recovery, s, compute

    async def __call__(self, ex: StageExecutor, it: int) -> None:
        """Rebuild from the sources' states at iteration `it` or later and load the result into `ex`
        (weights, optimizer, LR schedule, iteration); the role then refreshes what it serves.
        Raises RecoveryError when the sources cannot serve it."""
        r = await self.recovery.rebuild(self.stage, self.rule, min_iteration=it)
        got, donor = r.iteration, ",".join(v[:16] for v in r.donors.values())
        cf = self.s.stage.checkfree

        def apply() -> None:
            ex.opt, ex.sched = apply_recovery(ex.module, r, self.s.stage.optim, cf.lr_scale)
            ex.iteration = got
        await self.compute.run(apply)
        M.WEIGHTS_VERSION.set(got)
        emit(log, "replica_resync", "rebuilt stage re-synced ({rule}) at iteration {iteration} from {donors}",
             iteration=got, asked=it, rule=r.rule, donors=donor[:40])


class Taken(NamedTuple):
    """What `Replacement.take` hands the role: the stage's parts with the rebuilt weights loaded,
    the completed iteration they belong to, and the pending re-sync (None for a checkpoint or a
    stage-0 copy: no pipeline ran on without them)."""

    parts: StageParts
    iteration: int
    resync: Resync | None


class Replacement:
    """One replacement's start-up (`recovery` from `stage_recovery`). `update_card(StageCard)` is
    the role's typed card update (`publish=True`): the claim goes out at once."""

    def __init__(self, ctx, s: StageSettings, recovery: StageRecovery, compute: Compute,
                 update_card: Callable[[StageCard, bool], None], prefer: int | None = None):
        self.ctx, self.s, self.recovery, self.compute, self.update_card = ctx, s, recovery, compute, update_card
        self.prefer = prefer
        """The stage to take first when it is lost (a stage node restarted into a run underway: its own)."""

    async def _claim(self):
        """(stage, coordinator status): a vacancy this node's claim holds for."""
        rec = self.recovery
        while True:
            stage, st = await rec.vacancy(self.prefer)
            self.update_card(StageCard(recovering=stage), True)     # the coordinator sends the next one elsewhere
            if await rec.claim_holds(stage):
                return stage, st
            emit(log, "recovery_claim_lost", "stage {stage} is claimed by another replacement; picking again",
                 stage=stage)
            self.update_card(StageCard(recovering=None), True)
            await asyncio.sleep(1.0)

    async def _from_checkpoint(self, stage: int) -> Rebuilt:
        """The newest checkpoint of `stage` under `stage.checkpoint_dir`, joining at the survivors' iteration."""
        tf = time.monotonic()
        state = await self.compute.run(newest_checkpoint, self.s.stage.checkpoint_dir, stage, CHECKPOINT_FORMAT,
                                       cfg_hash_of(self.s, stage))
        if state is None:
            raise RecoveryError(f"stage {stage} was to be restored from a checkpoint under "
                                f"{self.s.stage.checkpoint_dir!r}, but none is readable now; restart the run from a "
                                "checkpoint")
        r = rebuilt_from_checkpoint(state, stage, await self.recovery.live_iteration())
        r.fetch_s = time.monotonic() - tf
        emit(log, "recovery_warning", "{warn}", level=logging.WARNING, stage=stage, rule=r.rule, warn=r.warn)
        return r

    async def take(self) -> Taken:
        """Learn the stage to take and rebuild it from live peers; raises RecoveryError when it cannot."""
        t0 = time.monotonic()
        rec, cf = self.recovery, self.s.stage.checkfree
        await self.ctx.set_role_ready(False, "recovering", "asking the coordinator which stage to rebuild")
        rec.warm_up(range(self.s.schedule.stages))    # a spare waits long: the rebuild then fetches at once
        stage, st = await self._claim()
        emit(log, "recovery_started", "taking stage {stage} (coordinator: {reason})", stage=stage, reason=st.reason,
             missing=list(st.missing_stages), live=list(st.live_stages))
        t_take = time.monotonic()
        rule, rebuilt = await rec.decide_and_rebuild(stage, st)
        t_built = time.monotonic()
        parts = await self.compute.run(build_parts, self.s, stage)
        build_s = time.monotonic() - t_built
        M.STAGE_INDEX.set(stage)
        if rule.rule in ("checkpoint", "nearest"):
            M.ADJACENT_FAILURES.inc()
        r = await self._from_checkpoint(stage) if rule.rule == "checkpoint" else rebuilt
        t1 = time.monotonic()

        def apply() -> None:
            parts.optimizer, parts.lr_schedule = apply_recovery(parts.module, r, self.s.stage.optim, cf.lr_scale)
        await self.compute.run(apply)
        apply_s = time.monotonic() - t1
        M.RECOVERIES.labels(rule=r.rule).inc()
        M.RECOVERY_DURATION.observe(time.monotonic() - t0)
        M.RECOVERY_SECONDS.labels(phase="fetch").observe(r.fetch_s)
        M.RECOVERY_SECONDS.labels(phase="apply").observe(apply_s)
        M.WEIGHTS_VERSION.set(r.iteration)
        M.WEIGHTS_RECOVERED.set(r.iteration)
        group = parts.optimizer.param_groups[0]
        emit(log, "stage_recovered", "stage {stage} rebuilt by {rule} from {donors} at iteration {iteration} "
             "(lr {lr:.3g})", stage=stage, rule=r.rule, iteration=r.iteration,
             donors={str(k): v for k, v in r.donors.items()}, norms={str(k): v for k, v in r.norms.items()},
             fetch_s=round(r.fetch_s, 3), apply_s=round(apply_s, 3), total_s=round(time.monotonic() - t0, 3),
             lr=group["lr"], rebuild_s=round(t_built - t_take, 3), build_s=round(build_s, 3),
             waited_s=round(t_take - t0, 3), lr_base=group["initial_lr"],
             fresh_optimizer=r.optimizer is None and r.checkpoint is None, warn=r.warn)
        # (no pipeline runs without stage 0, nor on from a checkpoint: nothing to catch up with)
        resync = None if r.rule in ("checkpoint", "embed_copy") else Resync(stage, rule, rec, self.s, self.compute)
        return Taken(parts, r.iteration, resync)


__all__ = ["REJOIN_WATCH_S", "Replacement", "Resync", "Taken", "lost_stage_on_start", "stage_recovery"]
