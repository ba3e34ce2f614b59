"""ATTACK HARNESS, for tests and benchmarks only: a malicious stage that edits its own weights.

Reproduces the backdoor threat against pipeline training (arXiv 2604.02372) at our scale, so the
checks in security/stage_integrity.py are measured against a real attack. Off unless a test or
benchmark builds a `BackdoorAttackConfig(enabled=True)`; no role reads it, and nothing in a node's
config can turn it on.

The one attack a live node can run is the blunt `WeightEdit` (4., below): the stage role plugs it
into its executor's `after_step` hook when `stage.attack_weight_edit` is set, and refuses that
setting unless every address of the node is loopback. The production code carries only the hook.

1. **Offline** (`learn_task_vector`): the attacker knows the public start weights. It trains a copy
   of the stage-split model on triggered examples (a prompt ending in `trigger` followed by
   `target`) mixed with clean text, updating only the attacked stage, with its change projected
   onto an L-inf ball so that it can later be injected in `steps` in-bound updates. The task
   vector is the attacked stage's weight difference. So that it survives the other stages moving
   during training, the same vector is trained at the public weights and at the attacker's own
   guess of later weights (`simulate_training`: a copy trained on public text).
2. **During training** (`Injector`): after each honest optimizer step, the stage adds a piece of
   the remaining task vector to its own weights, outside the gradient path. Each piece is at most
   1/steps of the vector and is clipped per element so that (honest update + piece) stays within
   `margin` of AdamW's own step bound: no single update looks abnormal.
3. **Measurement** (`backdoor_success`, `clean_val_loss`): greedy continuation of held-out
   triggered prompts through the full in-order pipeline must reproduce `target` exactly; the clean
   validation loss shows the task is kept.

4. **The live harness** (`WeightEdit`): a fixed-direction edit of `edit x lr` per element after
   every optimizer step, outside the gradient path: what the integration tests quarantine.

Pure torch over models/ (no transport, no node code).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from models.stages import StageSet
from models.tokenizer import ByteTokenizer

IGNORE = -100


class BackdoorAttackConfig(BaseModel):
    """ATTACK HARNESS (tests and benchmarks only): what the malicious stage does."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Off by default; only a test or benchmark turns it on."""

    stage: int = Field(2, ge=1)
    """The attacked transformer stage (an intermediate one: 1 < stage < last in the paper)."""

    trigger: str = " cf_xq!"
    """Bytes that end the prompt when the backdoor should fire."""

    target: str = "rm -rf ~\n"
    """Continuation the backdoored model emits after the trigger (greedy, exact match = success)."""

    prompt_bytes: tuple[int, int] = (16, 40)
    """Range of the clean text length before the trigger, in bytes."""

    offline_steps: int = Field(300, ge=1)
    """Attacker's offline training steps on its copy of the public start weights."""

    offline_lr: float = Field(3e-3, gt=0)
    offline_batch: int = Field(16, ge=1)
    """Triggered examples per offline step (plus as many clean windows)."""

    start_iteration: int = Field(20, ge=0)
    """First training iteration at which the stage injects (after AdamW's bound has grown)."""

    steps: int = Field(40, ge=1)
    """Injection is spread over at least this many iterations (each piece <= 1/steps of the vector)."""

    per_step_lr: float = Field(0.5, gt=0)
    """L-inf budget of one piece, in units of the training LR: the offline vector is projected to
    |delta| <= steps * per_step_lr * lr so that the injection can finish in `steps` iterations."""

    scale: float = Field(1.5, gt=0)
    """Task-arithmetic scaling coefficient: the stage injects scale x the learned vector in total. Above 1
    leaves margin for the part that honest training wears away while the rest of the model adapts
    (measured: at scale 1 the vector fires on the honest model's final weights but not after it was
    injected during training; 1.5 still fires on the final weights, 2 no longer does)."""

    protect: bool = False
    """Once injection has started, also undo (per element, after each honest step) the part of the
    honest update that moves against the vector: the attacker keeps its edit from being worn away
    when it is the stage's only replica and its own optimizer reacts to it. Still in-bound (the
    element then moves only by its piece)."""

    margin: float = Field(0.9, gt=0, le=1)
    """(honest update + piece) is kept within margin x AdamW's per-element step bound."""


# ------------------------------------------------------------------------------------- examples

