"""GRPO math (pure torch): mixed-group advantages, the clipped surrogate, k3 KL, loss aggregation.

Owns the loss of docs/grpo.md, 'GRPO loss'. Samples are flat rows i = 0..N-1 (local and foreign completions alike), each with
a `group` id (its prompt), a reward in [0, 1] recomputed locally, and per-token tensors [N, L]
right-padded with `mask` False on padding and after the end. Importance weights and the F-TIS
filter (`rl/ftis.py`) enter as `weights` [N, L] and `keep` [N]; plain GRPO passes neither.
No gRPC, hivemind or node code here (import-linter contract "Method modules are pure").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]
LossAgg = Literal["sample", "seq", "token", "dr_grpo"]
ADV_EPS = 1e-4


def group_advantages(rewards: Tensor, group: Tensor, scale: ScaleRewards = "group",
                     valid: Tensor | None = None, eps: float = ADV_EPS) -> Tensor:
    """A_i = (r_i - mean_group r) / (std + eps), std with ddof 1.

    scale: "group" = std within the group, "batch" = std over every valid reward of the round,
    "none" = no division (Dr.GRPO). Groups with fewer than 2 valid members and constant-reward
    groups get A = 0 (never NaN). Rows with valid=False get A = 0 and do not enter the statistics
    (e.g. foreign rows in solo mode).
    """
    r = rewards.float()
    v = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool()
    g = group.long()
    n_groups = int(g.max()) + 1 if g.numel() else 0
    vf = v.float()
    count = torch.zeros(n_groups, dtype=torch.float32, device=r.device).index_add_(0, g, vf)
    total = torch.zeros_like(count).index_add_(0, g, r * vf)
    mean = total / count.clamp(min=1)
    centered = (r - mean[g]) * vf
    if scale == "group":
        ss = torch.zeros_like(count).index_add_(0, g, centered ** 2)
        std = (ss / (count - 1).clamp(min=1)).sqrt()[g]
    elif scale == "batch":
        rv = r[v]
        std = (rv.std(unbiased=True) if rv.numel() > 1 else r.new_zeros(())).expand_as(r)
    elif scale == "none":
        std = None
    else:
        raise ValueError(f"scale_rewards={scale!r}; use 'group', 'batch' or 'none'")
    adv = centered if std is None else centered / (std + eps)
    enough = count[g] >= 2
    return torch.where(v & enough, adv, torch.zeros_like(adv))


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """l_{i,t} = log_softmax(logits / T)[token], fp32; logits [N, L, V] aligned to tokens."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, tokens.long()[..., None]).squeeze(-1)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """D = exp(lref - l) - (lref - l) - 1 per token (k3 estimator of KL(pi || pi_ref), >= 0)."""
    d = ref_logp.float() - logp.float()
    return torch.exp(d) - d - 1


@dataclass
class GRPOLoss:
    loss: Tensor          # scalar, differentiable
    token_loss: Tensor    # [N, L] ell_{i,t} (0 where masked)
    clip_frac: float      # fraction of real tokens whose gradient the clip removed
    kl_mean: float        # mean k3 over real tokens (0 when beta = 0)
    n_tokens: int


def aggregate(token_loss: Tensor, mask: Tensor, agg: LossAgg = "sample", *,
              n_slots: int | None = None, max_len: int | None = None,
              n_tokens_total: float | None = None, n_samples_total: float | None = None,
              ) -> Tensor:
    """Reduce ell [N, L] to a scalar (docs/grpo.md, 'GRPO loss').

    sample  (1/S) sum_i (1/L_i) sum_t m ell      S = n_slots (round config; default N rows).
            Length-robust: one completion's pull is bounded whatever its length, and arrivals
            never dilute other samples (S is fixed).
    seq     same per-sample mean, divided by the samples present (n_samples_total or N).
    token   sum m ell / tokens present (n_tokens_total or sum m): pull grows with length.
    dr_grpo sum m ell / (S * max_len)  (max_len default L).
    The *_total overrides let micro-batches share one normaliser: summing the micro-batch
    losses then equals the full-batch loss (gradient accumulation without an extra divisor).
    """
    m = mask.float()
    N, L = m.shape
    per_tok = token_loss * m
    lengths = m.sum(1).clamp(min=1)
    if agg == "sample":
        return (per_tok.sum(1) / lengths).sum() / (n_slots if n_slots is not None else max(N, 1))
    if agg == "seq":
        present = n_samples_total if n_samples_total is not None else max(N, 1)
        return (per_tok.sum(1) / lengths).sum() / present
    if agg == "token":
        denom = n_tokens_total if n_tokens_total is not None else m.sum().clamp(min=1)
        return per_tok.sum() / denom
    if agg == "dr_grpo":
        S = n_slots if n_slots is not None else max(N, 1)
        return per_tok.sum() / (S * (max_len if max_len is not None else L))
    raise ValueError(f"loss_agg={agg!r}; use 'sample', 'seq', 'token' or 'dr_grpo'")


def grpo_loss(logp: Tensor, adv: Tensor, mask: Tensor, *, old_logp: Tensor | None = None,
              eps_lo: float = 0.2, eps_hi: float = 0.28, weights: Tensor | None = None,
              keep: Tensor | None = None, beta: float = 0.0, ref_logp: Tensor | None = None,
              agg: LossAgg = "sample", **agg_kwargs) -> GRPOLoss:
    """Clipped GRPO: ell = -M_i w_{i,t} min(rho A, clip(rho, 1-eps_lo, 1+eps_hi) A) + beta D.

    logp [N, L]: learner log-probs with grad. old_logp: log-probs of the policy that the ratio
    is taken against; None means mu = 1 (rho = exp(l - sg(l)): value 1, gradient grad log pi).
    weights [N, L] (detached IS weights) and keep [N] (0/1 filter) come from rl/ftis.py.
    beta > 0 needs ref_logp (k3 KL); beta = 0 never touches a reference model.
    """
    m = mask.bool()
    old = logp.detach() if old_logp is None else old_logp.detach().float()
    ratio = torch.exp(logp.float() - old)
    A = adv.float()[:, None]
    s1 = ratio * A
    s2 = ratio.clamp(1 - eps_lo, 1 + eps_hi) * A
    surrogate = torch.minimum(s1, s2)
    clipped = ((A > 0) & (ratio > 1 + eps_hi)) | ((A < 0) & (ratio < 1 - eps_lo))
    w = torch.ones_like(surrogate) if weights is None else weights.detach().float()
    M = torch.ones_like(A) if keep is None else keep.float()[:, None]
    ell = -M * w * surrogate
    kl_mean = 0.0
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (reference-model log-probs); set beta = 0 "
                             "to train without a reference model")
        D = k3_kl(logp, ref_logp.detach())
        ell = ell + beta * D
        kl_mean = float(D[m].mean()) if m.any() else 0.0
    ell = ell * m
    loss = aggregate(ell, m, agg, **agg_kwargs)
    n_tok = int(m.sum())
    clip_frac = float((clipped & m).sum()) / max(n_tok, 1)
    return GRPOLoss(loss, ell, clip_frac, kl_mean, n_tok)
