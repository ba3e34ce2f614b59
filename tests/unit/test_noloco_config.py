"""`NoLoCoConfig` validators and `cfg_hash`, and the inner LR schedule."""

import math

import pytest
import torch
from pydantic import ValidationError

from optimizers.config import HASHED_FIELDS, InnerConfig, NoLoCoConfig
from optimizers.schedule import inner_lr_scheduler, lr_at, lr_factor


# ---- config ---------------------------------------------------------------------------------
def test_defaults_are_the_demo_column():
    cfg = NoLoCoConfig()
    assert (cfg.outer, cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum, cfg.consensus,
            cfg.group_size) == ("noloco", 20, 0.7, 0.5, "tied", 2)
    assert cfg.pairing == "seeded" and cfg.max_round_skew == 2 and cfg.max_solo_rounds == 3
    assert (cfg.inner.warmup, cfg.inner.total_steps, cfg.inner.min_lr_ratio) == (50, 2000, 0.1)
    assert cfg.inner.weight_decay == 0.0 and cfg.inner.clip_norm == 1.0
    assert cfg.inner.betas == (0.9, 0.999)
    assert cfg.gamma == 0.7 and not cfg.exchanges_phi


def test_every_field_is_documented():
    for model in (NoLoCoConfig, InnerConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_extra_keys_rejected():
    with pytest.raises(ValidationError, match="extra"):
        NoLoCoConfig(outer_learning_rate=0.7)
    with pytest.raises(ValidationError, match="extra"):
        NoLoCoConfig(inner={"learning_rate": 1e-3})


def test_group_size_one_with_noloco_rejected_with_fix():
    with pytest.raises(ValidationError, match="group_size=2"):
        NoLoCoConfig(group_size=1)
    NoLoCoConfig(group_size="all")
    NoLoCoConfig(group_size=4)


def test_consensus_float_with_diloco_rejected():
    with pytest.raises(ValidationError, match="remove consensus"):
        NoLoCoConfig(outer="diloco", consensus=0.5)
    cfg = NoLoCoConfig(outer="diloco", diloco_momentum="nesterov", outer_momentum=0.9)
    assert not cfg.exchanges_phi
    with pytest.raises(ValidationError, match="every live worker"):
        NoLoCoConfig(outer="diloco", group_size=2)
    NoLoCoConfig(outer="diloco", group_size="all")


def test_numeric_validators():
    with pytest.raises(ValidationError):
        NoLoCoConfig(inner_steps=0)
    with pytest.raises(ValidationError):
        NoLoCoConfig(outer_momentum=1.0)
    with pytest.raises(ValidationError):
        NoLoCoConfig(outer_lr=0)
    with pytest.raises(ValidationError, match=r"\[0, 2\)"):
        NoLoCoConfig(consensus=-0.1)
    with pytest.raises(ValidationError, match="tied"):
        NoLoCoConfig(consensus="loose")
    with pytest.raises(ValidationError, match="diverge"):
        NoLoCoConfig(outer_lr=2.5)
    with pytest.raises(ValidationError, match="total_steps"):
        NoLoCoConfig(inner={"warmup": 100, "total_steps": 50})
    with pytest.raises(ValidationError, match="betas"):
        NoLoCoConfig(inner={"betas": (0.9, 1.0)})
    with pytest.raises(ValidationError, match="round_timeout"):
        NoLoCoConfig(pairing="matchmaking", matchmaking_time=5, jitter_s=5, round_timeout=8)
    assert NoLoCoConfig(consensus="0.3").consensus == 0.3
    assert NoLoCoConfig(consensus=0).gamma == 0.0


def test_cfg_hash_stable_and_sensitive():
    base = NoLoCoConfig()
    h = base.cfg_hash()
    assert len(h) == 12 and all(c in "0123456789abcdef" for c in h)
    assert h == "b2e4b254641a"                                     # pinned: peers must agree
    assert NoLoCoConfig(outer_lr=0.7, inner_steps=20).cfg_hash() == h
    assert NoLoCoConfig.model_validate({"outer_lr": "0.7"}).cfg_hash() == h
    # knobs that need not match between peers do not change it
    assert NoLoCoConfig(round_timeout=30, checkpoint_every=3, inner={"lr": 1e-3}).cfg_hash() == h
    changed = {"outer": "diloco", "diloco_momentum": "nesterov", "inner_steps": 50,
               "outer_lr": 0.8, "outer_momentum": 0.3, "consensus": 0.7, "group_size": 4,
               "seed": 1}
    assert set(changed) == set(HASHED_FIELDS)
    seen = {h}
    for key, value in changed.items():
        other = NoLoCoConfig(**{key: value}).cfg_hash()
        assert other not in seen, key
        seen.add(other)


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


def _run_sched(cfg, start, steps):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=123.0)
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
    opt = torch.optim.Adam([p], lr=1.0)
    sched2 = inner_lr_scheduler(opt, cfg)
    sched2.load_state_dict(state)
    sched2.step()                                                  # the 26th inner step is next
    assert opt.param_groups[0]["lr"] == pytest.approx(full[26], rel=1e-12)
