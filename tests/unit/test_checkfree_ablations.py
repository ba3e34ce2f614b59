"""CheckFree ablations (copy a neighbour, uniform average, random re-init) and the
checks test_checkfree.py leaves out: versioning (P18) for every averaging rule, determinism across
replicas that received the neighbours' weights over the wire (P19), the optimizer reset leaving the
other stages alone (P20), and the recovery rules applied to a trained stage set (P22, P23, P24)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.config import ModelConfig
from models.llama import lm_loss
from models.optim import InnerConfig
from models.stages import StageSet, build_stage, run_path_stagewise
from pipeline.checkfree import (ABLATIONS, RecoveryError, average_neighbours, checkfree_plus_order,
                                choose_recovery, copy_neighbour, fresh_optimizer, random_reinit, shift_layers,
                                uniform_average)

CFG = ModelConfig(d_model=32, n_layers=4, n_heads=2, max_seq_len=16)


def _state(seed: int, stage: int = 2) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_stage(CFG, seed, stage, 5).state_dict().items()}


def _floats(state):
    return [k for k, v in state.items() if v.is_floating_point()]


# ---- the ablation rules ----------------------------------------------------------------------------------

def test_ablation_names():
    assert ABLATIONS == ("copy", "uniform", "random")


def test_copy_neighbour_clones_every_tensor():
    src = _state(1)
    out = copy_neighbour(src)
    assert out.keys() == src.keys() and all(torch.equal(out[k], src[k]) for k in src)
    name = _floats(src)[0]
    out[name].add_(1.0)                                     # a copy, not the neighbour's storage
    assert not torch.equal(out[name], src[name])
    with pytest.raises(RecoveryError, match="no tensors"):
        copy_neighbour({})


def test_uniform_average_is_the_midpoint_whatever_the_norms():
    left, right = _state(1), _state(2)
    out = uniform_average(left, right, left_iteration=4, right_iteration=4)
    for k in _floats(left):
        torch.testing.assert_close(out[k], (left[k] + right[k]) / 2, atol=1e-7, rtol=0)
    weighted = average_neighbours(left, right, left_norm=5.0, right_norm=0.1, left_iteration=4, right_iteration=4)
    k = next(k for k in _floats(left) if left[k].dim() == 2)
    assert not torch.allclose(weighted[k], out[k])          # the norms matter to the real rule, not here


def test_random_reinit_shapes_gains_and_scale():
    template = {k: (v * 0.5 if v.dim() == 1 else v) for k, v in _state(1).items()}   # gains no longer ones
    template["counter"] = torch.tensor([5], dtype=torch.long)
    out = random_reinit(template, seed=3)
    assert out.keys() == template.keys()
    assert all(out[k].shape == template[k].shape and out[k].dtype == template[k].dtype for k in template)
    assert out["counter"].item() == 5
    mats = [k for k in _floats(template) if template[k].dim() >= 2]
    gains = [k for k in _floats(template) if template[k].dim() == 1]
    assert gains and all(torch.equal(out[k], torch.ones_like(out[k])) for k in gains)
    flat = torch.cat([out[k].flatten() for k in mats])
    assert 0.015 < flat.std().item() < 0.025 and abs(flat.mean().item()) < 2e-3
    assert all(not torch.equal(out[k], template[k]) for k in mats)    # the template's values are not used
    assert all(torch.equal(out[k], random_reinit(_state(7), seed=3)[k]) for k in mats)
    assert not torch.equal(out[mats[0]], random_reinit(template, seed=4)[mats[0]])


# ---- P18 versioning: every averaging rule needs both neighbours at the same completed iteration ---------

@pytest.mark.parametrize("rule", ["gradnorm", "uniform"])
def test_averages_refuse_neighbours_of_different_iterations(rule):
    left, right = _state(1), _state(2)
    with pytest.raises(RecoveryError, match="same iteration"):
        if rule == "gradnorm":
            average_neighbours(left, right, left_norm=1, right_norm=2, left_iteration=10, right_iteration=9)
        else:
            uniform_average(left, right, left_iteration=10, right_iteration=11)


# ---- P19 determinism across replicas ---------------------------------------------------------------------

def _over_the_wire(state):
    """What a replacement replica gets: the neighbour's tensors as safetensors bytes, decoded."""
    return st_load(st_save({k: v.contiguous() for k, v in state.items()}))


