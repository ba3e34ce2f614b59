"""The SkipPipe coordinator: the `Schedule` gRPC service the bootstrap hosts for the `stage` role.

Owns planning from the swarm's state and publishing the result (docs/pipeline.md, 'Coordinator'): every second
it reads the run's node cards, takes the `stage` nodes that are not draining (their `stage`,
`memory` and `compute_ms` card details), and when that membership changed and then stayed put
for `schedule.settle_s` (and every stage has a node, and at least `schedule.expect_nodes` are
present) it builds the cost model (per-node compute; links from this node's `[netem]` matrix,
links or default, keyed by gRPC address or peer ID, else `schedule.default_latency_ms`),
plans with `pipeline.search.plan` off the event loop, validates the schedule and publishes it
with the next epoch; the `schedule_published` log event carries the schedule body and the cost
model it was planned on, so any run's schedule can be re-simulated or re-planned offline. `Schedule.Get` answers one epoch (0 = latest), `Schedule.Watch` streams
every new one. Stage nodes validate again before use. The planning itself is pure
(pipeline/search.py); this module is its glue to cards and gRPC.

The liveness rules (health probes, the stage a replacement should take, who is readmitted) are
pipeline/stage_liveness.py; this module acts on them: a stage of the schedule left with no live
node suspends the schedule (`stage_down`), `Schedule.Status` reports it.

Admission and stalls (pipeline/stage_admission.py): a stage node is a member only once it answered
a stage probe (a forward of a probe microbatch over its tensor stream); when no planned node steps
for `schedule.stall_s`, every planned node is probed again and those that fail leave the plan for
good. The replica-integrity audits are pipeline/replica_audits.py, the attribution of non-finite
outputs pipeline/nonfinite_watch.py; this module quarantines.

Standby coordinators (node/coordinator_lease.py): with several bootstraps, only the one holding
the coordinator lease (`ctx.coordinator_lease.active`) plans and answers; the others answer every
call UNAVAILABLE naming the active one, and run no planner. One that takes over goes on after the
highest epoch the lease names (the active one stores each epoch in its lease entry before it
publishes it) and re-plans with the live stage nodes; one that steps down stops planning and ends
its watch streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections import OrderedDict
from typing import Any

import grpc


from node.card import CardView, card_int, read_cards
from node.integrity_metrics import count_flags
from node.logs import emit
from node.netem import LinkSpec, NetemConfig
from pipeline.cluster import Cluster, comm_matrix
from pipeline.config import ScheduleConfig
from pipeline.coordinator_state import load_epoch, save_epoch
from pipeline.schedule import Schedule, ScheduleViolation, checkfree_plus_paths, validate_schedule
from pipeline.search import plan
from pipeline.loss_trend import LossTrend
from pipeline.nonfinite_watch import NonfiniteWatch
from pipeline.stage_evidence import parse_nonfinite
from pipeline.stage_admission import StageAdmission
from pipeline.stage_liveness import LivenessProbe, hold_back_late, pick_vacancy, readmit_returned, stage_replicas
from pipeline.stage_probe import ProbeSpec
from pipeline.simulator import iteration_period
from pipeline.replica_audits import (REPLICA_COMMIT, ReplicaAudits, StageAuditSpec, commit_disagreements, parse_commit,
                                     parse_commits)
from pipeline import stage_metrics as M
from protocol import pipeline_pb2, pipeline_pb2_grpc
from security.stage_integrity import CheckResult

log = logging.getLogger("swarmnode.pipeline.coordinator")

KEEP_EPOCHS = 8
"""Schedules kept for `Get(epoch)` (nodes finishing an iteration on an older epoch)."""

STAGE_ROLE = "stage"


def stage_members(views: list[CardView], stages: int) -> list[tuple]:
    """The stage nodes a schedule is planned over, sorted by (stage, peer ID): tuples
    (peer_id, stage, grpc_addr, memory or None, compute_ms or None, grad_bytes or None)."""
    out = []
    for v in views:
        if v.card.role != STAGE_ROLE or v.card.state not in ("joining", "ready"):
            continue
        s = card_int(v, "stage")
        if s is None or s >= stages:
            continue
        out.append((v.peer_id, s, v.card.grpc_addr, card_int(v, "memory"), card_int(v, "compute_ms"),
                    card_int(v, "grad_bytes")))
    return sorted(out, key=lambda m: (m[1], m[0]))


def _link(netem: NetemConfig, src: tuple, dst: tuple) -> LinkSpec | None:
    """The emulated link src -> dst from a `[netem]` config, by address or peer ID."""
    if netem.matrix is not None:
        for a, b in ((src[2], dst[2]), (src[0], dst[0])):
            link = netem.matrix.link(a, b)
            if link is not None:
                return link
    for key in (dst[2], dst[0]):
        if key in netem.links:
            return netem.links[key]
    return netem.default


def build_cluster(members: list[tuple], cfg: ScheduleConfig, netem: NetemConfig, activation_bytes: int) -> Cluster:
    """Cost model over `members`: compute from cards (else `compute_s`), memory from cards (else
    `memory`), send costs from the netem description (else `default_latency_ms`) split into
    latency and transfer, and each node's gradient time to every other (its card's `grad_bytes`
    over the link): the replica exchange between iterations."""
    n = len(members)
    lat = [[0.0] * n for _ in range(n)]
    bw: list[list[float | None]] = [[None] * n for _ in range(n)]
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            if i == j:
                continue
            link = _link(netem, a, b)
            if link is None:
                lat[i][j] = cfg.default_latency_ms / 1000
            else:
                lat[i][j] = link.latency_ms / 1000
                bw[i][j] = None if link.bandwidth_mbps is None else link.bandwidth_mbps * 1e6 / 8
    grad = [[0.0 if i == j else lat[j][i] + (members[j][5] or 0) / (bw[j][i] or float("inf")) for i in range(n)]
            for j in range(n)]
    return Cluster(compute=[(m[4] / 1000 if m[4] else cfg.compute_s) for m in members],
                   comm=comm_matrix(lat, bw, activation_bytes),
                   memory=[m[3] or cfg.memory for m in members], names=[m[0] for m in members],
                   latency=lat, grad_s=grad)


def plan_for(members: list[tuple], cfg: ScheduleConfig, netem: NetemConfig, activation_bytes: int,
             epoch: int) -> tuple[Schedule, Cluster]:
    """A validated schedule over `members` and the cost model it was planned on (pure; runs in
    a worker thread)."""
    cluster = build_cluster(members, cfg, netem, activation_bytes)
    partition = tuple(tuple(i for i, m in enumerate(members) if m[1] == s) for s in range(cfg.stages))
    sched = plan(cluster, partition, cfg.rules(), cfg.mb_per_origin, method=cfg.method, seed=cfg.seed,
                 time_budget_s=cfg.time_budget_s, epoch=epoch)
    if cfg.checkfree_plus:
        sched = checkfree_plus_paths(sched)
    return validate_schedule(sched, cluster), cluster


class ScheduleCoordinator(pipeline_pb2_grpc.ScheduleServicer):
    """The bootstrap's schedule service (one per bootstrap node)."""

    def __init__(self, ctx: Any, cfg: ScheduleConfig, activation_bytes: int, poll_s: float = 1.0,
                 audit: StageAuditSpec | None = None, probe: ProbeSpec | None = None):
        self.ctx, self.cfg, self.activation_bytes, self.poll_s = ctx, cfg, activation_bytes, poll_s
        self.quarantined: dict[str, str] = {}            # peer ID -> why (left out of every later plan)
        self.incarnations: dict[str, float] = {}         # peer ID -> its card's started_at (the plan records it)
        self.planned_ever: set[str] = set()              # every node a plan of this coordinator named
        self.late: set[str] = set()                      # never planned, far behind the pipeline: logged once
        self.reset_moments = False   # a stage's only node quarantined: the next plan without it clears AdamW moments
        self.admission = None if probe is None else StageAdmission(ctx, probe, cfg.probe_timeout_s, cfg.stall_s)
        self.audits = None if audit is None else ReplicaAudits(ctx, audit, cfg.solo_audit_every_s, cfg.stages,
                                                                self._quarantine)
        self.epoch = 0
        # a restarted bootstrap goes on from the epoch it published last (pipeline/coordinator_state.py)
        self.restored_epoch, why = load_epoch(ctx.config.state_dir, ctx.config.run_id)
        if why:
            emit(log, "schedule_state_unread", "{why}", level=logging.WARNING, why=why)
        elif self.restored_epoch:
            emit(log, "schedule_state_restored", "restarted coordinator: schedule epochs go on after {epoch}; it "
                 "re-plans as soon as every stage has a node", epoch=self.restored_epoch)
        self._save_error = ""
        self.replies: OrderedDict[int, pipeline_pb2.ScheduleReply] = OrderedDict()
        self.waiting_reason = "no stage node has published its card yet"
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self.probe = LivenessProbe()
        self.live: list[tuple] = []             # live stage members at the last poll
        self.peak: dict[int, int] = {}          # stage -> most nodes it had in a published schedule
        self.claims: dict[str, int] = {}        # replacement peer ID -> stage it rebuilds (card detail `recovering`)
        self.scheduled: list[tuple] = []        # members of the latest published schedule
        self.suspended_since: float | None = None
        self.reported_down: set[int] = set()
        self._replan_now = asyncio.Event()      # a quarantine: re-plan at the next poll, skipping settle_s
        self.nonfinite = NonfiniteWatch()
        self.trend = LossTrend(cfg.loss_trend_window)
        self.lease = getattr(ctx, "coordinator_lease", None)
        if self.lease is not None:
            self.lease.remember_epoch(self.restored_epoch)
            self.lease.on_change(self._lease_changed)

    @property
    def active(self) -> bool:
        """Whether this bootstrap is the one that plans (always, without a lease)."""
        return self.lease is None or self.lease.active

    async def _lease_changed(self, state: str) -> None:
        """Take over (go on after the lease's highest epoch, plan at once) or step down."""
        if self.active:
            self.restored_epoch = max(self.restored_epoch, self.lease.max_epoch)
            self.scheduled, self.live, self.peak, self.claims = [], [], {}, {}
            self.suspended_since = None
            self.reported_down.clear()
            self.probe = LivenessProbe()
            self.waiting_reason = "took over as the active coordinator; reading the stage nodes"
            self._ensure_started()
            return
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
        async with self._changed:
            self._changed.notify_all()          # watch streams end (UNAVAILABLE)

    def _ensure_started(self) -> None:
        """The planner loop, supervised (restarted with backoff should it ever fail), from the first call on
        (only while this bootstrap holds the coordinator lease)."""
        if not self.active:
            return
        if self._task is None or self._task.done():
            self._task = self.ctx.supervisor.spawn("schedule_planner", self._loop)

    async def _loop(self) -> None:
        planned: list | None = None
        seen, since = None, 0.0
        urgent = False
        loop = asyncio.get_running_loop()
        while True:
            try:
                views = await read_cards(self.ctx.membership.dht, self.ctx.config.run_id)
                members = stage_members(views, self.cfg.stages)
                if self.scheduled:
                    planned_ids = {m[0] for m in self.scheduled}
                    await self.probe.probe([m for m in members if m[0] in planned_ids], loop.time())
                cards = {v.peer_id: (card_int(v, "iteration"), v.card.started_at) for v in views}
                members = readmit_returned(self.probe, members, self.quarantined, loop.time(), cards)
                members = hold_back_late(members, self.planned_ever, {p: c[0] for p, c in cards.items()}, self.late)
                self.incarnations = {v.peer_id: v.card.started_at for v in views}
                if self.probe.restarted:      # the iteration in flight died with it: a new epoch restarts it
                    self.probe.restarted.clear()
                    planned = None
                    self._replan_now.set()
                pending: dict[str, int] = {}
                if self.admission is not None:      # only nodes that answered a stage probe are planned
                    pending = self.admission.claims(members)
                    members = self.admission.admitted(members, loop.time())
                if self.audits is not None:
                    self.audits.note(views, members, self.scheduled)
                self._watch_nonfinite(views, members)
                self._watch_loss(views, members)
            except Exception as exc:  # noqa: BLE001 - the next poll retries
                log.debug("reading cards failed: %r", exc)
                await asyncio.sleep(self.poll_s)
                continue
            self.live = members
            self.claims = {v.peer_id: c for v in views if v.card.role == STAGE_ROLE and card_int(v, "stage") is None
                           and v.card.state in ("joining", "ready") and (c := card_int(v, "recovering")) is not None}
            self.claims.update(pending)     # a rebuilt stage still being probed is taken
            self._check_liveness(members, loop.time())
            if self.admission is not None and self.suspended_since is None \
                    and self.admission.stalled(views, self.scheduled, loop.time()):
                dropped = await self.admission.on_stall(self.scheduled, self.epoch, loop.time())
                if dropped:
                    members = [m for m in members if m[0] not in dropped]
                    self._replan_now.set()
            if members != seen:
                seen, since = members, loop.time()
            missing = [s for s in range(self.cfg.stages) if not any(m[1] == s for m in members)]
            if missing:
                self.waiting_reason = f"stages {missing} have no node yet ({len(members)} stage nodes seen)"
            elif len(members) < self.cfg.expect_nodes and self.epoch == 0 and not self.restored_epoch:
                # only the run's first plan waits
                self.waiting_reason = f"{len(members)} of the {self.cfg.expect_nodes} expected stage nodes are up"
            elif members != planned and (loop.time() - since >= self.cfg.settle_s or urgent):
                # settle_s waits out churn; a quarantined replica goes at once (each iteration it stays
                # in the plan feeds its edited weights to its neighbours and its twin)
                await self._plan(members)
                planned = members
            try:
                await asyncio.wait_for(self._replan_now.wait(), self.poll_s)
                urgent = True
            except asyncio.TimeoutError:
                urgent = False
            self._replan_now.clear()

    async def _plan(self, members: list[tuple]) -> None:
        if not self.active:
            return
        epoch = max(self.epoch, self.restored_epoch, self.lease.max_epoch if self.lease else 0) + 1
        try:
            sched, cluster = await asyncio.to_thread(plan_for, members, self.cfg, self.ctx.config.netem,
                                                     self.activation_bytes, epoch)
            # which process each node runs as: a node restarted as itself aborts the iteration in flight
            sched = dataclasses.replace(sched, incarnations=tuple(self.incarnations.get(n, 0.0) for n in sched.names),
                                        reset_moments=self.reset_moments and not any(
                                            m[0] in self.quarantined for m in members))
        except ScheduleViolation as exc:
            self.waiting_reason = f"planning failed: {exc}"
            emit(log, "schedule_failed", "no schedule for {nodes} stage nodes: {error}", level=logging.ERROR, nodes=len(members),
                 error=str(exc), rule=exc.rule)
            return
        body = sched.to_json()
        reply = pipeline_pb2.ScheduleReply(epoch=epoch, schedule_json=body,
                                           sha256=hashlib.sha256(body.encode()).hexdigest(),
                                           addrs={m[0]: m[2] for m in members})
        if self.suspended_since is not None:
            seconds = asyncio.get_running_loop().time() - self.suspended_since
            emit(log, "schedule_resumed", "schedule resumed on epoch {epoch} after {suspended_s:.1f} s suspended",
                 epoch=epoch, suspended_s=round(seconds, 3))
            self.suspended_since = None
            self.reported_down.clear()
        if self.lease is not None:
            await self.lease.note_epoch(epoch)      # in the lease before any stage can adopt it
            if not self.active:
                return
        self.scheduled = list(members)
        self.planned_ever.update(m[0] for m in members)
        if self.admission is not None:
            self.admission.reset(asyncio.get_running_loop().time())
        for st, n in stage_replicas(members, self.cfg.stages).items():
            self.peak[st] = max(self.peak.get(st, 0), n)
        if self.audits is not None:
            self.audits.published(epoch, {m[0]: (m[1], frozenset(i for i, p in enumerate(sched.paths) if n in p[1:]))
                                          for n, m in enumerate(members)})
        if sched.reset_moments:
            self.reset_moments = False
        async with self._changed:
            self.epoch = epoch
            self.replies[epoch] = reply
            while len(self.replies) > KEEP_EPOCHS:
                self.replies.popitem(last=False)
            self._changed.notify_all()
        self._save_epoch(epoch)
        emit(log, "schedule_published", "schedule epoch {epoch}: {nodes} nodes, {paths} paths, predicted makespan "
             "{expected_makespan:.3f} s ({method})", epoch=epoch, nodes=len(members), paths=len(sched.paths),
             expected_makespan=sched.expected_makespan, method=sched.method, sha256=reply.sha256,
             schedule=sched.to_dict(), expected_period=iteration_period(cluster, sched.paths, sched.partitions).period,
             cost_model={"compute": cluster.compute, "comm": cluster.comm, "memory": cluster.memory,
                         "latency": cluster.latency, "grad_s": cluster.grad_s})

    def _save_epoch(self, epoch: int) -> None:
        """Keep the published epoch on disk for a restart; an error is said once (the run goes on)."""
        try:
            save_epoch(self.ctx.config.state_dir, self.ctx.config.run_id, epoch)
            self._save_error = ""
        except OSError as exc:
            if repr(exc) != self._save_error:
                self._save_error = repr(exc)
                emit(log, "schedule_state_unsaved", "cannot save the schedule epoch in state_dir ({error}); the run "
                     "goes on, but a restarted bootstrap would count epochs from 1 again and its plans would be "
                     "ignored: make state_dir writable (or point state_dir at a writable disk)",
                     level=logging.ERROR, error=repr(exc), state_dir=str(self.ctx.config.state_dir))

    # ------------------------------------------------------------------ replica integrity (pipeline/replica_audits.py)
    def _quarantine(self, peer: str, stage: int, why: str) -> None:
        """Leave `peer` out of every later plan (the next poll re-plans, SkipPipe's path) and say why."""
        if peer in self.quarantined:
            return
        self.quarantined[peer] = why
        if not why.startswith(REPLICA_COMMIT):
            # it carried its stage alone: what it sent is in every stage's AdamW moments (Schedule.reset_moments)
            self.reset_moments = True
        if self.audits is not None:
            self.audits.forget(peer)
        M.QUARANTINED.set(len(self.quarantined))
        self.ctx.card.update(publish=True, quarantined=";".join(f"{p[-8:]}={w[:80]}" for p, w in self.quarantined.items()))
        emit(log, "replica_quarantined", "quarantined stage {stage} replica {short}: {why}; re-planning without it",
             level=logging.WARNING, stage=stage, short=peer[:16], peer=peer, why=why)
        self._replan_now.set()

    def _watch_nonfinite(self, views: list[CardView], members: list[tuple]) -> None:
        """The receivers' tallies of non-finite tensors (pipeline/nonfinite_watch.py): the node where
        they start, iteration after iteration, is suspected and quarantined."""
        live = {m[0]: m[1] for m in members}
        reports = [(v.peer_id, card_int(v, "iteration"), parse_nonfinite(v.card.details.get("nonfinite")))
                   for v in views if v.peer_id in live]
        scheduled = {m[0] for m in self.scheduled} & set(live)
        for peer, its in self.nonfinite.note(reports, scheduled):
            stage = live[peer]
            result = CheckResult("nonfinite_output", peer, its[-1])
            result.flag(f"the first node whose outputs are non-finite in iterations {its}")
            count_flags([result])
            emit(log, "stage_suspected", "stage {stage} node {short} sends non-finite tensors from finite inputs "
                 "(iterations {iterations}): quarantining it", level=logging.WARNING, stage=stage, peer=peer,
                 short=peer[:16], check="nonfinite_output", iterations=its, iteration=its[-1])
            self._quarantine(peer, stage, f"nonfinite_output@{its[-1]}: non-finite outputs from finite inputs in "
                                          f"iterations {its}")

    def _watch_loss(self, views: list[CardView], members: list[tuple]) -> None:
        """The data nodes' training loss (pipeline/loss_trend.py): when it rises, every unreplicated
        stage is audited now."""
        data = {m[0] for m in members if m[1] == 0}
        for v in views:
            loss, it = v.card.details.get("loss"), card_int(v, "iteration")
            if v.peer_id not in data or not isinstance(loss, (int, float)) or it is None:
                continue
            mean = self.trend.note(it - 1, float(loss))
            if mean is not None:
                emit(log, "loss_rising", "the pipeline's training loss rises (mean of the last {window} iterations "
                     "{mean:.4f}, iteration {iteration}): auditing every unreplicated stage now", level=logging.WARNING,
                     window=self.trend.window, mean=round(mean, 4), iteration=it - 1)
                if self.audits is not None:
                    self.audits.audit_now()

    def _check_liveness(self, members: list[tuple], now: float) -> None:
        """A stage of the published schedule with no live node suspends it (logged once per stage)."""
        if not self.scheduled:
            return
        replicas = stage_replicas(members, self.cfg.stages)
        if not members:          # every stage node left at once: the run ended (or the coordinator is cut off)
            if self.scheduled:
                emit(log, "pipeline_gone", "no stage node of schedule epoch {epoch} is live any more", epoch=self.epoch)
                self.scheduled = []
            return
        for s in sorted(s for s, n in replicas.items() if n == 0 and s not in self.reported_down):
            lost = [m for m in self.scheduled if m[1] == s]
            last_ok = max((self.probe.last_ok.get(m[0], now) for m in lost), default=now)
            detect_s = max(0.0, now - last_ok)
            self.reported_down.add(s)
            self.suspended_since = self.suspended_since or now
            M.RECOVERY_SECONDS.labels(phase="detect").observe(detect_s)
            M.STAGES_DOWN.inc()
            why = {m[0][:16]: self.probe.down.get(m[0], "card gone or draining") for m in lost}
            emit(log, "stage_down", "stage {stage} has no live node ({lost}): schedule epoch {epoch} suspended until a "
                 "replacement joins (start a `stage` node with stage.checkfree.recover=true)", level=logging.WARNING, stage=s,
                 detect_s=round(detect_s, 3), lost=why, epoch=self.epoch,
                 adjacent_lost=sorted(x for x in (s - 1, s + 1) if replicas.get(x) == 0))
        if self.suspended_since is not None and {m[0] for m in self.scheduled} <= {m[0] for m in members}:
            # every node of the published plan is live again (a frozen node that answers again,
            # `readmit_returned`): the plan runs on as it is, and no stage counts as lost any more
            # (a later replacement would take them for lost in the same incident)
            emit(log, "schedule_resumed", "schedule resumed on epoch {epoch} after {suspended_s:.1f} s suspended: "
                 "its nodes answer again", epoch=self.epoch, suspended_s=round(now - self.suspended_since, 3))
            self.suspended_since = None
            self.reported_down.clear()

    def status(self) -> pipeline_pb2.ScheduleStatus:
        replicas = stage_replicas(self.live, self.cfg.stages)
        missing = [s for s, n in replicas.items() if n == 0]
        suspended = bool(self.scheduled) and bool(missing)
        return pipeline_pb2.ScheduleStatus(
            # the epoch the run has reached: a restarted or newly active coordinator has published
            # nothing yet, but the run is underway (a replacement may take a vacancy: epoch > 0)
            epoch=max(self.epoch, self.restored_epoch), suspended=suspended, missing_stages=missing,
            live_stages=[s for s, n in replicas.items() if n > 0],
            vacancy=pick_vacancy(replicas, set(self.claims.values()), self.peak) if self.live else -1,   # nothing to rebuild from
            down_stages=sorted(self.reported_down), claimed_stages=sorted(set(self.claims.values())), claims=self.claims,
            quarantined=sorted(self.quarantined),
            hold=bool(self.scheduled) and not {m[0] for m in self.scheduled} <= {m[0] for m in self.live},
            short_stages=[s for s, n in replicas.items() if 0 < n < self.peak.get(s, 0)],
            reason=(f"stages {missing} have no live node" if suspended else self.waiting_reason if not self.scheduled
                    else "running"), replicas=replicas)

    async def Status(self, request, context):  # noqa: N802 - gRPC API
        await self._check_run(request, context)
        return self.status()

    async def _check_run(self, request, context) -> None:
        if not self.active:
            holder = self.lease.holder
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"standby coordinator: the active one is {holder or '(none yet: a takeover is under way)'}")
        self._ensure_started()
        if request.run_id and request.run_id != self.ctx.config.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this coordinator serves run {self.ctx.config.run_id!r}, not {request.run_id!r}")

    async def Get(self, request, context):  # noqa: N802 - gRPC API
        await self._check_run(request, context)
        reply = self.replies.get(request.epoch or self.epoch)
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no schedule epoch {request.epoch or 'latest'} here: {self.waiting_reason}"
                                if not request.epoch or request.epoch > self.epoch else
                                f"epoch {request.epoch} is no longer kept (latest {self.epoch})")
        return reply

    async def Watch(self, request, context):  # noqa: N802 - gRPC API
        await self._check_run(request, context)
        sent = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.epoch > sent or not self.active)
                if not self.active:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this coordinator stepped down")
                reply = self.replies[self.epoch]
            sent = reply.epoch
            yield reply


