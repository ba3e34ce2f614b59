"""NoLoCo's engine: one worker's model, inner optimizer and outer state, with no network.

Owns what a NoLoCo (or DiLoCo) worker computes: the model, its inner AdamW and LR schedule,
the outer optimizer (phi, m: fp32, ``optimizers/noloco.py`` / ``diloco.py``), the data stream,
the step and round counters and the last good state (phi as served to joiners, m as a rollback
restores it). Does not own pairing, waiting, the exchange, node cards, metrics or checkpoint
files: the role (``optimizers/noloco_role.py``) decides when each operation runs and hands the
results to the swarm. Every method that touches a tensor runs on the role's compute thread.

    eng = NoLoCoEngine(cfg, model_cfg)
    eng.place(Placement(...))            # where to compute (default: all on the CPU)
    eng.load_data(data_cfg, shard, num_shards); eng.start_data(); eng.mark_good()
    loss = eng.inner_steps(cfg.inner_steps)
    sent = eng.outgoing()                # fp32 copies to average with the group
    res = eng.outer_step(mean, n, sent, rnd)   # step + check + good-state snapshot, or a rollback

Pure torch and ``models/``: placement comes in as plain torch objects (:class:`Placement`),
built by the role from the ``[device]`` section.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from models.config import DataConfig, ModelConfig
from models.corpus import Corpus, batches, eval_batches, evaluate, load_corpus
from models.hf_adapter import build_from_config
from models.optim import build_optimizer, inner_lr_scheduler, inner_step
from optimizers.config import NoLoCoConfig
from optimizers.noloco import make_outer
from optimizers.outer_codec import OuterCodec, Outgoing
from optimizers.outer_state import copy_into
from optimizers.robust import distance

__all__ = ["GoodState", "NoLoCoEngine", "OuterResult", "Placement"]

CPU = torch.device("cpu")

@dataclass(frozen=True)
class Placement:
    """Where the engine computes; the role builds it from ``[device]`` (``node/device.py``)."""

    device: torch.device = CPU
    """The model, its inner optimizer and every forward/backward pass."""
    outer_device: torch.device = CPU
    """phi and m (``noloco.outer_state_device``): the model's device, or the host."""
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """A fresh context for each forward pass (the configured precision)."""
    scaler: torch.amp.GradScaler | None = None
    """Loss scaling for fp16; None otherwise."""
    to_host: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None
    """Off the CPU: device->host copies into reusable (pinned) buffers, same keys, one buffer per
    key; the tensors to send are staged there."""


@dataclass(frozen=True)
class GoodState:
    """The state of the last good outer step (or of the start, a join or a resync)."""

    round: int
    phi: dict[str, Tensor]
    """Host fp32 copies of phi by parameter name: what joiners download, what a rollback restores."""
    m: list[Tensor] | None
    """Host copy of m after the last good outer step; None: a rollback zeroes m."""


@dataclass(frozen=True)
class OuterResult:
    norm: float
    """||phi_new - phi_before||: the update norm."""
    spread: float | None
    """RMS distance per parameter between the theta sent and the group mean; None when solo."""
    refused: str | None
    """None: the step was kept (round moved on, good state taken). Else why it was refused
    ("nonfinite", "out_of_bound (...)"): the engine is already back at the last good state."""


