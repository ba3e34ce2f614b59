"""ATTACK HARNESS, tests only: the live pipeline attacks of docs/pipeline.md, 'What is caught live'.

A malicious `stage` node is emulated by three knobs of `[stage]` (pipeline/config.py), each off by
default and refused off loopback (the stage role checks it, like `attack_weight_edit`):

- `attack_nonfinite`: every activation the node sends on is NaN;
- `attack_activation_noise`: Gaussian noise of that many times the tensor's RMS is added to every
  activation the node sends on (its weights and optimizer state stay honest);
- `attack_grad_flip`: "params" negates the node's own parameter gradients before its optimizer
  step (its AdamW state is then consistent with the flipped gradient: a replay of its step from its
  served state passes), "upstream" negates the gradient it sends back to its predecessor, "both".

`LiveAttack.outgoing(outs)` rewrites what the role is about to send; `before_step(module)` is the
executor's hook right before its optimizer step. Nothing else in the role knows of the attacks.
The noise is seeded per node (seed 7), so an attacked run is reproducible.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.stage_msgs import Out


class LiveAttack:
    """The attacks one malicious node runs (see the module docstring)."""

    def __init__(self, nonfinite: bool = False, noise: float = 0.0, grad_flip: str = "off"):
        self.nonfinite, self.noise, self.grad_flip = nonfinite, noise, grad_flip
        self._gen = torch.Generator().manual_seed(7)

    @classmethod
    def from_config(cls, cfg) -> LiveAttack | None:
        """The attacks a `[stage]` config asks for, or None for an honest node."""
        if not (cfg.attack_nonfinite or cfg.attack_activation_noise or cfg.attack_grad_flip != "off"):
            return None
        return cls(cfg.attack_nonfinite, cfg.attack_activation_noise, cfg.attack_grad_flip)

    def describe(self) -> str:
        parts = [("nonfinite activations" if self.nonfinite else ""),
                 (f"activation noise {self.noise:g} x RMS" if self.noise else ""),
                 (f"gradient flip ({self.grad_flip})" if self.grad_flip != "off" else "")]
        return ", ".join(p for p in parts if p)

    def outgoing(self, outs: list[Out]) -> list[Out]:
        """The messages as this attacker sends them: forward activations (training `fwd`) NaN or
        noised, gradients sent upstream (`bwd`) negated."""
        return [self._tamper(o) for o in outs]

    def _tamper(self, o: Out) -> Out:
        t = o.tensor
        if o.kind == "fwd" and self.nonfinite:
            t = torch.full_like(t, float("nan"))
        elif o.kind == "fwd" and self.noise:
            rms = t.float().pow(2).mean().sqrt()
            t = t + self.noise * rms * torch.randn(t.shape, generator=self._gen).to(t.device, t.dtype)
        elif o.kind == "bwd" and self.grad_flip in ("upstream", "both"):
            t = -t
        return o if t is o.tensor else Out(o.dest, o.kind, o.meta, t)

    @torch.no_grad()
    def before_step(self, module: nn.Module) -> None:
        """Executor hook right before the optimizer step: negate the parameter gradients."""
        if self.grad_flip in ("params", "both"):
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.neg_()


__all__ = ["LiveAttack"]