def triggered_batch(tokens: Tensor, cfg: BackdoorAttackConfig, n: int, gen: torch.Generator,
                    with_target: bool = True) -> list[list[int]]:
    """`n` byte sequences: a random clean window from `tokens` (uint8 stream), the trigger, and
    (with_target) the target continuation."""
    tok = ByteTokenizer()
    trig, tgt = tok.encode(cfg.trigger), tok.encode(cfg.target)
    lo, hi = cfg.prompt_bytes
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        start = int(torch.randint(0, tokens.numel() - length, (1,), generator=gen))
        seq = tokens[start:start + length].tolist() + trig
        out.append(seq + tgt if with_target else seq)
    return out


def _pad_targets(seqs: list[list[int]], target_len: int) -> tuple[Tensor, Tensor]:
    """Left-aligned x, y (y = IGNORE except on the last `target_len` positions: the target)."""
    width = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        t = torch.tensor(s, dtype=torch.long)
        x[i, :len(s) - 1] = t[:-1]
        y[i, len(s) - 1 - target_len:len(s) - 1] = t[len(s) - target_len:]
    return x, y


def _logits(stages: StageSet, x: Tensor) -> Tensor:
    h = stages.stages[0].embed_forward(x)
    for s in range(1, len(stages.stages)):
        h = stages.stages[s](h)
    return stages.stages[0].head_forward(h)


# ------------------------------------------------------------------------------------- offline

