"""A stage node frozen past its liveness probes and its card's TTL, then resumed (issue 29, the
chaos soak's SIGSTOP of 20-60 s): bootstrap + one stage node per stage (0, 1, 2) as OS processes on
127.0.0.1; stage 1's process group is SIGSTOPped for 20 s (by PID), then SIGCONTed.

The coordinator marks it down and suspends the schedule (`stage_down`); once it answers again it
fills its stage again (`stage_node_back`: no replacement holds the stage) and every stage steps on.
Before, a node marked down was never probed again: the pipeline stayed suspended for good.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from node.localswarm import LocalSwarm
from tests.integration.test_noloco_swarm import events, wait_for
from tests.integration.test_pipeline_coordinator_loss import running_pipeline, settings, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_a_frozen_stage_node_that_resumes_fills_its_stage_again_and_the_pipeline_steps_on(tmp_path):
    with LocalSwarm(run_id="freeze", workdir=tmp_path, common_set=settings()) as swarm:
        boot, stages = running_pipeline(swarm)
        frozen = stages[1]
        os.killpg(frozen.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: any(e["stage"] == 1 for e in events(boot, "stage_down")), 60,
                     "the coordinator to mark stage 1 down")
            time.sleep(12)                               # past the card's TTL (card.ttl_s=10)
        finally:
            os.killpg(frozen.pid, signal.SIGCONT)
        t_thaw = time.monotonic()
        at_thaw = {n.name: len(steps(n)) for n in stages}
        wait_for(lambda: all(len(steps(n)) >= at_thaw[n.name] + 5 for n in stages), 120,
                 lambda: f"5 more steps on every stage after the thaw ({ {n.name: len(steps(n)) for n in stages} }); "
                         f"bootstrap log tail: {boot.log_text()[-2500:]}")
        back_s = time.monotonic() - t_thaw
        back = events(boot, "stage_node_back")
        alive = [n.alive() for n in stages]
    print(f"stage 1 frozen, marked down, resumed: 5 more steps everywhere {back_s:.1f} s after the thaw")
    assert all(alive), alive
    assert back and back[-1]["stage"] == 1, back
