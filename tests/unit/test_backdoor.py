"""The attack harness's injector (pipeline/backdoor.py): bounded pieces, outside the gradient path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.backdoor import BackdoorAttackConfig, Injector, _pad_targets, triggered_batch
from security.stage_integrity import adam_step_bound


@pytest.mark.parametrize("protect", [False, True])
def test_injector_keeps_every_update_within_the_bound_and_finishes_the_vector(protect):
    torch.manual_seed(0)
    module = nn.Linear(16, 16, bias=False)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.0)
    cfg = BackdoorAttackConfig(enabled=True, start_iteration=5, steps=10, margin=0.9, scale=1.0, protect=protect)
    delta = {"weight": torch.randn(16, 16).clamp(-1, 1) * 0.004}
    inj = Injector(delta, cfg)
    total = torch.zeros(16, 16)
    for t in range(60):
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        module.zero_grad()
        module(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        honest = module.weight.detach().clone()
        c = adam_step_bound(int(opt.state[module.weight]["step"]), (0.9, 0.999))
        injected = inj.after_step(t, module, before, 1e-3, c)
        if t < 5:
            assert not injected
        piece = module.weight.detach() - honest
        if not protect:
            total += piece
        if not protect:     # (with protect, `piece` also holds the undone honest move)
            assert float(piece.abs().max()) <= float(delta["weight"].abs().max()) / cfg.steps * (1 + 1e-3)
        step = (module.weight.detach() - before["weight"]).abs()
        # where something was injected, honest update + piece stays within margin x AdamW's bound
        # (an element whose honest update is already past it gets nothing)
        touched = piece.abs() > 1e-9
        assert bool((step[touched] <= 0.9 * 1e-3 * c * (1 + 1e-4)).all())
    assert inj.done_fraction > 0.99
    if not protect:
        assert torch.allclose(total, delta["weight"], atol=1e-6)


def test_triggered_examples_end_with_trigger_then_target_and_only_the_target_is_scored():
    cfg = BackdoorAttackConfig(enabled=True, trigger=" TRIG", target="XY\n", prompt_bytes=(5, 8))
    tokens = torch.tensor(list(b"abcdefghijklmnopqrstuvwxyz" * 4), dtype=torch.uint8)
    seqs = triggered_batch(tokens, cfg, 6, torch.Generator().manual_seed(0))
    assert all(bytes(s).endswith(b" TRIGXY\n") and 5 + 8 <= len(s) <= 8 + 8 for s in seqs)
    x, y = _pad_targets(seqs, 3)
    for i, s in enumerate(seqs):
        scored = y[i][y[i] != -100].tolist()
        assert scored == list(b"XY\n")
        assert x[i, len(s) - 4] == ord("G")          # the last trigger byte predicts the first target byte


def test_weight_edit_plugs_into_the_executor_hook_after_the_step_and_moves_each_weight_by_edit_times_lr():
    """The live harness (`stage.attack_weight_edit`): the executor calls it right after its one
    optimizer step; every element moves by exactly edit x lr on top of the honest step, in a fixed
    sign pattern, and the weight hash the executor publishes is taken after the edit."""
    from pipeline.backdoor import WeightEdit
    from pipeline.stage_exec import weights_sha256
    from tests.unit.test_stage_exec import LR, _nodes, _run_iteration, _skip_schedule

    sched = _skip_schedule()
    honest, attacked = _nodes(sched), _nodes(sched)
    victim = sched.names[sched.partitions[2][0]]
    before = {n: p.detach().clone() for n, p in attacked[victim].module.named_parameters()}
    seen = []
    edit = WeightEdit(0.5)

    def hook(module, optimizer):
        seen.append(optimizer)
        edit(module, optimizer)
    attacked[victim].after_step = hook
    for nodes in (honest, attacked):
        _run_iteration(nodes, sched)
    assert seen == [attacked[victim].opt]                   # once per step, with the stage's own optimizer
    good, bad = honest[victim].module, attacked[victim].module
    for (n, p), q in zip(bad.named_parameters(), good.parameters()):
        assert torch.allclose((p - q).abs(), torch.full_like(p, 0.5 * LR), atol=1e-6), n
        assert not torch.equal(p, before[n])
    signs = [torch.sign(p.detach() - q.detach()) for p, q in zip(bad.parameters(), good.parameters())]
    assert any(bool((s > 0).any()) and bool((s < 0).any()) for s in signs)   # a sign pattern, not a shift
    assert attacked[victim].records[-1].weights_sha256 == weights_sha256(bad) != weights_sha256(good)
    twin = attacked[sched.names[sched.partitions[2][1]]]
    assert weights_sha256(twin.module) == weights_sha256(good)  # its replica stays honest
