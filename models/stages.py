"""Pipeline stages cut from the LLaMA-style model, run stage by stage along a SkipPipe path.

Owns how the model is split for the `stage` role (docs/pipeline.md, 'Terms'): stage 0 holds the
embedding, `stage0_layers` leading blocks (None: a stage's worth, `stage0_share`), the final
norm, the head and the loss; stages 1..T hold the remaining blocks in equal contiguous ranges. It also owns `run_order` (the whole
model with its blocks taken in a given order: the single-process reference) and
`run_path_stagewise` (one microbatch forward and backward stage by stage, with activations and
gradients passed explicitly as tensors, exactly what the stage role does over the network).
Knows nothing of the network, schedules or optimizers; models/llama.py stays the architecture.

A path is the schedule's stage sequence, starting with 0 (`(0, 2, 1, 3)`: embed at stage 0,
then stages 2, 1, 3, then back to stage 0 for norm, head and loss). Parameter names are the
whole model's, so a stage's gradients compare name by name with the whole model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.config import ModelConfig
from models.llama import Llama, build_model, lm_loss, rope_tables


def stage0_share(n_layers: int, n_stages: int) -> int:
    """A stage's worth of blocks for stage 0: n_layers // n_stages, the model cut into n_stages
    equal parts as the SkipPipe code does (its `LLamaFirstStage` holds the embedding and as many
    blocks as every other stage: 24 blocks, 6 stages -> 4 each). 0 when the model has fewer blocks
    than stages."""
    return n_layers // n_stages


def resolve_stage0_layers(n_layers: int, n_stages: int, stage0_layers: int | None) -> int:
    """`stage0_layers` as configured, or `stage0_share` when it is None (the `[stage]` default)."""
    return stage0_share(n_layers, n_stages) if stage0_layers is None else stage0_layers


def stage_layer_ranges(n_layers: int, n_stages: int, stage0_layers: int | None = 0
                       ) -> list[tuple[int, int]]:
    """Block ranges [start, end) per stage: stage 0 gets the first `stage0_layers` blocks (None: a
    stage's worth, `stage0_share`), the other n_stages - 1 stages split the rest contiguously
    (earlier stages take the remainder)."""
    stage0_layers = resolve_stage0_layers(n_layers, n_stages, stage0_layers)
    t = n_stages - 1
    rest = n_layers - stage0_layers
    if t < 1 or stage0_layers < 0 or rest < t:
        raise ValueError(f"cannot cut {n_layers} blocks into stage 0 ({stage0_layers} blocks) + "
                         f"{t} transformer stages of >= 1 block; raise model.n_layers or use "
                         "fewer stages")
    ranges, start = [(0, stage0_layers)], stage0_layers
    for i in range(t):
        size = rest // t + (1 if i < rest % t else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def check_hidden(x: Tensor, cfg: ModelConfig) -> None:
    """Raise ValueError unless x is hidden states [B, T, d_model] with 1 <= T <= max_seq_len."""
    if x.dim() != 3 or x.shape[-1] != cfg.d_model or not 1 <= x.shape[1] <= cfg.max_seq_len \
            or not x.is_floating_point():
        raise ValueError(f"expected hidden states [batch, seq <= {cfg.max_seq_len}, "
                         f"{cfg.d_model}] (float), got {tuple(x.shape)} {x.dtype}; the sender "
                         "runs a different model config or stage split")


class Stage0(nn.Module):
    """The originator's stage: embedding (+ leading blocks) out, norm + head + loss on return."""

    def __init__(self, cfg: ModelConfig, seed: int, stage0_layers: int = 0):
        """`stage0_layers`: the resolved count (an int; see `resolve_stage0_layers`)."""
        super().__init__()
        self.cfg = cfg
        self.core = build_model(cfg, seed, layers=(0, stage0_layers), embed=True, head=True)

    def embed_forward(self, tokens: Tensor) -> Tensor:
        """Token ids [B, T] -> hidden states after the embedding and stage 0's own blocks."""
        h = self.core.embed(tokens)
        cos, sin = rope_tables(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device)
        for block in self.core.layers.values():
            h = block(h, cos, sin)
        return h

    def head_forward(self, h: Tensor) -> Tensor:
        """Hidden states back from the last hop -> logits [B, T, vocab]."""
        check_hidden(h, self.cfg)
        return self.core.head(self.core.norm(h))


class TransformerStage(nn.Module):
    """Stage s >= 1: a contiguous range of blocks, hidden states in and out."""

    def __init__(self, cfg: ModelConfig, seed: int, layers: tuple[int, int]):
        super().__init__()
        self.cfg = cfg
        self.core = build_model(cfg, seed, layers=layers, embed=False, head=False)

    def forward(self, x: Tensor) -> Tensor:
        check_hidden(x, self.cfg)
        return self.core(x)


def build_stage(cfg: ModelConfig, seed: int, stage: int, n_stages: int,
                stage0_layers: int | None = 0) -> nn.Module:
    """The module one `stage` node holds: Stage0 for stage 0, else TransformerStage."""
    ranges = stage_layer_ranges(cfg.n_layers, n_stages, stage0_layers)
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is not in [0, {n_stages})")
    if stage == 0:
        return Stage0(cfg, seed, ranges[0][1])
    return TransformerStage(cfg, seed, ranges[stage])


@dataclass
class StageSet:
    """All stages of one model in one process (tests, benchmarks, single-process references)."""

    cfg: ModelConfig
    stages: list[nn.Module]
    ranges: list[tuple[int, int]]

    @classmethod
    def build(cls, cfg: ModelConfig, seed: int, n_stages: int, stage0_layers: int | None = 0
              ) -> "StageSet":
        ranges = stage_layer_ranges(cfg.n_layers, n_stages, stage0_layers)
        return cls(cfg, [build_stage(cfg, seed, s, n_stages, stage0_layers)
                         for s in range(n_stages)], ranges)

    def block_order(self, path: tuple[int, ...] | list[int]) -> list[int]:
        """Whole-model block indices a microbatch with `path` runs, in order."""
        return block_order(self.ranges, path)

    def grads(self, stage: int) -> dict[str, Tensor]:
        """Accumulated gradient of each parameter of `stage`, by whole-model name."""
        return {name: p.grad for name, p in self.stages[stage].core.named_parameters()
                if p.grad is not None}

    @torch.no_grad()
    def logits(self, tokens: Tensor, path) -> Tensor:
        """Inference along `path` (no graph): the full in-order path for validation, or a
        path with stages dropped for the skipped-inference perplexity figures."""
        check_path(path, len(self.stages))
        h = self.stages[0].embed_forward(tokens)
        for s in path[1:]:
            h = self.stages[s](h)
        return self.stages[0].head_forward(h)

    def zero_grad(self) -> None:
        for m in self.stages:
            m.zero_grad(set_to_none=True)


def block_order(ranges: list[tuple[int, int]], path: tuple[int, ...] | list[int]) -> list[int]:
    """Whole-model block indices a microbatch with stage sequence `path` runs, in order, for the
    split `ranges` (`stage_layer_ranges`): stage 0's blocks first, on every path."""
    check_path(path, len(ranges))
    order = list(range(*ranges[0]))
    for s in path[1:]:
        order.extend(range(*ranges[s]))
    return order


def check_path(path, n_stages: int) -> None:
    path = list(path)
    if not path or path[0] != 0 or len(set(path)) != len(path) \
            or any(not 0 <= s < n_stages for s in path):
        raise ValueError(f"path {path} must start at stage 0 and visit distinct stages in "
                         f"[1, {n_stages}) after it")


def run_path_stagewise(stages: StageSet, tokens: Tensor, targets: Tensor, path,
                       loss_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """One microbatch forward then backward along `path`, every hop its own autograd graph
    (inputs detached, gradients handed back explicitly, as over the network). Gradients
    accumulate into each stage's parameters; the loss is scaled by `loss_scale` before
    backward (e.g. 1 / microbatches). Returns (logits, unscaled loss), both detached."""
    check_path(path, len(stages.stages))
    stage0 = stages.stages[0]
    h_out = stage0.embed_forward(tokens)                      # originator forward
    msg = h_out.detach()
    hops = []
    for s in path[1:]:                                        # Forward(hdr, x) -> next hop
        x = msg.requires_grad_()
        y = stages.stages[s](x)
        hops.append((x, y))
        msg = y.detach()
    h_in = msg.requires_grad_()                               # forward returns to originator
    logits = stage0.head_forward(h_in)
    loss = lm_loss(logits, targets)
    (loss * loss_scale).backward()
    grad = h_in.grad
    for x, y in reversed(hops):                               # Backward(g) -> exact predecessor
        y.backward(grad)
        grad = x.grad
    h_out.backward(grad)
    return logits.detach(), loss.detach()


def run_order(model: Llama, tokens: Tensor, block_order: list[int]) -> Tensor:
    """Whole model (embed and head present) with its blocks run in `block_order`, one graph:
    the single-process reference for a path. Returns logits."""
    if model.embed is None or model.head is None:
        raise ValueError("run_order needs a whole model (embed=True, head=True)")
    h = model.embed(tokens)
    cos, sin = rope_tables(tokens.shape[1], model.cfg.head_dim, model.cfg.rope_theta, h.device)
    for i in block_order:
        h = model.layers[str(i)](h, cos, sin)
    return model.head(model.norm(h))


__all__ = ["Stage0", "StageSet", "TransformerStage", "block_order", "build_stage", "check_hidden", "resolve_stage0_layers",
           "run_order", "run_path_stagewise", "stage0_share", "stage_layer_ranges"]
