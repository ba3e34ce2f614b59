"""A stage node's own forward time: the `w[x]` the SkipPipe scheduler plans with (docs/pipeline.md, 'Terms').

Owns `measure_forward_s`: the fastest of a few timed forward passes of one microbatch through
this node's stage (stage 0: embedding, its own blocks and the head), after a warm-up, on the
configured device and precision. The role adds `stage.compute_delay_s` and publishes the sum as
`compute_ms` on its card; the coordinator takes it as the node's forward time (backward 1.5x,
loss 0.25x, as in the simulator). Torch only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from models.config import ModelConfig
from models.stages import Stage0


def measure_forward_s(module: nn.Module, batch: int, seq: int, cfg: ModelConfig, device: torch.device,
                      autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                      reps: int = 3) -> float:
    """Seconds of one microbatch's forward through `module` (min over `reps`, after a warm-up)."""
    if isinstance(module, Stage0):
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)

        def run() -> None:
            module.head_forward(module.embed_forward(tokens))
    else:
        x = torch.zeros(batch, seq, cfg.d_model, device=device)

        def run() -> None:
            module(x)
    best = float("inf")
    with torch.no_grad():
        for i in range(reps + 1):
            t0 = time.perf_counter()
            with autocast():
                run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i > 0:                      # the first pass is the warm-up
                best = min(best, time.perf_counter() - t0)
    return best


__all__ = ["measure_forward_s"]
