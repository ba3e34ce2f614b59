"""What one stage node trains and what its state depends on: settings, cfg hash, module + optimizer.

Owns the stage role's settings model (the config sections it reads), the cfg hash (what a stage's
weights depend on: nodes whose hashes differ never share state), the checkpoint format name, and
`build_parts`: one stage's module, AdamW and LR schedule, built the same way for a node started
with `stage.index` and for a CheckFree replacement before it loads the rebuilt weights
(pipeline/replacement.py). Torch and models/ only: no transport, no node code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from models.config import DataConfig, ModelConfig
from models.optim import build_optimizer, inner_lr_scheduler
from models.stages import build_stage, resolve_stage0_layers
from pipeline.config import ScheduleConfig, StageConfig

CHECKPOINT_FORMAT = "swarmnode-stage-v1"
"""The stage role's checkpoint file format (node/checkpoint.py); bump it when the parts change."""


class StageSettings(BaseModel):
    """The sections the stage role reads: ``[stage]``, ``[schedule]``, ``[model]``, ``[data]``."""

    model_config = ConfigDict(extra="forbid")
    stage: StageConfig
    schedule: ScheduleConfig
    model: ModelConfig
    data: DataConfig


def activation_bytes(s: StageSettings) -> int:
    """Bytes of one microbatch's activation (fp32) between two stages: what the planner prices."""
    return s.data.batch_size * s.data.seq_len * s.model.d_model * 4


def stage0_layers(s: StageSettings) -> int:
    """Blocks stage 0 holds in this run: `stage.stage0_layers`, or a stage's worth when unset."""
    return resolve_stage0_layers(s.model.n_layers, s.schedule.stages, s.stage.stage0_layers)


def stage_cfg_hash(s: StageSettings) -> str:
    """What a stage's weights depend on: nodes whose hashes differ cannot share state."""
    body = f"{s.model.model_dump_json()}|{s.schedule.stages}|{s.stage.index}|{stage0_layers(s)}|{s.stage.seed}"
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def cfg_hash_of(s: StageSettings, index: int) -> str:
    """The cfg hash nodes of stage `index` publish (`stage_cfg_hash` with `stage.index = index`)."""
    return stage_cfg_hash(s.model_copy(update={"stage": s.stage.model_copy(update={"index": index})}))


def build_module(s: StageSettings, index: int) -> nn.Module:
    """Stage `index`'s module at the run's initial weights (`stage.seed`), on the current device."""
    return build_stage(s.model, s.stage.seed, index, s.schedule.stages, stage0_layers(s))


@dataclass
class StageParts:
    """One stage's trainable state before the executor takes it over (pipeline/stage_exec.py)."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler


def build_parts(s: StageSettings, index: int) -> StageParts:
    """Stage `index`'s module, its AdamW (`stage.optim`) and LR schedule at step 0."""
    module = build_module(s, index)
    opt = build_optimizer(module.parameters(), s.stage.optim)
    return StageParts(index, module, opt, inner_lr_scheduler(opt, s.stage.optim))


__all__ = ["CHECKPOINT_FORMAT", "StageParts", "StageSettings", "activation_bytes", "build_module", "build_parts",
           "cfg_hash_of", "stage0_layers", "stage_cfg_hash"]
