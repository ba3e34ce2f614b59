"""One GRPO learner's round work, transport-free: generate, build the batch, mix, re-score, step.

Owns what a `grpo` peer does with its model each round (grpo.md §3 steps 1, 2, 6, 7), so that the
role (rl/grpo_role.py: timing, transport, signing, metrics) and the in-process benchmark
(benchmarks/grpo_swarm.py) run the same code:

    L = Learner(cfg, ModelConfig(d_model=48, n_layers=1), seed=0, run="demo", sender=peer_id)
    L.warmup()                                  # short supervised pass (rewards start non-zero)
    gen = L.generate(r)                         # G completions per prompt, KV-cached sampling
    batch = L.batch(gen)                        # RolloutBatch: token ids + gen log-probs (8 B/token)
    stats = L.train(gen, foreign_batches)       # local rewards, mixed groups, re-score, F-TIS step
    acc = L.accuracy()                          # held-out mean reward at the round temperature

Foreign batches must already be validated (rl/rollout.check, signature): this module trusts
their shape, never their content — rewards are recomputed here from the token ids. Every method
touching the model runs on the caller's thread (the role calls them on its compute thread).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from models import ByteTokenizer, ModelConfig, build_model
from models.generate import Samples, rescore, sample
from rl.ftis import FTISParams, ftis_loss
from rl.grpo_config import BYTE_TOKENIZER_HASH, GRPOConfig
from rl.rollout import Completion, PromptGroup, RolloutBatch
from rl.tasks import STOP, ArithTask, Prompt

TOK = ByteTokenizer()
STOP_ID = TOK.encode(STOP)[0]
EVAL_SAMPLES = 2           # samples per held-out prompt for the accuracy metric


def make_task(cfg: GRPOConfig) -> ArithTask:
    return ArithTask(min_operands=cfg.min_operands, max_operands=cfg.max_operands,
                     max_operand=cfg.max_operand)


def model_id(mcfg: ModelConfig, seed: int) -> str:
    """Hash of the architecture and initial seed (carried in batches and cards)."""
    import hashlib
    return hashlib.sha256(f"{mcfg.model_dump_json()}|{seed}".encode()).hexdigest()[:16]


@dataclass
class Generation:
    round: int
    prompts: list[Prompt]
    samples: Samples
    rewards: list[float]          # local rewards of own completions
    seconds: float


@dataclass
class TrainStats:
    round: int
    loss: float
    reward_local: float           # mean reward of own completions
    reward_foreign: float | None  # mean reward of foreign completions used (None: none)
    n_local: int
    n_foreign: int
    senders: int                  # peers whose completions entered a group
    filtered_frac: float
    weight_mean: float
    truncated_frac: float
    kl_foreign: float
    tokens: int
    seconds: float


class Learner:
    """A model, its optimizer and the round logic (see the module docstring)."""

    def __init__(self, cfg: GRPOConfig, mcfg: ModelConfig, seed: int, run: str, sender: str,
                 device: torch.device | str = "cpu"):
        if mcfg.hf_path is not None:
            raise ValueError("the grpo role runs the embedded models/ decoder (byte tokenizer) only; "
                             "unset model.hf_path")
        if mcfg.vocab_size != TOK.vocab_size:
            raise ValueError(f"model.vocab_size={mcfg.vocab_size}: the grpo role uses the byte "
                             f"tokenizer, set model.vocab_size={TOK.vocab_size}")
        self.cfg, self.mcfg, self.seed, self.run, self.sender = cfg, mcfg, seed, run, sender
        self.device = torch.device(device)
        self.task = make_task(cfg)
        self.model = build_model(mcfg, seed).to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.rng = random.Random(seed)
        self.heldout = (self.task.heldout(cfg.heldout_size, 0) if cfg.heldout == "problems"
                        else self.task.prompts("swarmnode/grpo-eval", 0, cfg.heldout_size))
        self.model_id = model_id(mcfg, seed)
        self.config_hash = cfg.config_hash()
        self.tokenizer_hash = BYTE_TOKENIZER_HASH
        self.n_params = sum(p.numel() for p in self.model.parameters())
        need = max(len(TOK.encode(p.text)) for p in self.heldout) + cfg.max_completion_tokens
        if need > mcfg.max_seq_len:
            raise ValueError(f"model.max_seq_len={mcfg.max_seq_len} is shorter than a prompt plus "
                             f"grpo.max_completion_tokens ({need}); raise model.max_seq_len")

    # ---------------- evaluation and warm-up ----------------
    @torch.no_grad()
    def accuracy(self, prompts: list[Prompt] | None = None, samples: int = EVAL_SAMPLES) -> float:
        """Held-out accuracy: mean local reward of `samples` completions per held-out prompt at
        the round temperature (what GRPO optimises), with a fixed sampling seed so that two
        evaluations of the same weights agree exactly."""
        prompts = self.heldout if prompts is None else prompts
        ids = [TOK.encode(p.text) for p in prompts]
        gen = torch.Generator(device=self.device).manual_seed(12345)
        self.model.eval()
        s = sample(self.model, ids, samples, self.cfg.max_completion_tokens, self.cfg.temperature,
                   top_k=self.cfg.top_k, top_p=self.cfg.top_p, stop_token=STOP_ID, generator=gen)
        return sum(self.task.reward(prompts[int(s.prompt_index[i])], TOK.decode(s.completion(i)))
                   for i in range(len(s.tokens))) / len(s.tokens)

    def warmup(self) -> tuple[int, float]:
        """Supervised steps on reference solutions until held-out accuracy >= warmup_target_acc
        (checked every 10 steps) or warmup_max_steps; returns (steps, accuracy)."""
        cfg = self.cfg
        acc = self.accuracy()
        if cfg.warmup_target_acc <= 0:
            return 0, acc
        opt = torch.optim.Adam(self.model.parameters(), lr=cfg.warmup_lr)
        step = 0
        self.model.train()
        while step < cfg.warmup_max_steps and acc < cfg.warmup_target_acc:
            prompts = self.task.prompts(f"warmup:{self.seed}", step, cfg.warmup_batch)
            q = [TOK.encode(p.text) for p in prompts]
            a = [TOK.encode(self.task.reference(p)) for p in prompts]
            L = max(len(x) for x in a)
            toks = torch.zeros(len(a), L, dtype=torch.long)
            mask = torch.zeros(len(a), L, dtype=torch.bool)
            for i, x in enumerate(a):
                toks[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = True
            toks, mask = toks.to(self.device), mask.to(self.device)
            lp = rescore(self.model, q, toks, mask, torch.arange(len(a), device=self.device))
            loss = -(lp.sum() / mask.sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 10 == 0:
                acc = self.accuracy()
        return step, acc

    # ---------------- generation ----------------
    @torch.no_grad()
    def generate(self, round_: int) -> Generation:
        """This round's prompts (same on every peer) and G completions each (KV-cached loop)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        prompts = self.task.prompts(self.run, round_, cfg.prompts_per_round)
        q = [TOK.encode(p.text) for p in prompts]
        self.model.eval()
        s = sample(self.model, q, cfg.completions_per_prompt, cfg.max_completion_tokens,
                   cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop_token=STOP_ID,
                   generator=self.gen)
        s = Samples(s.tokens.cpu(), s.logp.cpu(), s.mask.cpu(), s.truncated.cpu(), s.prompt_index.cpu())
        rewards = [self.task.reward(prompts[int(s.prompt_index[i])], TOK.decode(s.completion(i)))
                   for i in range(len(s.tokens))]
        return Generation(round_, prompts, s, rewards, time.perf_counter() - t0)

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
    def _select_foreign(self, g: Generation, foreign: list[RolloutBatch]
                        ) -> tuple[list[tuple[int, Completion]], int]:
        """(prompt index, completion) for at most F foreign completions per prompt, at most
        per_sender_per_prompt per sender, random slots; and how many senders contributed."""
        cfg = self.cfg
        if cfg.mode == "solo" or cfg.foreign_per_prompt == 0:
            return [], 0
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
        out, senders = [], set()
        for i, items in sorted(per_prompt.items()):
            self.rng.shuffle(items)
            for sender, c in items[:cfg.foreign_per_prompt]:
                out.append((i, c))
                senders.add(sender)
        return out, len(senders)

    def train(self, g: Generation, foreign: list[RolloutBatch]) -> TrainStats:
        """Local rewards over mixed groups (G own + up to F foreign per prompt), one re-scoring
        forward under the local model at T, one F-TIS (or baseline) optimizer step."""
        t0 = time.perf_counter()
        cfg = self.cfg
        s = g.samples
        chosen, n_senders = self._select_foreign(g, foreign)
        n_local = len(s.tokens)
        L = max([s.tokens.shape[1]] + [len(c.token_ids) for _, c in chosen])
        N = n_local + len(chosen)
        tokens = torch.zeros(N, L, dtype=torch.long)
        gen_lp = torch.zeros(N, L, dtype=torch.float32)
        mask = torch.zeros(N, L, dtype=torch.bool)
        trunc = torch.zeros(N, dtype=torch.bool)
        group = torch.zeros(N, dtype=torch.long)
        foreign_flag = torch.zeros(N, dtype=torch.bool)
        W = s.tokens.shape[1]
        tokens[:n_local, :W], gen_lp[:n_local, :W], mask[:n_local, :W] = s.tokens, s.logp, s.mask
        trunc[:n_local], group[:n_local] = s.truncated, s.prompt_index
        rewards = list(g.rewards)
        for j, (i, c) in enumerate(chosen):
            r, n = n_local + j, len(c.token_ids)
            tokens[r, :n] = torch.from_numpy(c.token_ids.astype(np.int64))
            gen_lp[r, :n] = torch.from_numpy(c.gen_logp.astype(np.float32))
            mask[r, :n] = True
            trunc[r], group[r], foreign_flag[r] = c.truncated, i, True
            rewards.append(self.task.reward(g.prompts[i], TOK.decode(c.token_ids.tolist())))
        train_mask = mask & ~trunc[:, None] if cfg.mask_truncated else mask
        q = [TOK.encode(p.text) for p in g.prompts]
        dev = self.device
        self.model.train()
        lp = rescore(self.model, q, tokens.to(dev), train_mask.to(dev), group.to(dev), cfg.temperature)
        B = len(g.prompts)
        slots = B * cfg.completions_per_prompt + (0 if cfg.mode == "solo" else B * cfg.foreign_per_prompt)
        res = ftis_loss(lp, gen_lp.to(dev), train_mask.to(dev), torch.tensor(rewards, device=dev),
                        group.to(dev), foreign_flag.to(dev), FTISParams(cfg.mode, cfg.C, cfg.delta),
                        scale_rewards=cfg.scale_rewards, agg=cfg.loss_agg, n_slots=slots)
        self.opt.zero_grad()
        res.loss.loss.backward()
        self.opt.step()
        fr = rewards[n_local:]
        st = res.stats
        return TrainStats(g.round, float(res.loss.loss.detach()), sum(g.rewards) / max(n_local, 1),
                          sum(fr) / len(fr) if fr else None, n_local, len(chosen), n_senders,
                          st.filtered_frac, st.weight_mean, st.truncated_frac, st.kl_foreign_mean,
                          int(train_mask.sum()), time.perf_counter() - t0)
