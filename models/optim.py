"""Inner (local) training pieces every training role shares: config, LR schedule, optimizer, step.

Owns `InnerConfig` (the `inner` table of a training role's section), the inner learning-rate
schedule (linear warm-up, then cosine decay to `min_lr_ratio * lr`), the one place the inner
optimizer is built (`build_optimizer`: AdamW, i.e. *decoupled* weight decay) and one inner step
(`inner_step`: backward -> clip -> optimizer step -> scheduler step -> zero grads). The noloco role
and the single-process benchmarks use these, so they train the same way; the stage and grpo roles
are meant to as well. Does not own outer optimizers (optimizers/) or the model (models/llama.py).

    from models.optim import InnerConfig, build_optimizer, inner_lr_scheduler, inner_step
    opt = build_optimizer(model.parameters(), cfg)
    sched = inner_lr_scheduler(opt, cfg, start_step=step)   # a resuming worker passes its step
    loss = inner_step(model, (x, y), opt, sched, params, cfg.clip_norm)

Schedule step convention: `step` is the number of inner steps already taken, i.e. the index of the
step about to be taken. The first step (step 0) uses lr * 1/warmup, never 0. The LR is a pure
function of the global inner step, so a worker that resumes (or a joiner that starts at round r,
i.e. at step r*H) gets exactly the LR an uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from models.llama import lm_loss

__all__ = ["InnerConfig", "build_optimizer", "inner_lr_scheduler", "inner_step", "lr_at", "lr_factor"]


class InnerConfig(BaseModel):
    """Inner (local) optimizer: AdamW with linear warm-up, then cosine decay to `min_lr_ratio`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(6e-4, gt=0)
    """Peak inner learning rate. The official values are 6e-4 ("125M"), 2e-4 ("1.3B") and
    1.2e-4 ("6.8B"). Lower it if `swarmnode_train_loss` spikes right after warm-up; tiny CPU demo
    models tolerate ~1e-3 to 3e-3."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas. The DiLoCo-Nesterov recipe uses (0.9, 0.95); keep (0.9, 0.999) for NoLoCo."""

    eps: float = Field(1e-8, gt=0)
    """Adam epsilon. Raise (e.g. 1e-6) only if bf16 training shows NaNs in the inner step."""

    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW): every step multiplies each weight by (1 - lr_t *
    weight_decay), independent of the gradient and of Adam's scaling. NoLoCo and heavy-ball
    DiLoCo use 0; the DiLoCo-Nesterov recipe uses 0.1. Raise it if replicas' weights grow
    without bound over a long run."""

    clip_norm: float | None = Field(1.0, gt=0)
    """Global gradient-norm clip applied before every inner step; None disables it. Only change
    it together with the learning rate."""

    warmup: int = Field(50, ge=0)
    """Inner steps of linear LR warm-up (official 1000; demo 50). Raise it if the loss diverges
    in the first few hundred steps."""

    total_steps: int = Field(2000, ge=1)
    """Inner step at which the cosine reaches `min_lr_ratio * lr` (official 25,000; demo 2000).
    Set it to the planned run length; after it the LR stays at the floor."""

    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final LR as a fraction of `lr` (0.1 for NoLoCo/heavy-ball DiLoCo, 0 for DiLoCo-Nesterov)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(
                f"inner.betas={v} must both lie in [0, 1); the default is (0.9, 0.999)")
        return v

    @model_validator(mode="after")
    def _warmup_fits(self) -> "InnerConfig":
        if self.warmup > self.total_steps:
            raise ValueError(
                f"inner.warmup={self.warmup} exceeds inner.total_steps={self.total_steps}; "
                "lower warmup or raise total_steps to the planned run length")
        return self


# ---- optimizer ------------------------------------------------------------------------------
def build_optimizer(params: Iterable[Tensor] | Iterable[dict], cfg: InnerConfig) -> torch.optim.AdamW:
    """The inner optimizer for `params`: AdamW with `cfg`'s betas, eps and decoupled weight decay.

    The LR set here is `cfg.lr`; `inner_lr_scheduler` then drives it. With weight_decay = 0 the
    update is bit-for-bit Adam's, so runs without decay train exactly as before."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


# ---- schedule -------------------------------------------------------------------------------
def lr_factor(step: int, cfg: InnerConfig) -> float:
    """Multiplier on `cfg.lr` for inner step `step` (0-based)."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    decay_steps = max(1, cfg.total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Absolute inner LR for inner step `step` (0-based)."""
    return cfg.lr * lr_factor(step, cfg)


def inner_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: InnerConfig,
                       start_step: int = 0) -> LambdaLR:
    """A `LambdaLR` that drives `optimizer` with `lr_at`, positioned at `start_step`.

    Sets every param group's `lr`/`initial_lr` to `cfg.lr` (the peak), so the optimizer's own LR
    is irrelevant. Call `scheduler.step()` after each `optimizer.step()`. To resume, either pass
    `start_step` (e.g. r*H for a joiner) or load the scheduler's `state_dict()`; both give the LR of
    an uninterrupted run. The lambda is a plain function, so the state dict holds only integers
    and floats (safe with `torch.load(weights_only=True)`).
    """
    if start_step < 0:
        raise ValueError(f"start_step={start_step} must be >= 0")
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr
        group["initial_lr"] = cfg.lr
    cfg = cfg.model_copy()

    def factor(step: int) -> float:
        return lr_factor(step, cfg)

    return LambdaLR(optimizer, factor, last_epoch=start_step - 1)


# ---- one step -------------------------------------------------------------------------------
def inner_step(model: torch.nn.Module, batch: tuple[Tensor, Tensor], optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, params: Sequence[Tensor],
               clip_norm: float | None, *, autocast=None, scaler: torch.amp.GradScaler | None = None) -> float:
    """Train on ``batch`` = (x, y) once (next-token LM loss); return the loss before the step.

    Precision (node/device.py): ``autocast`` is a context manager (``node.device.autocast(dev,
    precision)``) entered for the forward pass only; ``scaler`` (fp16, ``node.device.grad_scaler``)
    scales the loss, unscales before clipping and skips the step on inf/nan gradients."""
    x, y = batch
    if autocast is None:
        loss = lm_loss(model(x), y)
    else:
        with autocast:
            loss = lm_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    if clip_norm:
        torch.nn.utils.clip_grad_norm_(params, clip_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
