"""CheckFree / CheckFree+ rules (docs/pipeline.md, 'CheckFree recovery'), on real stage modules."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.optim import InnerConfig
from models.stages import build_stage
from pipeline.checkfree import (RecoveryError, average_neighbours, checkfree_plus_order, choose_recovery,
                                fresh_optimizer, neighbour_weight)

CFG = ModelConfig(d_model=32, n_layers=4, n_heads=2, max_seq_len=16)


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_stage(CFG, seed, 2, 5).state_dict().items()}


def _avg(left, right, ln, rn, **kw):
    return average_neighbours(left, right, left_norm=ln, right_norm=rn, left_iteration=7, right_iteration=7, **kw)


def test_formula_by_hand_midpoint_and_limit():
    left, right = _state(1), _state(2)
    name = next(k for k, v in left.items() if v.is_floating_point() and v.dim() == 2)
    out = _avg(left, right, 3.0, 1.0)
    wl, wr = 3.0 + 1e-4, 1.0 + 1e-4
    torch.testing.assert_close(out[name], (wl * left[name] + wr * right[name]) / (wl + wr), atol=1e-6, rtol=0)
    mid = _avg(left, right, 0.5, 0.5)                                   # equal norms: exact midpoint
    torch.testing.assert_close(mid[name], (left[name] + right[name]) / 2, atol=1e-7, rtol=0)
    near_left = _avg(left, right, 1000.0, 0.0)                          # wr -> 0 gives about W[i-1]
    assert (near_left[name] - left[name]).abs().max() < 1e-6 * (right[name] - left[name]).abs().max() + 1e-6
    assert neighbour_weight(-2.0) == pytest.approx(2.0001) and neighbour_weight(2.0, power=2) == pytest.approx(4.0001)


def test_non_float_buffers_are_copied_not_averaged():
    left, right = _state(1), _state(2)
    left["counter"], right["counter"] = torch.tensor([3], dtype=torch.long), torch.tensor([9], dtype=torch.long)
    out = _avg(left, right, 1.0, 1.0)
    assert out["counter"].dtype == torch.long and out["counter"].item() == 3


def test_same_iteration_required_and_schema_checked():
    left, right = _state(1), _state(2)
    with pytest.raises(RecoveryError, match="same iteration"):
        average_neighbours(left, right, left_norm=1, right_norm=1, left_iteration=7, right_iteration=8)
    with pytest.raises(RecoveryError, match="different tensors"):
        _avg(left, {k: v for k, v in right.items() if k != next(iter(right))}, 1, 1)
    with pytest.raises(RecoveryError, match="gradient norm is nan"):
        _avg(left, right, float("nan"), 1.0)


def test_replacements_compute_bit_identical_weights():
    left, right = _state(1), _state(2)
    a, b = _avg(left, right, 0.37, 1.91), _avg({k: v.clone() for k, v in left.items()}, right, 0.37, 1.91)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fresh_optimizer_scales_from_the_initial_lr_without_compounding():
    stage = build_stage(CFG, 0, 2, 5)
    old = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    stage(torch.randn(2, 16, 32)).sum().backward()
    old.step()
    opt = fresh_optimizer(stage.parameters(), InnerConfig(lr=1e-3), lr_scale=1.1)
    assert opt.state_dict()["state"] == {}                              # no moments carried over
    assert opt.param_groups[0]["lr"] == pytest.approx(1.1e-3) and opt.param_groups[0]["weight_decay"] == 0.0
    again = fresh_optimizer(stage.parameters(), InnerConfig(lr=1e-3), lr_scale=1.1)   # a second failure
    assert again.param_groups[0]["lr"] == pytest.approx(1.1e-3)


def test_fresh_optimizer_takes_the_runs_betas_eps_and_weight_decay():
    """A rebuilt stage steps with the run's `stage.optim` like its neighbours (issue 31, item 7), not
    AdamW's defaults; only the LR is scaled."""
    stage = build_stage(CFG, 0, 2, 5)
    run = InnerConfig(lr=2e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = fresh_optimizer(stage.parameters(), run, lr_scale=1.2)
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["eps"] == 1e-6 and group["weight_decay"] == 0.1
    assert group["lr"] == pytest.approx(2.4e-4) and run.lr == 2e-4      # the run's config is not changed
    assert sum(p.numel() for p in group["params"]) == sum(p.numel() for p in stage.parameters())


def test_rule_table():
    t, every = 5, {0, 1, 2, 3, 4, 5}
    assert choose_recovery(3, t, every - {3}, replica_alive=True).rule == "replica"            # P21
    r = choose_recovery(3, t, every - {3})
    assert (r.rule, r.sources) == ("average", (2, 4))
    assert choose_recovery(0, t, every - {0}).sources == (1,)
    # CheckFree+: stage 1 copies 2, stage T copies T-1, and the partners copy back (P22)
    assert [choose_recovery(s, t, every - {s}, plus=True).sources for s in (1, 2, 4, 5)] == [(2,), (1,), (5,), (4,)]
    assert choose_recovery(3, t, every - {3}, plus=True).rule == "average"
    with pytest.raises(RecoveryError, match="edge stage"):
        choose_recovery(1, t, every - {1})
    warned = choose_recovery(5, t, every - {5}, allow_edge_copy=True)
    assert (warned.rule, warned.sources) == ("copy_neighbour", (4,)) and warned.warn
    with pytest.raises(RecoveryError, match="at least 4"):
        choose_recovery(1, 3, {0, 2, 3}, plus=True)


def test_adjacent_double_failure_never_averages_missing_weights():
    t, every = 5, {0, 1, 2, 3, 4, 5}
    lost = every - {2, 3}
    assert choose_recovery(3, t, lost, has_checkpoint=True).rule == "checkpoint"               # P23
    r = choose_recovery(3, t, lost)
    assert r.rule == "nearest" and r.sources == (1, 4) and r.warn
    assert choose_recovery(2, t, lost, plus=True).sources == (1,)       # partner 1 survives: copy it
    edge = choose_recovery(1, t, every - {1, 2}, plus=True)
    assert edge.rule == "nearest" and edge.sources == (3,)


@pytest.mark.parametrize("t", [4, 5, 6, 9])
def test_exactly_the_odd_microbatches_swap_the_edge_pairs(t):
    inorder = list(range(1, t + 1))
    for mb in range(6):
        order = checkfree_plus_order(mb, t)
        assert sorted(order) == inorder
        if mb % 2 == 0:
            assert order == inorder
        else:
            assert order[:2] == [2, 1] and order[-2:] == [t, t - 1] and order[2:-2] == inorder[2:-2]
    with pytest.raises(RecoveryError):
        checkfree_plus_order(1, 3)
