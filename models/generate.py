"""Sampling G completions per prompt with a KV cache, and re-scoring given tokens in one forward.

Owns the decoding loop of the embedded decoder (`models/llama.py`) for RL: temperature, top-k and
top-p sampling with the per-token log-probs of the *processed* sampling distribution (what a
rollout sends as `gen_logp`), and teacher-forced re-scoring `log_softmax(logits / T)` of given
completions (what the learner trains on). Knows nothing about rewards, the swarm or the loss.

Works with any full causal LM that offers ``forward_cached(ids, valid, cache)`` (padded,
KV-cached forward returning logits) and ``new_cache(batch, max_len, device)``: the embedded
`models.llama.Llama` and the Hugging Face wrapper `models.hf_adapter.HFCausalLM`.

Layout shared by both: completions are rows [N, L], right-padded, `mask` True on real tokens
(up to and including the stop token), `prompt_index[i]` names the prompt of row i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from torch import nn


@dataclass
class Samples:
    """G completions per prompt, rows grouped by prompt (row i belongs to prompt i // G)."""

    tokens: Tensor        # [N, L] int64, 0 after the end
    logp: Tensor          # [N, L] float32 generator log-probs (processed distribution), 0 after
    mask: Tensor          # [N, L] bool: real tokens (stop token included)
    truncated: Tensor     # [N] bool: no stop token within max_new_tokens
    prompt_index: Tensor  # [N] int64

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(1)

    def completion(self, i: int) -> list[int]:
        return self.tokens[i][self.mask[i]].tolist()


def _left_pad(prompts: list[list[int]], device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[i, width - len(p):] = True
    return ids, valid


def processed_logprobs(logits: Tensor, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> Tensor:
    """log-probs [.., V] (fp32) of the distribution actually sampled: /T, then top-k, top-p."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy: use a small T)")
    z = logits.float() / temperature
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = sorted_z.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p        # keep the smallest prefix reaching top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    return z.log_softmax(-1)


@torch.no_grad()
def sample(model: nn.Module, prompts: list[list[int]], G: int, max_new_tokens: int,
           temperature: float = 1.0, *, top_k: int = 0, top_p: float = 1.0,
           stop_token: int | None = None, generator: torch.Generator | None = None) -> Samples:
    """G completions per prompt in one KV-cached loop (one forward per new token, batch B*G)."""
    if G < 1 or max_new_tokens < 1 or not prompts or any(not p for p in prompts):
        raise ValueError("sample needs G >= 1, max_new_tokens >= 1 and non-empty prompts")
    device = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(G)]
    ids, valid = _left_pad(rows, device)
    N = len(rows)
    cache = model.new_cache(N, ids.shape[1] + max_new_tokens, device=device)
    logits = model.forward_cached(ids, valid, cache)[:, -1]
    tokens = torch.zeros(N, max_new_tokens, dtype=torch.long, device=device)
    logp = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=device)
    mask = torch.zeros(N, max_new_tokens, dtype=torch.bool, device=device)
    alive = torch.ones(N, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        lp = processed_logprobs(logits, temperature, top_k, top_p)
        nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1)
        tokens[:, t] = torch.where(alive, nxt, 0)
        logp[:, t] = torch.where(alive, lp.gather(1, nxt[:, None]).squeeze(1), 0.0)
        mask[:, t] = alive
        if stop_token is not None:
            alive = alive & (nxt != stop_token)
        if not alive.any() or t == max_new_tokens - 1:
            break
        logits = model.forward_cached(tokens[:, t:t + 1], alive[:, None], cache)[:, -1]
    ended = mask.sum(1) < max_new_tokens
    if stop_token is not None:
        ended = ended | ((tokens == stop_token) & mask).any(1)
    truncated = ~ended
    index = torch.arange(len(prompts), device=device).repeat_interleave(G)
    return Samples(tokens, logp, mask, truncated, index)


def rescore(model: nn.Module, prompts: list[list[int]], tokens: Tensor, mask: Tensor,
            prompt_index: Tensor, temperature: float = 1.0) -> Tensor:
    """Teacher-forced log_softmax(f(q ++ a_<t) / T)[a_t], fp32 [N, L], in one padded forward.

    Keeps the graph (this is the training forward); wrap in torch.no_grad() to only score.
    Positions where mask is False hold 0.
    """
    N, L = tokens.shape
    rows = [prompts[int(i)] for i in prompt_index]
    p_ids, p_valid = _left_pad(rows, tokens.device)
    P = p_ids.shape[1]
    ids = torch.cat([p_ids, tokens.long()], dim=1)
    valid = torch.cat([p_valid, mask.bool()], dim=1)
    logits = model.forward_cached(ids, valid)[:, P - 1:P - 1 + L]        # predicts tokens[:, t]
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    out = lp.gather(2, tokens.long()[..., None]).squeeze(2)
    return out * mask
