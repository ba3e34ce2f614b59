"""Stage 0 holds the embedding and a stage's worth of first blocks (issue 31, item 6; docs/pipeline.md, 'Terms').

Stage 0 is on every path, first (R1), so blocks it holds are never skipped, swapped or dropped:
the planner's paths (SkipPipe, random, CheckFree+) and the omission benchmark's kept subsets all
run them first, in order. With `stage0_layers = 0` (our earlier default) the first blocks sat on
stage 1 and were skipped and swapped; the control cases show the checks would see that.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import skippipe as bench
from models.config import DataConfig, ModelConfig
from models.stages import StageSet, block_order, stage0_share, stage_layer_ranges
from pipeline import stage_demo
from pipeline.config import ScheduleConfig, StageConfig
from pipeline.geo import geo_cluster
from pipeline.schedule import checkfree_plus_paths
from pipeline.search import plan
from pipeline.stage_parts import StageSettings, build_module, stage0_layers, stage_cfg_hash

PAPER_MODEL = ModelConfig(d_model=64, n_layers=24, n_heads=4, max_seq_len=32)
"""The paper's depth: 24 blocks over 6 stages (4 each, stage 0 included)."""


def _settings(model: ModelConfig, **stage) -> StageSettings:
    return StageSettings(stage=StageConfig(**stage), schedule=ScheduleConfig(), model=model, data=DataConfig())


def _block_orders(schedule, ranges) -> list[list[int]]:
    return [block_order(ranges, schedule.stages(p)) for p in range(len(schedule.paths))]


def test_stage0_holds_a_stages_worth_of_first_blocks_by_default():
    s = _settings(PAPER_MODEL)
    assert StageConfig().stage0_layers is None and stage0_layers(s) == 4 == stage0_share(24, 6)
    assert stage_layer_ranges(24, 6, None) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24)]
    names = {n for n, _ in build_module(s, 0).core.named_parameters()}
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "2", "3"}
    assert {"embed.weight", "norm.weight"} <= names                     # embedding (tied head) and final norm
    # configured otherwise: 0 blocks (our earlier split) or any count; the cfg hash follows the resolved count
    assert stage0_layers(_settings(PAPER_MODEL, stage0_layers=0)) == 0
    assert stage_cfg_hash(_settings(PAPER_MODEL, stage0_layers=4)) == stage_cfg_hash(s)
    assert stage_cfg_hash(_settings(PAPER_MODEL, stage0_layers=0)) != stage_cfg_hash(s)
    # too few blocks for a share: stage 0 keeps none, the transformer stages one each
    assert stage0_share(5, 6) == 0 and stage_layer_ranges(5, 6, None)[0] == (0, 0)
    # the demo and the benchmark give stage 0 one block of four
    assert stage0_share(bench.MODEL["n_layers"], bench.STAGES) == 1
    demo_layers = next(int(v.split("=")[1]) for v in stage_demo.node_settings(1) if v.startswith("model.n_layers="))
    assert stage0_share(demo_layers, stage_demo.STAGES) == 1


@pytest.mark.parametrize("method", ["skippipe", "random", "checkfree_plus"])
def test_the_planner_never_skips_or_swaps_stage0s_blocks(method):
    """The default [schedule] (S = 6, k = 1/3) on 20 geo-distributed nodes: every path runs blocks
    0-3 first, in order; with stage0_layers = 0 the same paths skip or swap block 0."""
    cfg = ScheduleConfig()
    cluster = geo_cluster(20, seed=0)
    base = "random" if method == "checkfree_plus" else method
    sched = plan(cluster, [5, 3, 3, 3, 3, 3], cfg.rules(), cfg.mb_per_origin, method=base, seed=1,
                 time_budget_s=20, **({"max_iters": 150} if base == "skippipe" else {}))
    if method == "checkfree_plus":
        sched = checkfree_plus_paths(sched)
    ranges = stage_layer_ranges(PAPER_MODEL.n_layers, cfg.stages, stage0_layers(_settings(PAPER_MODEL)))
    orders = _block_orders(sched, ranges)                    # the split the [stage] defaults give
    assert len(orders) == 5 * cfg.mb_per_origin
    for order in orders:
        assert order[:4] == [0, 1, 2, 3] and order.count(0) == 1                 # first, in order, once
        assert len(order) == 4 + (cfg.rules().L - 1) * 4                         # 4 + 3 stages x 4 blocks
    # control: with no blocks on stage 0, the same schedule skips block 0 on some paths and, for
    # CheckFree+, swaps it behind stage 2's blocks on others
    old = _block_orders(sched, stage_layer_ranges(24, cfg.stages, 0))
    assert any(0 not in o for o in old) or any(o[0] != 0 for o in old if 0 in o)
    if method == "checkfree_plus":
        assert any(0 in o and o[0] != 0 for o in old)


def test_the_omission_benchmark_never_drops_stage0s_blocks():
    """benchmarks/skippipe.py drops 25% / 50% of the stages at inference; every kept path starts
    at stage 0, whose block runs first, and the paths `dropped_stage_perplexity` evaluates are those."""
    n = bench.STAGES
    for drop in range(n):
        subsets = bench.kept_stage_subsets(n, drop)
        assert len(subsets) == len({s for s in subsets}) and all(p[0] == 0 and 0 not in p[1:] for p in subsets)
        assert all(len(p) == n - drop for p in subsets)
    with pytest.raises(ValueError):
        bench.kept_stage_subsets(n, n)
    cfg = ModelConfig(**bench.MODEL)
    stages = StageSet.build(cfg, 0, n, stage0_layers=None)
    assert stages.ranges[0] == (0, 1) and "layers.0.attn.wq.weight" in dict(stages.stages[0].core.named_parameters())
    assert all(stages.block_order(p)[0] == 0 for drop in range(n) for p in bench.kept_stage_subsets(n, drop))
    seen = []
    logits = stages.logits

    def spy(tokens, path):
        seen.append(tuple(path))
        return logits(tokens, path)

    stages.logits = spy
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    ppl = bench.dropped_stage_perplexity(stages, [(x, x)], 0.5)
    assert ppl > 1 and len(seen) == 3 + 3                    # 1.5 of 3 dropped: C(3,2) + C(3,1) subsets
    assert all(p[0] == 0 for p in seen) and {len(p) for p in seen} == {2, 3}