async def fetch_schedule(channel: grpc.aio.Channel, run_id: str, epoch: int = 0,
                         timeout: float = 5.0) -> tuple[Schedule, dict[str, str]]:
    """`Schedule.Get` + parse + validate (raises ScheduleViolation naming the rule, grpc errors)."""
    stub = pipeline_pb2_grpc.ScheduleStub(channel)
    reply = await stub.Get(pipeline_pb2.GetScheduleRequest(run_id=run_id, epoch=epoch), timeout=timeout)
    return parse_reply(reply)


def parse_reply(reply: pipeline_pb2.ScheduleReply) -> tuple[Schedule, dict[str, str]]:
    """The schedule of a reply, checked against its sha256 and validated before use."""
    if hashlib.sha256(reply.schedule_json.encode()).hexdigest() != reply.sha256:
        raise ScheduleViolation("STRUCT", "schedule body does not match its sha256")
    sched = validate_schedule(Schedule.from_json(reply.schedule_json))
    if sched.epoch != reply.epoch:
        raise ScheduleViolation("STRUCT", f"schedule body says epoch {sched.epoch}, reply {reply.epoch}")
    missing = [n for n in sched.names if n not in reply.addrs]
    if missing or len(sched.names) != sum(len(g) for g in sched.partitions):
        raise ScheduleViolation("STRUCT", f"schedule names nodes without an address: {missing[:3]}")
    return sched, dict(reply.addrs)


__all__ = ["ScheduleCoordinator", "StageAuditSpec", "commit_disagreements", "parse_commit", "parse_commits", "build_cluster",
           "fetch_schedule", "parse_reply", "plan_for", "stage_members"]
