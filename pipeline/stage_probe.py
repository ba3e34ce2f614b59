"""The stage probe (docs/pipeline.md, 'Admission probes and stalls'): one forward of a small probe microbatch
over a stage node's real transport, asked by the coordinator before it plans with that node.

Owns both ends of the probe and nothing else:

- the stage node's side (`ProbeServer`): the `probe` channel of the node's tensor stream service
  (`TensorStream.Open`, the service its pipeline neighbours stream activations through). Each
  probe tensor is run through the node's own stage module on its compute thread (no gradient, no
  optimizer, no executor state: training is not touched) and the output goes back on the same
  stream. Probes are answered one at a time, at most one per `MIN_INTERVAL_S`, and only as long as
  `PROBE_TOKENS` x d_model: a peer cannot buy much compute with them;
- the coordinator's side (`probe_stage`): the probe input for a stage (stage 0: token ids
  [1, T]; a transformer stage: hidden states [1, T, d_model], seeded per probe), the call with a
  deadline, and the check of the answer: name, exact shape [1, T, d_model], float dtype, every
  value finite and not a copy of the input. It returns None when the node passed, else why not.

A node that only answers health checks, answers nothing, or answers with garbage fails. What a
probe cannot show is a node that computes probes but drops or delays real pipeline traffic; the
coordinator's stall watch (pipeline/stage_admission.py) re-probes and drops nodes when a planned
pipeline stops stepping, and the replica audits (pipeline/replica_audits.py) check the weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.stage_msgs import placeholder
from protocol.channels import ChannelPool
from protocol.streams import StreamError, TensorStream, open_stream

PROBE_CHANNEL = "probe"
PROBE_TOKENS = 8
"""Sequence length of a probe microbatch (batch 1): enough to run every layer, cheap on any node."""
MIN_INTERVAL_S = 0.2
"""A stage node answers at most one probe per this many seconds (over all callers)."""


@dataclass(frozen=True)
class ProbeSpec:
    """The model facts a probe needs (from the bootstrap's `[model]` / `[data]` sections)."""

    d_model: int
    vocab_size: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return max(1, min(PROBE_TOKENS, self.seq_len))

    def max_bytes(self) -> int:
        return 8 * self.tokens * max(self.d_model, 1) + 1024


def probe_input(spec: ProbeSpec, stage: int, seed: int) -> Tensor:
    """Stage 0: token ids [1, T]; stage s >= 1: hidden states [1, T, d_model] (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    if stage == 0:
        return torch.randint(0, spec.vocab_size, (1, spec.tokens), generator=gen, dtype=torch.int64)
    return torch.randn(1, spec.tokens, spec.d_model, generator=gen)


def check_output(spec: ProbeSpec, x: Tensor, name: str, y: Tensor) -> str | None:
    """None when `y` is a plausible forward of probe `x`, else what is wrong with it."""
    want = (1, spec.tokens, spec.d_model)
    if name != "probe_out":
        return f"answered {name[:40]!r} instead of probe_out"
    if tuple(y.shape) != want or not y.is_floating_point():
        return f"answered a {tuple(y.shape)} {y.dtype} tensor where hidden states {want} (float) were expected"
    if not bool(torch.isfinite(y).all()):
        return "answered non-finite hidden states"
    if x.is_floating_point() and torch.equal(y.float(), x.float()):
        return "echoed the probe input back instead of computing its stage"
    return None


async def probe_stage(pool: ChannelPool, *, run_id: str, me: str, peer_id: str, addr: str, stage: int,
                      spec: ProbeSpec, timeout_s: float, seed: int | None = None) -> str | None:
    """Probe `peer_id` at `addr` as a node of `stage`; None = passed, else why it failed."""
    seed = int(time.time_ns() & 0x7FFFFFFF) if seed is None else seed
    x = probe_input(spec, stage, seed)
    stream: TensorStream | None = None
    try:
        async with asyncio.timeout(timeout_s):
            stream = await open_stream(pool.get(addr, peer_id=peer_id), run_id=run_id, sender=me,
                                       channel_name=PROBE_CHANNEL, max_tensor_bytes=spec.max_bytes(),
                                       timeout=timeout_s)
            await stream.send("probe", x, {"stage": str(stage)}, timeout=timeout_s)
            got = await stream.recv(timeout=timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        return f"no answer to the stage probe within {timeout_s:g} s (schedule.probe_timeout_s)"
    except StreamError as exc:
        return f"the stage probe failed: {exc.reason}: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - any failure to answer is a failed probe
        return f"the stage probe failed: {exc!r}"[:300]
    finally:
        if stream is not None:
            stream.cancel()
    if got.name == "err":
        return f"refused the stage probe: {str(got.meta.get('detail', ''))[:200]}"
    return check_output(spec, x, got.name, got.tensor)


class ProbeServer:
    """A stage node's answers to probes: register `on_stream` on the node's tensor stream
    service under PROBE_CHANNEL. `module()` -> the stage module once built (None before);
    `run(fn, *args)` runs on the compute thread (the role's `Compute.run`)."""

    def __init__(self, module: Callable[[], nn.Module | None], run: Callable[..., Awaitable[Any]],
                 device: Callable[[], torch.device], autocast: Callable[[], Any]):
        self.module, self.run, self.device, self.autocast = module, run, device, autocast
        self._lock = asyncio.Lock()
        self._last = 0.0
        self.answered = 0

    def _forward(self, mod: nn.Module, x: Tensor) -> Tensor:
        dev = self.device()
        with torch.no_grad(), self.autocast():
            if x.dtype == torch.int64:
                y = mod.embed_forward(x.to(dev))
            else:
                y = mod(x.to(dev, torch.float32))
        return y.detach().to("cpu", torch.float32)

    async def on_stream(self, stream: TensorStream) -> None:
        async for r in stream:
            mod = self.module()
            x = r.tensor
            ok_shape = x.dim() == 2 if x.dtype == torch.int64 else (x.dim() == 3 and x.is_floating_point())
            if mod is None or r.name != "probe" or not ok_shape or x.shape[0] != 1 or x.shape[1] > PROBE_TOKENS:
                why = "not built yet" if mod is None else f"not a probe ({r.name[:20]!r}, {tuple(x.shape)})"
                await stream.send("err", placeholder(), {"reason": "probe", "detail": why}, timeout=5.0)
                continue
            async with self._lock:
                wait = self._last + MIN_INTERVAL_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    y = await self.run(self._forward, mod, x)
                except Exception as exc:  # noqa: BLE001 - a wrong input is answered, never a crash
                    await stream.send("err", placeholder(), {"reason": "probe", "detail": str(exc)[:200]},
                                      timeout=5.0)
                    continue
                finally:
                    self._last = time.monotonic()
            self.answered += 1
            await stream.send("probe_out", y, {}, timeout=5.0)


__all__ = ["MIN_INTERVAL_S", "PROBE_CHANNEL", "PROBE_TOKENS", "ProbeServer", "ProbeSpec", "check_output",
           "probe_input", "probe_stage"]
