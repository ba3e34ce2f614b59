"""Tensor-list helpers both outer optimizers (``noloco.py``, ``diloco.py``) share.

Owns the fp32 copies the outer state is made of, the shape check that names the bad tensor,
copying a new phi into model parameters and restoring phi/m from a state dict. Pure torch; the
outer updates themselves stay in their own modules, which import this one (never each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_like", "copy_into", "fp32_copy", "restore_phi_m"]


def fp32_copy(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Fresh fp32 copies (detached), on the tensors' own devices."""
    return [t.detach().to(dtype=torch.float32, copy=True) for t in tensors]


def check_like(name: str, tensors: Sequence[Tensor], ref: Sequence[Tensor]) -> None:
    """ValueError unless ``tensors`` has one tensor per ``ref`` tensor, each of the same shape."""
    if len(tensors) != len(ref):
        raise ValueError(f"{name} has {len(tensors)} tensors, expected {len(ref)} (one per "
                         "parameter, in the order the outer optimizer was built with)")
    for i, (t, r) in enumerate(zip(tensors, ref)):
        if t.shape != r.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, expected {tuple(r.shape)}")


@torch.no_grad()
def copy_into(params: Sequence[Tensor], values: Sequence[Tensor]) -> None:
    """Copy `values` (e.g. the new phi) into model parameters in place, casting to their dtype."""
    check_like("values", values, params)
    for p, v in zip(params, values):
        p.copy_(v)


@torch.no_grad()
def restore_phi_m(outer: Any, state: dict[str, Any]) -> None:
    """Load fp32 copies of ``state``'s phi and m into an outer optimizer (NoLoCo or DiLoCo) after
    checking that the stored coefficients are this run's."""
    if state.get("config") != outer.config_dict():
        raise ValueError(
            f"checkpoint outer config {state.get('config')} differs from this run's "
            f"{outer.config_dict()}; resume with the run's original outer settings")
    check_like("state['phi']", state["phi"], outer.phi)
    check_like("state['m']", state["m"], outer.m)
    outer.phi = [t.detach().to(dtype=torch.float32, device=p.device, copy=True)
                 for t, p in zip(state["phi"], outer.phi)]
    outer.m = [t.detach().to(dtype=torch.float32, device=p.device, copy=True)
               for t, p in zip(state["m"], outer.m)]
