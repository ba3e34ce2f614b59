"""The `stage` role: one SkipPipe pipeline stage on one node (pipeline.md §2.5, §5).

    swarmnode run --role stage --set stage.index=2 --initial-peers /ip4/…/p2p/12D3KooW…

Glue only: the executor (routing, memory window, deferral, visit-normalised replica averaging,
the single step) is pipeline/stage_exec.py, the model split models/stages.py, the planner
pipeline/search.py behind the bootstrap's `Schedule` service (pipeline/coordinator.py, hosted
through `StageRole.bootstrap_services`). This module owns the node's side:

- its card carries `stage`, `memory` and `compute_ms` (what the coordinator plans with) and
  `iteration`; it follows `Schedule.Watch` on the bootstrap, validates every schedule before
  use and fetches an epoch it has not seen when a message names one;
- one open tensor stream per neighbour it sends to (`protocol/streams.py`, channel `pipe`),
  fed by a per-neighbour queue, so compute never waits for a slow link; incoming streams feed
  one inbox; every message is handled on the compute thread (`node/compute.py`), in arrival
  order; a message the executor cannot use (wrong shape) is answered with an `err` tensor on
  the same stream, never a crash; stale/unknown ones are dropped and counted;
- stage-0 nodes hold the data (a shard of the corpus picked from the peer ID), start each
  iteration after their step, and the schedule's first originator validates the full in-order
  model every `stage.eval_every` iterations; after `stage.iterations` it validates once more
  and sends `fin` to every node, which then drains;
- metrics (pipeline/stage_metrics.py) and one `stage_step` log line per step with the weight
  hash, so replicas can be compared.
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
from models.stages import build_stage, stage_layer_ranges
from node import metrics as NM
from node.card import read_cards
from node.compute import Compute
from node.config import ConfigError
from node.device import resolve_device
from node.roles import RoleBase, Service, register
from pipeline import stage_metrics as M
from pipeline.config import ScheduleConfig, StageConfig
from pipeline.coordinator import ScheduleCoordinator, fetch_schedule, parse_reply
from pipeline.schedule import ScheduleViolation
from pipeline.stage_exec import BadInput, EvalResult, Msg, Out, StageExecutor, StepResult
from protocol import pipeline_pb2, pipeline_pb2_grpc
from protocol.streams import ChannelPool, StreamError, TensorStreamService, add_tensor_stream_to_server, open_stream

log = logging.getLogger("swarmnode.stage")

CHANNEL = "pipe"


class StageSettings(BaseModel):
    """The sections the stage role reads: ``[stage]``, ``[schedule]``, ``[model]``, ``[data]``."""

    model_config = ConfigDict(extra="forbid")
    stage: StageConfig
    schedule: ScheduleConfig
    model: ModelConfig
    data: DataConfig


def activation_bytes(s: StageSettings) -> int:
    return s.data.batch_size * s.data.seq_len * s.model.d_model * 4


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
        return s

    @classmethod
    def bootstrap_services(cls, ctx) -> list[Service]:
        """The schedule service, planned from the [schedule] section of the bootstrap's config."""
        s = super().validate_config(ctx.config)
        return [Service(pipeline_pb2_grpc.add_ScheduleServicer_to_server,
                        ScheduleCoordinator(ctx, s.schedule, activation_bytes(s)), "swarmnode.Schedule")]

    def __init__(self, ctx, settings: StageSettings):
        self.ctx, self.s, self.cfg = ctx, settings, settings.stage
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.me = ctx.peer_id
        self.module = build_stage(settings.model, self.cfg.seed, self.cfg.index, settings.schedule.stages,
                                  self.cfg.stage0_layers)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.compute = Compute(self.name)
        self.max_bytes = int(self.cfg.max_activation_mb * 2 ** 20)
        self.svc = TensorStreamService(run_id=ctx.config.run_id, peer_id=self.me, max_tensor_bytes=self.max_bytes,
                                       on_reject=lambda reason: NM.TENSORS_REJECTED.labels(reason=reason).inc())
        self.svc.register(CHANNEL, self._on_stream)
        self.pool = ChannelPool()
        self.addrs: dict[str, str] = {}
        self.coordinator: str | None = None
        self.ex: StageExecutor | None = None
        self._tasks: list[asyncio.Task] = []
        self._outq: dict[str, asyncio.Queue] = {}
        self._inbox: asyncio.Queue | None = None
        self._have_schedule = asyncio.Event()
        self._eval_start: float | None = None
        self._eval_end: float | None = None
        self._loss_start: float | None = None
        self._loss_end: float | None = None
        self._last_step = time.monotonic()
        self._idle = 0.0
        self._done = False

    def services(self) -> list[Service]:
        return [Service(add_tensor_stream_to_server, self.svc, "swarmnode.TensorStream")]

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        await self.ctx.set_role_ready(False, "role_init", "building the stage and waiting for a schedule")
        self._inbox = asyncio.Queue()
        M.STAGE_INDEX.set(self.cfg.index)
        compute_ms = int(round(self.cfg.compute_delay_s * 1000))
        self.ctx.card.update(publish=True, stage=self.cfg.index, memory=self.s.schedule.memory, iteration=0,
                             **({"compute_ms": compute_ms} if compute_ms else {}))
        self.ctx.supervisor.spawn("stage_main", self._main, restart=False)

    def _setup(self) -> None:
        """Compute thread: device, data (stage 0) and the executor."""
        self.device = resolve_device(self.ctx.config.device)
        self.module.to(self.device)
        data = eval_data = None
        if self.cfg.index == 0:
            from models.corpus import batches, eval_batches, load_corpus
            corpus = load_corpus(self.s.data)
            shard = int(hashlib.sha256(self.me.encode()).hexdigest(), 16) % 16
            gen = batches(corpus.train, self.s.data.batch_size, self.s.data.seq_len, self.cfg.seed + 1,
                          shard=shard, num_shards=16)
            data = lambda: next(gen)  # noqa: E731
            eval_data = eval_batches(corpus.val, self.s.data.batch_size, self.s.data.seq_len, self.cfg.eval_batches)
        d = self.cfg.compute_delay_s
        factors = {"forward": 1.0, "backward": 1.5, "loss": 0.25}
        delay = (lambda kind: time.sleep(d * factors[kind])) if d else None
        self.ex = StageExecutor(self.me, self.cfg.index, self.module, self.opt, memory=self.s.schedule.memory,
                                clip=self.cfg.clip, data=data, eval_data=eval_data, delay=delay, device=self.device)

    async def _find_coordinator(self) -> str:
        while True:
            try:
                for v in await read_cards(self.ctx.membership.dht, self.ctx.config.run_id):
                    if v.card.role == "bootstrap" and v.card.grpc_addr:
                        return v.card.grpc_addr
            except Exception as exc:  # noqa: BLE001 - retried
                log.debug("reading cards: %r", exc)
            await asyncio.sleep(1.0)

    async def _watch(self) -> None:
        """Follow Schedule.Watch; reconnect on errors."""
        while True:
            try:
                stub = pipeline_pb2_grpc.ScheduleStub(self.pool.get(self.coordinator))
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
        self.addrs.update(addrs)
        await self.compute.run(self.ex.add_schedule, sched)
        log.info("schedule epoch %d adopted (%d paths, predicted %.3f s)", sched.epoch, len(sched.paths),
                 sched.expected_makespan, extra={"event": "schedule_adopted", "epoch": sched.epoch})
        if self.me in sched.names:
            self._have_schedule.set()

    async def _main(self) -> None:
        await self.compute.run(self._setup)
        self.coordinator = await self._find_coordinator()
        self._tasks.append(asyncio.ensure_future(self._watch()))
        await self._have_schedule.wait()
        await self._settle()
        self._last_step = time.monotonic()
        self._tasks.append(asyncio.ensure_future(self._watchdog()))
        await self.ctx.set_role_ready(True, "ready", "")
        M.SCHEDULE_EPOCH.set(self.ex.epoch)
        sched = self.ex.schedules[self.ex.epoch]
        if self.ex.is_origin(sched):
            if self._evaluator():
                self._dispatch(await self.compute.run(self.ex.start_eval))
            else:
                self._dispatch(await self.compute.run(self.ex.start_iteration))
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

    # ------------------------------------------------------------------ transport
    async def _on_stream(self, stream) -> None:
        sender = stream.peer.sender
        async for r in stream:
            try:
                meta = {k: int(v) for k, v in r.meta.items()}
            except ValueError:
                M.DROPPED.labels(reason="malformed").inc()
                continue
            self._inbox.put_nowait((Msg(r.name, sender, meta, r.tensor), stream))

    def _dispatch(self, outs: list[Out]) -> None:
        for o in outs:
            if o.dest == self.me:
                self._inbox.put_nowait((Msg(o.kind, self.me, o.meta, o.tensor), None))
                continue
            q = self._outq.get(o.dest)
            if q is None:
                q = self._outq[o.dest] = asyncio.Queue()
                self._tasks.append(asyncio.ensure_future(self._sender(o.dest, q)))
            q.put_nowait(o)

    async def _open(self, dest: str):
        addr = self.addrs.get(dest)
        if addr is None:
            raise StreamError("refused", f"no address for {dest[:16]} in any schedule")
        stream = await open_stream(self.pool.get(addr), run_id=self.ctx.config.run_id, sender=self.me,
                                   channel_name=CHANNEL, max_tensor_bytes=self.max_bytes)
        self._tasks.append(asyncio.ensure_future(self._replies(dest, stream)))
        return stream

    async def _replies(self, dest: str, stream) -> None:
        """Errors a peer answers on our outgoing stream (e.g. wrong-shape activations)."""
        try:
            async for r in stream:
                if r.name == "err":
                    log.warning("%s refused a message: %s", dest[:16], r.meta.get("detail", ""),
                                extra={"event": "pipeline_error_reply", "reason": r.meta.get("reason", "")})
        except StreamError:
            pass

    async def _sender(self, dest: str, q: asyncio.Queue) -> None:
        stream = None
        while True:
            o = await q.get()
            tensor = o.tensor.detach().cpu().contiguous()
            meta = {k: str(v) for k, v in o.meta.items()}
            addr = self.addrs.get(dest, dest)
            await self.ctx.netem.delay(addr, tensor.numel() * tensor.element_size())
            for attempt in range(3):
                try:
                    if stream is None or stream.error is not None:
                        stream = await self._open(dest)
                    await stream.send(o.kind, tensor, meta, timeout=self.cfg.iteration_timeout_s)
                    break
                except (StreamError, TimeoutError, grpc.aio.AioRpcError) as exc:
                    log.warning("send %s to %s failed (attempt %d): %r", o.kind, dest[:16], attempt + 1, exc,
                                extra={"event": "pipeline_send_failed"})
                    if stream is not None:
                        stream.cancel()
                    stream = None
                    await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ the loop
    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._done:
            t0 = loop.time()
            msg, reply = await self._inbox.get()
            if self.ex.in_flight or self.ex.iteration > 0:
                M.IDLE_SECONDS.inc(loop.time() - t0)
                self._idle += loop.time() - t0
            ep = msg.meta.get("ep")
            if ep is not None and ep not in self.ex.schedules and msg.meta.get("it", -1) >= self.ex.iteration:
                await self._fetch_epoch(ep)
            before = dict(self.ex.dropped)
            try:
                outs = await self.compute.run(self.ex.handle, msg)
            except BadInput as exc:
                M.ERRORS_SENT.labels(reason=exc.reason).inc()
                NM.count_rejection(exc.reason)
                log.warning("refused %s from %s: %s", msg.kind, msg.sender[:16], exc,
                            extra={"event": "pipeline_bad_input", "reason": exc.reason})
                if reply is not None:
                    try:
                        await reply.send("err", torch.zeros(1), {"reason": exc.reason, "detail": str(exc)[:300]},
                                         timeout=5.0)
                    except (StreamError, TimeoutError):
                        pass
                continue
            for reason, n in self.ex.dropped.items():
                if n > before.get(reason, 0):
                    M.DROPPED.labels(reason=reason).inc(n - before.get(reason, 0))
            self._dispatch(outs)
            M.IN_FLIGHT.set(self.ex.in_flight)
            await self._after()

    async def _fetch_epoch(self, ep: int) -> None:
        try:
            sched, addrs = await fetch_schedule(self.pool.get(self.coordinator), self.ctx.config.run_id, ep)
            await self._adopt(sched, addrs)
        except (ScheduleViolation, grpc.aio.AioRpcError) as exc:
            log.warning("could not fetch schedule epoch %d: %r", ep, exc)

    async def _after(self) -> None:
        events, self.ex.events = self.ex.events, []
        for e in events:
            if isinstance(e, StepResult):
                await self._on_step(e)
            elif isinstance(e, EvalResult):
                await self._on_eval(e)
            elif e == "fin":
                self._finish()

    async def _on_step(self, e: StepResult) -> None:
        now = time.monotonic()
        seconds, self._last_step = now - self._last_step, now
        M.ITERATION_SECONDS.observe(seconds)
        M.IDLE_FRACTION.set(min(1.0, self._idle / seconds) if seconds > 0 else 0.0)
        idle, self._idle = self._idle, 0.0
        M.ITERATION.set(self.ex.iteration)
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
        self.ctx.card.update(iteration=self.ex.iteration)
        log.info("stage %d step %d: %d/%d visits, grad norm %.4f", self.cfg.index, e.iteration, e.visits,
                 e.total_visits, e.grad_norm,
                 extra={"event": "stage_step", "stage": self.cfg.index, "iteration": e.iteration,
                        "visits": e.visits, "total_visits": e.total_visits,
                        "grad_norm": None if math.isnan(e.grad_norm) else e.grad_norm,
                        "weights_sha256": e.weights_sha256, "loss": e.loss, "seconds": seconds, "idle_s": idle,
                        "epoch": self.ex.epoch})
        sched = self.ex.schedules[self.ex.epoch]
        if not self.ex.is_origin(sched):
            return
        done = self.cfg.iterations and self.ex.iteration >= self.cfg.iterations
        if self._evaluator() and (done or (self.cfg.eval_every and self.ex.iteration % self.cfg.eval_every == 0)):
            self._dispatch(await self.compute.run(self.ex.start_eval))
        elif not done:
            self._dispatch(await self.compute.run(self.ex.start_iteration))

    async def _on_eval(self, e: EvalResult) -> None:
        NM.EVAL_LOSS.set(e.loss)
        if self._eval_start is None:
            self._eval_start = e.loss
            NM.EVAL_LOSS_INITIAL.set(e.loss)
        self._eval_end = e.loss
        log.info("validation (full in-order model) after %d iterations: %.4f", e.iteration, e.loss,
                 extra={"event": "pipeline_eval", "iteration": e.iteration, "eval_loss": e.loss})
        if self.cfg.iterations and e.iteration >= self.cfg.iterations:
            self._dispatch(self.ex.fin_messages())
            await asyncio.sleep(0.5)  # let the fin messages leave before draining
            self._finish()
        else:
            self._dispatch(await self.compute.run(self.ex.start_iteration))

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        log.info("pipeline finished after %d iterations", self.ex.iteration,
                 extra={"event": "training_finished", "iterations": self.ex.iteration, "stage": self.cfg.index,
                        "eval_loss_start": self._eval_start, "eval_loss_end": self._eval_end,
                        "train_loss_start": self._loss_start, "train_loss_end": self._loss_end,
                        "dropped": dict(self.ex.dropped)})
        self.ctx.request_drain("finished")

    async def _watchdog(self) -> None:
        while not self._done:
            await asyncio.sleep(min(5.0, self.cfg.iteration_timeout_s / 4))
            if time.monotonic() - self._last_step > self.cfg.iteration_timeout_s and not self._done:
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
        for stream in list(self.svc.open_streams):
            stream.cancel()
        await self.pool.close()
        await self.compute.drain(max(0.1, budget_s / 4))
        self.compute.close()


__all__ = ["StageRole", "StageSettings"]