@pytest.mark.parametrize("rule", ["gradnorm", "uniform", "copy", "random"])
def test_two_replacement_replicas_compute_bit_identical_weights(rule):
    left, right = _state(1), _state(2)

    def rebuild(lw, rw):
        if rule == "gradnorm":
            return average_neighbours(lw, rw, left_norm=0.731, right_norm=2.113, left_iteration=3, right_iteration=3)
        if rule == "uniform":
            return uniform_average(lw, rw, left_iteration=3, right_iteration=3)
        if rule == "copy":
            return copy_neighbour(lw)
        return random_reinit(lw, seed=11)

    a = rebuild(_over_the_wire(left), _over_the_wire(right))
    # the second replica receives the tensors in another order and in another dict
    b = rebuild(_over_the_wire(dict(reversed(list(left.items())))), _over_the_wire(dict(reversed(list(right.items())))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- P20 optimizer reset on a trained stage set ----------------------------------------------------------

def _train(stages: StageSet, opts, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
        y = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
        stages.zero_grad()
        run_path_stagewise(stages, x, y, tuple(range(len(stages.stages))))
        for o in opts:
            o.step()


def test_recovered_stage_gets_a_fresh_optimizer_and_the_others_are_untouched():
    stages = StageSet.build(CFG, 0, 5)                      # stage 0 + 4 transformer stages of 1 block
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0) for m in stages.stages]
    _train(stages, opts, 3)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in stages.stages]
    moments = [{i: {k: v.clone() for k, v in s.items()} for i, s in o.state_dict()["state"].items()} for o in opts]
    # stage 2 is lost: rebuilt from 1 and 3, fresh optimizer at lr_scale * base_lr
    new = average_neighbours(shift_layers(before[1], +1), shift_layers(before[3], -1), left_norm=0.4, right_norm=0.9, left_iteration=3, right_iteration=3)
    stages.stages[2].load_state_dict(new)
    opts[2] = fresh_optimizer(stages.stages[2].parameters(), InnerConfig(lr=1e-3), lr_scale=1.2)
    for s in (0, 1, 3, 4):
        assert all(torch.equal(stages.stages[s].state_dict()[k], before[s][k]) for k in before[s])
        state = opts[s].state_dict()["state"]
        assert all(torch.equal(state[i][k], moments[s][i][k]) for i in state for k in state[i])
        assert opts[s].param_groups[0]["lr"] == pytest.approx(1e-3)
    assert opts[2].state_dict()["state"] == {} and opts[2].param_groups[0]["lr"] == pytest.approx(1.2e-3)
    _train(stages, opts, 2, seed=1)                         # training goes on with the new optimizer
    assert all(torch.isfinite(p).all() for m in stages.stages for p in m.parameters())
    assert opts[2].param_groups[0]["lr"] == pytest.approx(1.2e-3)
    # a second failure of the same stage: still 1.2 x the initial LR, not 1.44 x
    opts[2] = fresh_optimizer(stages.stages[2].parameters(), InnerConfig(lr=1e-3), lr_scale=1.2)
    assert opts[2].param_groups[0]["lr"] == pytest.approx(1.2e-3)


# ---- P22 / P23 / P24 on a real stage set -----------------------------------------------------------------

def test_edge_stage_under_checkfree_plus_copies_its_swap_partner_exactly():
    stages = StageSet.build(CFG, 0, 5)                      # T = 4: pairs (1,2) and (3,4)
    t, alive = 4, {0, 1, 2, 3}
    r = choose_recovery(4, t, alive, plus=True)
    assert (r.rule, r.sources) == ("copy_partner", (3,))
    # blocks carry whole-model names (stage 3 holds block 2, stage 4 block 3): renamed, then copied
    rebuilt = copy_neighbour(shift_layers(stages.stages[3].state_dict(), +1))
    stages.stages[4].load_state_dict(rebuilt)
    assert all(torch.equal(stages.stages[4].state_dict()[f"core.layers.3.{k}"], v)
               for k, v in stages.stages[3].core.layers["2"].state_dict().items())
    with pytest.raises(RecoveryError, match="different tensors"):       # not renamed: refused, not mixed up
        average_neighbours(stages.stages[1].state_dict(), stages.stages[3].state_dict(), left_norm=1, right_norm=1,
                           left_iteration=0, right_iteration=0)
    with pytest.raises(RecoveryError, match="layer ranges"):
        shift_layers(stages.stages[1].state_dict(), -1)


def test_shift_layers_renames_only_blocks():
    state = {"core.layers.2.attn.wq.weight": torch.zeros(1), "norm.weight": torch.ones(1), "layers.x.y": torch.ones(1)}
    out = shift_layers(state, 3)
    assert list(out) == ["core.layers.5.attn.wq.weight", "norm.weight", "layers.x.y"]
    assert out["norm.weight"] is state["norm.weight"]


def test_adjacent_failure_without_checkpoint_never_reads_a_lost_stage():
    t = 6
    for lost in ({3, 4}, {2, 3}, {4, 5}):
        alive = set(range(t + 1)) - lost
        for s in lost:
            r = choose_recovery(s, t, alive)
            assert r.rule == "nearest" and r.warn and not set(r.sources) & lost, (lost, s, r)
            assert choose_recovery(s, t, alive, has_checkpoint=True).rule == "checkpoint"


def test_swapped_microbatch_trains_the_swapped_order_and_evaluation_runs_in_order():
    stages = StageSet.build(ModelConfig(d_model=32, n_layers=4, n_heads=2, max_seq_len=16), 0, 5)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    even, odd = (0, *checkfree_plus_order(0, 4)), (0, *checkfree_plus_order(1, 4))
    assert even == (0, 1, 2, 3, 4) and odd == (0, 2, 1, 4, 3)
    assert stages.block_order(odd) == [1, 0, 3, 2]
    logits_odd, _ = run_path_stagewise(stages, x, x, odd)
    logits_even = stages.logits(x, even)
    assert not torch.allclose(logits_odd, logits_even)     # the swap really changes the computation
    torch.testing.assert_close(lm_loss(stages.logits(x, even), x), lm_loss(logits_even, x))
