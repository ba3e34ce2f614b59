"""CheckFree / CheckFree+ rules: rebuild a lost stage from its neighbours, with no checkpoint
(docs/pipeline.md, 'CheckFree recovery'). Pure torch (and models/optim.py's optimizer builder): no
transport, no node code.

Stage numbering: stage 0 holds data, embedding and head; transformer stages are 1..T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.optim import InnerConfig, build_optimizer

NORM_EPS = 1e-4
"""Added to each neighbour weight so two zero gradient norms still give the midpoint."""


class RecoveryError(RuntimeError):
    """A lost stage cannot be rebuilt by the rule asked for; the message says what to do."""


def neighbour_weight(grad_norm: float, power: float = 1.0) -> float:
    """w = |gn|^p + 1e-4 (P17): a neighbour that still moves counts more."""
    if not torch.isfinite(torch.tensor(float(grad_norm))):
        raise RecoveryError(f"neighbour gradient norm is {grad_norm}: recover from a replica or a checkpoint")
    return abs(float(grad_norm)) ** power + NORM_EPS


def average_neighbours(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], *,
                       left_norm: float, right_norm: float, left_iteration: int, right_iteration: int,
                       power: float = 1.0) -> dict[str, torch.Tensor]:
    """W_i = (wl*W[i-1] + wr*W[i+1]) / (wl + wr) per floating tensor; non-float buffers are copied
    from the left neighbour (P17). Both neighbours must describe the same completed iteration (P18);
    the result depends only on the inputs, so every replacement replica computes the same bits (P19)."""
    if left_iteration != right_iteration:
        raise RecoveryError(f"neighbours are at iterations {left_iteration} and {right_iteration}: wait until "
                            "both have completed the same iteration before averaging")
    if left.keys() != right.keys():
        missing = sorted(set(left) ^ set(right))
        raise RecoveryError(f"neighbour stages hold different tensors ({missing[:4]}): they are not the same "
                            "schema; recover from a replica or a checkpoint")
    wl, wr = neighbour_weight(left_norm, power), neighbour_weight(right_norm, power)
    out = {}
    for name in sorted(left):
        a, b = left[name], right[name]
        if a.shape != b.shape:
            raise RecoveryError(f"{name}: neighbour shapes {tuple(a.shape)} and {tuple(b.shape)} differ; "
                                "recover from a replica or a checkpoint")
        if a.is_floating_point():
            out[name] = ((wl * a.double() + wr * b.double()) / (wl + wr)).to(a.dtype)
        else:
            out[name] = a.clone()
    return out


@dataclass(frozen=True)
class Recovery:
    """How to rebuild a lost stage: `rule` and the stages to read (`sources`)."""

    rule: str      # replica | average | copy_partner | copy_neighbour | checkpoint | nearest | embed_copy
    sources: tuple[int, ...]
    warn: str = ""


def swap_partner(stage: int, n_transformer: int) -> int | None:
    """CheckFree+ partner of a transformer stage: 1<->2 and T-1<->T; None for the others."""
    t = n_transformer
    return {1: 2, 2: 1, t - 1: t, t: t - 1}.get(stage) if t >= 4 else None


def choose_recovery(stage: int, n_transformer: int, alive: set[int], *, replica_alive: bool = False,
                    plus: bool = False, allow_edge_copy: bool = False, has_checkpoint: bool = False) -> Recovery:
    """Which rule rebuilds `stage` given the stages with a live replica (`alive`); docs/pipeline.md, 'Which rule applies'."""
    t = n_transformer
    if not 0 <= stage <= t:
        raise RecoveryError(f"stage {stage} is not in 0..{t}")
    if plus and t < 4:
        raise RecoveryError(f"CheckFree+ needs at least 4 transformer stages, got {t}: turn checkfree_plus off")
    if replica_alive:
        return Recovery("replica", (stage,))                                           # P21
    if stage == 0:
        if 1 not in alive:
            raise RecoveryError("stage 0 and stage 1 are both lost: the embedding copy is gone; restart from a checkpoint")
        return Recovery("embed_copy", (1,))
    partner = swap_partner(stage, t)
    if plus and partner is not None and partner in alive:
        return Recovery("copy_partner", (partner,))                                    # P22
    left, right = stage - 1, stage + 1
    edge = stage in (1, t)
    if not edge and left in alive and right in alive:
        return Recovery("average", (left, right))
    neighbour = 2 if stage == 1 else t - 1
    if edge and neighbour in alive:        # with CheckFree+ on, the neighbour is the partner: copied above
        if not allow_edge_copy:
            raise RecoveryError(f"stage {stage} is an edge stage: turn on checkfree_plus (swap partner copy) or "
                                "allow_edge_copy (copy the neighbour, a larger loss jump)")
        return Recovery("copy_neighbour", (neighbour,), warn=f"edge stage {stage} copied from stage {neighbour}")
    # a neighbour is lost too: never average with missing weights (P23)
    if has_checkpoint:
        return Recovery("checkpoint", ())
    lower = next((s for s in range(stage - 1, 0, -1) if s in alive), None)
    upper = next((s for s in range(stage + 1, t + 1) if s in alive), None)
    sources = tuple(s for s in (lower, upper) if s is not None)
    if not sources:
        raise RecoveryError("no transformer stage survives and no checkpoint is configured: restart the run")
    return Recovery("nearest", sources, warn=f"stage {stage} and a neighbour are lost: rebuilt from stages {sources}")


def checkfree_plus_order(mb_index: int, n_transformer: int) -> list[int]:
    """Transformer stage order for a microbatch under CheckFree+: odd microbatches swap (1,2) and
    (T-1,T), even ones run in order (P24); evaluation always runs in order."""
    t = n_transformer
    if t < 4:
        raise RecoveryError(f"CheckFree+ swaps need at least 4 transformer stages, got {t}")
    order = list(range(1, t + 1))
    if mb_index % 2:
        order[0], order[1] = order[1], order[0]
        order[-2], order[-1] = order[-1], order[-2]
    return order


def fresh_optimizer(params, optim: InnerConfig, lr_scale: float) -> torch.optim.AdamW:
    """The recovered stage's optimizer (P20): fresh AdamW state built from the run's own optimizer
    config `optim` (`stage.optim`: its betas, eps and weight decay, as every other stage steps),
    with lr = lr_scale * optim.lr, always from the configured LR so a second recovery does not
    compound. (The official code resets to AdamW's defaults; a run configured otherwise would then
    step its rebuilt stage with other hyperparameters than its neighbours.)"""
    return build_optimizer(params, optim.model_copy(update={"lr": lr_scale * optim.lr}))


# ---- ablations (copy, uniform average, random re-init; benchmarks/checkfree.py) --------------------------------------
# The baselines the gradient-norm average is measured against. Same contract as `average_neighbours`:
# pure functions of their inputs (every replacement replica computes the same bits), new tensors out,
# inputs untouched, non-float buffers copied.

ABLATIONS = ("copy", "uniform", "random")
"""Ablation rules, by the name the benchmark reports them under."""

INIT_STD = 0.02
"""Std of `random_reinit`'s matrices: the models' own initial std (models/llama.py INIT_STD)."""


def copy_neighbour(neighbour: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ablation "copy": the lost stage takes one neighbour's weights unchanged (a clone of every
    tensor). Which neighbour is the caller's choice (the benchmark copies stage i-1, or the only
    transformer neighbour of an edge stage)."""
    if not neighbour:
        raise RecoveryError("the neighbour sent no tensors: fetch its weights again or recover from a checkpoint")
    return {name: neighbour[name].clone() for name in sorted(neighbour)}


