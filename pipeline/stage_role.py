"""The `stage` role: one SkipPipe pipeline stage on one node (pipeline.md §2.5, §5).

    swarmnode run --role stage --set stage.index=2 --initial-peers /ip4/…/p2p/12D3KooW…
    swarmnode demo --role stage          # 3 data nodes + 3 stages x 2 replicas on 127.0.0.1

Glue only: the executor (routing, memory window, deferral, visit-normalised replica averaging,
the single step) is pipeline/stage_exec.py, validation pipeline/stage_eval.py, the streams
pipeline/stage_transport.py, the model split models/stages.py, the planner pipeline/search.py
behind the bootstrap's `Schedule` service (pipeline/coordinator.py, hosted through
`StageRole.bootstrap_services`). This module owns the node's side:

- the stage's layers live on the configured device (node/device.py; forward passes under its
  autocast; fp16 is refused, a pipeline would need one loss scale across stages);
- its card carries `stage`, `memory` (microbatch slots), `compute_ms` (its measured forward
  time plus `stage.compute_delay_s`), `grad_bytes` (what it exchanges with its replicas per
  iteration), its device and `iteration` (what the coordinator plans with), and `cfg_hash`
  (what its state depends on: donors for a recovering node are picked by it); it follows
  `Schedule.Watch` on the bootstrap (calls signed for the bootstrap's peer ID), validates every
  schedule before use (a violation is refused and logged with the rule) and fetches an epoch it
  has not seen when a message or the replicas' agreement names one;
- every message is handled on the compute thread (`node/compute.py`) in arrival order; one the
  executor cannot use (wrong shape) is answered with an `err` on its stream, never a crash;
  stale/unknown ones are dropped and counted (`swarmnode_pipeline_dropped_total{reason}`);
- stage-0 nodes hold the data (shard = their position among the schedule's originators),
  start each iteration after their step, and the schedule's first originator validates the
  full in-order model every `stage.eval_every` iterations; after `stage.iterations` it
  validates once more and sends `fin` to every node (waiting until they are sent), which then
  drain; each node writes its weights and optimizer state (node/checkpoint.py) at the end and
  every `stage.checkpoint_every` iterations;
- its state (weights, optimizer, last norms, weight hash) is served after every step through
  `WeightService.Fetch` (node/state_sync.py): replicas and recovering neighbours download it;
- metrics (pipeline/stage_metrics.py) and one `stage_step` log line per step with the weight
  hash (replicas compare them), norms, visits, seconds and idle seconds; originators add
  when their microbatches started and came back (`started_at`, `done_at`, unix seconds);
- CheckFree (pipeline/recovery.py): with `stage.checkfree.recover` the node starts with no
  stage, asks the coordinator which stage lost its nodes, rebuilds it from live peers
  (`stage_recovered` event, `swarmnode_checkfree_*` metrics) and only then publishes its card,
  so the coordinator's next plan resumes the run; a node whose running iteration's schedule is
  replaced by one without a lost node aborts that iteration and (origins) restarts it on the new
  epoch (`iteration_aborted`); while the coordinator reports the schedule suspended the
  stuck-iteration watchdog waits instead of draining. A replacement that copied a live replica
  re-fetches it at the first iteration it is asked to run (`replica_resync`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time

import grpc
import torch
from pydantic import BaseModel, ConfigDict

from models.config import DataConfig, ModelConfig
from models.optim import build_optimizer, inner_lr_scheduler
from models.stages import build_stage, stage_layer_ranges
from node import metrics as NM
from node.card import CFG_HASH, read_cards
from node.checkpoint import Checkpointer
from node.compute import Compute
from node.config import ConfigError
from node.device import autocast, device_details, resolve_device
from node.roles import RoleBase, Service, register
from node.state_sync import StateServicer, StateSnapshot, add_state_service
from pipeline import stage_metrics as M
from pipeline.config import ScheduleConfig, StageConfig
from pipeline.coordinator import ScheduleCoordinator, StageAuditSpec, fetch_schedule, parse_reply
from pipeline.schedule import ScheduleViolation
from pipeline.checkfree import RecoveryError
from pipeline.recovery import (Rebuilt, StageRecovery, apply_recovery, coordinator_status, newest_checkpoint,
                               optimizer_spec, param_spec, rebuilt_from_checkpoint, stage_checkpoint_dir)
from pipeline.stage_exec import Aborted, BadInput, EvalResult, OriginDone, StageExecutor, StepResult
from pipeline.stage_timing import measure_forward_s
from pipeline.stage_transport import StageTransport
from protocol import pipeline_pb2, pipeline_pb2_grpc
from security.config import is_loopback_host, is_loopback_maddr
from protocol.streams import add_tensor_stream_to_server

log = logging.getLogger("swarmnode.stage")

CHECKPOINT_FORMAT = "swarmnode-stage-v1"
SUSPEND_POLL_S = 0.5
"""How often a data node asks the coordinator whether the schedule is suspended (one small RPC)."""
FIN_FLUSH_S = 10.0
"""Longest wait for the `fin` messages to leave before the evaluating node drains."""


class StageSettings(BaseModel):
    """The sections the stage role reads: ``[stage]``, ``[schedule]``, ``[model]``, ``[data]``."""

    model_config = ConfigDict(extra="forbid")
    stage: StageConfig
    schedule: ScheduleConfig
    model: ModelConfig
    data: DataConfig


def activation_bytes(s: StageSettings) -> int:
    return s.data.batch_size * s.data.seq_len * s.model.d_model * 4


def stage_cfg_hash(s: StageSettings) -> str:
    """What a stage's weights depend on: nodes whose hashes differ cannot share state."""
    body = f"{s.model.model_dump_json()}|{s.schedule.stages}|{s.stage.index}|{s.stage.stage0_layers}|{s.stage.seed}"
    return hashlib.sha256(body.encode()).hexdigest()[:12]


