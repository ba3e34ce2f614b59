"""Attributing a replica disagreement (docs/pipeline.md, 'Quarantine and audits'): replay a replica's last AdamW step from its
own served state. Pure torch; pipeline/coordinator.py fetches the tensors and acts on the verdict.

Replicas of a stage step on the same averaged gradient, so honest replicas end every iteration with
bit-identical weights (their `commit` card details agree). When they disagree, *who* deviates is
decided per replica, without a majority (a stage may have two): the coordinator fetches the
replica's served state at its latest iteration T (weights ``W_T``, AdamW state ``m_T, v_T, step``,
and the LR of that step) and its kept state at T-1 (``W_{T-1}``), each pinned by the commit the
replica itself published for that iteration when the coordinator saw it, and replays the step:

    W_T' = W_{T-1} * (1 - lr * wd) - lr / (1 - b1^step) * m_T / (sqrt(v_T / (1 - b2^step)) + eps)

(torch's AdamW, from the post-step moments, so the gradient is not needed). An honest replica
replays to a few ulps; an edit outside the gradient path leaves a residual of its own size. The
residual is measured per element in units of the step's lr: a replica above `RESIDUAL_LR` fails.
Limits: a replica that also forges its optimizer moments consistently with its edit is not caught
here (spot checks and the update monitor of security/stage_integrity.py are the other layers), and
the pinning to published commits holds only for iterations whose card version the coordinator saw.

An unreplicated stage's step replays by construction when it tampers with what it computes rather
than with its weights (noise on its activations, a flipped gradient: its AdamW state is consistent
with the gradient it stepped on). `replay_outputs` checks the computation itself, from tensors its
honest neighbours kept (pipeline/stage_evidence.py): its outputs are recomputed from its inputs
with its served weights, the gradient it sent upstream and the gradient it stepped on (from its
served moments, `step_gradient`) from the gradients of its outputs it received.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from torch import Tensor

RESIDUAL_LR = 0.05
"""A replayed step may miss the served weights by at most this many lr per element (honest: ~1e-6)."""


def commit_of(weights: Mapping[str, Tensor]) -> str:
    """The stage's `weights_sha256` (pipeline/stage_msgs.py) over fetched fp32 weights in served order."""
    h = hashlib.sha256()
    for name, t in weights.items():
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def replay_residual(before: Mapping[str, Tensor], after: Mapping[str, Tensor], opt_after: Mapping[str, Tensor],
                    lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> tuple[float, str]:
    """(largest per-element |after - replayed| in units of `lr`, the tensor it is in)."""
    worst, where = 0.0, ""
    b1, b2 = betas
    for n, w0 in before.items():
        step = float(opt_after[f"{n}.step"])
        m, v = opt_after[f"{n}.exp_avg"].double(), opt_after[f"{n}.exp_avg_sq"].double()
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        pred = w0.double() * (1 - lr * weight_decay) - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
        res = float((after[n].double() - pred).abs().max()) / lr
        if res > worst or not math.isfinite(res):
            worst, where = res, n
    return worst, where




# ------------------------------------------------------------------ outputs and gradients (an unreplicated stage)

FORWARD_RTOL = 0.02
"""A stage's output may differ from its recomputation from its inputs by this relative RMS (honest,
fp32 on the same kind of device: ~1e-6; a bf16 device: ~1e-2)."""
GRAD_COS_MIN = 0.9
"""Cosine between the gradient a stage stepped on (from its served AdamW moments) and the one
recomputed from its inputs and its outputs' gradients, below which it fails (honest: ~1)."""
UPSTREAM_COS_MIN = 0.9
"""The same for the gradient it sent back to its predecessor."""


def step_gradient(opt_before: Mapping[str, Tensor], opt_after: Mapping[str, Tensor], names: list[str],
                  b1: float) -> dict[str, Tensor] | None:
    """The (clipped) gradient of the AdamW step between two served states: m_T = b1 m_{T-1} +
    (1 - b1) g, so g = (m_T - b1 m_{T-1}) / (1 - b1); at step count 1 the moments are fresh (the
    first step, or the first after a quarantine cleared them: `Schedule.reset_moments`), so
    g = m_T / (1 - b1). None when no step was taken in between (a skipped, non-finite step leaves
    the moments as they were) or a moment is missing."""
    out = {}
    for n in names:
        m1 = opt_after.get(f"{n}.exp_avg")
        if m1 is None:
            return None
        s1 = float(opt_after.get(f"{n}.step", torch.tensor(0.0)))
        s0 = float(opt_before.get(f"{n}.step", torch.tensor(0.0)))
        if s1 == 1:                      # AdamW's first step, or the first after its moments were cleared
            m0 = None
        elif s1 != s0 + 1:
            return None
        else:
            m0 = opt_before.get(f"{n}.exp_avg")
        m0 = torch.zeros_like(m1) if m0 is None else m0
        out[n] = (m1.double() - b1 * m0.double()) / (1 - b1)
    return out


def _rel(a: Tensor, b: Tensor) -> float:
    d = float((a.double() - b.double()).norm()) / max(float(b.double().norm()), 1e-12)
    return d if math.isfinite(d) else math.inf


def _cos(a: Tensor, b: Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    c = float(a @ b) / max(float(a.norm() * b.norm()), 1e-30)
    return c if math.isfinite(c) else -math.inf


def replay_outputs(module: torch.nn.Module, weights: Mapping[str, Tensor],
                   samples: list[tuple[Tensor, Tensor, Tensor, Tensor | None]],
                   stepped: Mapping[str, Tensor] | None) -> tuple[bool | None, str]:
    """Recompute an unreplicated stage's microbatches of one iteration from its neighbours'
    evidence: `samples` are (input x it received, output y it sent, gradient gy of y it received,
    gradient gx of x it sent upstream or None); `weights` its served weights of that iteration;
    `stepped` the gradient its next served state says it stepped on (None: not checked).
    Returns (True: consistent | False: caught | None: inconclusive, why)."""
    if not samples:
        return None, "no evidence of its microbatches"
    module.load_state_dict({n: w.float() for n, w in weights.items()}, strict=False)
    module.float().train()
    module.zero_grad(set_to_none=True)
    worst_fwd, worst_up = 0.0, 1.0
    for x, y, gy, gx in samples:
        xi = x.detach().float().clone().requires_grad_()
        out = module(xi)
        worst_fwd = max(worst_fwd, _rel(y.float(), out.detach()))
        out.backward(gy.float())
        if gx is not None:
            worst_up = min(worst_up, _cos(gx, xi.grad))
    if worst_fwd > FORWARD_RTOL:
        return False, f"its outputs differ from their recomputation from its inputs by {worst_fwd:.3g} (relative, " \
                      f"limit {FORWARD_RTOL})"
    if worst_up < UPSTREAM_COS_MIN:
        return False, f"the gradient it sent upstream has cosine {worst_up:.3g} with its recomputation (limit " \
                      f"{UPSTREAM_COS_MIN})"
    if stepped is None:
        return True, f"{len(samples)} microbatches recompute (outputs {worst_fwd:.2g})"
    names = list(stepped)
    params = dict(module.named_parameters())
    mine = torch.cat([(params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).reshape(-1)
                      for n in names])
    cos = _cos(torch.cat([stepped[n].reshape(-1) for n in names]), mine)
    if cos < GRAD_COS_MIN:
        return False, f"the gradient it stepped on has cosine {cos:.3g} with the one recomputed from its " \
                      f"{len(samples)} microbatches (limit {GRAD_COS_MIN})"
    return True, f"{len(samples)} microbatches recompute (outputs {worst_fwd:.2g}, gradient cosine {cos:.4f})"


__all__ = ["FORWARD_RTOL", "GRAD_COS_MIN", "RESIDUAL_LR", "UPSTREAM_COS_MIN", "commit_of", "replay_outputs",
           "replay_residual", "step_gradient"]
