"""NoLoCo outer optimizer: slow weights `phi`, outer momentum `m`, one outer step per round.

Owns the update of docs/noloco.md, 'Outer step', on lists of tensors, in fp32. Does not own the inner loop,
the grouping (optimizers/grouping.py) or the exchange: the caller computes the unweighted group
means `theta_bar` (and `phi_bar` when consensus is untied) and passes them in; this module never
sees a peer or a socket.

Sign convention (pitfall 4), used throughout this module: a *direction* is `theta - phi`, the way
the inner steps moved, and it is **added**. (The paper's pseudo-gradient `Delta = phi - theta` is
never formed here.) The update, per tensor, for a group G of n >= 2 members::

    theta_bar = mean_G(theta);  phi_bar = mean_G(phi)
    m   <- alpha*m + beta*(theta_bar - phi_bar) + gamma*(phi_bar - phi)   # consensus pulls phi
    phi <- phi + m                                                       # toward phi_bar
    theta <- phi                                                         # caller copies

With consensus "tied" (gamma = beta, the official code) `phi_bar` cancels:
`m <- alpha*m + beta*(theta_bar - phi)`, and only theta is exchanged. The solo step (n = 1:
no partner, timeout, error) uses theta_bar = theta, phi_bar = phi:
`m <- alpha*m + beta*(theta - phi)`. The round counter is the caller's.

`phi`, `m` and exchanged buffers are fp32 whatever the model dtype (documented deviation from
the official bf16). `m` never leaves the worker; the inner Adam state is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from optimizers.diloco import DiLoCoOuter
from optimizers.outer_state import check_like, copy_into, fp32_copy, restore_phi_m

__all__ = ["NoLoCoOuter", "copy_into", "make_outer", "replica_spread"]

Consensus = Literal["tied"] | float


@torch.no_grad()
def replica_spread(replicas: Sequence[Sequence[Tensor]]) -> float:
    """sqrt(sum_w ||x_w - mean(x)||^2 / (P*W)) over W replicas of P parameters (the spread benchmarks/noloco_convergence.py reports)."""
    W = len(replicas)
    if W == 0:
        return 0.0
    total, count = 0.0, 0
    for tensors in zip(*replicas):
        stack = torch.stack([t.detach().to(torch.float64) for t in tensors])
        total += float(((stack - stack.mean(0)) ** 2).sum())
        count += tensors[0].numel()
    return (total / (count * W)) ** 0.5 if count else 0.0


class NoLoCoOuter:
    """Outer state of one NoLoCo worker.

    Build it from the initial parameters (all workers start from the same theta0): phi = theta0
    in fp32, m = 0. After H inner steps::

        send = outer.exchange_tensors(theta)            # fp32; theta [+ phi if untied]
        means, n = <group mean of `send` over my group>  # caller / transport
        theta_bar, phi_bar = outer.split_means(means)
        phi = outer.outer_step(theta, theta_bar, phi_bar, n)
        copy_into(model_params, phi)                     # theta <- phi; keep the Adam state
    """

    kind = "noloco"

    def __init__(self, params: Sequence[Tensor], outer_lr: float = 0.7,
                 outer_momentum: float = 0.5, consensus: Consensus = "tied") -> None:
        if outer_lr <= 0:
            raise ValueError(f"outer_lr={outer_lr} must be > 0")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum={outer_momentum} must be in [0, 1)")
        if consensus != "tied" and not isinstance(consensus, (int, float)):
            raise ValueError(f"consensus={consensus!r} must be 'tied' or a float")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.consensus: Consensus = consensus if consensus == "tied" else float(consensus)
        self.phi: list[Tensor] = fp32_copy(params)
        self.m: list[Tensor] = [torch.zeros_like(p) for p in self.phi]

    @classmethod
    def from_config(cls, params: Sequence[Tensor], cfg: Any) -> "NoLoCoOuter":
        """Build from a `NoLoCoConfig` (outer_lr, outer_momentum, consensus)."""
        return cls(params, cfg.outer_lr, cfg.outer_momentum, cfg.consensus)

    # ---- coefficients -----------------------------------------------------------------------
    @property
    def tied(self) -> bool:
        """gamma == beta and only theta is exchanged."""
        return self.consensus == "tied"

    @property
    def gamma(self) -> float:
        return self.outer_lr if self.tied else float(self.consensus)

    # ---- exchange ---------------------------------------------------------------------------
    @torch.no_grad()
    def exchange_tensors(self, theta: Sequence[Tensor]) -> list[Tensor]:
        """Fresh fp32 buffers to average over the group: theta (tied) or theta + phi (untied).

        Never contains `m`. The caller averages them element-wise over the group (unweighted)
        and hands the result to `split_means`."""
        check_like("theta", theta, self.phi)
        out = fp32_copy(theta)
        if not self.tied:
            out += [p.clone() for p in self.phi]
        return out

    def split_means(self, means: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor] | None]:
        """Split group means of `exchange_tensors` into (theta_bar, phi_bar or None)."""
        P = len(self.phi)
        expected = P if self.tied else 2 * P
        if len(means) != expected:
            raise ValueError(f"got {len(means)} averaged tensors, expected {expected}")
        means = list(means)
        return means[:P], (None if self.tied else means[P:])

    # ---- the outer step ---------------------------------------------------------------------
    @torch.no_grad()
    def outer_step(self, theta: Sequence[Tensor], theta_bar: Sequence[Tensor] | None,
                   phi_bar: Sequence[Tensor] | None = None, n: int | None = None) -> list[Tensor]:
        """One outer step; returns the new phi (fp32). Copy it into the model (`copy_into`).

        theta: this worker's fast weights (any float dtype). theta_bar / phi_bar: unweighted group
        means including this worker; phi_bar is required when consensus is untied and ignored
        when tied. n: group size including this worker; n == 1 is the solo step, which ignores
        theta_bar and phi_bar. The returned tensors are this object's state: do not modify them.
        """
        if n is None:
            raise TypeError("outer_step needs n, the group size including this worker "
                            "(1 for a solo step)")
        if n < 1:
            raise ValueError(f"group size n={n} must be >= 1")
        check_like("theta", theta, self.phi)
        alpha, beta, gamma = self.outer_momentum, self.outer_lr, self.gamma
        if n == 1:
            for phi, m, th in zip(self.phi, self.m, theta):
                direction = th.to(torch.float32) - phi               # theta - phi: add it
                m.mul_(alpha).add_(direction, alpha=beta)
                phi.add_(m)
            return self.phi
        if theta_bar is None:
            raise ValueError("theta_bar is required for a group step (n >= 2)")
        check_like("theta_bar", theta_bar, self.phi)
        if self.tied:
            for phi, m, tb in zip(self.phi, self.m, theta_bar):
                direction = tb.to(torch.float32) - phi               # mean_G(theta) - phi
                m.mul_(alpha).add_(direction, alpha=beta)
                phi.add_(m)
            return self.phi
        if phi_bar is None:
            raise ValueError(
                "phi_bar is required with an untied consensus (gamma != beta): exchange "
                "exchange_tensors(theta), which includes phi, and pass split_means(...)[1]")
        check_like("phi_bar", phi_bar, self.phi)
        for phi, m, tb, pb in zip(self.phi, self.m, theta_bar, phi_bar):
            tb32, pb32 = tb.to(torch.float32), pb.to(torch.float32)
            direction = tb32 - pb32                                  # mean_G(theta - phi)
            toward_centre = pb32 - phi                               # + gamma*(phi_bar - phi)
            m.mul_(alpha).add_(direction, alpha=beta).add_(toward_centre, alpha=gamma)
            phi.add_(m)
        return self.phi

    # ---- persistence ------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "consensus": self.consensus}

    def state_dict(self) -> dict[str, Any]:
        """{"phi", "m", "config"}: tensors are clones; no inner-optimizer state."""
        return {"phi": [p.clone() for p in self.phi], "m": [m.clone() for m in self.m],
                "config": self.config_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore phi and m. The stored config must match this object's coefficients."""
        restore_phi_m(self, state)


def make_outer(params: Sequence[Tensor], cfg: Any) -> NoLoCoOuter | DiLoCoOuter:
    """`NoLoCoOuter` or `DiLoCoOuter` for a `NoLoCoConfig`, built from the initial parameters."""
    if cfg.outer == "noloco":
        return NoLoCoOuter.from_config(params, cfg)
    return DiLoCoOuter.from_config(params, cfg)
