"""The stage watchdog: what a stage node does when its pipeline makes no progress (issue 33,
finding 3; issue 29). A suspended schedule waits; a coordinator that does not answer is waited
for up to `stage.coordinator_outage_s`; else the node waits one more `stage.iteration_timeout_s`
for a new plan, then gives up: `PipelineStuck` fails the supervised task and the node exits 1.
`pipeline_stuck` says which. `role` is the StageRole (its cfg, stats, link, ex, log, stop)."""

from __future__ import annotations

import asyncio
import logging
import time

from node.logs import emit


async def watch(role) -> None:
    """No step for `stage.iteration_timeout_s`: a suspended schedule waits; a coordinator that
    does not answer is waited for up to `stage.coordinator_outage_s` (it re-plans when it is
    back); else the node waits once for a new plan (the coordinator drops a node that stalls
    its plan and re-plans, `schedule.stall_s`); when none came, or the coordinator stayed away,
    it gives up and exits 1 (`pipeline_stuck` says which): a stuck pipeline is a failure, never
    a clean exit."""
    waited_on: int | None = None          # the schedule epoch this node already waited past once
    unanswered_since: float | None = None  # when the coordinator stopped answering this watchdog
    while not role.stopping:
        await asyncio.sleep(min(5.0, role.cfg.iteration_timeout_s / 4))
        if time.monotonic() - role.stats.last_step <= role.cfg.iteration_timeout_s or role.stopping:
            continue
        try:
            st = await role.link.status()
        except Exception as exc:  # noqa: BLE001 - no answer: treat as stuck
            st = None
            role.log.info("coordinator status unavailable: %r", exc)
        if st is None:
            now = time.monotonic()
            unanswered_since = now if unanswered_since is None else unanswered_since
            if now - unanswered_since < role.cfg.coordinator_outage_s:
                emit(role.log, "pipeline_stuck", "iteration {iteration} made no progress for {timeout_s:.0f} s; "
                     "waiting for: {waiting_for}; the coordinator does not answer: waiting for it to come back "
                     "and re-plan ({outage_s:.0f} s of stage.coordinator_outage_s={limit_s:.0f} s; restart the "
                     "bootstrap with its key file, or start a standby)", level=logging.WARNING,
                     iteration=role.ex.iteration, timeout_s=role.cfg.iteration_timeout_s,
                     waiting_for=role.ex.waiting_for(), epoch=role.ex.latest_epoch,
                     action="wait_for_coordinator", exit_code=None, outage_s=now - unanswered_since,
                     limit_s=role.cfg.coordinator_outage_s)
                role.stats.touch()
                continue
        else:
            unanswered_since = None
        if st is not None and st.suspended:
            emit(role.log, "pipeline_suspended", "iteration {iteration} waits: the coordinator suspended the "
                 "schedule ({reason}); start a replacement with stage.checkfree.recover=true",
                 level=logging.WARNING, iteration=role.ex.iteration, reason=st.reason,
                 missing=list(st.missing_stages))
            role.stats.touch()
            continue
        wait = st is not None and waited_on != role.ex.latest_epoch
        emit(role.log, "pipeline_stuck", "iteration {iteration} made no progress for {timeout_s:.0f} s; waiting "
             "for: {waiting_for}; {action_text}", level=logging.WARNING if wait else logging.ERROR,
             iteration=role.ex.iteration, timeout_s=role.cfg.iteration_timeout_s,
             waiting_for=role.ex.waiting_for(), epoch=role.ex.latest_epoch,
             action="wait_for_plan" if wait else "exit", exit_code=None if wait else 1,
             action_text=("waiting one more timeout for the coordinator to drop the stalling node and re-plan"
                          if wait else "no new plan came" if st is not None else "the coordinator did not "
                          f"answer for stage.coordinator_outage_s={role.cfg.coordinator_outage_s:.0f} s"
                          ) + ("" if wait else "; giving up (exit 1)"))
        if wait:
            waited_on = role.ex.latest_epoch
            role.stats.touch()
            continue
        role.stop()
        raise PipelineStuck(f"pipeline stuck at iteration {role.ex.iteration} (epoch {role.ex.latest_epoch}); "
                            "see the pipeline_stuck line above")


class PipelineStuck(RuntimeError):
    """The stage watchdog gave up on a stuck pipeline: the node exits 1 (its supervised task fails)."""


__all__ = ["PipelineStuck", "watch"]
