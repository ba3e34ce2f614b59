"""Content checks on peers' rollouts for same-model senders: token support, probability floor,
claimed log-probs (grpo.md §4.1, the logit / token-support check [rec from HTTT]).

An honest homogeneous sample came from our model and our sampler, so, per token, on the
receiver's re-scoring pass (the same teacher-forced forward that serves the gradient and F-TIS:
no second forward):

=================  =====================================================================  ==========
check              reject the completion when a token ...                                  default
=================  =====================================================================  ==========
``support``        lies outside the sampler's top-k / top-p set (mass ranked above it      slack 0.01
                   >= top_p + ``support_slack``, or rank >= top_k)
``min_prob``       has a processed probability below ``min_token_prob``                   1e-3
``logp_mismatch``  carries a claimed generator log-prob more than ``eps_lp`` nats from     0.5
                   the recomputed processed one (a liar inflating importance weights)
=================  =====================================================================  ==========

Generic over tensors (logits, token ids, log-probs, masks): no model, task or transport here
(``security`` never imports the method packages; the GRPO glue is ``rl/defense.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LogitCheckParams", "SupportStats", "support_stats", "logit_check", "floor_check",
           "LOGIT_REASONS"]

LOGIT_REASONS = ("support", "min_prob", "logp_mismatch")


@dataclass(frozen=True)
class LogitCheckParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    support_slack: float = 0.01
    min_token_prob: float = 1e-3
    eps_lp: float = 0.5


@dataclass
class SupportStats:
    """Per token [N, L], from the receiver's own logits at the round temperature."""

    processed_logp: Tensor   # log-prob under the processed (top-k / top-p renormalised) sampler; -inf off support
    mass_above: Tensor       # probability mass of the tokens ranked strictly above this one (before top-p)
    rank: Tensor             # how many tokens are strictly more probable (int64)


@torch.no_grad()
def support_stats(logits: Tensor, tokens: Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> SupportStats:
    """Support statistics of ``tokens`` [N, L] under ``logits`` [N, L, V] (detached).

    The processed distribution is the one a sampler with (T, top_k, top_p) draws from: scale by
    1/T, keep the k most probable, then the smallest prefix reaching ``top_p``, renormalise
    (models/generate.processed_logprobs)."""
    z = logits.detach().float() / temperature
    tok = tokens.long()[..., None]
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = z.softmax(-1)
    p_tok = p.gather(-1, tok)
    above = p > p_tok
    mass_above = (p * above).sum(-1)
    rank = above.sum(-1)
    if top_p < 1.0:
        sp, _ = p.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) <= top_p
        z_norm = (sp * keep).sum(-1)
        in_set = (mass_above <= top_p) & (p_tok.squeeze(-1) > 0)
        plp = torch.where(in_set, p_tok.squeeze(-1).clamp(min=1e-30).log() - z_norm.log(),
                          torch.full_like(mass_above, float("-inf")))
    else:
        plp = p_tok.squeeze(-1).clamp(min=1e-30).log()
    return SupportStats(plp, mass_above, rank)


def logit_check(stats: SupportStats, gen_logp: Tensor, mask: Tensor, params: LogitCheckParams) -> list[str | None]:
    """Per row: None (keep) or the first failed check (``support``, ``min_prob``,
    ``logp_mismatch``). Only real tokens (``mask``) count."""
    m = mask.bool()
    out: list[str | None] = []
    off = torch.zeros_like(m)
    if params.top_p < 1.0:
        off |= stats.mass_above >= params.top_p + params.support_slack
    if params.top_k:
        off |= stats.rank >= params.top_k
    off &= m
    floor = math.log(params.min_token_prob) if params.min_token_prob > 0 else float("-inf")
    plp = stats.processed_logp
    # off-support tokens have plp = -inf; the floor and the mismatch look at in-support ones
    low = (plp < floor) & m & ~off
    finite = torch.isfinite(plp)
    diff = (gen_logp.float() - torch.where(finite, plp, gen_logp.float())).abs()
    bad_lp = (diff > params.eps_lp) & m & ~off
    for i in range(m.shape[0]):
        if bool(off[i].any()):
            out.append("support")
        elif bool(low[i].any()):
            out.append("min_prob")
        elif bool(bad_lp[i].any()):
            out.append("logp_mismatch")
        else:
            out.append(None)
    return out


def floor_check(logp: Tensor, mask: Tensor, min_prob: float) -> list[bool]:
    """Per row: True when every real token's receiver log-prob is at least log(min_prob) (the
    loose floor applied to other-model senders before the judge)."""
    if min_prob <= 0:
        return [True] * logp.shape[0]
    bad = (logp.detach().float() < math.log(min_prob)) & mask.bool()
    return [not bool(b) for b in bad.any(1)]
