"""models/optim.py: the inner LR schedule, `build_optimizer` (AdamW: decoupled decay) and `inner_step`."""

import copy
import math

import pytest
import torch

from models.optim import InnerConfig, build_optimizer, inner_lr_scheduler, inner_step, lr_at, lr_factor


# ---- optimizer ------------------------------------------------------------------------------
def _one_step_with_zero_grad(opt_cls_or_builder, lr: float, wd: float) -> torch.Tensor:
    p = torch.nn.Parameter(torch.full((4,), 2.0))
    opt = opt_cls_or_builder([p], lr, wd)
    p.grad = torch.zeros_like(p)
    opt.step()
    return p.detach().clone()


def test_weight_decay_is_decoupled():
    """AdamW semantics: with a zero gradient the only change is p <- p * (1 - lr * wd), exactly.
    Adam with coupled L2 (the old construction) adds wd*p to the gradient, and Adam's
    normalisation turns that into a step of about lr: far from lr*wd*p."""
    lr, wd = 0.1, 0.01
    built = _one_step_with_zero_grad(
        lambda ps, lr, wd: build_optimizer(ps, InnerConfig(lr=lr, weight_decay=wd, warmup=0)), lr, wd)
    expected = torch.full((4,), 2.0) * (1 - lr * wd)
    assert torch.equal(built, expected), (built, expected)
    coupled = _one_step_with_zero_grad(
        lambda ps, lr, wd: torch.optim.Adam(ps, lr=lr, weight_decay=wd), lr, wd)
    assert (coupled - expected).abs().max() > 0.05                   # ~ lr, not lr*wd*p = 0.002


def test_build_optimizer_carries_the_config():
    cfg = InnerConfig(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-6, 0.1)
    assert g["decoupled_weight_decay"] is True


def test_zero_decay_trains_exactly_like_adam():
    """Runs without decay (every current recipe) keep their figures bit for bit."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(16))
    b = torch.nn.Parameter(a.detach().clone())
    adam = torch.optim.Adam([a], lr=1e-2)
    ours = build_optimizer([b], InnerConfig(lr=1e-2))
    for i in range(5):
        g = torch.randn(16, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        adam.step()
        ours.step()
    assert torch.equal(a, b)


def test_inner_step_trains_and_returns_the_loss():
    from models.config import ModelConfig
    from models.llama import build_model, lm_loss

    model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16), 0)
    params = list(model.parameters())
    cfg = InnerConfig(lr=3e-3, warmup=0, total_steps=10, clip_norm=1.0)
    opt = build_optimizer(params, cfg)
    sched = inner_lr_scheduler(opt, cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 16), generator=g)
    y = torch.randint(0, 256, (2, 16), generator=g)
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        expected = lm_loss(model(x), y).item()
    losses = [inner_step(model, (x, y), opt, sched, params, cfg.clip_norm) for _ in range(3)]
    assert losses[0] == pytest.approx(expected, rel=1e-6)          # the loss *before* the step
    assert losses[-1] < losses[0]
    assert all(p.grad is None for p in params)                      # grads zeroed after the step
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sched.last_epoch == 3


# ---- schedule -------------------------------------------------------------------------------
def test_lr_warmup_cosine_floor():
    cfg = InnerConfig(lr=1e-3, warmup=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(10_000, cfg) == pytest.approx(1e-4)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert lr_factor(0, InnerConfig(warmup=0, total_steps=10)) == pytest.approx(1.0)
    assert not any(math.isnan(lr_at(s, InnerConfig(warmup=5, total_steps=5))) for s in range(8))
    with pytest.raises(ValueError, match="step=-1"):
        lr_factor(-1, cfg)


def _run_sched(cfg, start, steps):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], cfg.model_copy(update={"lr": 123.0}))
    sched = inner_lr_scheduler(opt, cfg, start_step=start)
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen, sched


def test_scheduler_matches_lr_at_and_resumes_identically():
    cfg = InnerConfig(lr=2e-3, warmup=7, total_steps=60)
    full, _ = _run_sched(cfg, 0, 60)
    assert full == pytest.approx([lr_at(s, cfg) for s in range(60)], rel=1e-12)
    for start in (1, 7, 33):                                       # a joiner starting at r*H
        resumed, _ = _run_sched(cfg, start, 60 - start)
        assert resumed == pytest.approx(full[start:], rel=1e-12)
    # and through the scheduler's state dict
    _, sched = _run_sched(cfg, 0, 25)
    state = sched.state_dict()
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], cfg)
    sched2 = inner_lr_scheduler(opt, cfg)
    sched2.load_state_dict(state)
    sched2.step()                                                  # the 26th inner step is next
    assert opt.param_groups[0]["lr"] == pytest.approx(full[26], rel=1e-12)


def test_every_inner_field_is_documented():
    for name, field in InnerConfig.model_fields.items():
        assert field.description, f"InnerConfig.{name} has no docstring"
