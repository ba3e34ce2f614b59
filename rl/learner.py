"""One GRPO learner's round work, transport-free: generate, build the batch, mix, re-score, step.

Owns what a `grpo` peer does with its policy each round (docs/grpo.md, 'Rounds': generate and step), so that the
role (rl/grpo_role.py: timing, transport, signing, metrics) and the in-process benchmark variant
(benchmarks/grpo_swarm.py) run the same code:

    L = Learner(cfg, ModelConfig(d_model=48, n_layers=1), seed=0, run="demo", sender=peer_id)
    L.warmup()                                  # short supervised pass (rewards start non-zero)
    gen = L.generate(r)                         # G completions per prompt (round_prompts), KV-cached
    batch = L.batch(gen)                        # RolloutBatch: token ids + gen log-probs (8 B/token)
    stats = L.train(gen, foreign_batches)       # local rewards, mixed groups, re-score, F-TIS step
    acc = L.accuracy()                          # held-out mean reward at the round temperature

`train` is three steps with a seam between them: `mix` (``grpo.topology``, rl/topology.py:
``horizontal``, G own + up to F foreign completions per prompt in one group; ``vertical``, whole
foreign groups kept as groups of their own, their prompts rebuilt from the sender and round;
rewards recomputed here from the token ids in both), `rescore` (the one teacher-forced forward
under the local policy: it serves the gradient, F-TIS and, through ``filters``, content checks
such as a logit check), then the loss and one optimizer step. A filter is a callable
``(mixed, logp) -> bool [N]`` (True = keep); dropped rows leave the advantages and the loss.
``Learner.defense`` (rl/defense.py, set by the role; None = none) admits foreign batches (rate
bans, token budgets) before the mix and checks the foreign rows after the re-scoring forward,
whose logits also give the logit / support check its statistics (no second forward); what a
rejection does is ``grpo.defense.reject_rule`` (``apply_rejections``: dropped, or kept at reward 0).

Foreign batches must already be validated (rl/rollout.check, signature): this module trusts
their shape, never their content. Every method touching the model runs on the caller's thread
(the role calls them on its compute thread).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from models import ModelConfig
from models.generate import Samples, _left_pad, rescore, sample
from models.policy import Policy, build_policy
from node.device import autocast
from rl.ftis import FTISParams, ftis_loss
from rl.grpo_config import GRPOConfig
from rl.rollout import Completion, PromptGroup, RolloutBatch
from rl.tasks import STOP, Prompt, make_task
from rl.topology import pick_groups, prompt_key
from security.rollout_filters import support_stats

EVAL_SEED = 12345          # sampling seed of the accuracy metric (same weights -> same figure)


@dataclass
class Generation:
    round: int
    prompts: list[Prompt]
    samples: Samples
    rewards: list[float]          # local rewards of own completions
    seconds: float


@dataclass
class Mixed:
    """One round's training rows: own completions first, then the chosen foreign ones."""

    prompts: list[Prompt]         # by group index (vertical: own B prompts, then one per foreign group)
    tokens: Tensor                # [N, L] int64
    gen_logp: Tensor              # [N, L] generator log-probs (own: ours; foreign: from the wire)
    mask: Tensor                  # [N, L] real tokens
    truncated: Tensor             # [N]
    group: Tensor                 # [N] group index (into ``prompts``)
    foreign: Tensor               # [N] bool
    rewards: list[float]          # [N], recomputed locally
    senders: list[str] = field(default_factory=list)   # [N]: "" for own rows
    model_ids: list[str] = field(default_factory=list)  # [N]: the sender batch's model_id ("" for own rows)
    support: object = None         # SupportStats of the rows ``support_rows`` names (same forward)
    support_rows: Tensor | None = None

    @property
    def n_local(self) -> int:
        return int((~self.foreign).sum())


@dataclass
class TrainStats:
    round: int
    loss: float
    reward_local: float           # mean reward of own completions
    reward_foreign: float | None  # mean reward of foreign completions used (None: none)
    n_local: int
    n_foreign: int
    senders: int                  # peers whose completions entered a group
    filtered: int                 # samples the F-TIS KL filter dropped
    filtered_frac: float
    rejected: int                 # foreign rows a content check rejected (dropped, or kept at reward 0)
    weight_mean: float
    truncated_frac: float
    kl_foreign: float
    tokens: int
    seconds: float
    rejected_by: dict = field(default_factory=dict)       # reason -> foreign rows dropped by the defense
    foreign_tokens: dict = field(default_factory=dict)    # sender -> tokens of its rows in the loss
    kl_seq_foreign: float = 0.0                           # mean per-sequence KL of foreign samples