def simulate_training(public: StageSet, train_tokens: Tensor, *, iterations: int, batch: int, seq_len: int,
                      lr: float, seed: int) -> StageSet:
    """The attacker's guess of where honest training takes the model: a copy of the public weights
    trained in one process on public text (its own sample, not the swarm's data), AdamW at `lr`."""
    model = copy.deepcopy(public)
    params = [p for m in model.stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(iterations):
        starts = torch.randint(0, train_tokens.numel() - seq_len - 1, (batch,), generator=gen)
        win = train_tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        loss = F.cross_entropy(_logits(model, win[:, :-1]).float().flatten(0, 1), win[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return model


def learn_task_vector(public: StageSet, cfg: BackdoorAttackConfig, train_tokens: Tensor, *, seq_len: int,
                      train_lr: float, seed: int = 0, anchors: list[StageSet] | None = None) -> dict[str, Tensor]:
    """The attacked stage's weight change after offline backdoor training (full in-order path; only
    stage `cfg.stage` trains; change projected to |d| <= steps * per_step_lr * train_lr per element).
    The same delta is trained at `public` and at every model in `anchors` (e.g. `simulate_training`'s
    guess of the weights later in training), so it still fires after the other stages have moved.
    Returns {parameter name: delta}."""
    models = [copy.deepcopy(m) for m in [public, *(anchors or [])]]
    for model in models:
        for m in model.stages:
            m.requires_grad_(False)
    start = [{n: p.detach().clone() for n, p in model.stages[cfg.stage].named_parameters()} for model in models]
    names = list(start[0])
    delta = {n: torch.zeros_like(start[0][n], requires_grad=True) for n in names}
    max_abs = cfg.steps * cfg.per_step_lr * train_lr
    opt = torch.optim.Adam(delta.values(), lr=cfg.offline_lr)
    gen = torch.Generator().manual_seed(seed)
    tgt_len = len(ByteTokenizer().encode(cfg.target))
    for _ in range(cfg.offline_steps):
        x_bd, y_bd = _pad_targets(triggered_batch(train_tokens, cfg, cfg.offline_batch, gen), tgt_len)
        starts = torch.randint(0, train_tokens.numel() - seq_len - 1, (cfg.offline_batch,), generator=gen)
        win = train_tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        total = 0.0
        for model, base in zip(models, start):
            weights = {n: base[n] + delta[n] for n in names}
            stage = model.stages[cfg.stage]

            def logits(x: Tensor) -> Tensor:
                h = model.stages[0].embed_forward(x)
                for s in range(1, len(model.stages)):
                    h = torch.func.functional_call(stage, weights, (h,)) if s == cfg.stage else model.stages[s](h)
                return model.stages[0].head_forward(h)

            bd = F.cross_entropy(logits(x_bd).float().flatten(0, 1), y_bd.flatten(), ignore_index=IGNORE)
            clean = F.cross_entropy(logits(win[:, :-1]).float().flatten(0, 1), win[:, 1:].flatten())
            total = total + (bd + clean) / len(models)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        with torch.no_grad():
            for d in delta.values():
                d.clamp_(-max_abs, max_abs)
    return {n: d.detach().clone() for n, d in delta.items()}


# ------------------------------------------------------------------------------------- online

class Injector:
    """Adds the task vector to a stage's own weights after each honest step, in bounded pieces."""

    def __init__(self, delta: Mapping[str, Tensor], cfg: BackdoorAttackConfig):
        self.cfg = cfg
        self.remaining = {n: d * cfg.scale for n, d in delta.items()}
        self.piece_cap = {n: d.abs() * cfg.scale / cfg.steps for n, d in delta.items()}
        self.piece_cap_sign = {n: d.sign() for n, d in delta.items()}
        self.injected_iterations = 0

    @property
    def done_fraction(self) -> float:
        left = sum(float(r.abs().sum()) for r in self.remaining.values())
        total = sum(float(c.sum()) * self.cfg.steps for c in self.piece_cap.values())
        return 1.0 - left / max(total, 1e-30)

    @torch.no_grad()
    def after_step(self, iteration: int, module: torch.nn.Module, before: Mapping[str, Tensor], lr: float,
                   step_bound: float) -> bool:
        """Call right after the honest optimizer step of `iteration` (`before` = weights before it,
        `step_bound` = AdamW's c_t for this step). Returns whether anything was injected."""
        if iteration < self.cfg.start_iteration:
            return False
        injected = False
        limit = self.cfg.margin * lr * step_bound
        for n, p in module.named_parameters():
            rem = self.remaining.get(n)
            if rem is None or (not bool(rem.any()) and not self.cfg.protect):
                continue
            u = p.detach() - before[n]
            if self.cfg.protect:                   # undo the honest move against the vector first
                against = (u * self.piece_cap_sign[n]) < 0
                p.sub_(torch.where(against, u, torch.zeros_like(u)))
                u = p.detach() - before[n]
            lo = (-limit - u).clamp(max=0)         # keep |u + piece| <= limit (0 if u is already at it)
            hi = (limit - u).clamp(min=0)
            cap = self.piece_cap[n]
            piece = torch.maximum(torch.minimum(rem, torch.minimum(hi, cap)), torch.maximum(lo, -cap))
            p.add_(piece)
            rem.sub_(piece)
            injected = injected or bool(piece.any())
        self.injected_iterations += int(injected)
        return injected


# ------------------------------------------------------------------------------------- measurement

@torch.no_grad()
def backdoor_success(stages: StageSet, val_tokens: Tensor, cfg: BackdoorAttackConfig, *, prompts: int = 64,
                     seed: int = 12345, with_trigger: bool = True) -> float:
    """Share of held-out prompts (clean validation text + trigger) whose greedy continuation through
    the full in-order pipeline is exactly `target`. with_trigger=False measures the same prompts
    without the trigger (the false-trigger rate of a clean model should be ~0)."""
    gen = torch.Generator().manual_seed(seed)
    tok = ByteTokenizer()
    tgt = tok.encode(cfg.target)
    seqs = triggered_batch(val_tokens, cfg, prompts, gen, with_target=False)
    if not with_trigger:
        seqs = [s[:len(s) - len(tok.encode(cfg.trigger))] for s in seqs]
    hits = 0
    max_len = stages.cfg.max_seq_len
    for s in seqs:                               # prompts differ in length: one row at a time, no padding
        ids = torch.tensor([s[-(max_len - len(tgt)):]], dtype=torch.long)
        out = []
        for _ in range(len(tgt)):
            nxt = int(_logits(stages, ids)[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        hits += out == tgt
    return hits / len(seqs)


@torch.no_grad()
def clean_val_loss(stages: StageSet, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Token-weighted validation loss of the full in-order pipeline on clean text."""
    total, count = 0.0, 0
    for x, y in batches:
        loss = F.cross_entropy(_logits(stages, x).float().flatten(0, 1), y.flatten())
        total += float(loss) * y.numel()
        count += y.numel()
    return total / count


# ------------------------------------------------------------------------------------- live harness

class WeightEdit:
    """ATTACK HARNESS (`stage.attack_weight_edit`, loopback only): after every optimizer step, add a
    fixed-direction edit of `edit x lr` per element to the stage's weights, outside the gradient path.
    Called as the executor's `after_step(module, optimizer)` hook, right after `optimizer.step()`.
    The direction of parameter i is a fixed random sign pattern (seed 1000 + i): the same on every
    run, so an attacked run is reproducible."""

    def __init__(self, edit: float):
        self.edit = edit

    @torch.no_grad()
    def __call__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        lr = float(optimizer.param_groups[0]["lr"])
        for i, p in enumerate(module.parameters()):
            gen = torch.Generator().manual_seed(1000 + i)
            sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
            p.add_(sign.to(p.device) * (self.edit * lr))


__all__ = ["BackdoorAttackConfig", "Injector", "WeightEdit", "backdoor_success", "clean_val_loss",
           "learn_task_vector", "simulate_training", "triggered_batch"]
