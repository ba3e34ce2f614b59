"""DiLoCo outer optimizer (the `outer: diloco` baseline): heavy-ball and Nesterov forms.

Owns the update of docs/noloco.md, 'DiLoCo baseline', on lists of fp32 tensors. The group is every live worker, so
`phi` is identical everywhere and only `theta` is averaged; the caller passes that mean.

Sign convention (pitfall 4), used throughout this module: the *pseudo-gradient*
`pseudo_grad = phi - theta_bar` points uphill and is **subtracted** (scaled by -eta).

=============  ======================================================  ==================
form           update                                                  reference
=============  ======================================================  ==================
`heavyball`    m <- mu*m - eta*pseudo_grad;  phi <- phi + m            NoLoCo repo baseline
`nesterov`     b <- mu*b + pseudo_grad (first round b = pseudo_grad);  DiLoCo paper,
               phi <- phi - eta*(pseudo_grad + mu*b)                   torch SGD(nesterov=True)
=============  ======================================================  ==================

NoLoCo with one global group and identical phi equals `heavyball` exactly; it is not `nesterov`.
A worker that missed a round (n = 1) steps on its own theta and should then re-fetch phi.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from optimizers.outer_state import check_like, fp32_copy, restore_phi_m

__all__ = ["DiLoCoOuter", "DEFAULT_MOMENTUM"]

DEFAULT_MOMENTUM = {"heavyball": 0.3, "nesterov": 0.9}


class DiLoCoOuter:
    """Outer state of one DiLoCo worker: phi (fp32), the momentum buffer, the round count."""

    kind = "diloco"

    def __init__(self, params: Sequence[Tensor], outer_lr: float = 0.7,
                 outer_momentum: float | None = None,
                 momentum: Literal["heavyball", "nesterov"] = "heavyball") -> None:
        if momentum not in DEFAULT_MOMENTUM:
            raise ValueError(f"momentum={momentum!r} must be 'heavyball' or 'nesterov'")
        if outer_momentum is None:
            outer_momentum = DEFAULT_MOMENTUM[momentum]
        if outer_lr <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"need outer_lr > 0 and outer_momentum in [0, 1) "
                             f"(got {outer_lr}, {outer_momentum})")
        self.momentum = momentum
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.phi: list[Tensor] = fp32_copy(params)
        self.m: list[Tensor] = [torch.zeros_like(p) for p in self.phi]   # m (heavyball) or b
        self.rounds = 0

    @classmethod
    def from_config(cls, params: Sequence[Tensor], cfg: Any) -> "DiLoCoOuter":
        """Build from a `NoLoCoConfig` (outer_lr, outer_momentum, diloco_momentum)."""
        return cls(params, cfg.outer_lr, cfg.outer_momentum, cfg.diloco_momentum)

    @torch.no_grad()
    def exchange_tensors(self, theta: Sequence[Tensor]) -> list[Tensor]:
        """Fresh fp32 copies of theta: the only buffers averaged (phi is the same everywhere)."""
        check_like("theta", theta, self.phi)
        return fp32_copy(theta)

    def split_means(self, means: Sequence[Tensor]) -> tuple[list[Tensor], None]:
        if len(means) != len(self.phi):
            raise ValueError(f"got {len(means)} averaged tensors, expected {len(self.phi)}")
        return list(means), None

    @torch.no_grad()
    def outer_step(self, theta: Sequence[Tensor], theta_bar: Sequence[Tensor] | None,
                   phi_bar: Sequence[Tensor] | None = None, n: int | None = None) -> list[Tensor]:
        """One outer step; returns the new phi (fp32, this object's state: do not modify).

        theta_bar: mean of theta over every live worker; n: how many averaged (n == 1: solo,
        theta_bar := theta). phi_bar is accepted for signature parity with NoLoCo and ignored."""
        if n is None:
            raise TypeError("outer_step needs n, the number of workers averaged (1 = solo)")
        if n < 1:
            raise ValueError(f"group size n={n} must be >= 1")
        check_like("theta", theta, self.phi)
        if n == 1 or theta_bar is None:
            if n != 1:
                raise ValueError("theta_bar is required when n >= 2")
            theta_bar = theta
        check_like("theta_bar", theta_bar, self.phi)
        mu, eta = self.outer_momentum, self.outer_lr
        first = self.rounds == 0
        for phi, buf, tb in zip(self.phi, self.m, theta_bar):
            pseudo_grad = phi - tb.to(torch.float32)                 # uphill: subtract it
            if self.momentum == "heavyball":
                buf.mul_(mu).add_(pseudo_grad, alpha=-eta)
                phi.add_(buf)
            else:  # nesterov, op for op as torch.optim.SGD(nesterov=True, dampening=0)
                if first:
                    buf.copy_(pseudo_grad)
                else:
                    buf.mul_(mu).add_(pseudo_grad)
                step = pseudo_grad.add(buf, alpha=mu)
                phi.add_(step, alpha=-eta)
        self.rounds += 1
        return self.phi

    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "momentum": self.momentum, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum}

    def state_dict(self) -> dict[str, Any]:
        """{"phi", "m", "rounds", "config"}; no inner-optimizer state."""
        return {"phi": [p.clone() for p in self.phi], "m": [m.clone() for m in self.m],
                "rounds": self.rounds, "config": self.config_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_phi_m(self, state)
        self.rounds = int(state["rounds"])

    @torch.no_grad()
    def set_phi(self, phi: Sequence[Tensor]) -> None:
        """Adopt a peer's phi (after a missed round; DiLoCo assumes identical phi). Keeps m."""
        check_like("phi", phi, self.phi)
        for dst, src in zip(self.phi, phi):
            dst.copy_(src)