def uniform_average(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], *,
                    left_iteration: int, right_iteration: int) -> dict[str, torch.Tensor]:
    """Ablation "uniform": the plain midpoint (W[i-1] + W[i+1]) / 2, i.e. `average_neighbours` with
    equal weights; the same-iteration and schema checks apply (P18)."""
    return average_neighbours(left, right, left_norm=1.0, right_norm=1.0, left_iteration=left_iteration,
                              right_iteration=right_iteration)


def random_reinit(template: dict[str, torch.Tensor], seed: int, std: float = INIT_STD) -> dict[str, torch.Tensor]:
    """Ablation "random": fresh weights shaped like `template` (any stage's state, e.g. a neighbour's;
    its values are not used). Floating tensors of >= 2 dims ~ N(0, std^2), each from its own generator
    seeded by (seed, name), so the result depends only on (seed, names, shapes); 1-dim floating
    tensors (RMSNorm gains) are ones, as at initialisation; non-float buffers are copied."""
    import hashlib  # here, not at the top: this block is appended without touching the module head

    out = {}
    for name in sorted(template):
        t = template[name]
        if not t.is_floating_point():
            out[name] = t.clone()
        elif t.dim() < 2:
            out[name] = torch.ones_like(t)
        else:
            digest = hashlib.sha256(f"checkfree-random:{int(seed)}:{name}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            out[name] = (torch.randn(t.shape, generator=gen, dtype=torch.float32) * std).to(t.dtype)
    return out


def shift_layers(state: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """`state` with every block renamed ``...layers.{i}.`` -> ``...layers.{i + offset}.`` (same tensors).

    Stage state dicts carry whole-model block names (models/llama.py), so a neighbour's blocks must be
    renamed to the lost stage's indices before averaging or copying: for stage i rebuilt from stage j,
    offset = first block of i - first block of j. Other names (no ``layers.`` prefix) are kept."""
    out = {}
    for name, t in state.items():
        parts = name.split(".")
        for j in range(len(parts) - 1):
            if parts[j] == "layers" and parts[j + 1].isdigit():
                idx = int(parts[j + 1]) + offset
                if idx < 0:
                    raise RecoveryError(f"{name} shifted by {offset} gives block {idx}: the stages' layer ranges "
                                        "do not match; recover from a replica or a checkpoint")
                parts[j + 1] = str(idx)
                name = ".".join(parts)
                break
        out[name] = t
    return out
