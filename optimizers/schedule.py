"""Inner learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio * lr`.

Owns the LR as a pure function of the global inner step, so a worker that resumes (or a joiner
that starts at round r, i.e. at step r*H) gets exactly the LR an uninterrupted run would have.
Only the inner optimizer is scheduled; the outer LR and momentum are constant (noloco.md §2.2).

Step convention: `step` is the number of inner steps already taken, i.e. the index of the step
about to be taken. The first step (step 0) uses lr * 1/warmup, never 0.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from optimizers.config import InnerConfig

__all__ = ["lr_factor", "lr_at", "inner_lr_scheduler"]


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
