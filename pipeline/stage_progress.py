"""What one stage node measures about its own run and publishes after each step and validation.

Owns the stage role's typed card details (`StageCard`) and the figures it reports
(pipeline/stage_role.py): seconds per iteration and the
idle share (time blocked on the inbox while an iteration was open), first and last training and
validation loss, training seconds without validation, when an originator's microbatches started
and came back, the weight commits the coordinator compares between replicas; and the stage's own
metrics (pipeline/stage_metrics.py; the shared train series go through the role's report). The
executor keeps
running totals (microbatches, deferrals); they are published by their difference to what this
object published before, never by reading a counter back.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from node import metrics as NM
from node.round_report import TrainStep
from node.run_settings import TrainingCard
from pipeline import stage_metrics as M
from pipeline.stage_exec import EvalResult, StageExecutor, StepResult

COMMITS_KEPT = 4
"""Weight commits on the card: the coordinator compares replicas polled at different iterations."""


class StageCard(TrainingCard):
    """A stage node's card details: what the coordinator plans, audits and recovers with."""

    stage: int | None = None
    """The stage this node serves (absent on a replacement until it holds one)."""
    memory: int | None = None
    """Microbatch slots (`schedule.memory`): the planner caps the visits per node by it."""
    compute_ms: int | None = None
    """Measured forward milliseconds per microbatch, plus `stage.compute_delay_s`."""
    grad_bytes: int | None = None
    """Bytes this node exchanges with each replica per iteration (its flat gradient)."""
    iteration: int | None = None
    """Completed iterations (optimizer steps): donors are ordered by it."""
    commit: str | None = None
    """The last COMMITS_KEPT weight commits, `<iteration>:<sha256 prefix>`, newest first."""
    embed_copy_iter: int | None = None
    """Stage 1: the iteration of the copy of stage 0 it keeps (pipeline/embed_copy.py)."""
    recovering: int | None = None
    """A replacement's claim: the stage it is rebuilding (None once it holds one or picks again)."""
    loss: float | None = None
    """A data node's mean training loss of its last iteration (the coordinator's loss trend)."""
    nonfinite: str | None = None
    """Non-finite tensors received in its last iterations, `<iteration>:<fwd|bwd>:<sender>`
    (pipeline/stage_evidence.py): the coordinator tells from them which node produces them."""
    coordinator_wait: str | None = None
    """Set only before the node's first schedule, while its coordinator does not answer:
    `<coordinator peer ID or ?>@<unix seconds>` (node/coordinator_wait.py; `swarmnode status`
    shows it). A running node does not publish it: its card is near the 16-detail limit."""


class StageProgress:
    """One stage node's own record of its run. `last_step` is the watchdog's last sign of progress."""

    def __init__(self) -> None:
        self.last_step = time.monotonic()
        self.idle = 0.0                        # seconds blocked on the inbox since the last step
        self.train_t0: float | None = None     # monotonic start of iteration 0
        self.eval_s = 0.0                      # validation seconds since then (not training time)
        self.eval_t0: float | None = None
        self.loss_start: float | None = None
        self.loss_end: float | None = None
        self.eval_start: float | None = None
        self.eval_end: float | None = None
        self.origin_times: dict[int, list[float]] = {}
        self.commits: list[str] = []
        self._published: Counter = Counter()   # executor totals already added to their counters

    def waited(self, seconds: float) -> None:
        """The node waited `seconds` for a message while an iteration was open."""
        self.idle += seconds
        M.IDLE_SECONDS.inc(seconds)

    def touch(self) -> None:
        """Progress without a step (an aborted iteration, a suspended schedule): reset the watchdog."""
        self.last_step = time.monotonic()

    def iteration_started(self, iteration: int) -> None:
        if self.train_t0 is None:
            self.train_t0 = time.monotonic()
        self.origin_times[iteration] = [time.time()]

    def origin_done(self, iteration: int) -> None:
        """This originator's microbatches of `iteration` all came back."""
        self.origin_times.setdefault(iteration, [math.nan]).append(time.time())

    def _publish_totals(self, ex: StageExecutor) -> None:
        totals = {("microbatches", d): ex.microbatches[d] for d in ("forward", "backward")}
        totals[("deferred", "")] = ex.deferred_total
        for key, total in totals.items():
            counter = M.MICROBATCHES.labels(direction=key[1]) if key[0] == "microbatches" else M.DEFERRED
            counter.inc(total - self._published[key])
            self._published[key] = total

    def step(self, e: StepResult, ex: StageExecutor, tokens_per_visit: int) -> tuple[dict, TrainStep | None]:
        """Record step `e` (the executor now at ex.iteration); returns the `stage_step` fields this
        object owns (seconds, idle, an originator's start and end times) and, on a data node (it
        has the loss), the step for the shared train series."""
        now = time.monotonic()
        seconds, self.last_step = now - self.last_step, now
        idle, self.idle = self.idle, 0.0
        M.ITERATION_SECONDS.observe(seconds)
        M.IDLE_FRACTION.set(min(1.0, idle / seconds) if seconds > 0 else 0.0)
        M.ITERATION.set(ex.iteration)
        M.WEIGHTS_VERSION.set(ex.iteration)
        M.SCHEDULE_EPOCH.set(ex.epoch)
        self._publish_totals(ex)
        train = None
        if e.loss is not None:
            train = TrainStep(e.loss, tokens_per_visit * e.visits, seconds)
            self.loss_start = e.loss if self.loss_start is None else self.loss_start
            self.loss_end = e.loss
        else:
            NM.TRAIN_STEPS.inc()           # a transformer stage steps without a loss of its own
        origin = self.origin_times.pop(e.iteration, None)
        return {"seconds": seconds, "idle_s": idle,
                **({"started_at": origin[0], "done_at": origin[-1]} if origin and len(origin) == 2 else {})}, train

    def commit(self, iteration: int, weights_sha256: str) -> str:
        """The card's `commit` detail after step `iteration`: the last COMMITS_KEPT, newest first."""
        self.commits = (self.commits + [f"{iteration}:{weights_sha256[:16]}"])[-COMMITS_KEPT:]
        return ",".join(reversed(self.commits))

    def eval_started(self) -> None:
        self.eval_t0 = time.monotonic()

    def eval_done(self, e: EvalResult) -> float:
        """Record validation `e`; returns the training seconds so far (validation time left out)."""
        if self.eval_t0 is not None and self.train_t0 is not None:
            self.eval_s += time.monotonic() - self.eval_t0
        train_s = 0.0 if self.train_t0 is None else time.monotonic() - self.train_t0 - self.eval_s
        NM.EVAL_LOSS.set(e.loss)
        if self.eval_start is None:
            self.eval_start = e.loss
            NM.EVAL_LOSS_INITIAL.set(e.loss)
        self.eval_end = e.loss
        return train_s

    def summary(self) -> dict:
        """The losses of the `training_finished` event."""
        return {"eval_loss_start": self.eval_start, "eval_loss_end": self.eval_end,
                "train_loss_start": self.loss_start, "train_loss_end": self.loss_end}


__all__ = ["COMMITS_KEPT", "StageCard", "StageProgress"]
