"""Content checks on peers' rollouts for same-model senders: token support, probability floor,
claimed log-probs (the logit / token-support check of docs/grpo.md, 'Defenses').

An honest homogeneous sample came from our model and our sampler, so, per token, on the
receiver's re-scoring pass (the same teacher-forced forward that serves the gradient and F-TIS:
no second forward):

=================  =====================================================================  ==========
check              reject the completion when a token ...                                  default
=================  =====================================================================  ==========
``min_prob``       has a probability (at the round temperature) below ``min_token_prob``  1e-4
``support``        lies outside the sampler's top-k / top-p set (mass ranked above it      slack 0.04,
                   >= top_p + ``support_slack``, or rank >= top_k), for at least           3 tokens
                   ``support_min_tokens`` tokens of the completion
``logp_mismatch``  carries claimed generator log-probs more than ``eps_lp`` nats (mean over   1.0
                   its tokens) below the recomputed processed ones (a liar inflating
                   importance weights; claiming higher only shrinks its own weights)
=================  =====================================================================  ==========

Drift (``min_token_weight`` > 0): same-model peers train apart, so a token counts for ``min_prob``
and ``support`` only when its F-TIS weight exp(ours - claimed) is at least the bound (the sender
claims it improbable too); a token the sender's sampler found probable teaches nothing anyway.

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
    min_token_prob: float = 1e-4
    eps_lp: float = 1.0
    support_min_tokens: int = 3
    min_token_weight: float = 0.0    # > 0: a low / off-support token counts only with exp(ours - claimed) >= this


@dataclass
class SupportStats:
    """Per token [N, L], from the receiver's own logits at the round temperature."""

    processed_logp: Tensor   # log-prob under the processed (top-k / top-p renormalised) sampler; -inf off support
    logp: Tensor             # log-prob at the round temperature before top-k / top-p (finite)
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
    # before top-k / top-p (finite): what the floor and the drift rule compare with the claims; an
    # off-top-k token would otherwise read as probability 0 and look like drift (weight ~0)
    raw_logp = z.log_softmax(-1).gather(-1, tok).squeeze(-1)
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
    return SupportStats(plp, raw_logp, mass_above, rank)


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
    if params.min_token_weight > 0:
        # drift: a token the sender claims probable and we do not has F-TIS weight below the bound
        # and teaches nothing; only tokens the sender also claims improbable count against it
        counts = (stats.logp - gen_logp.float()) >= math.log(params.min_token_weight)
        m_low = m & counts
        off &= counts
    else:
        m_low = m
    floor = math.log(params.min_token_prob) if params.min_token_prob > 0 else float("-inf")
    plp = stats.processed_logp
    finite = torch.isfinite(plp)     # -inf: outside the exact top-p set (off support, or within the slack)
    low = (stats.logp < floor) & m_low
    many_off = off.sum(1) >= max(1, params.support_min_tokens)
    # claimed lower than recomputed, mean over the completion's real tokens inside our sampler's
    # support (a token outside it has no processed log-prob to compare): a liar gains only by
    # claiming low generator log-probs (w = exp(l - gen) up to C) and is off on every token, while
    # identical models drift apart with training in both directions (one token's gap says little).
    # A row with a few off-support tokens (fewer than `support_min_tokens`) is still compared on
    # the rest: before, any off-support token exempted the row, and a liar with 1-2 of them passed
    on = m & finite
    diff = torch.where(on, plp - gen_logp.float(), torch.zeros_like(plp))
    bad_lp = ((diff.sum(1) / on.sum(1).clamp(min=1)) > params.eps_lp)[:, None] & on.any(1, keepdim=True)
    for i in range(m.shape[0]):
        if bool(low[i].any()):
            out.append("min_prob")
        elif bool(many_off[i]):
            out.append("support")
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
