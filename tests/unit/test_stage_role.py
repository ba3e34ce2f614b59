"""The stage role's own parts, without a swarm: its run settings (one name per knob, the older
`iterations` still accepted), what it publishes after a step (metrics by difference, the commit
list, the typed card), stage 1's copy-refresh cadence and the role's declaration on TrainingRole.
The role running on real nodes is tests/integration/test_pipeline_swarm.py."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from node.metrics import REGISTRY
from node.training import TrainingRole
from pipeline.config import StageConfig
from pipeline.embed_copy import EmbedCopy
from pipeline.stage_msgs import StepResult
from pipeline.stage_progress import COMMITS_KEPT, StageCard, StageProgress
from pipeline.stage_role import StageRole


def test_exit_after_is_the_one_name_and_iterations_still_fills_it():
    assert StageConfig.model_validate({"iterations": 20}).exit_after == 20
    assert StageConfig.model_validate({"exit_after": 7}).exit_after == 7
    with pytest.raises(ValidationError, match="iterations and exit_after are the same setting"):
        StageConfig.model_validate({"iterations": 20, "exit_after": 20})
    c = StageConfig()
    assert (c.exit_after, c.eval_every, c.checkpoint_every, c.torch_threads) == (0, 5, 0, 0)
    assert "iterations" not in StageConfig.model_fields


def test_the_role_is_a_training_role_counting_iterations_and_serving_its_state():
    assert issubclass(StageRole, TrainingRole)
    assert StageRole.run_section == "stage" and StageRole.Card is StageCard and StageRole.serves_state
    assert StageRole.progress_key == "iteration" and StageRole.checkpoint_format == "swarmnode-stage-v1"
    assert StageRole.finished_msg.format(iterations=3) == "pipeline finished after 3 iterations"


def _sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def _step(it: int, loss: float | None, visits: int = 3) -> StepResult:
    return StepResult(it, visits, 6, 0.5, 0.5, "ab" * 32, loss, 1)


def test_a_step_publishes_the_executor_totals_by_difference_and_returns_the_train_step():
    names = [("swarmnode_pipeline_microbatches_total", {"direction": "forward"}),
             ("swarmnode_pipeline_microbatches_total", {"direction": "backward"}),
             ("swarmnode_pipeline_deferred_total", {})]
    before = [_sample(n, lb) for n, lb in names]
    ex = SimpleNamespace(microbatches=Counter(forward=4, backward=3), deferred_total=2, iteration=1, epoch=1)
    stats = StageProgress()
    stats.iteration_started(0)
    stats.origin_done(0)
    fields, train = stats.step(_step(0, 5.5), ex, tokens_per_visit=128)
    assert train is not None and (train.loss, train.tokens) == (5.5, 3 * 128)
    assert fields["started_at"] <= fields["done_at"] and fields["seconds"] >= 0 and fields["idle_s"] == 0
    ex.microbatches.update(forward=2, backward=4)          # totals 6 / 7; deferred unchanged
    ex.iteration = 2
    fields, train = stats.step(_step(1, 4.0), ex, tokens_per_visit=128)
    assert "started_at" not in fields                       # not an originator of this one
    after = [_sample(n, lb) for n, lb in names]
    assert [a - b for a, b in zip(after, before)] == [6, 7, 2]       # the totals, each counted once
    assert (stats.loss_start, stats.loss_end) == (5.5, 4.0)
    _, train = stats.step(_step(2, None), ex, tokens_per_visit=128)
    assert train is None and stats.loss_end == 4.0          # a transformer stage has no loss of its own


def test_the_card_carries_the_last_commits_newest_first():
    stats = StageProgress()
    for it in range(1, COMMITS_KEPT + 3):
        value = stats.commit(it, f"{it:02d}" * 32)
    parts = value.split(",")
    assert len(parts) == COMMITS_KEPT and parts[0] == f"{COMMITS_KEPT + 2}:" + f"{COMMITS_KEPT + 2:02d}" * 8
    assert [int(p.split(":")[0]) for p in parts] == list(range(COMMITS_KEPT + 2, 2, -1))
    card = StageCard(iteration=7, commit=value)
    assert card.details() == {"iteration": 7, "commit": value}     # unset fields stay off the card
    assert StageCard(recovering=None).details() == {"recovering": None}   # None removes the detail
    with pytest.raises(ValidationError):
        StageCard(stage_index=1)


def test_eval_time_is_left_out_of_the_training_seconds():
    stats = StageProgress()
    stats.iteration_started(0)
    stats.eval_started()
    stats.train_t0 -= 150.0                                 # training began 150 s ago,
    stats.eval_t0 -= 100.0                                  # and a validation took the last 100 s
    train_s = stats.eval_done(SimpleNamespace(loss=3.0, iteration=0))
    assert 49.0 < train_s < 51.0 and stats.eval_start == stats.eval_end == 3.0
    assert stats.summary() == {"eval_loss_start": 3.0, "eval_loss_end": 3.0, "train_loss_start": None,
                               "train_loss_end": None}
    assert not math.isnan(_sample("swarmnode_eval_loss"))


async def test_stage_1_refreshes_its_copy_first_then_whenever_it_is_n_iterations_old_one_at_a_time():
    started: list[int] = []
    gate = asyncio.Event()

    class Supervisor:
        def spawn(self, name, factory, restart=True):
            return asyncio.get_running_loop().create_task(factory())

    copy = EmbedCopy(SimpleNamespace(supervisor=Supervisor()), recovery=None, every=10, update_card=None)

    async def refresh(iteration):
        started.append(iteration)
        await gate.wait()
        copy.copy = SimpleNamespace(meta={"iteration": iteration})
    copy.refresh = refresh
    copy.maybe_refresh(1)                                   # no copy yet: the first step refreshes
    await asyncio.sleep(0)
    copy.maybe_refresh(10)                                  # due, but the first refresh still runs
    await asyncio.sleep(0)
    gate.set()
    await asyncio.sleep(0.01)
    # the copy of iteration 1 is 10 old at step 11: refreshed at once, not at step 20 (under load
    # a slow first fetch made the copy 19 iterations old and failed test_checkfree_swarm)
    copy.maybe_refresh(11)
    await asyncio.sleep(0.01)
    for it in (12, 19, 20):
        copy.maybe_refresh(it)                              # the copy of 11 is fresh enough
    copy.maybe_refresh(21)
    await asyncio.sleep(0.01)
    assert started == [1, 11, 21]
    assert not EmbedCopy(None, None, every=0, update_card=None).due(10)   # 0 = no copy


async def test_a_failed_refresh_is_tried_again_after_n_iterations_not_at_every_step():
    class Supervisor:
        def spawn(self, name, factory, restart=True):
            return asyncio.get_running_loop().create_task(factory())

    class Failing:
        calls = 0

        async def fetch(self, stage, *, optimizer, min_iteration=0, holder=None):
            Failing.calls += 1
            raise RuntimeError("no data node serves stage 0")
    copy = EmbedCopy(SimpleNamespace(supervisor=Supervisor()), Failing(), every=10, update_card=None)
    for it in range(1, 12):
        copy.maybe_refresh(it)
        await asyncio.sleep(0.01)
    assert Failing.calls == 2 and copy.copy is None       # steps 1 and 11


async def test_the_copy_takes_the_data_nodes_state_of_the_iteration_it_is_finishing():
    """Stage 1 steps before the data node finishes the same iteration: asked after stage 1's step
    20, a data node still at 19 is taken (waiting for 20 cost a 0.5 s retry, and a data node lost
    within it left the copy at 10: 17 iterations old when it was needed, seen in CI)."""
    asked: list[int] = []

    class Recovery:
        async def fetch(self, stage, *, optimizer, min_iteration=0, holder=None):
            asked.append(min_iteration)
            return {"iteration": "19"}, {"w": torch.zeros(2)}, None, "12D3KooWdata"

    cards: list = []
    copy = EmbedCopy(None, Recovery(), every=10, update_card=lambda card, publish: cards.append(card))
    await copy.refresh(20)
    assert asked == [19] and copy.copy.meta["iteration"] == 19 and cards[0].embed_copy_iter == 19
