"""The ``noloco`` role: a data-parallel worker trained with NoLoCo (or the DiLoCo baseline).

    swarmnode run --role noloco --initial-peers /ip4/…/p2p/12D3KooW… [--set noloco.inner_steps=50]

Glue only: the method is ``optimizers/noloco.py`` / ``diloco.py`` (pure torch), the transport
``optimizers/exchange.py`` (pairing through the DHT roster, exchange over our gRPC), the model
and data ``models/``; the role toolkit in ``node/``: checkpoints (``node/checkpoint.py``), the
joiner's state download (``node/state_sync.py``), the compute thread (``node/compute.py``) and
the shared training metrics (``node/metrics.py``).

Loop per round r: H inner Adam steps on the compute thread (the event loop stays free to serve
peers; every whole-model pass runs there) -> exchange theta with a random live partner (NoLoCo)
or everyone (DiLoCo) within ``round_timeout`` -> outer step (solo when no valid partner: never a
hang) -> theta <- phi -> card/metrics -> evaluation and an atomic checkpoint when due. NoLoCo
trains on while its exchange is in flight (``overlap_fraction``: the next round's first steps;
theta <- phi + the progress since the tensors were sent), so waiting for a partner costs little. A joiner downloads phi and the
round from a random READY peer and starts at that round with fresh Adam state and m = 0.

Devices (``node/device.py``, the ``[device]`` section): ``start()`` resolves the device on the
compute thread (the DHT is already up, so hivemind forked before any CUDA call), then moves the
model and inner optimizer there; the forward pass runs under the configured precision (autocast,
GradScaler for fp16). The outer state (phi, m) is fp32 on the device, or on the host with
``noloco.outer_state_device = "host"``. On a GPU the tensors to send are copied device->host into
reusable pinned buffers (two sets, by round parity, so a late send of round r never sees round
r+1's bytes); received means go host->device once. Snapshots served to joiners are host copies;
checkpoints and downloaded state are host tensors placed on the device by ``load_state_dict`` /
``copy_``. On the CPU every one of these is a no-op: the same tensors, the same copies as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import deque

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.config import DataConfig, ModelConfig
from models.corpus import batches, eval_batches, evaluate, load_corpus
from models.hf_adapter import build_from_config
from models.optim import build_optimizer, inner_lr_scheduler, inner_step
from node import metrics as NM
from node.card import card_int, frontier_card_int, peers, read_cards
from node.checkpoint import CheckpointError, Checkpointer
from node.compute import Compute
from node.device import PinnedPool, autocast, device_details, grad_scaler, outer_state_device, record_memory, \
    resolve_device, to_device
from node.logs import set_context
from node.metrics import TRANSFER_BYTES, count_rejection
from node.roles import NodeContext, RoleBase, register
from node.state_sync import StateFetchError, StateServicer, StateSnapshot, add_state_service, fetch_state, \
    meta_int, order_donors
from optimizers import noloco_metrics as M
from optimizers.config import NoLoCoConfig
from optimizers.exchange import ExchangeResult, OuterExchange, add_exchange_to_server
from optimizers.exchange_common import TensorBounds
from optimizers.noloco import copy_into, make_outer
from optimizers.roster import ROSTER
from optimizers.waiting import FINISHING, NEXT_EXCHANGE_AT, someone_can_meet, steps_to_wait, wait_bound

log = logging.getLogger("swarmnode.noloco")

JOIN_WAIT_S = 60.0
"""A starting worker waits at most this long for its DHT join before looking for a state donor."""
MAX_PAIR_TRIES = 4
"""Tries at pairing in one round (a try ends early when the peers move to a later round label:
the worker waits on there); the wait bound covers all of them together."""
WATCH_POLL_S = 0.25
"""Seconds between card reads while waiting for a partner (one DHT read per waiting worker)."""


class WorkerConfig(NoLoCoConfig):
    """``[noloco]``: the method knobs (optimizers/config.py) plus how this worker runs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    exit_after_steps: int = Field(0, ge=0)
    """Drain and exit 0 after this many inner steps (0 = train until stopped). The demo uses it."""

    data_shards: int = Field(16, ge=1)
    """The training stream is cut into this many IID shards; a worker picks one from its peer ID.
    Raise it above the worker count so that workers rarely share a shard."""

    torch_threads: int = Field(0, ge=0)
    """Intra-op threads for this worker's torch compute (0 = torch's default). Set 1 when several
    workers share one machine (the demo does)."""

    compute_delay_s: float = Field(0.0, ge=0)
    """Extra seconds slept per inner step, to emulate a slower accelerator in experiments."""

    join_from_peers: bool = True
    """A new worker in a run that already has trained rounds downloads a peer's state first
    (from the most advanced live peer)."""

    catch_up: bool = True
    """Before each exchange, adopt the highest round label among live peers' node cards, so a
    worker that fell behind (a solo round, slower hardware, a restart) meets the others again
    instead of waiting alone in an old round. Only the label moves: no inner steps are skipped.
    NoLoCo only (DiLoCo re-fetches phi and the round after a missed round). Turn it off only to
    study strictly lock-step round labels."""

    @model_validator(mode="after")
    def _supported_pairing(self) -> "WorkerConfig":
        if self.pairing != "seeded":
            raise ValueError(f"pairing={self.pairing!r} is not available in this version of the noloco role; "
                             "use pairing = \"seeded\" (the DHT roster + gRPC exchange)")
        if self.outer == "noloco" and self.group_size != 2:
            raise ValueError(f"group_size={self.group_size!r}: the noloco role averages in pairs only (the "
                             "paper's k = 2); use group_size = 2, or outer = \"diloco\" for a global average")
        return self


