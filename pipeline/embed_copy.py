"""Stage 1's copy of stage 0 (CheckFree): what rebuilds the data nodes' stage when all of them are lost.

Stage 0 (embedding, final norm, head) has no neighbour on one side to average with, so stage-1
nodes keep a copy of its weights in host memory: fetched from a data node after stage 1's first
step and every `stage.checkfree.embed_copy_every` iterations (`WeightService.Fetch`), served to a
replacement as stage 0's state stamped with the holder's own iteration (the replacement joins
there; pipeline/recovery.py rule `embed_copy`). A failed refresh keeps the older copy and is
logged; the next one tries again. At most one refresh runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from node.logs import emit
from node.state_sync import StateSnapshot
from pipeline import stage_metrics as M
from pipeline.recovery import StageRecovery
from pipeline.stage_progress import StageCard

log = logging.getLogger("swarmnode.stage")


class EmbedCopy:
    """The copy one stage-1 node keeps. `every` = `stage.checkfree.embed_copy_every` (0 = none);
    `update_card(StageCard, publish)` is the role's typed card update."""

    def __init__(self, ctx, recovery: StageRecovery, every: int, update_card: Callable[[StageCard, bool], None]):
        self.ctx, self.recovery, self.every, self.update_card = ctx, recovery, every, update_card
        self.copy: StateSnapshot | None = None
        self._task: asyncio.Task | None = None
        self._retry_after = 0                    # after a failed refresh: not before this iteration

    def due(self, iteration: int) -> bool:
        """A refresh is due after this step when none runs and the copy is `every` iterations old
        (or there is none yet). Measured from the copy's own iteration, not by multiples of
        `every`: a refresh still running at the next multiple (a slow fetch on a loaded node) no
        longer skips it, which left copies up to twice `every` old. A failed refresh waits `every`
        iterations before the next try."""
        if not self.every or iteration < self._retry_after:
            return False
        if self._task is not None and not self._task.done():
            return False
        return self.copy is None or iteration - int(self.copy.meta["iteration"]) >= self.every

    def maybe_refresh(self, iteration: int) -> None:
        """After stage 1's step `iteration`: start a refresh (supervised) when one is due."""
        if self.due(iteration):
            self._task = self.ctx.supervisor.spawn("stage_embed_copy", lambda: self.refresh(iteration),
                                                   restart=False)

    def served(self, stage: int, holder_iteration: int) -> StateSnapshot | None:
        """The copy of `stage` this node serves (stage 0's only), stamped with this node's own
        iteration: a replacement for stage 0 joins there."""
        c = self.copy
        if stage != 0 or c is None:
            return None
        return StateSnapshot({**c.meta, "holder_iteration": holder_iteration}, c.weights, None)

    async def refresh(self, iteration: int) -> None:
        """Download stage 0's weights of `iteration - 1` (or later) from a data node and keep them.
        Stage 1 steps before the data nodes finish the same iteration, so a data node asked at
        once still serves the previous one: waiting for `iteration` cost a 0.5 s retry, and a data
        node lost within it (5 fast iterations later, in CI) left a copy 17 iterations old."""
        t0 = time.monotonic()
        try:
            meta, weights, _, donor = await self.recovery.fetch(0, optimizer=False, min_iteration=max(0, iteration - 1))
        except Exception as exc:  # noqa: BLE001 - RecoveryError or a transport error: keep the older copy
            emit(log, "embed_copy_failed", "stage 0's copy not refreshed at iteration {iteration} ({error}); keeping "
                 "the copy of iteration {kept}", level=logging.WARNING, iteration=iteration, error=str(exc),
                 kept=self.copy.meta["iteration"] if self.copy else None)
            self._retry_after = iteration + self.every
            return
        got = int(meta["iteration"])
        self.copy = StateSnapshot({"stage": 0, "iteration": got}, weights, None)
        self.update_card(StageCard(embed_copy_iter=got), False)
        M.EMBED_COPY_ITERATION.set(got)
        emit(log, "embed_copy_refreshed", "kept a copy of stage 0 at iteration {iteration} from {donor}",
             iteration=got, donor=donor, seconds=round(time.monotonic() - t0, 3),
             bytes=sum(t.numel() * t.element_size() for t in weights.values()))

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


__all__ = ["EmbedCopy"]
