"""One inner optimizer step, as every NoLoCo/DiLoCo worker takes it (noloco.md §2.2).

backward -> clip the gradient norm -> optimizer step -> scheduler step -> zero the grads.
Shared by the ``noloco`` role and the single-process benchmarks, so both train the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from models.llama import lm_loss


def inner_step(model: torch.nn.Module, batch: tuple[Tensor, Tensor], optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, params: Sequence[Tensor],
               clip_norm: float | None) -> float:
    """Train on ``batch`` = (x, y) once; return the loss before the step."""
    x, y = batch
    loss = lm_loss(model(x), y)
    loss.backward()
    if clip_norm:
        torch.nn.utils.clip_grad_norm_(params, clip_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
