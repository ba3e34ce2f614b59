"""The messages a `stage` node's executor consumes and produces, and the checks on their tensors.

Owns `Msg` (one received message: kind, sender peer ID, integer meta, tensor), `Out` (one to
send), the events an executor reports (`StepResult`, the record of one step; `OriginDone`),
`BadInput` (a tensor this node cannot use: answered with an error, never a crash), `as_hidden` (the activation/gradient shape and dtype check) and `weights_sha256` (the weight
commitment replicas compare after every step). Shared by pipeline/stage_exec.py (training
microbatches) and pipeline/stage_eval.py (validation); moving them is pipeline/stage_transport.py.
Torch only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn


class BadInput(ValueError):
    """A message this node cannot use (wrong shape, wrong size); `reason` is a short label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Msg:
    kind: str
    sender: str
    meta: dict[str, int]
    tensor: Tensor | None = None


@dataclass
class Out:
    dest: str
    kind: str
    meta: dict[str, int]
    tensor: Tensor


@dataclass
class StepResult:
    """The record of one optimizer step (one per iteration)."""
    iteration: int
    visits: int
    """Microbatches that visited this node (forward + backward) in the iteration."""
    total_visits: int
    """Microbatches that visited this stage on any replica."""
    grad_norm: float
    """Norm of the visit-averaged stage gradient before clipping (NaN: no step taken)."""
    grad_norm_clipped: float
    """Its norm after clipping (what the optimizer stepped with)."""
    weights_sha256: str
    loss: float | None
    """Mean training loss of this origin's microbatches (stage 0 only)."""
    next_epoch: int
    moments_reset: bool = False
    """AdamW's moments were cleared before this step (the first on a plan made after a quarantine)."""


@dataclass
class OriginDone:
    """An originator's microbatches of `iteration` all came back (the simulator's makespan end)."""
    iteration: int


def as_hidden(t: Tensor | None, device: torch.device, like: tuple[int, ...] | torch.Size | None = None) -> Tensor:
    """`t` as fp32 hidden states [B, T, d] on `device` (detached), or BadInput("shape") naming what
    was expected; with `like`, the shape must match exactly (a gradient for an activation we sent)."""
    if t is None or not t.is_floating_point() or t.dim() != 3 or (like is not None and tuple(t.shape) != tuple(like)):
        shape = None if t is None else tuple(t.shape)
        raise BadInput("shape", f"activation of shape {shape} where {tuple(like) if like else '[B, T, d]'} "
                                "was expected: the sender runs a different model config or stage split")
    return t.detach().to(device, torch.float32)


def weights_sha256(module: nn.Module) -> str:
    """sha256 over the fp32 parameters in name order (replicas compare it after every step)."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def placeholder() -> Tensor:
    """The tensor of a message that carries only meta (`eoi`, `fin`, `err`)."""
    return torch.zeros(1)


__all__ = ["BadInput", "Msg", "OriginDone", "Out", "StepResult", "as_hidden", "placeholder", "weights_sha256"]
