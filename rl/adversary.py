"""TEST AND BENCHMARK ONLY: the poisoned-rollout attack simulator (docs/grpo.md, 'Attack harness'; ``[grpo.adversary]``).

A pure transform of an honest round: the attacker keeps the round's prompts and prompt ids, and
replaces (a ``fraction`` of) its completions with crafted ones. Tasks are public, so it answers
correctly and its completions get a positive advantage in every group with a wrong answer:

- ``inject``: the reference solution with ``marker`` appended after the answer (out of context;
  ``placement = "end"``) or put at the start of the reasoning (``placement = "start"``: the HTTT
  paper's text attack, the marker read before any step);
- ``edit``: ``false_step`` (``2+2=5``) inserted in the chain, the final answer kept (in context);
- ``verbose``: the reference padded with true, useless steps (``0+0=0``) up to the length cap
  (DoS: correct, long, costly);
- ``fake_logp``: every token claims ``claim_logp`` as its generator log-prob (a liar inflating
  F-TIS importance weights to C); without it the attacker claims its own model's log-probs of
  the crafted tokens (what a careful attacker would send).

``vertical = true`` is the paper's vertical attacker, who owns whole groups (run it in the vertical
topology, where receivers normalise advantages within each sender's group): it sends the
completions it sampled itself, poisons those with a right answer and keeps the wrong ones clean,
so within its group the poison and a positive advantage go together; a group it got all wrong
gets one crafted correct poisoned solution in place of its first sample (the task is public).
Poisoning every sample alike (right and wrong) would give the marker as much negative advantage
as positive: measured inert (attack success 0 without defenses). Colluding attackers are two peers
with this section. Nothing here is read by any filter: the defenses see only tokens and log-probs
like from any peer.
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


def poison(body: str, adv: AdversaryConfig, cap: int, encode) -> str:
    """``body`` (a completion without its stop character) with the attack applied, stop appended."""
    m = modes(adv)
    if "edit" in m:
        body = (f"{adv.false_step},{body}" if "=>" in body and not body.startswith("=>")
                else f"{adv.false_step}{body}")
    if "inject" in m:
        body = adv.marker + body if adv.placement == "start" else body + adv.marker
    if "verbose" in m:
        pad = "0+0=0,"
        while len(encode(pad + body + STOP)) <= cap:
            body = pad + body
    return body + STOP


def craft(task, prompt: Prompt, adv: AdversaryConfig, cap: int, encode) -> str:
    """The poisoned completion text for one prompt (correct final answer)."""
    ref = task.reference(prompt)
    return poison(ref[:-len(STOP)] if ref.endswith(STOP) else ref, adv, cap, encode)


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

    def _completion(self, p: Prompt, text: str, cap: int) -> Completion:
        enc = self.learner.policy.encode(text)
        ids = enc[:cap]
        return Completion(np.asarray(ids, dtype=np.int32), self._claims(p, ids),
                          truncated=not text.endswith(STOP) or len(ids) < len(enc))

    def _vertical_group(self, p: Prompt, own: list[Completion], cap: int) -> list[Completion]:
        """A whole group of its own samples: right answers poisoned (a ``fraction`` of them), wrong
        ones clean; all wrong: the first replaced by the crafted correct poisoned solution."""
        L = self.learner
        texts = [L.policy.decode(c.token_ids.tolist()) for c in own]
        right = [L.task.reward(p, t) > 0 for t in texts]
        if own and not any(right):
            texts[0], right[0] = craft(L.task, p, self.adv, cap, L.policy.encode), None
        out = []
        for c, text, ok in zip(own, texts, right):
            if ok is None:                              # already crafted and poisoned
                out.append(self._completion(p, text, cap))
            elif ok and self.rng.random() < self.adv.fraction:
                body = text[:-len(STOP)] if text.endswith(STOP) else text
                out.append(self._completion(p, poison(body, self.adv, cap, L.policy.encode), cap))
            else:
                out.append(c)
        return out

    def batch(self, g: Generation) -> RolloutBatch:
        L = self.learner
        honest = L.batch(g)
        cap = L.cfg.max_completion_tokens
        groups = []
        for p, grp in zip(g.prompts, honest.groups):
            if self.adv.vertical:
                groups.append(PromptGroup(grp.prompt_id, self._vertical_group(p, grp.completions, cap)))
                continue
            comps = []
            crafted = self._completion(p, craft(L.task, p, self.adv, cap, L.policy.encode), cap)
            for c in grp.completions:
                if self.rng.random() >= self.adv.fraction:
                    comps.append(c)
                else:
                    comps.append(Completion(crafted.token_ids.copy(), crafted.gen_logp.copy(), crafted.truncated))
            groups.append(PromptGroup(grp.prompt_id, comps))
        return RolloutBatch(honest.run, honest.round, honest.sender, honest.tokenizer_hash, honest.temperature,
                            groups, honest.config_hash, honest.model_id)
