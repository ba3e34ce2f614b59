"""models/stages.py: stage-by-stage runs along SkipPipe paths equal single-process runs (P9/P10)."""

import pytest
import torch

from models import ModelConfig, build_model, lm_loss
from models.stages import (StageSet, build_stage, check_hidden, run_order, run_path_stagewise,
                           stage_layer_ranges)

CFG = ModelConfig(d_model=32, n_layers=6, n_heads=4, max_seq_len=32)
ATOL = 1e-5


def _batch(seed, B=2, T=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _reference_grads(model, order_batches, scale):
    """Single process, one graph per microbatch over the whole model's blocks in path order."""
    model.zero_grad(set_to_none=True)
    logits = []
    for (x, y), order in order_batches:
        out = run_order(model, x, order)
        (lm_loss(out, y) * scale).backward()
        logits.append(out.detach())
    return logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_layer_ranges():
    assert stage_layer_ranges(6, 4) == [(0, 0), (0, 2), (2, 4), (4, 6)]
    assert stage_layer_ranges(7, 4, stage0_layers=1) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    assert stage_layer_ranges(5, 3) == [(0, 0), (0, 3), (3, 5)]
    with pytest.raises(ValueError, match="transformer stages"):
        stage_layer_ranges(2, 4)


@pytest.mark.parametrize("stage0_layers", [0, 1])
def test_full_in_order_path_equals_whole_model(stage0_layers):
    stages = StageSet.build(CFG, seed=3, n_stages=4, stage0_layers=stage0_layers)
    whole = build_model(CFG, 3)
    x, y = _batch(0)
    logits, loss = run_path_stagewise(stages, x, y, (0, 1, 2, 3))
    ref = whole(x)
    lm_loss(ref, y).backward()
    assert (logits - ref.detach()).abs().max().item() <= ATOL
    assert abs(loss.item() - lm_loss(ref, y).item()) <= ATOL
    ref_grads = {n: p.grad for n, p in whole.named_parameters()}
    seen = set()
    for s in range(4):
        for name, g in stages.grads(s).items():
            torch.testing.assert_close(g, ref_grads[name], atol=ATOL, rtol=0)
            seen.add(name)
    assert seen == set(ref_grads), "every whole-model parameter lives in exactly one stage"


def test_skipped_and_swapped_paths_accumulate_like_single_process():
    """Several microbatches with different paths (skip, adjacent swap): the stage-by-stage
    logits and each stage's accumulated gradient equal one process running the same orders."""
    stages = StageSet.build(CFG, seed=5, n_stages=4)
    whole = build_model(CFG, 5)
    paths = [(0, 1, 3), (0, 2, 1), (0, 1, 2, 3), (0, 3), (0, 2, 3), (0, 1, 3, 2)]
    batches = [_batch(10 + i) for i in range(len(paths))]
    scale = 1 / len(paths)
    logits = [run_path_stagewise(stages, x, y, p, loss_scale=scale)[0]
              for (x, y), p in zip(batches, paths)]
    ref_logits, ref_grads = _reference_grads(
        whole, [(b, stages.block_order(p)) for b, p in zip(batches, paths)], scale)
    for got, want in zip(logits, ref_logits):
        assert (got - want).abs().max().item() <= ATOL
    for s in range(4):
        got = stages.grads(s)
        assert got, f"stage {s} was visited and must hold a gradient"
        for name, g in got.items():
            torch.testing.assert_close(g, ref_grads[name], atol=ATOL, rtol=0)
    # a swapped order really is a different function (the test can tell orders apart)
    x, _ = batches[0]
    assert not torch.allclose(run_order(whole, x, stages.block_order((0, 1, 2))),
                              run_order(whole, x, stages.block_order((0, 2, 1))), atol=1e-4)


def test_inference_logits_along_paths():
    stages = StageSet.build(CFG, seed=4, n_stages=4)
    whole = build_model(CFG, 4)
    x, _ = _batch(3)
    with torch.no_grad():
        assert (stages.logits(x, (0, 1, 2, 3)) - whole(x)).abs().max().item() <= ATOL
        dropped = run_order(whole, x, stages.block_order((0, 1, 3)))
    assert (stages.logits(x, (0, 1, 3)) - dropped).abs().max().item() <= ATOL
    assert not stages.logits(x, (0, 1, 3)).requires_grad


def test_skipped_stage_gets_no_gradient():
    stages = StageSet.build(CFG, seed=1, n_stages=4)
    x, y = _batch(2)
    run_path_stagewise(stages, x, y, (0, 1, 3))
    assert stages.grads(2) == {}
    assert stages.grads(1) and stages.grads(3) and stages.grads(0)


def test_bad_inputs_raise_clear_errors():
    stage = build_stage(CFG, 0, stage=2, n_stages=4)
    with pytest.raises(ValueError, match="expected hidden states"):
        stage(torch.randn(2, 8, CFG.d_model + 1))
    with pytest.raises(ValueError, match="expected hidden states"):
        check_hidden(torch.randn(8, CFG.d_model), CFG)
    stages = StageSet.build(CFG, seed=0, n_stages=4)
    x, y = _batch(0)
    with pytest.raises(ValueError, match="must start at stage 0"):
        run_path_stagewise(stages, x, y, (1, 2))
    with pytest.raises(ValueError, match="must start at stage 0"):
        run_path_stagewise(stages, x, y, (0, 2, 2))