Filter = Callable[[Mixed, Tensor], Tensor]


def apply_rejections(dropped: Tensor, rejected: Tensor, rule: str) -> tuple[Tensor, Tensor]:
    """(rows excluded from advantages and loss, rows kept with reward 0) after the content checks
    rejected ``rejected`` [N] bool: ``drop`` excludes them, ``zero_reward`` (HTTT's reward x
    verdict) keeps them in their groups with reward 0 (``grpo.defense.reject_rule``)."""
    if rule == "zero_reward":
        return dropped, rejected & ~dropped
    if rule == "drop":
        return dropped | rejected, torch.zeros_like(rejected)
    raise ValueError(f"grpo.defense.reject_rule {rule!r}; use 'drop' or 'zero_reward'")


class Learner:
    """A policy, its optimizer and the round logic (see the module docstring)."""

    def __init__(self, cfg: GRPOConfig, mcfg: ModelConfig, seed: int, run: str, sender: str,
                 device: torch.device | str = "cpu", precision: str = "fp32",
                 policy: Policy | None = None):
        self.cfg, self.mcfg, self.seed, self.run, self.sender = cfg, mcfg, seed, run, sender
        self.device, self.precision = torch.device(device), precision
        self.policy = policy if policy is not None else build_policy(mcfg, seed, STOP)
        self.model = self.policy.model.to(self.device)
        self.task = make_task(cfg)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.rng = random.Random(seed)
        self.heldout = (self.task.heldout(cfg.heldout_size, 0) if cfg.heldout == "problems"
                        else self.task.prompts("swarmnode/grpo-eval", 0, cfg.heldout_size))
        self.model_id = self.policy.model_id
        self.tokenizer_hash = self.policy.tokenizer_hash
        self.config_hash = cfg.config_hash(self.policy.tokenizer_hash, self.policy.chat_template_hash)
        self.n_params = self.policy.n_params
        self.filters: list[Filter] = []
        self._prompt_cache: dict[tuple[int, str], dict[bytes, Prompt]] = {}
        self._prompt_lock = threading.Lock()     # round_prompts runs on the event loop (inbox) and the compute thread
        self.defense = None          # rl.defense.Defense (admission, logit check, judge, rate bans)
        need = max(len(self.policy.encode(p.text)) for p in self.heldout) + cfg.max_completion_tokens
        if need > self.policy.max_seq_len:
            raise ValueError(f"the model's longest sequence ({self.policy.max_seq_len}, model.max_seq_len) is "
                             f"shorter than a prompt plus grpo.max_completion_tokens ({need}); raise "
                             "model.max_seq_len or lower grpo.max_completion_tokens")

    def _sample(self, prompts: list[Prompt], G: int, generator: torch.Generator) -> Samples:
        cfg = self.cfg
        q = [self.policy.encode(p.text) for p in prompts]
        self.model.eval()
        with torch.no_grad(), autocast(self.device, self.precision):
            s = sample(self.model, q, G, cfg.max_completion_tokens, cfg.temperature, top_k=cfg.top_k,
                       top_p=cfg.top_p, stop_token=self.policy.stop_id, generator=generator)
        return Samples(s.tokens.cpu(), s.logp.cpu(), s.mask.cpu(), s.truncated.cpu(), s.prompt_index.cpu())

    def _rewards(self, prompts: list[Prompt], s: Samples) -> list[float]:
        return [self.task.reward(prompts[int(s.prompt_index[i])], self.policy.decode(s.completion(i)))
                for i in range(len(s.tokens))]

    # ---------------- evaluation and warm-up ----------------
    def accuracy(self, prompts: list[Prompt] | None = None) -> float:
        """Held-out accuracy: mean local reward of ``eval_samples`` completions per held-out
        prompt at the round temperature (what GRPO optimises), with a fixed sampling seed so that
        two evaluations of the same weights agree exactly."""
        return self.evaluate(prompts)[0]

    def evaluate(self, prompts: list[Prompt] | None = None, markers: tuple[str, ...] = ()
                 ) -> tuple[float, dict[str, float], float]:
        """(held-out accuracy as in :meth:`accuracy`, share of held-out completions containing
        each of ``markers`` (attack success), mean completion length in tokens), one sampling."""
        prompts = self.heldout if prompts is None else prompts
        gen = torch.Generator(device=self.device).manual_seed(EVAL_SEED)
        s = self._sample(prompts, self.cfg.eval_samples, gen)
        r = self._rewards(prompts, s)
        texts = [self.policy.decode(s.completion(i)) for i in range(len(s.tokens))] if markers else []
        rates = {mk: sum(mk in t for t in texts) / max(len(texts), 1) for mk in markers}
        return sum(r) / len(r), rates, float(s.lengths.float().mean())

    def warmup_key(self) -> str:
        """Hash of everything the warm-up result depends on (its cache file name)."""
        cfg = self.cfg
        knobs = (cfg.warmup_target_acc, cfg.warmup_max_steps, cfg.warmup_lr, cfg.warmup_batch,
                 cfg.heldout_size, cfg.eval_samples, cfg.temperature, cfg.top_k, cfg.top_p,
                 cfg.max_completion_tokens, self.task.spec)
        return hashlib.sha256(f"{self.model_id}|{self.seed}|{knobs}".encode()).hexdigest()[:16]

    def warmup(self, cache_dir: str | Path | None = None) -> tuple[int, float]:
        """Supervised steps on reference solutions until held-out accuracy >= warmup_target_acc
        (checked every 10 steps) or warmup_max_steps; returns (steps, accuracy). With
        ``cache_dir`` the warmed weights are reused across runs (keyed by :meth:`warmup_key`)."""
        cfg = self.cfg
        if cfg.warmup_target_acc <= 0:
            return 0, self.accuracy()
        path = Path(cache_dir) / f"grpo-warmup-{self.warmup_key()}.pt" if cache_dir else None
        if path is not None and path.is_file():
            saved = torch.load(path, map_location=self.device, weights_only=True)   # our own local file
            self.model.load_state_dict(saved["model"])
            return int(saved["steps"]), self.accuracy()
        opt = torch.optim.Adam(self.model.parameters(), lr=cfg.warmup_lr)
        step, acc = 0, self.accuracy()
        while step < cfg.warmup_max_steps and acc < cfg.warmup_target_acc:
            prompts = self.task.prompts(f"warmup:{self.seed}", step, cfg.warmup_batch)
            q = [self.policy.encode(p.text) for p in prompts]
            a = [self.policy.encode(self.task.reference(p)) for p in prompts]
            toks = torch.zeros(len(a), max(len(x) for x in a), dtype=torch.long)
            mask = torch.zeros_like(toks, dtype=torch.bool)
            for i, x in enumerate(a):
                toks[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = True
            toks, mask = toks.to(self.device), mask.to(self.device)
            self.model.train()
            with autocast(self.device, self.precision):
                lp = rescore(self.model, q, toks, mask, torch.arange(len(a), device=self.device))
            loss = -(lp.sum() / mask.sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 10 == 0:
                acc = self.accuracy()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            torch.save({"model": self.model.state_dict(), "steps": torch.tensor(step)}, tmp)
            tmp.replace(path)
        return step, acc

    # ---------------- generation ----------------
    def round_prompts(self, round_: int, peer: str | None = None) -> dict[bytes, Prompt]:
        """The B prompts ``peer`` (None: this peer) answers in a round, by prompt id: the same for
        every peer (horizontal) or its own (vertical; rl/topology.py, ``prompt_key``). Receivers
        rebuild a foreign group's prompt from it; the last few rounds are cached."""
        peer = self.sender if peer is None else peer
        key = (round_, prompt_key(self.run, self.cfg.topology, peer))
        with self._prompt_lock:
            got = self._prompt_cache.get(key)
        if got is None:
            got = {p.prompt_id: p for p in self.task.prompts(key[1], round_, self.cfg.prompts_per_round)}
            with self._prompt_lock:
                self._prompt_cache[key] = got
                for old in [k for k in self._prompt_cache if k[0] < round_ - 4]:
                    del self._prompt_cache[old]
        return got

    def generate(self, round_: int) -> Generation:
        """This round's prompts (:meth:`round_prompts`) and G completions each (KV-cached loop)."""
        t0 = time.perf_counter()
        prompts = list(self.round_prompts(round_).values())
        s = self._sample(prompts, self.cfg.completions_per_prompt, self.gen)
        return Generation(round_, prompts, s, self._rewards(prompts, s), time.perf_counter() - t0)

    def batch(self, g: Generation) -> RolloutBatch:
        """The rollout batch to publish: token ids and generator log-probs, no text, no reward."""
        s = g.samples
        groups = [PromptGroup(p.prompt_id, []) for p in g.prompts]
        for i in range(len(s.tokens)):
            m = s.mask[i]
            groups[int(s.prompt_index[i])].completions.append(
                Completion(s.tokens[i][m].numpy().astype(np.int32),
                           s.logp[i][m].numpy().astype(np.float32), bool(s.truncated[i])))
        return RolloutBatch(self.run, g.round, self.sender, self.tokenizer_hash, self.cfg.temperature,
                            groups, self.config_hash, self.model_id)

    # ---------------- the step ----------------
    def _select_foreign(self, g: Generation, foreign: list[RolloutBatch]) -> list[tuple[int, str, Completion]]:
        """(prompt index, sender, completion): at most F foreign completions per prompt, at most
        per_sender_per_prompt per sender, random slots."""
        cfg = self.cfg
        if cfg.mode == "solo" or cfg.foreign_per_prompt == 0:
            return []
        index = {p.prompt_id: i for i, p in enumerate(g.prompts)}
        per_prompt: dict[int, list[tuple[str, Completion]]] = {}
        for b in foreign[:cfg.max_senders]:
            for grp in b.groups:
                i = index.get(grp.prompt_id)
                if i is None:
                    continue
                comps = list(grp.completions)
                self.rng.shuffle(comps)
                per_prompt.setdefault(i, []).extend((b.sender, c) for c in comps[:cfg.per_sender_per_prompt])
        out = []
        for i, items in sorted(per_prompt.items()):
            self.rng.shuffle(items)
            out.extend((i, sender, c) for sender, c in items[:cfg.foreign_per_prompt])
        return out

    def _select_groups(self, g: Generation, foreign: list[RolloutBatch]
                       ) -> tuple[list[tuple[int, str, Completion]], list[Prompt]]:
        """Vertical: whole foreign groups (rl/topology.py, ``pick_groups``), each a group of its own
        after our B; returns the rows as (group index, sender, completion) and the groups' prompts,
        rebuilt from each sender's prompt key (a group whose prompt is not the sender's is skipped:
        the inbox refuses those already)."""
        cfg = self.cfg
        if cfg.mode == "solo" or cfg.foreign_per_prompt == 0:
            return [], []
        picked = pick_groups(foreign, cfg.prompts_per_round * cfg.foreign_per_prompt, cfg.max_senders, self.rng)
        rows: list[tuple[int, str, Completion]] = []
        prompts: list[Prompt] = []
        for grp in picked:
            p = self.round_prompts(g.round, grp.sender).get(grp.prompt_id)
            if p is None:
                continue
            k = len(g.prompts) + len(prompts)
            prompts.append(p)
            rows.extend((k, grp.sender, c) for c in grp.completions)
        return rows, prompts

    def mix(self, g: Generation, foreign: list[RolloutBatch]) -> Mixed:
        """Own completions plus the chosen foreign ones as padded rows, rewards recomputed here
        (``horizontal``: foreign rows join our prompts' groups; ``vertical``: foreign groups follow ours)."""
        s = g.samples
        if self.cfg.topology == "vertical":
            chosen, extra = self._select_groups(g, foreign)
        else:
            chosen, extra = self._select_foreign(g, foreign), []
        prompts = list(g.prompts) + extra
        n_local, W = s.tokens.shape
        L = max([W] + [len(c.token_ids) for _, _, c in chosen])
        N = n_local + len(chosen)
        m = Mixed(prompts, torch.zeros(N, L, dtype=torch.long), torch.zeros(N, L),
                  torch.zeros(N, L, dtype=torch.bool), torch.zeros(N, dtype=torch.bool),
                  torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.bool), list(g.rewards),
                  [""] * n_local, [""] * n_local)
        model_of = {b.sender: b.model_id for b in foreign}
        m.tokens[:n_local, :W], m.gen_logp[:n_local, :W], m.mask[:n_local, :W] = s.tokens, s.logp, s.mask
        m.truncated[:n_local], m.group[:n_local] = s.truncated, s.prompt_index
        for j, (i, sender, c) in enumerate(chosen):
            r, n = n_local + j, len(c.token_ids)
            m.tokens[r, :n] = torch.from_numpy(c.token_ids.astype(np.int64))
            m.gen_logp[r, :n] = torch.from_numpy(c.gen_logp.astype(np.float32))
            m.mask[r, :n] = True
            m.truncated[r], m.group[r], m.foreign[r] = c.truncated, i, True
            m.rewards.append(self.task.reward(prompts[i], self.policy.decode(c.token_ids.tolist())))
            m.senders.append(sender)
            m.model_ids.append(model_of.get(sender, ""))
        return m

    def train_mask(self, m: Mixed) -> Tensor:
        return m.mask & ~m.truncated[:, None] if self.cfg.mask_truncated else m.mask

    def rescore(self, m: Mixed, support_rows: Tensor | None = None) -> Tensor:
        """The one teacher-forced forward over every row at the round temperature (with grad).

        With ``support_rows`` [N] bool, the same forward's logits also give those rows' support
        statistics (security.rollout_filters.support_stats, detached) into ``m.support``: the
        logit check costs no second forward."""
        q = [self.policy.encode(p.text) for p in m.prompts]
        dev = self.device
        self.model.train()
        if support_rows is None or not bool(support_rows.any()):
            with autocast(dev, self.precision):
                return rescore(self.model, q, m.tokens.to(dev), self.train_mask(m).to(dev), m.group.to(dev),
                               self.cfg.temperature)
        tokens, mask = m.tokens.to(dev), self.train_mask(m).to(dev)
        N, L = tokens.shape
        p_ids, p_valid = _left_pad([q[int(i)] for i in m.group], dev)
        P = p_ids.shape[1]
        with autocast(dev, self.precision):
            # the checks read every real token (truncated rows too), the loss only the train mask
            logits = self.model.forward_cached(torch.cat([p_ids, tokens], 1),
                                               torch.cat([p_valid, m.mask.to(dev)], 1))[:, P - 1:P - 1 + L]
        lp = torch.log_softmax(logits.float() / self.cfg.temperature, -1).gather(2, tokens[..., None]).squeeze(2)
        rows = support_rows.to(dev).nonzero().squeeze(1)
        m.support_rows = support_rows.cpu()
        m.support = support_stats(logits[rows], tokens[rows], self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
        return lp * mask

    def train(self, g: Generation, foreign: list[RolloutBatch]) -> TrainStats:
        """Training groups (``mix``: mixed or per generator), one re-scoring forward, the content
        filters, then ``steps_per_round`` F-TIS (or baseline) optimizer steps (mu: the first at
        ratio 1, later ones clipped against the first pass's log-probs)."""
        t0 = time.perf_counter()
        cfg, dev = self.cfg, self.device
        if self.defense is not None:
            foreign = self.defense.admit(g.round, foreign)
        m = self.mix(g, foreign)
        lp = self.rescore(m, self.defense.support_rows(m) if self.defense is not None else None)
        dropped = torch.zeros(len(m.rewards), dtype=torch.bool, device=dev)
        for f in self.filters:
            dropped |= ~f(m, lp.detach()).to(dev) & m.foreign.to(dev)
        rejected_by: dict[str, int] = {}
        zeroed = torch.zeros_like(dropped)
        if self.defense is not None:
            bad, rejected_by = self.defense.check(g.round, m, lp.detach())
            dropped, zeroed = apply_rejections(dropped, bad.to(dev) & m.foreign.to(dev),
                                               self.defense.dcfg.reject_rule)
        tmask = self.train_mask(m).to(dev)
        B = len(g.prompts)
        slots = B * (cfg.completions_per_prompt + (0 if cfg.mode == "solo" else cfg.foreign_per_prompt))
        rewards, group, foreign_flag = torch.tensor(m.rewards, device=dev), m.group.to(dev), m.foreign.to(dev)
        rewards = rewards.masked_fill(zeroed, 0.0)       # the reward multiplier rule: reward x verdict
        gen_logp, old = m.gen_logp.to(dev), None
        for step in range(cfg.steps_per_round):
            if step:
                lp = self.rescore(m)
            res = ftis_loss(lp, gen_logp, tmask, rewards, group, foreign_flag,
                            FTISParams(cfg.mode, cfg.C, cfg.delta, cfg.kl_stat, cfg.g),
                            exclude=dropped, old_logp=old, scale_rewards=cfg.scale_rewards, agg=cfg.loss_agg,
                            n_slots=slots, eps_lo=cfg.epsilon, eps_hi=cfg.epsilon_high)
            if step == 0:
                old, first = lp.detach(), res
            self.opt.zero_grad()
            res.loss.loss.backward()
            self.opt.step()
        n_local = m.n_local
        fr = m.rewards[n_local:]
        st = first.stats
        used = (tmask.sum(1) * (~dropped).long()).cpu()
        foreign_tokens: dict[str, int] = {}
        for i in range(n_local, len(m.rewards)):
            foreign_tokens[m.senders[i]] = foreign_tokens.get(m.senders[i], 0) + int(used[i])
        return TrainStats(g.round, float(first.loss.loss.detach()), sum(g.rewards) / max(n_local, 1),
                          sum(fr) / len(fr) if fr else None, n_local, len(fr), len(set(m.senders[n_local:])),
                          st.filtered, st.filtered_frac, int((dropped | zeroed).sum()), st.weight_mean, st.truncated_frac,
                          st.kl_foreign_mean, int(tmask.sum()), time.perf_counter() - t0, rejected_by,
                          foreign_tokens, st.kl_seq_foreign_mean)
