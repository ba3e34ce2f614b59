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


__all__ = ["RESIDUAL_LR", "commit_of", "replay_residual"]