class RoleSettings(BaseModel):
    """The sections the noloco role reads: ``[noloco]``, ``[model]``, ``[data]``."""

    model_config = ConfigDict(extra="forbid")
    noloco: WorkerConfig
    model: ModelConfig
    data: DataConfig


CHECKPOINT_FORMAT = "swarmnode-noloco-v2"
CHECKPOINT_PARTS = ("model", "outer", "inner_optimizer", "scheduler")


def _param_names(model: torch.nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


@register
class NoLoCoRole(RoleBase):
    name = "noloco"
    Settings = RoleSettings
    rendezvous = (ROSTER,)

    def __init__(self, ctx: NodeContext, settings: RoleSettings):
        self.ctx, self.s, self.cfg = ctx, settings, settings.noloco
        self.cfg_hash = hashlib.sha256(
            f"{self.cfg.cfg_hash()}|{settings.model.model_dump_json()}".encode()).hexdigest()[:12]
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.model = build_from_config(settings.model, seed=self.cfg.seed)
        self.names = _param_names(self.model)
        self.params = [p for _, p in self.model.named_parameters()]
        # placement happens in start() (_place): until then everything is on the CPU, and no CUDA call
        self.device = self.outer_device = torch.device("cpu")
        self.precision, self.scaler, self.pool = "fp32", None, PinnedPool(pin=False)
        self._sends = 0  # rounds staged for sending: picks the pinned buffer set (GPU)
        self.outer = self._make_outer()
        log.info("outer %s: %s", self.cfg.outer, self.cfg.outer_momentum_note,
                 extra={"event": "outer_config", "outer_momentum": self.cfg.outer_momentum})
        ex_names = list(self.names) + ([f"phi.{n}" for n in self.names] if self.cfg.exchanges_phi else [])
        ex_specs = [(n, torch.float32, tuple(p.shape)) for n, p in
                    zip(ex_names, self.params * (2 if self.cfg.exchanges_phi else 1))]
        self.exchange = OuterExchange(
            run_id=ctx.config.run_id, peer_id=ctx.peer_id, cfg_hash=self.cfg_hash, grpc_addr=ctx.grpc_addr,
            dht=ctx.membership.dht, specs=ex_specs, netem=ctx.netem, max_round_skew=self.cfg.max_round_skew,
            max_message_bytes=ctx.config.grpc.max_message_bytes,
            on_reject=count_rejection,
            bounds=TensorBounds(self.cfg.max_norm_ratio, self.cfg.max_distance_ratio, self.cfg.bound_floor_rms))
        self.round = 0
        self.step = 0
        self._snapshot: StateSnapshot | None = None
        self._stopping = False
        self._round_task: asyncio.Task | None = None
        self._partners: deque[tuple[str, ...]] = deque(maxlen=21)
        self.compute = Compute(self.name)  # every whole-model pass runs on its one thread
        self.opt, self.sched = self._new_inner(0)
        self.train_iter = None  # built once the data is loaded and the start step is known
        self.checkpointer = Checkpointer(ctx.config.state_dir, CHECKPOINT_FORMAT, self.cfg_hash)
        self._round_start_step = 0  # inner step at the last outer step; theta == phi there
        self._first_loss: float | None = None
        self._last_loss: float | None = None
        self._rounds_ok = 0
        self._outer_steps = 0  # outer steps taken here (the round label can jump: catch_up)
        self._bad_rounds = 0  # outer steps rolled back in a row (checks/rollback region)
        self._good_m: list[torch.Tensor] | None = None  # host copy of m after the last good outer step
        self._good_norm: tuple[int, float] | None = None  # (id of the snapshot, ||phi|| in it)
        self._catch_up = self.cfg.catch_up and self.cfg.outer == "noloco"  # DiLoCo resyncs phi instead
        self._step_s: float | None = None  # measured seconds per inner step (moving average): the wait bound
        self._t_train0: float | None = None  # monotonic time training started (blocked fraction)
        self._blocked_s = 0.0  # seconds blocked in outer exchanges since training started
        self._eval_s = 0.0  # duration of the last evaluation (predicts when we next exchange)
        self.state_servicer = StateServicer(ctx.config.run_id, self.cfg_hash, lambda: self._snapshot, ctx.netem)

    def _parts(self) -> dict:
        return {"model": self.model, "outer": self.outer, "inner_optimizer": self.opt, "scheduler": self.sched}

    def services(self):
        return [(add_exchange_to_server, self.exchange.servicer(), "swarmnode.NoLoCo"),
                (add_state_service, self.state_servicer, "swarmnode.WeightService")]

    # ---------------- start-up ----------------
    async def start(self) -> None:
        await self.ctx.set_role_ready(False, "role_init", "loading data and building the model")
        # The DHT is up (Node.prepare forked hivemind): only now may CUDA be touched. Resolved on
        # the compute thread, which runs every CUDA call after it; a missing GPU raises ConfigError
        # here, so the node stops at start with the message (exit 2), never mid-training.
        self.ctx.card.update(**await self.compute.run(self._place))
        self.ctx.supervisor.spawn("noloco_train", self._main, restart=False)

    def _place(self) -> dict:
        """Resolve ``[device]`` and put the model, inner optimizer and outer state there (compute
        thread, before any training); returns the card details. On the CPU nothing moves."""
        dc = self.ctx.config.device
        self.device = resolve_device(dc)
        self.precision = dc.precision
        self.scaler = grad_scaler(self.device, self.precision)
        self.outer_device = outer_state_device(self.cfg.outer_state_device, self.device)
        self.pool = PinnedPool(pin=self.device.type == "cuda")
        if self.device.type != "cpu":
            self.model.to(self.device)  # the Parameter objects stay the same: self.params is still valid
            self.opt, self.sched = self._new_inner(self.step)
            self.outer = self._make_outer()
        details = device_details(self.device)
        record_memory(self.device)
        log.info("training on %s (%s, %s), outer state on %s", self.device, details["device_name"], self.precision,
                 self.outer_device, extra={"event": "device_ready", "device": str(self.device),
                                           "precision": self.precision, "outer_state_device": str(self.outer_device),
                                           **details})
        return details

    def _make_outer(self):
        """The outer optimizer (phi, m: fp32) from the current parameters, on ``outer_device``."""
        return make_outer([p.detach().to(self.outer_device) for p in self.params], self.cfg)

    def _setup_data(self) -> None:
        data = self.s.data
        corpus = load_corpus(data)
        shard = int(hashlib.sha256(self.ctx.peer_id.encode()).hexdigest(), 16) % self.cfg.data_shards
        self.shard = shard
        self._corpus = corpus
        self.eval_set = eval_batches(corpus.val, data.batch_size, data.seq_len, self.cfg.eval_batches)
        log.info("data ready: %s, %d train / %d val tokens, shard %d of %d", corpus.source, corpus.train.numel(),
                 corpus.val.numel(), shard, self.cfg.data_shards,
                 extra={"event": "data_ready", "train_tokens": int(corpus.train.numel()), "shard": shard})

    def _new_inner(self, start_step: int):
        """Fresh inner optimizer and LR schedule positioned at ``start_step``."""
        opt = build_optimizer(self.params, self.cfg.inner)
        return opt, inner_lr_scheduler(opt, self.cfg.inner, start_step=start_step)

    def _start_data(self, start_step: int) -> None:
        self.train_iter = batches(self._corpus.train, self.s.data.batch_size, self.s.data.seq_len, self.cfg.seed,
                                  shard=self.shard, num_shards=self.cfg.data_shards, start_step=start_step)

    async def _main(self) -> None:
        await self.compute.run(self._setup_data)
        resumed = False
        if self.ctx.config.resume:
            resumed = await self.compute.run(self._try_resume)
        if not resumed and self.cfg.join_from_peers:
            await self._try_join()
        self._start_data(self.step)
        await self._take_snapshot()
        eval0 = await self.compute.run(evaluate, self.model, self.eval_set)
        NM.EVAL_LOSS_INITIAL.set(eval0)
        NM.EVAL_LOSS.set(eval0)
        M.OUTER_ROUND.set(self.round)
        self.ctx.card.update(round=self.round, outer=self.cfg.outer, cfg_hash=self.cfg_hash)
        await self.ctx.set_role_ready(True, "ready", "")
        self._t_train0 = time.monotonic()
        log.info("training from round %d step %d (eval loss %.4f)", self.round, self.step, eval0,
                 extra={"event": "training_started", "round": self.round, "step": self.step, "eval_loss": eval0})
        while not self._stopping:
            self._round_task = asyncio.ensure_future(self._one_round())
            try:
                await asyncio.shield(self._round_task)
            except asyncio.CancelledError:
                if self._round_task is not None and not self._round_task.done():
                    self._round_task.cancel()
                raise
            if self.cfg.exit_after_steps and self.step >= self.cfg.exit_after_steps:
                self._stopping = True
                final_eval = await self.compute.run(evaluate, self.model, self.eval_set)
                NM.EVAL_LOSS.set(final_eval)
                log.info("reached %d inner steps (round %d, eval loss %.4f -> %.4f): draining", self.step,
                         self.round, eval0, final_eval,
                         extra={"event": "training_finished", "step": self.step, "round": self.round,
                                "eval_loss_start": eval0, "eval_loss_end": final_eval,
                                "train_loss_start": self._first_loss, "train_loss_end": self._last_loss,
                                "rounds_ok": self._rounds_ok, "outer_steps": self._outer_steps,
                                "blocked_s": round(self._blocked_s, 3), "train_s": round(self._train_s(), 3)})
                self.ctx.request_drain("finished")

    # ---------------- joining / resuming ----------------
    async def _fetch_from_donor(self, min_round: int) -> tuple[int, list[torch.Tensor], str] | None:
        """(round, phi, donor) from the most advanced READY worker of this run (round >= min_round)."""
        try:
            views = await read_cards(self.ctx.membership.dht, self.ctx.config.run_id)
        except Exception as exc:  # noqa: BLE001 - no view of the swarm: nothing to fetch
            log.warning("could not read node cards to find a state donor: %r", exc)
            return None
        donors = order_donors(views, role=self.name, cfg_hash=self.cfg_hash, exclude=self.ctx.peer_id,
                              min_progress=min_round,  # most advanced first, random among ties,
                              max_jump=self.cfg.max_round_jump)  # none past the robust frontier
        expected = {n: (torch.float32, tuple(p.shape)) for n, p in zip(self.names, self.params)}
        for donor in donors[:3]:
            addr = donor.card.grpc_addr
            try:
                meta, tensors = await fetch_state(addr, self.ctx.config.run_id, self.ctx.peer_id,
                                                  self.cfg_hash, expected, round=self.round,
                                                  max_message_bytes=self.ctx.config.grpc.max_message_bytes,
                                                  offload=self.compute.run, peer_id=donor.peer_id)
                rnd = meta_int(meta, "round", addr)
                claimed = card_int(donor, "round") or 0
                if not min_round <= rnd <= claimed + self.cfg.max_round_skew:
                    raise StateFetchError(f"{addr} served round {rnd}, but its card says {claimed} "
                                          f"(and we need >= {min_round}); not adopting it")
            except StateFetchError as exc:
                NM.STATE_DOWNLOADS.labels(outcome="failed").inc()
                log.warning("state download failed: %s", exc, extra={"event": "state_download_failed"})
                continue
            NM.STATE_DOWNLOADS.labels(outcome="ok").inc()
            return rnd, [tensors[n] for n in self.names], donor.peer_id
        return None

    async def _try_join(self) -> None:
        await self.ctx.set_role_ready(False, "state_sync", "looking for a peer with the run's current state")
        if not await self.ctx.membership.wait_joined(JOIN_WAIT_S):
            log.warning("not joined to the swarm after %.0f s: looking for a donor among the peers seen so far",
                        JOIN_WAIT_S, extra={"event": "join_wait_timeout"})
        got = await self._fetch_from_donor(min_round=1)
        if got is not None:
            rnd, phi, donor = got
            await self.compute.run(self._adopt_joined, rnd, phi)
            log.info("joined at round %d with state from %s", rnd, donor,
                     extra={"event": "resume", "source": "peer", "round": rnd, "donor": donor})

    def _adopt_joined(self, rnd: int, phi: list[torch.Tensor]) -> None:
        """A joiner takes a donor's phi and round, with fresh Adam state and m = 0 (compute thread)."""
        with torch.no_grad():
            copy_into(self.params, phi)  # host tensors -> the device, one copy each
        self.outer = self._make_outer()
        self.round = rnd
        self.step = rnd * self.cfg.inner_steps
        self.opt, self.sched = self._new_inner(self.step)
        self._round_start_step = self.step

    def _set_phi(self, phi: list[torch.Tensor]) -> None:
        with torch.no_grad():
            self.outer.set_phi(phi)
            copy_into(self.params, self.outer.phi)

    async def _resync_phi(self) -> None:
        """DiLoCo assumes identical phi: after a missed global round, take a peer's phi (and round);
        the Adam state and momentum stay local."""
        got = await self._fetch_from_donor(min_round=self.round)
        if got is None:
            return
        rnd, phi, donor = got
        await self.compute.run(self._set_phi, phi)
        self.round = rnd
        await self._take_snapshot()
        log.info("re-fetched phi at round %d from %s after a missed DiLoCo round", rnd, donor,
                 extra={"event": "phi_resync", "round": rnd, "donor": donor})

    def _try_resume(self) -> bool:
        """Load the latest checkpoint (compute thread); False: none, or unusable (logged)."""
        try:
            state = self.checkpointer.read(required=CHECKPOINT_PARTS)
            if state is None:
                log.info("no checkpoint in %s: starting fresh", self.ctx.config.state_dir)
                return False
            step, rnd = int(state["meta"]["step"]), int(state["meta"]["round"])
            self.opt, self.sched = self._new_inner(step)
            self.checkpointer.apply(state, self._parts())
        except (CheckpointError, KeyError, ValueError, TypeError) as exc:
            mismatch = isinstance(exc, CheckpointError) and exc.reason == "mismatch"
            log.error("checkpoint not loaded: %s", exc if isinstance(exc, CheckpointError) else f"bad metadata {exc!r}",
                      extra={"event": "checkpoint_mismatch" if mismatch else "checkpoint_corrupt"})
            self.opt, self.sched = self._new_inner(0)  # start fresh: nothing positioned at the file's step
            return False
        self.step, self.round = step, rnd
        self._round_start_step = self.step
        log.info("resumed from checkpoint at round %d step %d", self.round, self.step,
                 extra={"event": "resume", "source": "checkpoint", "round": self.round, "step": self.step})
        return True

    def _save_checkpoint(self) -> None:
        self.checkpointer.save(self._parts(), {"round": self.round, "step": self.step})

    def _snapshot_now(self) -> StateSnapshot:
        # host copies (one device->host copy on a GPU, one clone on the CPU): the servicer encodes them
        return StateSnapshot({"round": self.round}, {n: t.detach().to(device="cpu", dtype=torch.float32, copy=True)
                                                     for n, t in zip(self.names, self.outer.phi)})

    async def _take_snapshot(self) -> None:
        """The state joiners download: phi at the last outer step (cloned on the compute thread)."""
        self._snapshot = await self.compute.run(self._snapshot_now)

    # ---------------- training ----------------
    def _inner_steps(self, n: int) -> float:
        """``n`` inner steps (compute thread)."""
        self.model.train()
        loss_val = float("nan")
        for _ in range(n):
            if self._stopping or self.compute.stopping:  # drain: stop after this step, abandon the round
                break
            t0 = time.perf_counter()
            batch = next(self.train_iter)
            if self.device.type != "cpu":
                batch = (to_device(batch[0], self.device), to_device(batch[1], self.device))
            loss_val = inner_step(self.model, batch, self.opt, self.sched, self.params, self.cfg.inner.clip_norm,
                                  autocast=autocast(self.device, self.precision), scaler=self.scaler)
            if self.cfg.compute_delay_s:
                time.sleep(self.cfg.compute_delay_s)
            if self._first_loss is None:
                self._first_loss = loss_val
            self._last_loss = loss_val
            self.step += 1
            NM.record_train_step(loss_val, batch[0].numel(), time.perf_counter() - t0)
        return loss_val

    def _outgoing(self) -> list[torch.Tensor]:
        """The fp32 tensors to send this round (compute thread). CPU: the outer optimizer's fresh
        copies, as always. GPU: one device->host copy per tensor into this round parity's pinned
        buffers, which are also the host theta a host-side outer state steps with."""
        theta = [p.detach() for p in self.params]
        if self.device.type == "cpu":
            return self.outer.exchange_tensors(theta)
        slot = self._sends % 2  # alternates every round, whatever the round label or a rollback does
        self._sends += 1
        named = {f"{slot}.theta.{n}": t for n, t in zip(self.names, theta)}
        if self.cfg.exchanges_phi:
            named.update({f"{slot}.phi.{n}": t for n, t in zip(self.names, self.outer.phi)})
        return list(self.pool.to_host_all({k: v.to(torch.float32) for k, v in named.items()}, copy=True).values())

    def _outer_step(self, mean, n: int, sent: list[torch.Tensor],
                    stepped_since: bool = False) -> tuple[float, float | None]:
        """Outer step on the compute thread: (update norm, replica spread or None when solo).
        ``sent``: what ``_outgoing`` returned (fp32 copies of theta, first; host theta when the
        outer state lives on the host). ``stepped_since``: inner steps ran after ``sent`` was
        taken (``overlap_fraction``): the outer step takes theta from ``sent`` and the params
        become phi_new + (params - theta_sent)."""
        theta_bar = phi_bar = spread = None
        od = self.outer_device
        with torch.no_grad():
            if stepped_since:
                theta = [to_device(t, od) for t in sent[:len(self.params)]]
                progress = [p.detach().to(torch.float32) - to_device(t, p.device)
                            for p, t in zip(self.params, sent[:len(self.params)])]
            else:
                theta = [p.detach() for p in self.params] if od == self.device else sent[:len(self.params)]
                progress = None
            if mean is not None and n > 1:  # the exchange hands out only verified, finite means
                theta_bar, phi_bar = self.outer.split_means([to_device(t, od) for t in mean])
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

    async def _one_round(self) -> None:
        t_round = time.monotonic()
        # steps computed while the last exchange ran (past its outer step) belong to this round
        h = max(1, self.cfg.inner_steps - (self.step - self._round_start_step))
        if self.cfg.exit_after_steps:
            h = max(1, min(h, self.cfg.exit_after_steps - self.step))
        step0 = self.step
        want_views = self.cfg.outer == "noloco"
        t_round_pc = time.perf_counter()
        loss, views, t_outer = await self._steps_then_views(h, want_views)
        # from t_outer (the end of the compute, before any wait for the card read) the worker
        # computes nothing: blocked time
        if self.step > step0:  # the worker's own pace: what the waiting policy scales with
            per_step = (t_outer - t_round_pc) / (self.step - step0)
            self._step_s = per_step if self._step_s is None else 0.5 * self._step_s + 0.5 * per_step
        if self._stopping:
            return
        rnd = self._catch_up_round(views) if self._catch_up else self.round
        extra = self._steps_until_partner(views, rnd, self._extra_room())
        if extra:  # keep computing while waiting: nobody can meet us now, a peer is due soon
            log.info("round %d: no partner within the wait bound; %d more inner steps until one is due", rnd, extra,
                     extra={"event": "compute_while_waiting", "round": rnd, "extra_steps": extra})
            M.EXTRA_STEPS.inc(extra)
            # partners plan on this card: say at once that we exchange later, not at the stale time
            self.ctx.card.update(**{NEXT_EXCHANGE_AT: round(time.time() + extra * (self._step_s or 0.0), 3)},
                                 publish=True)
            loss, views, t_outer = await self._steps_then_views(extra, True)
            if self._stopping:
                return
            rnd = self._catch_up_round(views) if self._catch_up else self.round
        tensors = await self.compute.run(self._outgoing)
        sent_at = self.step
        timeout, bound, waited, computing = self.cfg.round_timeout, None, 0.0, 0.0
        if self.cfg.outer == "diloco":
            expected = await self._live_workers()
            res = await self.exchange.group_average(rnd, tensors, timeout, expected=expected)
        else:
            # waiting costs nothing while the worker can train on (overlap): wait that long too
            bound = min(self.cfg.round_timeout, max(wait_bound(self._step_s, self.cfg),
                                                    self._overlap_room() * (self._step_s or 0.0)))
            if views is not None and not someone_can_meet(self._ready_peers(views), rnd, by=time.time() + bound):
                res = ExchangeResult(None, 1, [], "solo", "nobody")  # no exchange at all: nobody will come
            else:
                t_pair = time.perf_counter()
                res, rnd, computing = await self._pair_within_bound(rnd, tensors, bound)
                waited = time.perf_counter() - t_pair
        blocked = time.perf_counter() - t_outer - computing  # trained on meanwhile: not blocked
        res.blocked_s = max(0.0, blocked)
        last = bool(self.cfg.exit_after_steps) and self.step >= self.cfg.exit_after_steps
        outcome, reason = res.outcome, res.reason
        n = res.n if res.mean is not None and res.n > 1 else 1
        # steps computed while the exchange ran: the outer step uses the tensors sent, and the
        # progress since is kept on top of the new phi
        norm, spread = await self.compute.run(self._outer_step, res.mean, n, tensors, self.step > sent_at)
        # ---- checks/rollback region (S2): a non-finite or out-of-bound outer step is undone
        why = await self.compute.run(self._outer_result_problem, norm)
        if why is not None:
            if n > 1:  # the partners' contribution made the step bad: do not pair with them for a while
                self.exchange.charge(res.partners, "rollback")
            await self._roll_back(rnd, why, outcome, reason)
            return
        if self._bad_rounds:
            await self._recovered()
        # ---- end of the checks/rollback region
        if spread is not None:
            M.REPLICA_SPREAD.set(spread)
        record_memory(self.device)
        self.round = rnd + 1
        self._round_start_step = sent_at  # theta == phi there (steps overlapped with the exchange came after)
        overlapped = self.step - sent_at
        await self._take_snapshot()
        M.OUTER_ROUNDS.labels(outcome=outcome if n > 1 else ("solo" if outcome == "ok" else outcome)).inc()
        if n == 1:
            M.SOLO_ROUNDS.labels(reason=reason or "no_partner").inc()
        M.GROUP_SIZE.observe(n)
        self._rounds_ok += n > 1
        self._outer_steps += 1
        M.BLOCKED_SECONDS.observe(res.blocked_s)
        self._blocked_s += res.blocked_s
        M.TRAINING_SECONDS.set(self._train_s())
        M.BLOCKED_FRACTION.set(self._blocked_s / max(1e-6, self._train_s()))
        M.SENT_BYTES.inc(res.sent_bytes)
        M.RECEIVED_BYTES.inc(res.received_bytes)
        TRANSFER_BYTES.labels(direction="sent", kind="outer").inc(res.sent_bytes)
        TRANSFER_BYTES.labels(direction="received", kind="outer").inc(res.received_bytes)
        M.UPDATE_NORM.set(norm)
        M.OUTER_ROUND.set(self.round)
        self._partners.append(tuple(sorted(res.partners)))
        pairs = list(self._partners)
        if len(pairs) > 1:
            repeats = sum(a == b and a != () for a, b in zip(pairs, pairs[1:]))
            M.PARTNER_REPEAT.set(repeats / (len(pairs) - 1))
        # blocked: share of this round's wall time spent waiting for the group (swarmnode status)
        blocked = res.blocked_s / max(1e-6, time.monotonic() - t_round)
        # finishing: this was the last round; no peer waits for it at a later label (waiting policy).
        # Published at once (a background store): peers waiting at our old label see that we
        # paired elsewhere and stop waiting for us, and plan on our next exchange time.
        eval_due = bool(self.cfg.eval_every) and self.round % self.cfg.eval_every == 0
        next_at = time.time() + (self._step_s or 0.0) * max(1, self.cfg.inner_steps - overlapped) + \
            (self._eval_s if eval_due else 0.0)
        self.ctx.card.update(round=self.round, blocked=round(min(1.0, blocked), 3), **{FINISHING: last},
                             **{NEXT_EXCHANGE_AT: round(next_at, 3)}, publish=True)
        set_context(round=self.round)
        log.info("round %d: n=%d %s%s loss %.4f blocked %.2f s", self.round, n, outcome,
                 f" ({reason})" if reason else "", loss, res.blocked_s,
                 extra={"event": "averaging_round_done", "round": self.round, "group_size": n, "outcome": outcome,
                        "reason": reason, "partners": list(res.partners), "train_loss": loss,
                        "blocked_s": round(res.blocked_s, 3), "step": self.step,
                        "wait_bound_s": None if bound is None else round(bound, 3),
                        "exchange_s": round(res.exchange_s, 3), "waited_s": round(waited, 3),
                        "overlap_steps": overlapped,
                        "train_s": round(self._train_s(), 3)})
        if eval_due:
            t_eval = time.monotonic()
            ev = await self.compute.run(evaluate, self.model, self.eval_set)
            self._eval_s = time.monotonic() - t_eval
            NM.EVAL_LOSS.set(ev)
            log.info("round %d: eval loss %.4f", self.round, ev,
                     extra={"event": "eval_done", "round": self.round, "step": self.step, "eval_loss": ev,
                            "train_s": round(self._train_s(), 3)})
        if self.cfg.checkpoint_every and self.round % self.cfg.checkpoint_every == 0:
            await self.compute.run(self._save_checkpoint)
        if self.cfg.outer == "diloco" and n == 1 and outcome != "ok":
            await self._resync_phi()

    # ---------------- waiting policy (issue 8) ----------------
    async def _steps_then_views(self, n: int, want_views: bool) -> tuple[float, list | None, float]:
        """``n`` inner steps -> (loss, node cards or None, ``time.perf_counter()`` when the
        compute ended). With ``want_views`` the cards are read (DHT) while the last step
        computes (the view is at most one step old); a read that outlasts the step is idle time,
        so the caller counts blocked time from the returned compute end, not from the read."""
        if not want_views:
            return await self.compute.run(self._inner_steps, n), None, time.perf_counter()
        loss = await self.compute.run(self._inner_steps, n - 1) if n > 1 else float("nan")
        if self._stopping:
            return loss, None, time.perf_counter()
        done: list[float] = []

        async def last_step() -> float:
            out = await self.compute.run(self._inner_steps, 1)
            done.append(time.perf_counter())
            return out

        loss, views = await asyncio.gather(last_step(), self._read_views())
        return loss, views, done[0]

    def _train_s(self) -> float:
        return 0.0 if self._t_train0 is None else time.monotonic() - self._t_train0

    def _extra_room(self) -> int:
        """Inner steps a round may add while waiting: at most half a phase more than one."""
        return self._within_exit(self.cfg.inner_steps + self.cfg.inner_steps // 2)

    def _within_exit(self, steps: int) -> int:
        """``steps``, no more than are left before ``exit_after_steps`` (when set)."""
        return max(0, min(steps, self.cfg.exit_after_steps - self.step)) if self.cfg.exit_after_steps else steps

    def _steps_until_partner(self, views: list | None, rnd: int, room: int) -> int:
        """Inner steps to add to this round instead of a solo step (``compute_while_waiting``)."""
        if views is None or self.cfg.outer != "noloco" or not self.cfg.compute_while_waiting:
            return 0
        idle = None if self._step_s is None else self.cfg.idle_steps * self._step_s
        return steps_to_wait(self._ready_peers(views), rnd, time.time(), wait_bound(self._step_s, self.cfg),
                             self._step_s, room, idle_s=idle)

    async def _pair_within_bound(self, rnd: int, tensors: list[torch.Tensor],
                                 bound: float) -> tuple[ExchangeResult, int, float]:
        """NoLoCo's exchange under the waiting policy -> (result, the round label it ended at,
        seconds spent computing inner steps meanwhile). The transport gets ``round_timeout`` as
        its hard cap; the *wait* (never an exchange already matched) ends when ``bound`` is
        spent ("wait_bound") or as soon as no live peer can still meet us within it ("nobody";
        node cards, polled). When the peers pair at our label and move to a later one, the
        worker moves there with the same tensors and waits on, within the same bound (at most
        ``MAX_PAIR_TRIES`` labels). Meanwhile it trains on (``overlap_fraction``): ``tensors``
        are copies, the steps leave them be."""
        M.WAIT_BOUND.set(bound)
        end_wall = time.time() + bound
        computing, room, stop = 0.0, self._overlap_room(), asyncio.Event()

        async def train_on() -> None:
            nonlocal computing, room
            while room > 0 and not stop.is_set() and not self._stopping:
                t0 = time.perf_counter()
                await self.compute.run(self._inner_steps, 1)
                computing += time.perf_counter() - t0
                room -= 1

        trainer = asyncio.ensure_future(train_on())
        try:
            for tries in range(1, MAX_PAIR_TRIES + 1):
                res, later = await self._pair_try(rnd, tensors, end_wall)
                if later is None or tries == MAX_PAIR_TRIES or time.time() >= end_wall:
                    break
                log.info("round label %d -> %d while waiting: the peers moved on", rnd, later,
                         extra={"event": "round_relabel", "from_round": rnd, "round": later})
                rnd = later
        finally:
            stop.set()  # the trainer ends after the step in flight, also when we are cancelled
        await trainer  # the outer step follows that step
        return res, rnd, computing

    async def _pair_try(self, rnd: int, tensors: list[torch.Tensor],
                        end_wall: float) -> tuple[ExchangeResult, int | None]:
        """One wait at label ``rnd`` until ``end_wall`` -> (result, a later label to move to or None)."""
        loop = asyncio.get_running_loop()
        later: list[int] = []
        timer = loop.call_later(max(0.0, end_wall - time.time()),
                                lambda: asyncio.ensure_future(self.exchange.stop_waiting(rnd, "wait_bound")))
        watch = asyncio.ensure_future(self._watch_wait(rnd, end_wall, later))
        try:
            res = await self.exchange.pair_average(rnd, tensors, self.cfg.round_timeout)
        finally:
            timer.cancel()
            watch.cancel()
        relabel = res.outcome == "solo" and res.reason == "relabel" and later
        return res, (later[0] if relabel else None)

    def _overlap_room(self) -> int:
        """Inner steps the worker may compute while its exchange is in flight."""
        return self._within_exit(math.ceil(self.cfg.overlap_fraction * self.cfg.inner_steps))

    async def _watch_wait(self, rnd: int, end_wall: float, later: list[int]) -> None:
        while time.time() < end_wall:
            await asyncio.sleep(WATCH_POLL_S)
            views = await self._read_views(timeout=max(0.1, min(2.0, end_wall - time.time())))
            if views is None:
                continue
            frontier = self._frontier(views) if self._catch_up else None
            if frontier is not None and frontier > rnd:
                # peers paired at our label and moved on: whoever arrives next goes to their label
                later.append(frontier)
                await self.exchange.stop_waiting(rnd, "relabel")
                return
            if not someone_can_meet(self._ready_peers(views), rnd, by=end_wall):
                await self.exchange.stop_waiting(rnd, "nobody")
                return

    async def _read_views(self, timeout: float | None = None) -> list | None:
        """The run's node cards, or None when the DHT gives no answer in time."""
        try:
            return await read_cards(self.ctx.membership.dht, self.ctx.config.run_id,
                                    timeout=timeout or min(2.0, self.cfg.round_timeout / 4))
        except Exception:  # noqa: BLE001 - no view of the swarm this time: callers keep their defaults
            return None

    # ---------------- checks and rollback (security.md §7; issue 7) ----------------
    def _outer_result_problem(self, norm: float) -> str | None:
        """None if the outer step just taken is good, else why not (compute thread): phi must be
        finite and ``||phi_new - phi_good|| <= max_update_ratio * ||phi_good||``, where phi_good is
        the last good phi (the snapshot joiners download). A good step refreshes the host copy of
        m that a later rollback restores."""
        if not math.isfinite(norm):
            return "nonfinite"
        snap = self._snapshot
        if snap is not None:
            if self._good_norm is None or self._good_norm[0] != id(snap):
                ref = math.sqrt(sum(float(torch.dot(t.reshape(-1).double(), t.reshape(-1).double()))
                                    for t in snap.weights.values()))
                self._good_norm = (id(snap), ref)
            ref = self._good_norm[1]
            if norm > self.cfg.max_update_ratio * max(ref, 1e-12):
                return f"out_of_bound (update norm {norm:.4g} > {self.cfg.max_update_ratio:g} x ||phi|| {ref:.4g})"
        self._good_m = [m.detach().to(device="cpu", dtype=torch.float32, copy=True) for m in self.outer.m]
        return None

    def _restore_good(self) -> None:
        """Back to the last good state (compute thread): phi from the snapshot, m from its host
        copy (zeros before the first good step), theta = phi, and a fresh inner optimizer at the
        current step (its moments may hold the same poison)."""
        snap = self._snapshot
        with torch.no_grad():
            if snap is not None:
                for dst, name in zip(self.outer.phi, self.names):
                    dst.copy_(snap.weights[name])
            for i, dst in enumerate(self.outer.m):
                if self._good_m is not None:
                    dst.copy_(self._good_m[i])
                else:
                    dst.zero_()
            copy_into(self.params, self.outer.phi)
        self.opt, self.sched = self._new_inner(self.step)
        self._round_start_step = self.step

    async def _roll_back(self, rnd: int, why: str, outcome: str, reason: str) -> None:
        """Undo a bad outer step, report not-ready ("recovering"); on the second bad step in a row
        re-download the state from a peer (then ready again)."""
        await self.compute.run(self._restore_good)
        self._bad_rounds += 1
        if outcome != "ok" and why.startswith("out_of_bound"):  # no partner took part: our own step
            why += ("; this was a solo step, so if honest rounds keep hitting this, raise "
                    "noloco.max_update_ratio")
        M.OUTER_ROUNDS.labels(outcome="failed").inc()
        M.SOLO_ROUNDS.labels(reason="rolled_back").inc()
        log.error("outer step of round %d was %s (exchange: %s %s): rolled back to round %d's state", rnd, why,
                  outcome, reason, self.round, extra={"event": "outer_rollback", "round": self.round, "why": why,
                                                      "bad_rounds": self._bad_rounds})
        await self.ctx.set_role_ready(False, "recovering", f"outer step of round {rnd} was {why}; rolled back "
                                                           f"to round {self.round}'s state")
        if self._bad_rounds < 2:
            return
        got = await self._fetch_from_donor(min_round=max(1, self.round))
        if got is None:
            log.warning("no peer could give a fresh state; retrying after the next round",
                        extra={"event": "recovery_download_failed"})
            return
        rnd2, phi, donor = got
        await self.compute.run(self._adopt_joined, rnd2, phi)
        self._good_m = None
        await self._take_snapshot()
        log.info("recovered at round %d with state from %s", rnd2, donor,
                 extra={"event": "resume", "source": "peer", "round": rnd2, "donor": donor})
        self.ctx.card.update(round=self.round, publish=True)
        await self._recovered()

    async def _recovered(self) -> None:
        self._bad_rounds = 0
        log.info("outer steps are good again: ready", extra={"event": "recovered", "round": self.round})
        await self.ctx.set_role_ready(True, "ready", "")

    def _catch_up_round(self, views: list | None) -> int:
        """The round label for this exchange: ours, or the most advanced live peer's if higher
        (see ``WorkerConfig.catch_up``). ``self.round`` moves only when the round completes."""
        target = self._frontier(views)
        if target is None or target <= self.round:
            return self.round
        log.info("round label %d -> %d: the swarm is ahead", self.round, target,
                 extra={"event": "round_catch_up", "from_round": self.round, "round": target})
        M.ROUND_CATCH_UPS.inc()
        return target

    def _frontier(self, views: list | None) -> int | None:
        """The most advanced live peer's round label (None: no view, or no peer with a round).
        Range check: a card more than max_round_jump past the peers' median is ignored."""
        if views is None:
            return None
        return frontier_card_int(self._ready_peers(views), "round", self.cfg.max_round_jump, own=self.round)

    async def _live_workers(self) -> int:
        try:
            views = await read_cards(self.ctx.membership.dht, self.ctx.config.run_id)
        except Exception:  # noqa: BLE001 - unknown: assume just us and whoever shows up
            return 1
        return max(1, len([v for v in peers(views, role=self.name, cfg_hash=self.cfg_hash,
                                            states=("ready", "joining"), unknown_cfg_ok=True)
                           if v.card.details.get(FINISHING) is not True]))

    def _ready_peers(self, views: list) -> list:
        """The other READY workers of our config: the peers this worker may take state from or
        follow to a higher round."""
        return peers(views, role=self.name, cfg_hash=self.cfg_hash, exclude=self.ctx.peer_id)

    # ---------------- drain ----------------
    async def drain(self, budget_s: float) -> None:
        """Finish the current round only if it ends within the budget, else leave it; then
        checkpoint the state of the last completed outer step."""
        self._stopping = True
        self.compute.stop()
        task = self._round_task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.0, budget_s - 2.0))
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - leaving mid-round is allowed
                task.cancel()
        await self.exchange.close()
        if not (self.cfg.checkpoint_every and self.step > 0):
            self.compute.close()
            return
        if not await self.compute.drain(max(0.1, budget_s / 4)):
            log.warning("compute thread still busy: no final checkpoint", extra={"event": "checkpoint_skipped"})
            self.compute.close()
            return
        try:
            await self.compute.run(self._final_checkpoint)
            log.info("checkpoint written at round %d", self.round, extra={"event": "checkpoint_written",
                                                                          "round": self.round})
        except Exception as exc:  # noqa: BLE001 - a failed final checkpoint is reported, not fatal
            log.warning("final checkpoint failed: %r", exc, extra={"event": "checkpoint_failed"})
        finally:
            self.compute.close()

    def _final_checkpoint(self) -> None:
        if self.step != self._round_start_step:  # an abandoned round: back to the last outer step
            with torch.no_grad():
                copy_into(self.params, self.outer.phi)
            self.step = self._round_start_step
        self._save_checkpoint()