def _to(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``: the same object when already there, else one copy (asynchronous
    from pinned host memory)."""
    return tensor.to(device=device, non_blocking=tensor.is_pinned() if tensor.device.type == "cpu" else False)


class NoLoCoEngine:
    """One NoLoCo/DiLoCo worker's training state and the operations on it."""

    def __init__(self, cfg: NoLoCoConfig, model_cfg: ModelConfig, *, compute_delay_s: float = 0.0,
                 on_step: Callable[[float, int, float], None] | None = None,
                 should_stop: Callable[[], bool] = lambda: False):
        """``compute_delay_s``: extra sleep per inner step (emulates a slower accelerator).
        ``on_step(loss, tokens, seconds)`` after each inner step (metrics); ``should_stop()`` is
        asked before each inner step (a drain abandons the round)."""
        self.cfg, self.compute_delay_s = cfg, compute_delay_s
        self.on_step, self.should_stop = on_step, should_stop
        self.model = build_from_config(model_cfg, seed=cfg.seed)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        self.placement = Placement()
        self.step = 0
        self.round = 0
        self.round_start_step = 0  # theta == phi at this step (the last outer step, or the start)
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.outer = self._new_outer()
        self.opt, self.sched = self._new_inner(0)
        self.data: DataConfig | None = None
        self.corpus: Corpus | None = None
        self.shard = (0, 1)  # (this worker's shard, number of shards) of the training stream
        self.eval_set: list[tuple[Tensor, Tensor]] = []
        self.train_iter: Iterator[tuple[Tensor, Tensor]] | None = None  # built once the start step is known
        self.good: GoodState | None = None
        self._good_norm: float | None = None  # ||good.phi||, computed once per good state
        self._sent_at = 0  # the step at which outgoing() took theta
        self._sends = 0  # rounds staged for sending: picks the host buffer set off the CPU
        self.last_move = 0.0  # ||theta - phi|| when outgoing() took theta (the robust clip's own scale)
        self.last_origin: list[Tensor] | None = None  # phi then, on the host (the robust clip's direction)
        # compressed exchanges (``[noloco] compression``): the codec with this worker's error
        # feedback, and the payload outgoing() compressed for the round in flight
        self.codec = OuterCodec.from_config(cfg, self.names, [tuple(p.shape) for p in self.params])
        self.wire: Outgoing | None = None
        self.encode_s = 0.0  # seconds the last compression took (compute thread)

    # ---------------- set-up ----------------
    @property
    def device(self) -> torch.device:
        return self.placement.device

    def _new_outer(self):
        """The outer optimizer (phi, m: fp32) from the current parameters, on the outer device."""
        return make_outer([p.detach().to(self.placement.outer_device) for p in self.params], self.cfg)

    def _new_inner(self, start_step: int):
        """Fresh inner optimizer and LR schedule positioned at ``start_step``."""
        opt = build_optimizer(self.params, self.cfg.inner)
        return opt, inner_lr_scheduler(opt, self.cfg.inner, start_step=start_step)

    def place(self, placement: Placement) -> None:
        """Move the model, inner optimizer and outer state where ``placement`` says (before any
        training). On the CPU nothing moves."""
        self.placement = placement
        if placement.device.type != "cpu":
            self.model.to(placement.device)  # the Parameter objects stay the same: self.params is still valid
            self.opt, self.sched = self._new_inner(self.step)
            self.outer = self._new_outer()

    def specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Parameter name -> (fp32, shape): the tensors a phi download or an exchange carries."""
        return {n: (torch.float32, tuple(p.shape)) for n, p in zip(self.names, self.params)}

    def load_data(self, data: DataConfig, shard: int, num_shards: int) -> Corpus:
        """Read the corpus and build the evaluation set; training takes shard ``shard`` of
        ``num_shards`` of the stream (:meth:`start_data`)."""
        self.data, self.corpus = data, load_corpus(data)
        self.shard = (shard, num_shards)
        self.eval_set = eval_batches(self.corpus.val, data.batch_size, data.seq_len, self.cfg.eval_batches)
        return self.corpus

    def start_data(self) -> None:
        """The training stream from the current step (a resumed or joined worker continues it)."""
        if self.corpus is None or self.data is None:
            raise RuntimeError("start_data() needs load_data() first: the corpus is not loaded")
        self.train_iter = batches(self.corpus.train, self.data.batch_size, self.data.seq_len, self.cfg.seed,
                                  shard=self.shard[0], num_shards=self.shard[1], start_step=self.step)

    def evaluate(self) -> float:
        """Mean loss over the evaluation set."""
        return evaluate(self.model, self.eval_set)

    # ---------------- training ----------------
    def inner_steps(self, n: int) -> float:
        """Up to ``n`` inner steps (fewer when ``should_stop()``); the last loss (nan: none)."""
        self.model.train()
        loss_val = float("nan")
        device = self.placement.device
        for _ in range(n):
            if self.should_stop():  # drain: stop after this step, abandon the round
                break
            t0 = time.perf_counter()
            batch = next(self.train_iter)
            if device.type != "cpu":
                batch = (_to(batch[0], device), _to(batch[1], device))
            loss_val = inner_step(self.model, batch, self.opt, self.sched, self.params, self.cfg.inner.clip_norm,
                                  autocast=self.placement.autocast(), scaler=self.placement.scaler)
            if self.compute_delay_s:
                time.sleep(self.compute_delay_s)
            if self.first_loss is None:
                self.first_loss = loss_val
            self.last_loss = loss_val
            self.step += 1
            if self.on_step is not None:
                self.on_step(loss_val, batch[0].numel(), time.perf_counter() - t0)
        return loss_val

    def outgoing(self) -> list[Tensor]:
        """The fp32 tensors to send this round (theta, then phi when consensus is untied); inner
        steps taken after this call are kept on top of the next outer step. CPU: the outer
        optimizer's fresh copies. Off the CPU: one device->host copy per tensor into this round
        parity's host buffers (two sets, so a late send of round r never sees round r+1's bytes),
        which are also the host theta a host-side outer state steps with."""
        self._sent_at = self.step
        theta = [p.detach() for p in self.params]
        if self.cfg.robust != "off":
            with torch.no_grad():
                self.last_move = distance(theta, [_to(f, t.device) for f, t in zip(self.outer.phi, theta)])
                # phi does not change until this round's outer step, after the exchange
                self.last_origin = [f.detach().to("cpu", torch.float32) for f in self.outer.phi]
        if self.placement.device.type == "cpu":
            return self._compress(self.outer.exchange_tensors(theta))
        slot = self._sends % 2  # alternates every round, whatever the round label or a rollback does
        self._sends += 1
        named = {f"{slot}.theta.{n}": t for n, t in zip(self.names, theta)}
        if self.cfg.exchanges_phi:
            named.update({f"{slot}.phi.{n}": t for n, t in zip(self.names, self.outer.phi)})
        return self._compress(list(self.placement.to_host({k: v.to(torch.float32) for k, v in named.items()}).values()))

    def _compress(self, tensors: list[Tensor]) -> list[Tensor]:
        """With compression on, compress this round's payload (``self.wire``) from ``tensors``."""
        if self.codec is not None:
            t0 = time.perf_counter()
            self.wire = self.codec.encode(tensors[:len(self.params)], self.outer.phi)
            self.encode_s = time.perf_counter() - t0
        return tensors

    def outer_step(self, mean: Sequence[Tensor] | None, n: int, sent: Sequence[Tensor], rnd: int) -> OuterResult:
        """The outer step of round label ``rnd`` with the group ``mean`` of ``n`` members (None or
        ``n`` 1: solo), ``sent`` being what :meth:`outgoing` returned. Then the check: phi must be
        finite and ``||phi_new - phi_before|| <= max_update_ratio * ||phi_good||``. A good step
        moves the round to ``rnd + 1`` and becomes the good state; a bad one is rolled back
        (:meth:`rollback`) before this returns."""
        if self.codec is not None and self.wire is not None and mean is not None and n > 1:
            self.codec.commit(self.wire)  # delivered: what it did not carry goes with the next round
        norm, spread = self._step(mean, n, sent)
        why = self._problem(norm)
        if why is not None:
            self.rollback()
            return OuterResult(norm, spread, why)
        self.round = rnd + 1
        self.round_start_step = self._sent_at  # theta == phi there (steps overlapped with the exchange came after)
        self._keep_good([m.detach().to(device="cpu", dtype=torch.float32, copy=True) for m in self.outer.m])
        return OuterResult(norm, spread, None)

    def _step(self, mean: Sequence[Tensor] | None, n: int, sent: Sequence[Tensor]) -> tuple[float, float | None]:
        """The outer step itself -> (update norm, replica spread or None when solo). When inner
        steps ran after ``sent`` was taken (the exchange overlapped them), the outer step takes
        theta from ``sent`` and the params become phi_new + (params - theta_sent)."""
        theta_bar = phi_bar = spread = None
        od, k = self.placement.outer_device, len(self.params)
        with torch.no_grad():
            if self.step > self._sent_at:
                theta = [_to(t, od) for t in sent[:k]]
                progress = [p.detach().to(torch.float32) - _to(t, p.device) for p, t in zip(self.params, sent[:k])]
            else:
                theta = [p.detach() for p in self.params] if od == self.placement.device else list(sent[:k])
                progress = None
            if mean is not None and n > 1:  # the exchange hands out only verified, finite means
                theta_bar, phi_bar = self.outer.split_means([_to(t, od) for t in mean])
                spread = float(torch.sqrt(sum(((t.to(torch.float32) - tb) ** 2).sum() for t, tb in
                                              zip(theta, theta_bar)) / sum(p.numel() for p in self.params)))
            else:
                n = 1
            before = [p.clone() for p in self.outer.phi]
            phi = self.outer.outer_step(theta, theta_bar, phi_bar, n=n)
            copy_into(self.params, phi)  # theta <- phi (host -> device when the outer state is on the host)
            if progress is not None:
                for p, d in zip(self.params, progress):
                    p.add_(d.to(p.dtype))
            return float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(phi, before)))), spread

    def _problem(self, norm: float) -> str | None:
        """None if the outer step just taken is good, else why not."""
        if not math.isfinite(norm):
            return "nonfinite"
        if self.good is not None:
            if self._good_norm is None:
                self._good_norm = math.sqrt(sum(float(torch.dot(t.reshape(-1).double(), t.reshape(-1).double()))
                                                for t in self.good.phi.values()))
            ref, ratio = self._good_norm, self.cfg.max_update_ratio
            if norm > ratio * max(ref, 1e-12):
                return f"out_of_bound (update norm {norm:.4g} > {ratio:g} x ||phi|| {ref:.4g})"
        return None

    # ---------------- good state ----------------
    def _keep_good(self, m: list[Tensor] | None) -> None:
        # host copies (one device->host copy on a GPU, one clone on the CPU): a download in
        # flight keeps encoding the previous state's tensors, never these
        phi = {n: t.detach().to(device="cpu", dtype=torch.float32, copy=True)
               for n, t in zip(self.names, self.outer.phi)}
        self.good = GoodState(self.round, phi, m)
        self._good_norm = None

    def mark_good(self) -> None:
        """The current phi and round become the good state (training starts; m as kept so far)."""
        self._keep_good(None if self.good is None else self.good.m)

    def rollback(self) -> None:
        """Back to the last good state: phi from it, m from its host copy (zeros before the first
        good step), theta = phi, and a fresh inner optimizer at the current step (its moments may
        hold the same poison)."""
        good = self.good
        with torch.no_grad():
            if good is not None:
                for dst, name in zip(self.outer.phi, self.names):
                    dst.copy_(good.phi[name])
            for i, dst in enumerate(self.outer.m):
                if good is not None and good.m is not None:
                    dst.copy_(good.m[i])
                else:
                    dst.zero_()
            copy_into(self.params, self.outer.phi)
        self.opt, self.sched = self._new_inner(self.step)
        self.round_start_step = self.step
        if self.codec is not None:
            self.codec.reset()  # the residual may hold the same poison

    def adopt(self, rnd: int, phi: Sequence[Tensor]) -> None:
        """Take a peer's phi and round (a joiner, or a recovery download): fresh Adam state and
        m = 0, the step at the round's start; this is the good state now."""
        with torch.no_grad():
            copy_into(self.params, phi)  # host tensors -> the device, one copy each
        self.outer = self._new_outer()
        self.round = rnd
        self.step = rnd * self.cfg.inner_steps
        self.opt, self.sched = self._new_inner(self.step)
        self.round_start_step = self.step
        if self.codec is not None:
            self.codec.reset()  # unsent progress of a state we no longer hold
        self._keep_good(None)

    def resync(self, rnd: int, phi: Sequence[Tensor]) -> None:
        """DiLoCo after a missed global round: take a peer's phi and round; the Adam state, m and
        the step stay local."""
        with torch.no_grad():
            self.outer.set_phi(phi)
            copy_into(self.params, self.outer.phi)
        if self.codec is not None:
            self.codec.reset()
        self.round = rnd
        self.mark_good()

    # ---------------- checkpoints ----------------
    def parts(self) -> dict:
        """The objects a checkpoint saves and loads (``state_dict`` / ``load_state_dict``)."""
        return {"model": self.model, "outer": self.outer, "inner_optimizer": self.opt, "scheduler": self.sched}

    def restore(self, step: int, rnd: int) -> None:
        """After a checkpoint's :meth:`parts` were loaded: continue at ``step`` and round ``rnd``
        (theta == phi there: checkpoints are taken at an outer step)."""
        self.step = self.round_start_step = step
        self.round = rnd

    def rewind(self) -> None:
        """Before a final checkpoint: an abandoned round goes back to its last outer step (theta = phi)."""
        if self.step != self.round_start_step:
            with torch.no_grad():
                copy_into(self.params, self.outer.phi)
            self.step = self.round_start_step
