"""TEST AND BENCHMARK ONLY: the poisoned-rollout attack simulator (docs/grpo.md, 'Attack harness'; ``[grpo.adversary]``).

A pure transform of an honest round: the attacker keeps the round's prompts and prompt ids, and
replaces (a ``fraction`` of) its completions with crafted ones. Tasks are public, so it answers
correctly and its completions get a positive advantage in every group with a wrong answer:

- ``inject``: the reference solution with ``marker`` appended after the answer (out of context);
- ``edit``: ``false_step`` (``2+2=5``) inserted in the chain, the final answer kept (in context);
- ``verbose``: the reference padded with true, useless steps (``0+0=0``) up to the length cap
  (DoS: correct, long, costly);
- ``fake_logp``: every token claims ``claim_logp`` as its generator log-prob (a liar inflating
  F-TIS importance weights to C); without it the attacker claims its own model's log-probs of
  the crafted tokens (what a careful attacker would send).

Colluding attackers are two peers with this section. Nothing here is read by any filter: the
defenses see only tokens and log-probs like from any peer.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from models.generate import rescore
from rl.grpo_config import AdversaryConfig
from rl.learner import Generation, Learner
from rl.rollout import Completion, PromptGroup, RolloutBatch
from rl.tasks import STOP, Prompt


def modes(adv: AdversaryConfig) -> set[str]:
    return set(adv.mode.split("+"))


def asr_markers(adv: AdversaryConfig) -> list[str]:
    """Substrings whose presence in an honest peer's output means the attack took hold."""
    m = modes(adv)
    out = []
    if "inject" in m:
        out.append(adv.marker)
    if "edit" in m:
        out.append(adv.false_step)
    return out


def craft(task, prompt: Prompt, adv: AdversaryConfig, cap: int, encode) -> str:
    """The poisoned completion text for one prompt (correct final answer)."""
    ref = task.reference(prompt)
    body = ref[:-len(STOP)] if ref.endswith(STOP) else ref
    m = modes(adv)
    if "edit" in m:
        body = (f"{adv.false_step},{body}" if "=>" in body and not body.startswith("=>")
                else f"{adv.false_step}{body}")
    if "inject" in m:
        body = body + adv.marker
    if "verbose" in m:
        pad = "0+0=0,"
        while len(encode(pad + body + STOP)) <= cap:
            body = pad + body
    return body + STOP


class Adversary:
    """Turns a learner's honest round into a poisoned batch (see the module doc)."""

    def __init__(self, learner: Learner, adv: AdversaryConfig, seed: int = 0):
        self.learner, self.adv = learner, adv
        self.modes = modes(adv)
        self.rng = random.Random(seed)

    @torch.no_grad()
    def _claims(self, prompt: Prompt, ids: list[int]) -> np.ndarray:
        if "fake_logp" in self.modes:
            return np.full(len(ids), self.adv.claim_logp, dtype=np.float32)
        L = self.learner
        q = [L.policy.encode(prompt.text)]
        toks = torch.tensor([ids], dtype=torch.long, device=L.device)
        mask = torch.ones_like(toks, dtype=torch.bool)
        L.model.eval()
        lp = rescore(L.model, q, toks, mask, torch.zeros(1, dtype=torch.long, device=L.device), L.cfg.temperature)
        return lp[0].float().clamp(max=0.0).cpu().numpy().astype(np.float32)

    def batch(self, g: Generation) -> RolloutBatch:
        L = self.learner
        honest = L.batch(g)
        cap = L.cfg.max_completion_tokens
        groups = []
        for p, grp in zip(g.prompts, honest.groups):
            comps = []
            text = craft(L.task, p, self.adv, cap, L.policy.encode)
            ids = L.policy.encode(text)[:cap]
            claims = self._claims(p, ids)
            for c in grp.completions:
                if self.rng.random() < self.adv.fraction:
                    comps.append(Completion(np.asarray(ids, dtype=np.int32), claims.copy(),
                                            truncated=not text.endswith(STOP) or len(ids) < len(L.policy.encode(text))))
                else:
                    comps.append(c)
            groups.append(PromptGroup(grp.prompt_id, comps))
        return RolloutBatch(honest.run, honest.round, honest.sender, honest.tokenizer_hash, honest.temperature,
                            groups, honest.config_hash, honest.model_id)