KEEP_SNAPSHOTS = 4
"""Snapshots (weights + optimizer state) a stage node keeps and serves by iteration, so the
coordinator's integrity audit can fetch a step's before and after while the node runs on."""


@register
class StageRole(RoleBase):
    name = "stage"
    Settings = StageSettings

    @classmethod
    def validate_config(cls, config):
        s = super().validate_config(config)
        if s.stage.index >= s.schedule.stages:
            raise ConfigError(f"stage.index={s.stage.index} but schedule.stages={s.schedule.stages}: use an index "
                              f"in [0, {s.schedule.stages})")
        try:
            stage_layer_ranges(s.model.n_layers, s.schedule.stages, s.stage.stage0_layers)
        except ValueError as exc:
            raise ConfigError(f"model.n_layers / schedule.stages: {exc}") from None
        if s.data.seq_len > s.model.max_seq_len:
            raise ConfigError(f"data.seq_len={s.data.seq_len} > model.max_seq_len={s.model.max_seq_len}")
        if config.device.precision == "fp16":
            raise ConfigError("device.precision=\"fp16\" is not supported by the stage role (a pipeline would need "
                              "one loss scale across stages); use \"bf16\" or \"fp32\"")
        return s

    @classmethod
    def bootstrap_services(cls, ctx) -> list[Service]:
        """The schedule service, planned from the [schedule] section of the bootstrap's config."""
        s = super().validate_config(ctx.config)
        specs: dict[int, tuple] = {}

        def stage_spec(index: int) -> tuple:
            """(weights spec, optimizer spec, cfg_hash) of stage `index`: what an integrity audit fetches."""
            if index not in specs:
                mod = build_stage(s.model, s.stage.seed, index, s.schedule.stages, s.stage.stage0_layers)
                specs[index] = (param_spec(mod), optimizer_spec(mod),
                                stage_cfg_hash(s.model_copy(update={"stage": s.stage.model_copy(update={"index": index})})))
            return specs[index]

        o = s.stage.optim
        audit = StageAuditSpec(stage_spec, tuple(o.betas), o.eps, o.weight_decay)
        return [Service(pipeline_pb2_grpc.add_ScheduleServicer_to_server,
                        ScheduleCoordinator(ctx, s.schedule, activation_bytes(s), audit=audit), "swarmnode.Schedule")]

    def __init__(self, ctx, settings: StageSettings):
        self.ctx, self.s, self.cfg = ctx, settings, settings.stage
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.me = ctx.peer_id
        if self.cfg.attack_weight_edit:
            c = ctx.config
            public = [h for h in (c.host, c.advertise_host) if h and not is_loopback_host(h)]
            public += [m for m in (*c.dht.initial_peers, *c.dht.announce_maddrs) if not is_loopback_maddr(m)]
            if public:
                raise ValueError(f"stage.attack_weight_edit is a test and benchmark harness: it is refused unless every "
                                 f"listen and peer address is loopback; {public[0]!r} is not. Set it to 0")
            log.warning("*** TEST ONLY: this stage node is MALICIOUS: it edits its weights outside the gradient path "
                        "(stage.attack_weight_edit=%g) ***", self.cfg.attack_weight_edit,
                        extra={"event": "stage_attack", "edit": self.cfg.attack_weight_edit})
        self.recovering = self.cfg.checkfree.recover
        self.module = self.opt = self.lr_sched = None
        self.cfg_hash = ""
        self.checkpointer: Checkpointer | None = None
        if not self.recovering:
            self._build(self.cfg.index)
        self.compute = Compute(self.name)
        self.net = StageTransport(run_id=ctx.config.run_id, me=self.me, netem=ctx.netem,
                                  max_tensor_bytes=int(self.cfg.max_activation_mb * 2 ** 20),
                                  send_timeout_s=self.cfg.iteration_timeout_s,
                                  on_reject=lambda reason: NM.TENSORS_REJECTED.labels(reason=reason).inc())
        self._snapshot: StateSnapshot | None = None
        self._kept: list[StateSnapshot] = []   # the last KEEP_SNAPSHOTS: integrity audits replay a step from them
        self._corpus = None                    # stage 0: the loaded corpus (train stream, validation batches)
        self._embed_copy: StateSnapshot | None = None   # stage 1: stage 0's weights as of the last refresh
        self._copy_rec: StageRecovery | None = None
        self.state_servicer = StateServicer(ctx.config.run_id, self.cfg_hash, lambda: self._snapshot, ctx.netem,
                                            history=self._snapshot_at, copies=self._copy_of)
        self.coordinator: tuple[str, str] | None = None   # (gRPC address, peer ID)
        self.ex: StageExecutor | None = None
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None     # set in _main: the compute thread emits through it
        self._have_schedule = asyncio.Event()
        self._eval_start: float | None = None
        self._eval_end: float | None = None
        self._loss_start: float | None = None
        self._loss_end: float | None = None
        self._last_step = time.monotonic()
        self._idle = 0.0
        self._train_t0: float | None = None    # monotonic start of iteration 0
        self._eval_s = 0.0                     # validation seconds since then (not training time)
        self._eval_t0: float | None = None
        self._origin_times: dict[int, list[float]] = {}
        self._done = False
        self.rebuilt: Rebuilt | None = None
        self._resync_stage: int | None = None   # a rebuilt stage: redo its rule at the first later iteration asked
        self._resync_rule = None
        self._running = asyncio.Event()          # data nodes: cleared while the coordinator reports suspended
        self._running.set()

    def _build(self, index: int) -> None:
        """The stage's module, optimizer, LR schedule, cfg hash and checkpointer for `index`."""
        self.cfg.index = index
        self.module = build_stage(self.s.model, self.cfg.seed, index, self.s.schedule.stages, self.cfg.stage0_layers)
        self.opt = build_optimizer(self.module.parameters(), self.cfg.optim)
        self.lr_sched = inner_lr_scheduler(self.opt, self.cfg.optim)
        self.cfg_hash = stage_cfg_hash(self.s)
        ckpt_dir = (stage_checkpoint_dir(self.cfg.checkpoint_dir, index) / self.me[:24] if self.cfg.checkpoint_dir
                    else self.ctx.config.state_dir)
        self.checkpointer = Checkpointer(ckpt_dir, CHECKPOINT_FORMAT, self.cfg_hash)
        if getattr(self, "state_servicer", None) is not None:
            self.state_servicer.cfg_hash = self.cfg_hash

    def _cfg_hash_of(self, index: int) -> str:
        return stage_cfg_hash(self.s.model_copy(update={"stage": self.cfg.model_copy(update={"index": index})}))

    def services(self) -> list[Service]:
        return [Service(add_tensor_stream_to_server, self.net.service, "swarmnode.TensorStream"),
                Service(add_state_service, self.state_servicer, "swarmnode.WeightService")]

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        await self.ctx.set_role_ready(False, "role_init", "building the stage and waiting for a schedule")
        if not self.recovering:
            M.STAGE_INDEX.set(self.cfg.index)
        for gauge in (NM.TRAIN_LOSS, NM.TRAIN_LOSS_INITIAL, NM.EVAL_LOSS, NM.EVAL_LOSS_INITIAL):
            gauge.set(math.nan)          # until this node has one: transformer stages never compute a loss
        self.ctx.supervisor.spawn("stage_main", self._main, restart=False)

    def _setup(self) -> dict:
        """Compute thread: device, executor, the first snapshot; returns the card details."""
        device = resolve_device(self.ctx.config.device)
        self.module.to(device)
        precision = self.ctx.config.device.precision
        d = self.cfg.compute_delay_s
        factors = {"forward": 1.0, "backward": 1.5, "loss": 0.25}
        delay = (lambda kind: time.sleep(d * factors[kind])) if d else None
        eval_data = None
        if self.cfg.index == 0:
            from models.corpus import eval_batches, load_corpus
            self._corpus = load_corpus(self.s.data)
            eval_data = eval_batches(self._corpus.val, self.s.data.batch_size, self.s.data.seq_len,
                                     self.cfg.eval_batches)
        self.ex = StageExecutor(self.me, self.cfg.index, self.module, self.opt, memory=self.s.schedule.memory,
                                clip=self.cfg.optim.clip_norm, eval_data=eval_data, delay=delay, device=device,
                                scheduler=self.lr_sched, autocast=lambda: autocast(device, precision),
                                emit=lambda outs: self._loop.call_soon_threadsafe(self.net.send, outs))
        if self.cfg.attack_weight_edit:
            self.ex.after_step = self._attack_edit      # ATTACK HARNESS: tests and benchmarks only
        if self.rebuilt is not None:
            self.ex.iteration = self.rebuilt.iteration
        self._take_snapshot()
        forward_s = measure_forward_s(self.module, self.s.data.batch_size, self.s.data.seq_len, self.s.model,
                                      device, lambda: autocast(device, precision))
        return {**device_details(device), "compute_ms": max(1, int(round((forward_s + d) * 1000))),
                "grad_bytes": 4 * sum(p.numel() for p in self.module.parameters())}

    def _take_snapshot(self) -> None:
        meta, weights, opt = self.ex.snapshot()
        self._snapshot = StateSnapshot(meta, weights, opt)
        self._kept = (self._kept + [self._snapshot])[-KEEP_SNAPSHOTS:]

    def _snapshot_at(self, iteration: int) -> StateSnapshot | None:
        """The kept snapshot of `iteration` (one of the last KEEP_SNAPSHOTS), else None."""
        for snap in reversed(self._kept):
            if snap is not None and int(snap.meta.get("iteration", -1)) == iteration:
                return snap
        return None

    # ------------------------------------------------------------------ stage 0's copy (on stage 1)
    def _copy_of(self, stage: int) -> StateSnapshot | None:
        """The copy of `stage` this node serves (stage 0's, on a stage-1 node), stamped with this
        node's own iteration: a replacement for stage 0 joins there."""
        c = self._embed_copy
        if stage != 0 or c is None or self.ex is None:
            return None
        return StateSnapshot({**c.meta, "holder_iteration": self.ex.iteration}, c.weights, None)

    async def _refresh_embed_copy(self, iteration: int) -> None:
        """Stage 1, after its first step and every `checkfree.embed_copy_every` iterations: download
        stage 0's weights of `iteration` (or later) from a data node and keep them (host memory) for
        a stage-0 rebuild. A failure keeps the older copy and is logged; the next refresh tries again."""
        t0 = time.monotonic()
        self._copy_rec = self._copy_rec or self._stage_recovery()
        try:
            meta, weights, _, donor = await self._copy_rec.fetch(0, optimizer=False, min_iteration=iteration)
        except RecoveryError as exc:
            log.warning("stage 0's copy not refreshed at iteration %d (%s); keeping the copy of iteration %s",
                        iteration, exc, self._embed_copy.meta["iteration"] if self._embed_copy else "none",
                        extra={"event": "embed_copy_failed", "iteration": iteration})
            return
        got = int(meta["iteration"])
        self._embed_copy = StateSnapshot({"stage": 0, "iteration": got}, weights, None)
        self.ctx.card.update(embed_copy_iter=got)
        M.EMBED_COPY_ITERATION.set(got)
        log.info("kept a copy of stage 0 at iteration %d from %s", got, donor[:16],
                 extra={"event": "embed_copy_refreshed", "iteration": got, "donor": donor,
                        "seconds": round(time.monotonic() - t0, 3),
                        "bytes": sum(t.numel() * t.element_size() for t in weights.values())})

    @torch.no_grad()
    def _attack_edit(self) -> None:
        """ATTACK HARNESS (stage.attack_weight_edit, loopback only): a fixed-direction edit outside the
        gradient path after every step, `attack_weight_edit * lr` per element."""
        lr = float(self.opt.param_groups[0]["lr"])
        for i, p in enumerate(self.module.parameters()):
            gen = torch.Generator().manual_seed(1000 + i)
            sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
            p.add_(sign.to(p.device) * (self.cfg.attack_weight_edit * lr))

    def _start_data(self) -> None:
        """Compute thread, stage 0: this originator's shard of the training stream."""
        from models.corpus import batches
        sched = self.ex.schedules[self.ex.epoch]
        shard = sched.origins.index(sched.names.index(self.me))
        gen = batches(self._corpus.train, self.s.data.batch_size, self.s.data.seq_len, self.cfg.seed + 1,
                      shard=shard, num_shards=len(sched.origins),   # a rebuilt data node goes on, not back to 0
                      start_step=self.ex.iteration * self.s.schedule.mb_per_origin)
        self.ex.data = lambda: next(gen)

    async def _find_coordinator(self) -> tuple[str, str]:
        while True:
            try:
                for v in await read_cards(self.ctx.membership.dht, self.ctx.config.run_id):
                    if v.card.role == "bootstrap" and v.card.grpc_addr:
                        return v.card.grpc_addr, v.peer_id
            except Exception as exc:  # noqa: BLE001 - retried
                log.debug("reading cards: %r", exc)
            await asyncio.sleep(1.0)

    def _coordinator_channel(self):
        addr, peer_id = self.coordinator
        return self.net.pool.get(addr, peer_id=peer_id)

    async def _watch(self) -> None:
        """Follow Schedule.Watch; reconnect on errors."""
        while True:
            try:
                stub = pipeline_pb2_grpc.ScheduleStub(self._coordinator_channel())
                async for reply in stub.Watch(pipeline_pb2.GetScheduleRequest(run_id=self.ctx.config.run_id)):
                    try:
                        sched, addrs = parse_reply(reply)
                    except ScheduleViolation as exc:
                        log.error("refused schedule epoch %d: %s", reply.epoch, exc,
                                  extra={"event": "schedule_refused", "rule": exc.rule})
                        continue
                    await self._adopt(sched, addrs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect
                log.info("schedule watch ended (%r); reconnecting", exc)
            await asyncio.sleep(1.0)

    async def _adopt(self, sched, addrs: dict[str, str]) -> None:
        self.net.addrs.update(addrs)
        await self.compute.run(self.ex.add_schedule, sched)
        if self.ex.events:                   # an aborted iteration, or a degraded step
            await self._after()
        log.info("schedule epoch %d adopted (%d paths, predicted %.3f s)", sched.epoch, len(sched.paths),
                 sched.expected_makespan, extra={"event": "schedule_adopted", "epoch": sched.epoch,
                                                 "expected_makespan": sched.expected_makespan,
                                                 "method": sched.method})
        if self.me in sched.names:
            self._have_schedule.set()

    async def _fetch_epoch(self, ep: int) -> None:
        try:
            sched, addrs = await fetch_schedule(self._coordinator_channel(), self.ctx.config.run_id, ep)
            await self._adopt(sched, addrs)
        except (ScheduleViolation, grpc.aio.AioRpcError) as exc:
            log.warning("could not fetch schedule epoch %d: %r", ep, exc)

    def _stage_recovery(self) -> StageRecovery:
        root = self.cfg.checkpoint_dir
        return StageRecovery(
            ctx=self.ctx, me=self.me, n_stages=self.s.schedule.stages, cfg=self.cfg.checkfree,
            build=lambda i: build_stage(self.s.model, self.cfg.seed, i, self.s.schedule.stages, self.cfg.stage0_layers),
            cfg_hash_of=self._cfg_hash_of, offload=self.compute.run,
            status=lambda: coordinator_status(self._coordinator_channel(), self.ctx.config.run_id),
            has_checkpoint=lambda i: bool(root) and newest_checkpoint(root, i, CHECKPOINT_FORMAT,
                                                                      self._cfg_hash_of(i)) is not None)

    async def _recover(self) -> None:
        """Replacement start-up: learn the stage to take, rebuild it from live peers (CheckFree)."""
        t0 = time.monotonic()
        root = self.cfg.checkpoint_dir
        rec = self._stage_recovery()
        await self.ctx.set_role_ready(False, "recovering", "asking the coordinator which stage to rebuild")
        # build every stage's meta skeleton while waiting (a spare waits long): the rebuild then
        # starts fetching at once
        async def warm_up() -> None:
            for i in range(self.s.schedule.stages):
                await rec.skeleton(i)
        warm = asyncio.ensure_future(warm_up())
        warm.add_done_callback(lambda f: f.cancelled() or f.exception())   # a failure resurfaces in the rebuild
        while True:
            stage, st = await rec.vacancy()
            self.ctx.card.update(publish=True, recovering=stage)     # the coordinator sends the next one elsewhere
            if await rec.claim_holds(stage):
                break
            log.info("stage %d is claimed by another replacement; picking again", stage)
            self.ctx.card.update(publish=True, recovering=None)
            await asyncio.sleep(1.0)
        log.info("taking stage %d (coordinator: %s)", stage, st.reason,
                 extra={"event": "recovery_started", "stage": stage, "missing": list(st.missing_stages),
                        "live": list(st.live_stages)})
        t_take = time.monotonic()
        rule, rebuilt = await rec.decide_and_rebuild(stage, st)
        t_built = time.monotonic()
        await self.compute.run(self._build, stage)
        build_s = time.monotonic() - t_built
        M.STAGE_INDEX.set(stage)
        if rule.rule in ("checkpoint", "nearest"):
            M.ADJACENT_FAILURES.inc()
        if rule.rule == "checkpoint":
            tf = time.monotonic()
            state = await self.compute.run(newest_checkpoint, root, stage, CHECKPOINT_FORMAT, self.cfg_hash)
            self.rebuilt = r = rebuilt_from_checkpoint(state, stage, await rec.live_iteration())
            r.fetch_s = time.monotonic() - tf
            log.warning("%s", r.warn, extra={"event": "recovery_warning", "stage": stage, "rule": r.rule})
        else:
            self.rebuilt = r = rebuilt
        t1 = time.monotonic()

        def apply() -> None:
            self.opt, self.lr_sched = apply_recovery(self.module, r, self.cfg.optim, self.cfg.checkfree.lr_scale)
        await self.compute.run(apply)
        apply_s = time.monotonic() - t1
        M.RECOVERIES.labels(rule=r.rule).inc()
        M.RECOVERY_DURATION.observe(time.monotonic() - t0)
        M.RECOVERY_SECONDS.labels(phase="fetch").observe(r.fetch_s)
        M.RECOVERY_SECONDS.labels(phase="apply").observe(apply_s)
        M.WEIGHTS_VERSION.set(r.iteration)
        M.WEIGHTS_RECOVERED.set(r.iteration)
        if r.rule not in ("checkpoint", "embed_copy"):    # (no pipeline runs without stage 0)
            # the pipeline may have run on meanwhile (a quarantined node is alive until the re-plan):
            # the first message of a later iteration redoes the rule there
            self._resync_stage, self._resync_rule = stage, rule
        lr = self.opt.param_groups[0]["lr"]
        log.info("stage %d rebuilt by %s from %s at iteration %d (lr %.3g)", stage, r.rule, r.donors, r.iteration, lr,
                 extra={"event": "stage_recovered", "stage": stage, "rule": r.rule, "iteration": r.iteration,
                        "donors": {str(k): v for k, v in r.donors.items()},
                        "norms": {str(k): v for k, v in r.norms.items()}, "fetch_s": round(r.fetch_s, 3),
                        "apply_s": round(apply_s, 3), "total_s": round(time.monotonic() - t0, 3), "lr": lr,
                        "rebuild_s": round(t_built - t_take, 3), "build_s": round(build_s, 3),
                        "waited_s": round(t_take - t0, 3),
                        "lr_base": self.opt.param_groups[0]["initial_lr"],
                        "fresh_optimizer": r.optimizer is None and r.checkpoint is None, "warn": r.warn})

    async def _missed(self, msg) -> bool:
        """A rebuilt stage's first message of a later iteration: did the pipeline step this node's
        iteration without it (see StageExecutor.missed)? Fetches the schedule the message names."""
        pe = msg.meta.get("pe", -1)
        if pe >= 0 and pe not in self.ex.schedules:
            await self._fetch_epoch(pe)
        return self.ex.missed(msg)

    async def _resync(self, it: int) -> None:
        """A rebuilt stage joined at an older iteration than the pipeline's: redo its rule (copy
        the replica, average the neighbours, ...) from the sources' states at `it`."""
        stage, self._resync_stage = self._resync_stage, None
        rule, self._resync_rule = self._resync_rule, None
        r = await self._stage_recovery().rebuild(stage, rule, min_iteration=it)
        got, donor = r.iteration, ",".join(v[:16] for v in r.donors.values())

        def apply() -> None:
            self.opt, self.lr_sched = apply_recovery(self.module, r, self.cfg.optim, self.cfg.checkfree.lr_scale)
            self.ex.opt, self.ex.sched, self.ex.iteration = self.opt, self.lr_sched, got
            self._take_snapshot()
        await self.compute.run(apply)
        M.WEIGHTS_VERSION.set(got)
        log.info("rebuilt stage re-synced (%s) at iteration %d from %s", r.rule, got, donor[:40],
                 extra={"event": "replica_resync", "iteration": got, "asked": it, "rule": r.rule})

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.recovering:
            self.coordinator = await self._find_coordinator()
            try:
                await self._recover()
            except RecoveryError as exc:
                log.error("recovery failed: %s", exc, extra={"event": "recovery_failed"})
                self._done = True
                self.ctx.request_drain("recovery_failed")
                return
        details = await self.compute.run(self._setup)
        self.ctx.card.update(publish=True, stage=self.cfg.index, memory=self.s.schedule.memory,
                             iteration=self.ex.iteration,
                             **{CFG_HASH: self.cfg_hash}, **details)
        M.WEIGHTS_VERSION.set(self.ex.iteration)
        log.info("stage %d built on %s (cfg_hash %s)", self.cfg.index, details["device_kind"], self.cfg_hash,
                 extra={"event": "stage_started", "stage": self.cfg.index, "cfg_hash": self.cfg_hash, **details})
        if self.coordinator is None:
            self.coordinator = await self._find_coordinator()
        self._tasks.append(asyncio.ensure_future(self._watch()))
        if self.cfg.index == 0:
            self._tasks.append(asyncio.ensure_future(self._watch_suspension()))
        await self._have_schedule.wait()
        await self._settle()
        self._last_step = time.monotonic()
        self._tasks.append(asyncio.ensure_future(self._watchdog()))
        await self.ctx.set_role_ready(True, "ready", "")
        M.SCHEDULE_EPOCH.set(self.ex.epoch)
        sched = self.ex.schedules[self.ex.epoch]
        if self.ex.is_origin(sched):
            await self.compute.run(self._start_data)
            if self._evaluator():
                await self._start_eval()
            else:
                await self._start_iteration()
        await self._pump()

    async def _settle(self) -> None:
        """Start on a schedule that stayed the newest for `schedule.settle_s`: every originator then
        starts iteration 0 on the same epoch (later epochs are agreed through the stage-0 exchange)."""
        while True:
            epoch = self.ex.latest_epoch
            await asyncio.sleep(self.s.schedule.settle_s)
            if self.ex.latest_epoch == epoch:
                return

    def _evaluator(self) -> bool:
        sched = self.ex.schedules[self.ex.epoch]
        return sched.names[sched.origins[0]] == self.me

    async def _watch_suspension(self) -> None:
        """Data nodes: follow the coordinator's `suspended` and `hold` (polled every SUSPEND_POLL_S).
        While the published plan names a node that is gone or quarantined, no new iteration starts:
        an iteration in flight when a stage node was quarantined (alive, so the pipeline would run on
        through it) ends, the next waits for the re-plan, and a rebuilt stage joins a pipeline at rest."""
        while not self._done:
            try:
                st = await coordinator_status(self._coordinator_channel(), self.ctx.config.run_id,
                                              timeout=SUSPEND_POLL_S * 4)
                if st.suspended or st.hold:
                    self._running.clear()
                else:
                    self._running.set()
            except grpc.aio.AioRpcError:
                pass                                   # keep the last answer; the next poll retries
            await asyncio.sleep(SUSPEND_POLL_S)

    async def _start_iteration(self) -> None:
        if not self._running.is_set():
            log.warning("iteration %d waits: the coordinator holds the schedule (a planned node is gone or "
                        "quarantined); it starts after the re-plan",
                        self.ex.iteration, extra={"event": "pipeline_held", "iteration": self.ex.iteration})
            await self._running.wait()
        if self._train_t0 is None:
            self._train_t0 = time.monotonic()
        self._origin_times[self.ex.iteration] = [time.time()]
        self.net.send(await self.compute.run(self.ex.start_iteration))

    async def _start_eval(self) -> None:
        self._eval_t0 = time.monotonic()
        self.net.send(await self.compute.run(self.ex.start_eval))

    # ------------------------------------------------------------------ the loop
    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._done:
            t0 = loop.time()
            msg, reply = await self.net.inbox.get()
            if self.ex.in_flight or self.ex.iteration > 0:
                self._idle += loop.time() - t0
                M.IDLE_SECONDS.inc(loop.time() - t0)
            ep = msg.meta.get("ep")
            if ep is not None and ep not in self.ex.schedules and msg.meta.get("it", -1) >= self.ex.iteration:
                await self._fetch_epoch(ep)
            if self._resync_stage is not None and msg.kind in ("fwd", "bwd", "eoi", "grad") \
                    and msg.meta.get("it", -1) > self.ex.iteration and await self._missed(msg):
                try:
                    await self._resync(msg.meta["it"])
                except RecoveryError as exc:
                    log.error("replica re-sync failed: %s", exc, extra={"event": "recovery_failed"})
                    self._done = True
                    self.ctx.request_drain("recovery_failed")
                    return
            before = dict(self.ex.dropped)
            try:
                outs = await self.compute.run(self.ex.handle, msg)
            except BadInput as exc:
                M.ERRORS_SENT.labels(reason=exc.reason).inc()
                NM.count_rejection(exc.reason)
                log.warning("refused %s from %s: %s", msg.kind, msg.sender[:16], exc,
                            extra={"event": "pipeline_bad_input", "reason": exc.reason})
                await self.net.answer_error(reply, exc.reason, str(exc))
                continue
            except Exception:  # noqa: BLE001 - a bug must not leave the swarm waiting on a silent node
                log.exception("the stage executor failed on %s from %s; draining", msg.kind, msg.sender[:16],
                              extra={"event": "pipeline_failed"})
                self._done = True
                self.ctx.request_drain("stage_failed")
                return
            for reason, n in self.ex.dropped.items():
                if n > before.get(reason, 0):
                    M.DROPPED.labels(reason=reason).inc(n - before.get(reason, 0))
            self.net.send(outs)
            M.IN_FLIGHT.set(self.ex.in_flight)
            await self._after()

    async def _after(self) -> None:
        events, self.ex.events = self.ex.events, []
        for e in events:
            if isinstance(e, OriginDone):
                self._origin_times.setdefault(e.iteration, [math.nan]).append(time.time())
            elif isinstance(e, StepResult):
                await self._on_step(e)
            elif isinstance(e, EvalResult):
                await self._on_eval(e)
            elif isinstance(e, Aborted):
                await self._on_abort(e)
            elif e == "fin":
                await self._finish()

    async def _on_abort(self, e: Aborted) -> None:
        dropped = self.net.forget(e.lost)
        log.warning("iteration %d aborted: schedule epoch %d drops %d node(s) of epoch %d; %s", e.iteration,
                    e.new_epoch, len(e.lost), e.old_epoch,
                    "restarting it" if e.had_state and self.cfg.index == 0 else "waiting for it to restart",
                    extra={"event": "iteration_aborted", "iteration": e.iteration, "old_epoch": e.old_epoch,
                           "new_epoch": e.new_epoch, "lost": [x[:16] for x in e.lost], "unsent_dropped": dropped})
        self._last_step = time.monotonic()
        M.SCHEDULE_EPOCH.set(self.ex.epoch)
        sched = self.ex.schedules.get(self.ex.epoch)
        if e.had_state and sched is not None and self.ex.is_origin(sched) and not self._done:
            await self._start_iteration()

    async def _on_step(self, e: StepResult) -> None:
        self._resync_stage = self._resync_rule = None     # stepped in step with the pipeline: in sync
        now = time.monotonic()
        seconds, self._last_step = now - self._last_step, now
        idle, self._idle = self._idle, 0.0
        M.ITERATION_SECONDS.observe(seconds)
        M.IDLE_FRACTION.set(min(1.0, idle / seconds) if seconds > 0 else 0.0)
        M.ITERATION.set(self.ex.iteration)
        M.WEIGHTS_VERSION.set(self.ex.iteration)
        M.SCHEDULE_EPOCH.set(self.ex.epoch)
        for direction in ("forward", "backward"):
            have = M.MICROBATCHES.labels(direction=direction)._value.get()
            M.MICROBATCHES.labels(direction=direction).inc(self.ex.microbatches[direction] - have)
        M.DEFERRED.inc(self.ex.deferred_total - M.DEFERRED._value.get())
        if e.loss is not None:
            NM.record_train_step(e.loss, self.s.data.batch_size * self.s.data.seq_len * e.visits, seconds)
            self._loss_start = e.loss if self._loss_start is None else self._loss_start
            self._loss_end = e.loss
        else:
            NM.TRAIN_STEPS.inc()
        await self.compute.run(self._take_snapshot)
        done = bool(self.cfg.iterations) and self.ex.iteration >= self.cfg.iterations
        if done or (self.cfg.checkpoint_every and self.ex.iteration % self.cfg.checkpoint_every == 0):
            await self.compute.run(self._save_checkpoint)
        every = self.cfg.checkfree.embed_copy_every
        if self.cfg.index == 1 and every and (self.ex.iteration % every == 0 or self._embed_copy is None):
            self._tasks = [t for t in self._tasks if not t.done()]
            if not any(t.get_name() == "embed_copy" for t in self._tasks):   # one refresh at a time
                self._tasks.append(asyncio.create_task(self._refresh_embed_copy(self.ex.iteration), name="embed_copy"))
        commit = self._snapshot.meta["weights_sha256"] if self._snapshot is not None else e.weights_sha256
        # the coordinator compares replicas' commits (pipeline.md §4) and audits a stage whose replicas
        # disagree; the last 4 ride along so it can compare replicas polled at different iterations
        self._commits = (getattr(self, "_commits", []) + [f"{self.ex.iteration}:{commit[:16]}"])[-4:]
        self.ctx.card.update(publish=True, iteration=self.ex.iteration, commit=",".join(reversed(self._commits)))
        origin = self._origin_times.pop(e.iteration, None)
        log.info("stage %d step %d: %d/%d visits, grad norm %.4f", self.cfg.index, e.iteration, e.visits,
                 e.total_visits, e.grad_norm,
                 extra={"event": "stage_step", "stage": self.cfg.index, "iteration": e.iteration,
                        "visits": e.visits, "total_visits": e.total_visits,
                        "grad_norm": None if math.isnan(e.grad_norm) else e.grad_norm,
                        "grad_norm_clipped": None if math.isnan(e.grad_norm_clipped) else e.grad_norm_clipped,
                        "weights_sha256": e.weights_sha256, "loss": e.loss, "seconds": seconds, "idle_s": idle,
                        "epoch": self.ex.epoch,
                        **({"started_at": origin[0], "done_at": origin[-1]} if origin and len(origin) == 2 else {})})
        if self.cfg.index != 0:
            return
        if self.ex.epoch not in self.ex.schedules:      # the replicas agreed on an epoch we have not seen
            await self._fetch_epoch(self.ex.epoch)
        sched = self.ex.schedules.get(self.ex.epoch)
        if sched is None or not self.ex.is_origin(sched):
            log.warning("not an originator of schedule epoch %d (%s); waiting for a schedule that names this node",
                        self.ex.epoch, "not fetched" if sched is None else "not in it")
            return
        if self._evaluator() and (done or (self.cfg.eval_every and self.ex.iteration % self.cfg.eval_every == 0)):
            await self._start_eval()
        elif not done:
            await self._start_iteration()

    def _save_checkpoint(self) -> None:
        self.checkpointer.save({"stage": self.module, "optimizer": self.opt, "lr_schedule": self.lr_sched},
                               {"iteration": self.ex.iteration, "stage": self.cfg.index, "cfg_hash": self.cfg_hash})

    async def _on_eval(self, e: EvalResult) -> None:
        if self._eval_t0 is not None and self._train_t0 is not None:
            self._eval_s += time.monotonic() - self._eval_t0
        train_s = 0.0 if self._train_t0 is None else time.monotonic() - self._train_t0 - self._eval_s
        NM.EVAL_LOSS.set(e.loss)
        if self._eval_start is None:
            self._eval_start = e.loss
            NM.EVAL_LOSS_INITIAL.set(e.loss)
        self._eval_end = e.loss
        log.info("validation (full in-order model) after %d iterations: %.4f", e.iteration, e.loss,
                 extra={"event": "pipeline_eval", "iteration": e.iteration, "eval_loss": e.loss,
                        "train_s": round(train_s, 3)})
        if self.cfg.iterations and e.iteration >= self.cfg.iterations:
            self.net.send(self.ex.fin_messages())
            if not await self.net.flush(FIN_FLUSH_S):
                log.warning("not every fin message left within %.0f s; those nodes stop on their own timeout",
                            FIN_FLUSH_S)
            await self._finish()
        else:
            await self._start_iteration()

    async def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        log.info("pipeline finished after %d iterations", self.ex.iteration,
                 extra={"event": "training_finished", "iterations": self.ex.iteration, "stage": self.cfg.index,
                        "eval_loss_start": self._eval_start, "eval_loss_end": self._eval_end,
                        "train_loss_start": self._loss_start, "train_loss_end": self._loss_end,
                        "dropped": dict(self.ex.dropped), "deferred": self.ex.deferred_total,
                        "send_retries": self.net.retries, **self.net.hops.summary(),
                        "checkpoint": str(self.checkpointer.latest_path() or "")})
        self.ctx.request_drain("finished")

    async def _watchdog(self) -> None:
        while not self._done:
            await asyncio.sleep(min(5.0, self.cfg.iteration_timeout_s / 4))
            if time.monotonic() - self._last_step > self.cfg.iteration_timeout_s and not self._done:
                try:
                    st = await coordinator_status(self._coordinator_channel(), self.ctx.config.run_id)
                except Exception as exc:  # noqa: BLE001 - no answer: treat as stuck
                    st = None
                    log.info("coordinator status unavailable: %r", exc)
                if st is not None and st.suspended:
                    log.warning("iteration %d waits: the coordinator suspended the schedule (%s); start a "
                                "replacement with stage.checkfree.recover=true", self.ex.iteration, st.reason,
                                extra={"event": "pipeline_suspended", "iteration": self.ex.iteration,
                                       "missing": list(st.missing_stages)})
                    self._last_step = time.monotonic()
                    continue
                log.error("iteration %d made no progress for %.0f s; waiting for: %s", self.ex.iteration,
                          self.cfg.iteration_timeout_s, self.ex.waiting_for(),
                          extra={"event": "pipeline_stuck", "iteration": self.ex.iteration})
                self._done = True
                self.ctx.request_drain("stuck")

    # ------------------------------------------------------------------ drain
    async def drain(self, budget_s: float) -> None:
        self._done = True
        self.compute.stop()
        for t in self._tasks:
            t.cancel()
        await self.net.close()
        await self.compute.drain(max(0.1, budget_s / 4))
        self.compute.close()


__all__ = ["StageRole", "StageSettings", "activation_bytes", "stage_cfg_hash"]
