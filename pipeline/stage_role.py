"""The `stage` role: one SkipPipe pipeline stage on one node.

    swarmnode run --role stage --set stage.index=2 --initial-peers /ip4/…/p2p/12D3KooW…
    swarmnode demo --role stage          # 3 data nodes + 3 stages x 2 replicas on 127.0.0.1

The node's round policy on node/training.py's `TrainingRole` (compute thread, device, the round
loop, finish, drain, checkpoints, state serving, the per-round report). The engine is the
transport-free executor (pipeline/stage_exec.py: routing, memory window, deferral,
visit-normalised replica averaging, the single step; validation pipeline/stage_eval.py); the
streams are pipeline/stage_transport.py, the coordinator pipeline/coordinator.py (hosted by the
bootstrap through `StageRole.bootstrap_services`) and this node's link to it
pipeline/coordinator_link.py, what a stage is built from pipeline/stage_parts.py, its figures and
card pipeline/stage_progress.py, CheckFree pipeline/replacement.py (a replacement's start-up),
pipeline/recovery.py (the rebuild) and pipeline/embed_copy.py (stage 1's copy of stage 0).
This module owns the node's policy:

- one round is one pipeline iteration of this node: messages, each handled on the compute thread
  in arrival order, until it steps; one the executor cannot use (wrong shape) is answered with an
  `err` on its stream, never a crash; stale/unknown ones are dropped and counted
  (`swarmnode_pipeline_dropped_total{reason}`); the watchdog drains a node whose iteration makes
  no progress for `stage.iteration_timeout_s` (unless the coordinator suspended the schedule, or
  does not answer: then it waits up to `stage.coordinator_outage_s` for it to come back);
- the stage's layers live on the configured device (forward passes under its autocast; fp16 is
  refused, a pipeline would need one loss scale across stages);
- its card (`StageCard`) carries `stage`, `memory`, `compute_ms` (its measured forward time plus
  `stage.compute_delay_s`), `grad_bytes`, its device, `iteration` and the last weight commits
  (what the coordinator plans and audits with), and `cfg_hash` (donors are picked by it);
- stage-0 nodes hold the data (shard = their position among the schedule's originators) and
  start each iteration after their step; the schedule's first originator validates the full
  in-order model every `stage.eval_every` iterations; after `stage.exit_after` it validates once
  more and sends `fin` to every node, and each node finishes (`training_finished`) and drains
  on it: a stage cannot stop on its own count, the final validation passes through it;
- checkpoints (weights, AdamW, LR schedule) every `stage.checkpoint_every` iterations, when
  `exit_after` is reached and at the drain; its state is served after every step through
  `WeightService.Fetch`, the last KEEP_SNAPSHOTS by iteration for the coordinator's audits;
- one `stage_step` report per step (weight hash, norms, visits, seconds, idle seconds;
  originators add when their microbatches started and came back, `started_at` / `done_at`);
- CheckFree: with `stage.checkfree.recover` the node starts with no stage, takes and rebuilds the
  one the coordinator names, and only then publishes its card; a running iteration whose schedule
  is replaced by one without a lost node is aborted and (origins) restarted (`iteration_aborted`);
- every pipeline message it sends and receives is kept a few iterations as evidence for the
  coordinator's audits of its neighbours, and received non-finite tensors are tallied on its card
  (pipeline/stage_evidence.py, `stage.evidence_iterations`);
- `stage.attack_weight_edit` (a test and benchmark harness, refused off loopback) plugs
  pipeline/backdoor.py's `WeightEdit` into the executor's `after_step` hook, and the
  `stage.attack_*` knobs pipeline/live_attacks.py's `LiveAttack` into `_send` and the
  `before_step` hook; nothing else here knows of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from models.stages import stage_layer_ranges
from node import metrics as NM
from node.config import ConfigError
from node.coordinator_wait import short
from node.device import autocast
from node.logs import emit
from node.roles import Service, register
from node.state_sync import StateServicer, StateSnapshot
from node.training import TrainingRole, require_loopback
from pipeline import stage_metrics as M
from pipeline.backdoor import WeightEdit
from pipeline.checkfree import RecoveryError
from pipeline.config import StageConfig
from pipeline.coordinator import ScheduleCoordinator, StageAuditSpec
from pipeline.coordinator_link import CoordinatorLink
from pipeline.embed_copy import EmbedCopy
from pipeline.live_attacks import LiveAttack
from pipeline.recovery import optimizer_spec, param_spec, stage_checkpoint_dir
from pipeline.replacement import Replacement, Resync, lost_stage_on_start, stage_recovery
from pipeline.schedule import Schedule
from pipeline.stage_evidence import EVIDENCE_CHANNEL, EvidenceLog, EvidenceServer
from pipeline.stage_exec import Aborted, BadInput, EvalResult, OriginDone, StageExecutor, StepResult
from pipeline.stage_parts import (CHECKPOINT_FORMAT, StageParts, StageSettings, activation_bytes, build_module,
                                  build_parts, cfg_hash_of, stage_cfg_hash)
from pipeline.stage_probe import PROBE_CHANNEL, ProbeServer, ProbeSpec
from pipeline.stage_progress import StageCard, StageProgress
from pipeline.stage_timing import measure_forward_s
from pipeline.stage_transport import StageTransport
from pipeline.stage_watchdog import watch
from protocol import pipeline_pb2_grpc
from protocol.streams import add_tensor_stream_to_server

FIN_FLUSH_S = 10.0
"""Longest wait for the `fin` messages to leave before the evaluating node drains."""
KEEP_SNAPSHOTS = 8
"""Snapshots (weights + optimizer state) a stage node keeps and serves by iteration, so the
coordinator's integrity audit can fetch a step's before and after while the node runs on (with 4,
a fast unreplicated node had rotated the older one out while a slow download lasted: the audit
ended inconclusive)."""
RESYNC_KINDS = ("fwd", "bwd", "eoi", "grad")
"""Messages whose iteration tells a rebuilt stage whether the pipeline ran on without it."""


@register
class StageRole(TrainingRole):
    name = "stage"
    Settings = StageSettings
    run_section = "stage"
    Card = StageCard
    checkpoint_format = CHECKPOINT_FORMAT
    serves_state = True
    progress_key = "iteration"
    finished_msg = "pipeline finished after {iterations} iterations"
    cfg: StageConfig

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
                mod = build_module(s, index)
                specs[index] = (param_spec(mod), optimizer_spec(mod), cfg_hash_of(s, index))
            return specs[index]

        modules: dict[int, object] = {}

        def stage_module(index: int):
            """Stage `index`'s module for the audits' recomputation (built once; its weights are
            loaded per audit, and one audit of a stage runs at a time)."""
            if index not in modules:
                modules[index] = build_module(s, index)
            return modules[index]

        o = s.stage.optim
        audit = StageAuditSpec(stage_spec, tuple(o.betas), o.eps, o.weight_decay, module=stage_module)
        probe = ProbeSpec(s.model.d_model, s.model.vocab_size, s.data.seq_len)
        return [Service(pipeline_pb2_grpc.add_ScheduleServicer_to_server,
                        ScheduleCoordinator(ctx, s.schedule, activation_bytes(s), audit=audit, probe=probe),
                        "swarmnode.Schedule")]

    def __init__(self, ctx, settings: StageSettings):
        super().__init__(ctx, settings)
        if self.cfg.attack_weight_edit:
            require_loopback(ctx.config, "stage.attack_weight_edit", "Set it to 0")
            emit(self.log, "stage_attack", "*** TEST ONLY: this stage node is MALICIOUS: it edits its weights "
                 "outside the gradient path (stage.attack_weight_edit={edit:g}) ***", level=logging.WARNING,
                 edit=self.cfg.attack_weight_edit)
        self.attack = LiveAttack.from_config(self.cfg)
        if self.attack is not None:
            require_loopback(ctx.config, "stage.attack_*", "Turn the attack_* knobs off")
            emit(self.log, "stage_attack", "*** TEST ONLY: this stage node is MALICIOUS: {attack} ***",
                 level=logging.WARNING, attack=self.attack.describe())
        self.evidence = EvidenceLog(self.cfg.evidence_iterations)
        if not self.cfg.checkfree.recover:        # a replacement learns its stage first
            self.cfg_hash = stage_cfg_hash(settings)
        self.net = StageTransport(run_id=ctx.config.run_id, me=ctx.peer_id, netem=ctx.netem,
                                  max_tensor_bytes=int(self.cfg.max_activation_mb * 2 ** 20),
                                  send_timeout_s=self.cfg.iteration_timeout_s,
                                  on_reject=lambda reason: NM.TENSORS_REJECTED.labels(reason=reason).inc(),
                                  spawn=ctx.supervisor.spawn)
        # the coordinator's stage probe (pipeline/stage_probe.py) before it plans with this node
        self.net.service.register(PROBE_CHANNEL, ProbeServer(
            lambda: None if self.ex is None else self.ex.module, self.compute.run, lambda: self.device,
            lambda: autocast(self.device, ctx.config.device.precision)).on_stream)
        coordinator = ctx.config.security.coordinator_peer_id
        self.net.service.register(EVIDENCE_CHANNEL, EvidenceServer(
            lambda: self.evidence, lambda sender: not coordinator or sender == coordinator).on_stream)
        self.link = CoordinatorLink(ctx, self._on_schedule, on_wait=self._coordinator_changed)
        self._readiness = asyncio.Lock()      # the coordinator's heartbeat and the start-up both set it
        self._awaiting_schedule = False       # from looking for the coordinator until READY
        self.embed = EmbedCopy(ctx, stage_recovery(ctx, settings, self.compute, self.link.status),
                               self.cfg.checkfree.embed_copy_every, self.update_card)
        self.stats = StageProgress()
        self._snapshots: list[StateSnapshot] = []   # the last KEEP_SNAPSHOTS, newest last
        self.ex: StageExecutor | None = None
        self._corpus = None                    # stage 0: the loaded corpus (train stream, validation batches)
        self._resync: Resync | None = None     # a rebuilt stage, until its first step
        self._tasks: list[asyncio.Task] = []

    def services(self) -> list[Service]:
        return [Service(add_tensor_stream_to_server, self.net.service, "swarmnode.TensorStream"),
                *super().services()]

    def make_state_servicer(self) -> StateServicer:
        return StateServicer(self.ctx.config.run_id, self.cfg_hash, lambda: self.last_snapshot, self.ctx.netem,
                             history=self._snapshot_at, copies=self._copy_of)

    # ------------------------------------------------------------------ engine hooks
    def progress(self) -> int:
        """Completed iterations (optimizer steps) of this node."""
        return 0 if self.ex is None else self.ex.iteration

    def exit_reached(self) -> bool:
        """Never on a count: the run ends inside a round, on the final validation (the evaluating
        origin) or its `fin` (every other node), which pass through nodes that stepped already."""
        return False

    def round_wait_s(self, budget_s: float) -> float:
        """A round only waits for messages: the drain cancels it at once."""
        return 0.0

    def parts(self) -> dict:
        if self.ex is None:
            return {}
        return {"stage": self.ex.module, "optimizer": self.ex.opt, "lr_schedule": self.ex.sched}

    def checkpoint_meta(self) -> dict:
        return {"iteration": self.progress(), "stage": self.cfg.index, "cfg_hash": self.cfg_hash}

    def checkpoint_dir(self):
        """`<stage.checkpoint_dir>/stage-<index>/<peer ID>/` (replacements read it), else `state_dir`."""
        if not self.cfg.checkpoint_dir:
            return self.ctx.config.state_dir
        return stage_checkpoint_dir(self.cfg.checkpoint_dir, self.cfg.index) / self.ctx.peer_id[:24]

    async def checkpoint_if_due(self, count: int | None = None) -> bool:
        """Every `checkpoint_every` iterations (the base) and once when `exit_after` is reached:
        the trained stages a finished run leaves behind (benchmarks/skippipe.py reads them)."""
        if await super().checkpoint_if_due(count):
            return True
        if not (self.cfg.exit_after and self.progress() == self.cfg.exit_after):
            return False
        await self.write_checkpoint()
        return True

    def snapshot(self) -> StateSnapshot:
        """Compute thread: weights, AdamW state and the last step's record, kept by iteration."""
        meta, weights, opt = self.ex.snapshot()
        snap = StateSnapshot(meta, weights, opt)
        self._snapshots = (self._snapshots + [snap])[-KEEP_SNAPSHOTS:]
        return snap

    def _snapshot_at(self, iteration: int) -> StateSnapshot | None:
        """The kept snapshot of `iteration` (one of the last KEEP_SNAPSHOTS), else None."""
        for snap in reversed(self._snapshots):
            if int(snap.meta.get("iteration", -1)) == iteration:
                return snap
        return None

    def _copy_of(self, stage: int) -> StateSnapshot | None:
        """The copy of another stage this node serves (stage 0's, on a stage-1 node)."""
        return None if self.ex is None else self.embed.served(stage, self.ex.iteration)

    async def summary(self) -> dict:
        return {"iterations": self.progress(), "stage": self.cfg.index, **self.stats.summary(),
                "dropped": dict(self.ex.dropped), "deferred": self.ex.deferred_total,
                "send_retries": self.net.retries, **self.net.hops.summary(),
                "checkpoint": str(self.checkpoints.latest_path() or "")}

    async def close_transport(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.embed.cancel()
        await self.net.close()
        await self.link.close()

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        if not self.cfg.checkfree.recover:
            M.STAGE_INDEX.set(self.cfg.index)
        for gauge in (NM.TRAIN_LOSS, NM.TRAIN_LOSS_INITIAL, NM.EVAL_LOSS, NM.EVAL_LOSS_INITIAL):
            gauge.set(math.nan)          # until this node has one: transformer stages never compute a loss
        await super().start()

    async def setup(self) -> None:
        """Take the stage (built, or rebuilt by a replacement), place it, publish the card, follow
        the coordinator until a schedule names this node, then (origins) start iteration 0."""
        try:
            parts, iteration = await self._take_stage()
        except RecoveryError as exc:
            emit(self.log, "recovery_failed", "recovery failed: {error}", level=logging.ERROR, error=str(exc))
            self.stop()
            raise                        # the training task fails: the node exits 1, never a clean 0
        details = await self.compute.run(self._setup, parts, iteration, asyncio.get_running_loop())
        await self.take_snapshot()
        self.update_card(StageCard(stage=self.cfg.index, memory=self.settings.schedule.memory,
                                   iteration=self.ex.iteration, cfg_hash=self.cfg_hash, **details), publish=True)
        M.WEIGHTS_VERSION.set(self.ex.iteration)
        emit(self.log, "stage_started", "stage {stage} built on {device_kind} (cfg_hash {cfg_hash})",
             stage=self.cfg.index, cfg_hash=self.cfg_hash, **details)
        self._awaiting_schedule = True
        await self.link.find()
        self._spawn("stage_schedule_watch", self.link.watch)
        self._spawn("stage_coordinator_heartbeat", self.link.heartbeat)
        if self.cfg.index == 0:
            self._spawn("stage_suspension_watch", lambda: self.link.watch_suspension(lambda: self.stopping))
        await self.link.have_schedule.wait()
        await self._settle()
        self.stats.touch()
        self._tasks.append(self.ctx.supervisor.spawn("stage_watchdog", self._watchdog, restart=False))  # fails: exit 1
        async with self._readiness:
            self._awaiting_schedule = False
            self.update_card(StageCard(coordinator_wait=None), publish=True)
            await self.ctx.set_role_ready(True, "ready", "")
        M.SCHEDULE_EPOCH.set(self.ex.epoch)
        if self.ex.is_origin(self.ex.schedules[self.ex.epoch]):
            await self.compute.run(self._start_data)
            if self._evaluator():
                await self._start_eval()
            else:
                await self._start_iteration()

    async def _coordinator_changed(self) -> None:
        """The coordinator started or stopped answering (pipeline/coordinator_link.py): a node with
        no schedule yet says in its readiness and card what it waits for; a running one trains on
        with its last schedule (`/readyz` `details.coordinator` and the log say it lost it)."""
        async with self._readiness:
            if not self._awaiting_schedule:
                return
            wait = self.link.wait
            self.update_card(StageCard(coordinator_wait=wait.card_value()), publish=True)
            if wait.waiting:
                await self.ctx.set_role_ready(False, "awaiting_coordinator", wait.sentence())
            else:
                st = self.link.last_status
                why = st.reason if st is not None and st.reason else "no schedule names this node yet"
                await self.ctx.set_role_ready(False, "awaiting_assignment", f"the coordinator {short(wait.peer_id)} "
                                              f"answers; waiting for a schedule that names this node ({why})")

    async def _take_stage(self) -> tuple[StageParts, int]:
        """(the stage's parts, the completed iteration they belong to): `stage.index` at its initial
        weights, or, for a replacement, the stage the coordinator names, rebuilt from live peers. A
        node started with `stage.index` into a run whose stage `index` is lost (restarted after a
        crash) rebuilds it as a replacement would (`stage_rejoin`)."""
        if not self.cfg.checkfree.recover:
            self._awaiting_schedule = True    # /readyz and the card say it waits for a coordinator
        await self.link.find()
        prefer = None
        if not self.cfg.checkfree.recover:
            st = await lost_stage_on_start(self.link.status, self.cfg.index, self.cfg.coordinator_outage_s)
            if st is None:
                return await self.compute.run(build_parts, self.settings, self.cfg.index), 0
            prefer, self._awaiting_schedule = self.cfg.index, False    # its readiness says `recovering` now
            emit(self.log, "stage_rejoin", "stage {stage} has no live node in schedule epoch {epoch}: rebuilding it "
                 "from live peers (CheckFree) instead of starting at its initial weights", level=logging.WARNING,
                 stage=self.cfg.index, epoch=st.epoch, missing=list(st.missing_stages))
        taken = await Replacement(self.ctx, self.settings, self.embed.recovery, self.compute,
                                  self.update_card, prefer=prefer).take()
        self._resync = taken.resync
        return taken.parts, taken.iteration

    def _setup(self, parts: StageParts, iteration: int, loop: asyncio.AbstractEventLoop) -> dict:
        """Compute thread: device, executor; returns the card details (device, compute_ms, grad_bytes)."""
        s = self.settings
        self.cfg.index = parts.index
        self.cfg_hash = stage_cfg_hash(s)
        details = self.place()
        device, precision = self.device, self.ctx.config.device.precision
        parts.module.to(device)
        d = self.cfg.compute_delay_s
        factors = {"forward": 1.0, "backward": 1.5, "loss": 0.25}
        delay = (lambda kind: time.sleep(d * factors[kind])) if d else None
        eval_data = None
        if parts.index == 0:
            from models.corpus import eval_batches, load_corpus
            self._corpus = load_corpus(s.data)
            eval_data = eval_batches(self._corpus.val, s.data.batch_size, s.data.seq_len, self.cfg.eval_batches)
        edit = self.cfg.attack_weight_edit
        self.ex = StageExecutor(self.ctx.peer_id, parts.index, parts.module, parts.optimizer, memory=s.schedule.memory,
                                clip=self.cfg.optim.clip_norm, eval_data=eval_data, delay=delay, device=device,
                                scheduler=parts.lr_schedule, autocast=lambda: autocast(device, precision),
                                emit=lambda outs: loop.call_soon_threadsafe(self._send, outs),
                                after_step=WeightEdit(edit) if edit else None,
                                before_step=self.attack.before_step if self.attack else None)
        self.ex.iteration = iteration
        forward_s = measure_forward_s(parts.module, s.data.batch_size, s.data.seq_len, s.model, device,
                                      lambda: autocast(device, precision))
        return {**details, "compute_ms": max(1, int(round((forward_s + d) * 1000))),
                "grad_bytes": 4 * sum(p.numel() for p in parts.module.parameters())}

    def _start_data(self) -> None:
        """Compute thread, stage 0: this originator's shard of the training stream."""
        from models.corpus import batches
        s, sched = self.settings, self.ex.schedules[self.ex.epoch]
        shard = sched.origins.index(sched.names.index(self.ctx.peer_id))
        gen = batches(self._corpus.train, s.data.batch_size, s.data.seq_len, self.cfg.seed + 1,
                      shard=shard, num_shards=len(sched.origins),   # a rebuilt data node goes on, not back to 0
                      start_step=self.ex.iteration * s.schedule.mb_per_origin)
        self.ex.data = lambda: next(gen)

    def _spawn(self, name: str, factory) -> None:
        """A long-lived task of this node: supervised, cancelled when the node drains."""
        self._tasks.append(self.ctx.supervisor.spawn(name, factory))

    def _fail(self, reason: str) -> None:
        """Stop training and drain (the log line that says why is the caller's)."""
        self.stop()
        self.ctx.request_drain(reason)

    async def _settle(self) -> None:
        """Start on a schedule that stayed the newest for `schedule.settle_s`: every originator then
        starts iteration 0 on the same epoch (later epochs are agreed through the stage-0 exchange)."""
        while True:
            epoch = self.ex.latest_epoch
            await asyncio.sleep(self.settings.schedule.settle_s)
            if self.ex.latest_epoch == epoch:
                return

    async def _on_schedule(self, sched: Schedule, addrs: dict[str, str]) -> None:
        """A validated schedule from the coordinator: its peers' addresses, then the executor."""
        self.net.addrs.update(addrs)
        await self.compute.run(self.ex.add_schedule, sched)
        if self.ex.events:                   # an aborted iteration, or a degraded step
            await self._after()

    def _evaluator(self) -> bool:
        sched = self.ex.schedules[self.ex.epoch]
        return sched.names[sched.origins[0]] == self.ctx.peer_id

    async def _start_iteration(self) -> None:
        if not self.link.running.is_set():
            emit(self.log, "pipeline_held", "iteration {iteration} waits: the coordinator holds the schedule (a "
                 "planned node is gone or quarantined); it starts after the re-plan", level=logging.WARNING,
                 iteration=self.ex.iteration)
            await self.link.running.wait()
        self.stats.iteration_started(self.ex.iteration)
        self._send(await self.compute.run(self.ex.start_iteration))

    async def _start_eval(self) -> None:
        self.stats.eval_started()
        self._send(await self.compute.run(self.ex.start_eval))

    # ------------------------------------------------------------------ one round
    async def one_round(self) -> None:
        """Messages, in arrival order, until this node steps (one iteration) or the run ends."""
        start = self.ex.iteration
        while not self.stopping and self.ex.iteration == start:
            await self._handle_next()

    async def _handle_next(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        msg, reply = await self.net.inbox.get()
        if self.ex.in_flight or self.ex.iteration > 0:
            self.stats.waited(loop.time() - t0)
        ep = msg.meta.get("ep")
        if ep is not None and ep not in self.ex.schedules and msg.meta.get("it", -1) >= self.ex.iteration:
            await self.link.fetch_epoch(ep)
        if self._resync is not None and msg.kind in RESYNC_KINDS \
                and msg.meta.get("it", -1) > self.ex.iteration and await self._missed(msg):
            resync, self._resync = self._resync, None
            try:
                await resync(self.ex, msg.meta["it"])
            except RecoveryError as exc:
                emit(self.log, "recovery_failed", "replica re-sync failed: {error}", level=logging.ERROR,
                     error=str(exc))
                self._fail("recovery_failed")
                return
            await self.take_snapshot()
        self.evidence.note("recv", msg.kind, msg.meta, msg.sender, msg.tensor)
        before = dict(self.ex.dropped)
        try:
            outs = await self.compute.run(self.ex.handle, msg)
        except BadInput as exc:
            self.evidence.refused(msg.kind, msg.meta, msg.sender)
            M.ERRORS_SENT.labels(reason=exc.reason).inc()
            NM.count_rejection(exc.reason)
            emit(self.log, "pipeline_bad_input", "refused {kind} from {sender}: {error}", level=logging.WARNING,
                 kind=msg.kind, sender=msg.sender[:16], error=str(exc), reason=exc.reason)
            await self.net.answer_error(reply, exc.reason, str(exc))
            return
        except Exception:  # noqa: BLE001 - a bug must not leave the swarm waiting on a silent node
            emit(self.log, "pipeline_failed", "the stage executor failed on {kind} from {sender}; draining",
                 level=logging.ERROR, exc_info=True, kind=msg.kind, sender=msg.sender[:16])
            self._fail("stage_failed")
            return
        for reason, n in self.ex.dropped.items():
            if n > before.get(reason, 0):
                M.DROPPED.labels(reason=reason).inc(n - before.get(reason, 0))
        self._send(outs)
        M.IN_FLIGHT.set(self.ex.in_flight)
        await self._after()

    def _send(self, outs: list) -> None:
        """Every pipeline message leaves here: kept as evidence (pipeline/stage_evidence.py), after
        the test-only attack harness (if any) rewrote it."""
        if self.attack is not None:
            outs = self.attack.outgoing(outs)
        for o in outs:
            self.evidence.note("sent", o.kind, o.meta, o.dest, o.tensor)
        self.net.send(outs)

    async def _missed(self, msg) -> bool:
        """A rebuilt stage's first message of a later iteration: did the pipeline step this node's
        iteration without it (see StageExecutor.missed)? Fetches the schedule the message names."""
        pe = msg.meta.get("pe", -1)
        if pe >= 0 and pe not in self.ex.schedules:
            await self.link.fetch_epoch(pe)
        return self.ex.missed(msg)

    async def _after(self) -> None:
        events, self.ex.events = self.ex.events, []
        for e in events:
            if isinstance(e, OriginDone):
                self.stats.origin_done(e.iteration)
            elif isinstance(e, StepResult):
                await self._on_step(e)
            elif isinstance(e, EvalResult):
                await self._on_eval(e)
            elif isinstance(e, Aborted):
                await self._on_abort(e)
            elif e == "fin":
                await self.finish()

    async def _on_abort(self, e: Aborted) -> None:
        restart = e.had_state and self.cfg.index == 0
        emit(self.log, "iteration_aborted", "iteration {iteration} aborted: schedule epoch {new_epoch} drops "
             "node(s) {lost} of epoch {old_epoch} (restart: {restart})", level=logging.WARNING,
             iteration=e.iteration, old_epoch=e.old_epoch, new_epoch=e.new_epoch, lost=[x[:16] for x in e.lost],
             unsent_dropped=self.net.forget(e.lost), restart=restart)
        self.stats.touch()
        M.SCHEDULE_EPOCH.set(self.ex.epoch)
        sched = self.ex.schedules.get(self.ex.epoch)
        if e.had_state and sched is not None and self.ex.is_origin(sched) and not self.stopping:
            await self._start_iteration()

    async def _on_step(self, e: StepResult) -> None:
        self._resync = None                      # stepped in step with the pipeline: in sync
        if e.moments_reset:
            emit(self.log, "optimizer_moments_reset", "iteration {iteration}: AdamW moments cleared before the step "
                 "(the first on schedule epoch {epoch}, made after a quarantine: what the quarantined node sent "
                 "is out of the optimizer state)", level=logging.WARNING, iteration=e.iteration, epoch=self.ex.epoch)
        timing, train = self.stats.step(e, self.ex, self.settings.data.batch_size * self.settings.data.seq_len)
        snap = await self.take_snapshot()
        if self.cfg.index == 1:
            self.embed.maybe_refresh(self.ex.iteration)
        # the coordinator compares replicas' commits and audits a stage whose replicas disagree
        commit = self.stats.commit(self.ex.iteration, snap.meta["weights_sha256"])
        self.report("stage_step", "stage {stage} step {iteration}: {visits}/{total_visits} visits, grad norm "
                    "{grad_norm:.4f}", steps=[train] if train else (),
                    card=StageCard(iteration=self.ex.iteration, commit=commit,
                                   nonfinite=self.evidence.card_detail() or None,
                                   loss=e.loss if e.loss is not None and math.isfinite(e.loss) else None),
                    publish=True,
                    stage=self.cfg.index, iteration=e.iteration, visits=e.visits, total_visits=e.total_visits,
                    grad_norm=None if math.isnan(e.grad_norm) else e.grad_norm,
                    grad_norm_clipped=None if math.isnan(e.grad_norm_clipped) else e.grad_norm_clipped,
                    weights_sha256=e.weights_sha256, loss=e.loss, epoch=self.ex.epoch, **timing)
        if self.cfg.index != 0:
            return
        if self.ex.epoch not in self.ex.schedules:      # the replicas agreed on an epoch we have not seen
            await self.link.fetch_epoch(self.ex.epoch)
        sched = self.ex.schedules.get(self.ex.epoch)
        if sched is None or not self.ex.is_origin(sched):
            emit(self.log, "not_an_origin", "not an originator of schedule epoch {epoch} ({why}); waiting for a "
                 "schedule that names this node", level=logging.WARNING, epoch=self.ex.epoch,
                 why="not fetched" if sched is None else "not in it")
            return
        done = bool(self.cfg.exit_after) and self.ex.iteration >= self.cfg.exit_after
        if self._evaluator() and (done or self.eval_due()):
            await self._start_eval()
        elif not done:
            await self._start_iteration()

    async def _on_eval(self, e: EvalResult) -> None:
        emit(self.log, "pipeline_eval", "validation (full in-order model) after {iteration} iterations: "
             "{eval_loss:.4f}", iteration=e.iteration, eval_loss=e.loss, train_s=round(self.stats.eval_done(e), 3))
        if self.cfg.exit_after and e.iteration >= self.cfg.exit_after:
            self.net.send(self.ex.fin_messages())
            if not await self.net.flush(FIN_FLUSH_S):
                emit(self.log, "fin_unsent", "not every fin message left within {timeout_s:.0f} s; those nodes "
                     "stop on their own timeout", level=logging.WARNING, timeout_s=FIN_FLUSH_S)
            await self.finish()
        else:
            await self._start_iteration()

    async def _watchdog(self) -> None:
        """pipeline/stage_watchdog.py: a stuck pipeline waits (suspended, coordinator gone) or exits 1."""
        await watch(self)


__all__ = ["CHECKPOINT_FORMAT", "StageCard", "StageRole", "StageSettings", "activation_bytes", "stage_cfg_hash"]
