"""F-TIS (pure torch): truncated importance weights and the KL filter for shared rollouts.

Owns docs/grpo.md, 'F-TIS': for each sample, w_{i,t} = min(exp(l_{i,t} - gen_logp_{i,t}), C)
(detached, truncated from above only); a sample is dropped (M_i = 0) iff A_i < 0 and its KL
statistic exceeds the threshold — positives are always kept. Two statistics of
KL(pi_gen || pi_theta), both computed and reported, one of them filtering (``FTISParams.kl_stat``):

- ``token_mean`` (ours): KL_i = mean_t (gen_logp - sg(l)), threshold ``delta`` (0.5): length-free;
- ``sequence`` (the F-TIS paper's): KL_i = sum_t (gen_logp - sg(l)), threshold ``g`` (the paper's
  50, ablated over 5, 10, 50, 100): grows with the completion's length.

Local samples use the same formula (w ~ 1). Three modes share one code path (`ftis_loss`):

- "ftis":        weights + filter as above (the swarmnode learner);
- "uncorrected": foreign samples treated as on-policy (w = 1, no filter): the genrl baseline;
- "solo":        foreign samples excluded from groups, weights and the loss: no sharing.

No gRPC, hivemind or node code here (import-linter contract "Method modules are pure").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rl.grpo import GRPOLoss, LossAgg, ScaleRewards, group_advantages, grpo_loss

Mode = Literal["ftis", "uncorrected", "solo"]
MODES = ("ftis", "uncorrected", "solo")
KLStat = Literal["token_mean", "sequence"]
KL_STATS = ("token_mean", "sequence")


@dataclass(frozen=True)
class FTISParams:
    mode: Mode = "ftis"
    C: float = 2.0        # weight cap: bounds variance and a liar's gain; inf = no truncation
    delta: float = 0.5    # per-token-mean KL threshold for negative-advantage samples; inf = no filter
    kl_stat: KLStat = "token_mean"   # which KL statistic filters: "token_mean" (delta) or "sequence" (g)
    g: float = 50.0       # per-sequence KL threshold (the F-TIS paper's g); inf = no filter

    @property
    def threshold(self) -> float:
        return self.g if self.kl_stat == "sequence" else self.delta


def truncated_weights(logp: Tensor, gen_logp: Tensor, C: float) -> Tensor:
    """w = min(exp(l - gen), C), detached; [N, L]."""
    return torch.exp(logp.detach().float() - gen_logp.float()).clamp(max=C)


def sample_kl(logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """KL_i = (1/L_i) sum_t m (gen_logp - sg(l)): MC estimate of KL(pi_gen || pi_theta); [N]."""
    m = mask.float()
    d = (gen_logp.float() - logp.detach().float()) * m
    return d.sum(1) / m.sum(1).clamp(min=1)


def sequence_kl(logp: Tensor, gen_logp: Tensor, mask: Tensor) -> Tensor:
    """KL_i = sum_t m (gen_logp - sg(l)): the per-sequence estimate the F-TIS paper thresholds; [N]."""
    return ((gen_logp.float() - logp.detach().float()) * mask.float()).sum(1)


def kl_filter(adv: Tensor, kl: Tensor, delta: float) -> Tensor:
    """M_i = 0 iff A_i < 0 and KL_i > delta, else 1 (float [N])."""
    return (~((adv < 0) & (kl > delta))).float()


@dataclass
class FTISStats:
    n_local: int
    n_foreign: int
    filtered: int             # samples with M = 0 (counted over the samples that took part)
    filtered_frac: float      # filtered / samples that took part
    weight_mean: float        # mean w over real tokens of foreign samples (1.0 if none)
    truncated_frac: float     # fraction of foreign real tokens with exp(l - gen) > C
    kl_foreign_mean: float    # mean per-token-mean KL_i over foreign samples (0 if none)
    kl_seq_foreign_mean: float = 0.0   # mean per-sequence KL_i over foreign samples (0 if none)
    kl_stat: str = "token_mean"        # the statistic that filtered


@dataclass
class FTISResult:
    loss: GRPOLoss
    advantages: Tensor        # [N]
    weights: Tensor           # [N, L]
    keep: Tensor              # [N]
    stats: FTISStats


def ftis_loss(logp: Tensor, gen_logp: Tensor, mask: Tensor, rewards: Tensor, group: Tensor,
              foreign: Tensor, params: FTISParams = FTISParams(), *, exclude: Tensor | None = None,
              old_logp: Tensor | None = None, scale_rewards: ScaleRewards = "group", agg: LossAgg = "sample",
              n_slots: int | None = None, **loss_kwargs) -> FTISResult:
    """Mixed-group advantages + F-TIS loss for one round's samples, in any of the three modes.

    logp [N, L] learner log-probs (with grad) at the round temperature; gen_logp [N, L] the
    generator's (own rows: our sampling log-probs; foreign: from the wire); rewards [N] local;
    group [N] prompt index; foreign [N] bool. n_slots = S of the `sample` aggregation (round
    config: B * (G + F)); default: rows that take part. exclude [N] bool: rows a content filter
    dropped (they leave the advantages and the loss but keep their slot in S). old_logp: the
    learner's log-probs before this round's first step (mu > 1 steps per round): the importance
    weights, the KL filter and the PPO ratio are taken against it; None (mu = 1) = logp itself.
    loss_kwargs go to `grpo_loss`.
    """
    if params.mode not in MODES:
        raise ValueError(f"ftis mode {params.mode!r}; use one of {MODES}")
    foreign = foreign.bool()
    m = mask.bool()
    take_part = ~foreign if params.mode == "solo" else torch.ones_like(foreign)
    if exclude is not None:
        take_part = take_part & ~exclude.bool()
    adv = group_advantages(rewards, group, scale_rewards, valid=take_part)
    before = logp.detach() if old_logp is None else old_logp.detach()
    if params.kl_stat not in KL_STATS:
        raise ValueError(f"ftis kl_stat {params.kl_stat!r}; use one of {KL_STATS}")
    kl = sample_kl(before, gen_logp, m)
    kl_seq = sequence_kl(before, gen_logp, m)
    if params.mode == "ftis":
        w = truncated_weights(before, gen_logp, params.C)
        keep = kl_filter(adv, kl_seq if params.kl_stat == "sequence" else kl, params.threshold)
    else:
        w = torch.ones_like(logp, dtype=torch.float32).detach()
        keep = torch.ones_like(adv)
    keep = keep * take_part.float()
    rows = int(take_part.sum())
    loss = grpo_loss(logp, adv, m, old_logp=old_logp, weights=w, keep=keep, agg=agg,
                     n_slots=n_slots if n_slots is not None else max(rows, 1), **loss_kwargs)
    fm = m & foreign[:, None]
    n_for_tok = int(fm.sum())
    raw = torch.exp(before.float() - gen_logp.float())
    filtered = int(((keep == 0) & take_part).sum())
    stats = FTISStats(
        n_local=int((~foreign).sum()), n_foreign=int(foreign.sum()), filtered=filtered,
        filtered_frac=filtered / max(rows, 1),
        weight_mean=float(w[fm].mean()) if n_for_tok else 1.0,
        truncated_frac=float((raw[fm] > params.C).float().mean()) if n_for_tok else 0.0,
        kl_foreign_mean=float(kl[foreign].mean()) if bool(foreign.any()) else 0.0,
        kl_seq_foreign_mean=float(kl_seq[foreign].mean()) if bool(foreign.any()) else 0.0,
        kl_stat=params.kl_stat)
    return FTISResult(loss, adv, w, keep, stats)
