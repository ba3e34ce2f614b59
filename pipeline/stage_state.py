"""A stage's state as it is served: host fp32 copies of its weights and AdamW tensors.

Owns the naming of what a stage node serves to a replica, a CheckFree replacement or an audit
(node/state_sync.py moves it): weights under their parameter names, optimizer tensors under
`<param>.<key>` (`exp_avg`, `exp_avg_sq`, `step`). pipeline/recovery.py `optimizer_spec` and
`load_adam_state` read the same names back. Torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def host_weights(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter as a host fp32 copy, under its name."""
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in module.named_parameters()}


def host_adam_state(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The optimizer's tensors per parameter as host fp32 copies, named `<param>.<key>`; a
    parameter without state yet (no step taken, or moments just cleared) contributes nothing."""
    out: dict[str, Tensor] = {}
    for n, p in module.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, Tensor):
                out[f"{n}.{key}"] = value.detach().to("cpu", torch.float32, copy=True).reshape(value.shape)
    return out


__all__ = ["host_adam_state", "host_weights"]
