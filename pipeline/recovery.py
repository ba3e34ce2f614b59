"""CheckFree recovery glue for the `stage` role (docs/pipeline.md, 'CheckFree recovery'): a replacement node rebuilds a
lost stage from live peers.

    swarmnode run --role stage --set stage.checkfree.recover=true --initial-peers …

Owns what happens between "this node holds no weights" and "it can join the schedule":
1. ask the coordinator (`Schedule.Status`, pipeline/coordinator.py) which stage has lost its
   nodes (`vacancy`) and which stages still have live ones;
2. pick the rule with `pipeline.checkfree.choose_recovery` (docs/pipeline.md, 'Which rule applies'): a live same-stage replica is
   copied (weights and optimizer state), an interior stage is the gradient-norm weighted average
   of both neighbours, an edge stage under CheckFree+ copies its swap partner; two adjacent lost
   stages are reported (`adjacent_failure` event, a metric) and rebuilt from a checkpoint when
   one exists, else from the nearest surviving stages with a loud WARN; never from missing weights;
   a lost stage 0 (every data node) is restored from the copy stage-1 nodes keep (`embed_copy`);
3. download the donors' state over `WeightService.Fetch` (node/state_sync.py): both neighbours
   must describe the same completed iteration t (their snapshots after step t; retried until
   they agree or `stage.checkfree.wait_s` passes, then a loud failure);
4. hand back the weights (renamed to this stage's parameter names: a neighbour's blocks carry
   their own layer indices), the iteration t, the donors and the phase seconds.
   pipeline/replacement.py applies them (`apply_recovery`) and reports; the claim on a vacancy
   is `claim_holds`. A replica's optimizer state is loaded as is; every other rule starts
   a fresh AdamW (the run's `stage.optim`: betas, eps, weight decay) at `lr_scale` x the
   configured LR (`pipeline.checkfree.fresh_optimizer`) with
   the LR schedule rebuilt at step t from that scaled base.

Transport and DHT reads are here; the rules themselves are pure (pipeline/checkfree.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from torch import nn

from models.optim import InnerConfig, inner_lr_scheduler
from node.card import card_int, read_cards
from node.checkpoint import CheckpointError, Checkpointer
from node.logs import emit
from node.state_sync import StateFetchError, fetch_state, order_donors, split_optimizer
from pipeline.checkfree import Recovery, RecoveryError, average_neighbours, choose_recovery, fresh_optimizer
from pipeline.config import CheckFreeConfig
from protocol import pipeline_pb2, pipeline_pb2_grpc

log = logging.getLogger("swarmnode.stage.recovery")

FETCH_TIMEOUT_S = 30.0
RETRY_S = 0.5
SUSPEND_WAIT_S = 10.0
"""A replacement that finds no suspended stage waits this long for one before joining the
least-replicated stage as a replica (detection takes a few seconds)."""


@dataclass
class Rebuilt:
    """What a recovery produced: this stage's weights (its own parameter names) after iteration
    `iteration`, and the donor optimizer state for a replica copy (None = fresh optimizer)."""

    stage: int
    rule: str
    iteration: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None
    donors: dict[int, str]                           # stage -> donor peer ID
    norms: dict[int, float] = field(default_factory=dict)
    warn: str = ""
    fetch_s: float = 0.0
    checkpoint: dict | None = None                   # rule "checkpoint": the file's state (optimizer too)


# ---------------------------------------------------------------------------------- pure helpers
def param_spec(module: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (torch.float32, tuple(p.shape)) for n, p in module.named_parameters()}


def optimizer_spec(module: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The AdamW state tensors a stage snapshot serves (pipeline/stage_state.py `host_adam_state`)."""
    out = {}
    for n, p in module.named_parameters():
        out.update({f"{n}.exp_avg": (torch.float32, tuple(p.shape)), f"{n}.exp_avg_sq": (torch.float32, tuple(p.shape)),
                    f"{n}.step": (torch.float32, ())})
    return out


def relabel(tensors: dict[str, torch.Tensor], theirs: list[str], mine: list[str]) -> dict[str, torch.Tensor]:
    """A neighbour's parameters under this stage's names, by position (its blocks carry their own
    global layer indices). Raises RecoveryError when the stages are not the same schema."""
    if len(theirs) != len(mine):
        raise RecoveryError(f"the donor stage has {len(theirs)} parameters, this stage {len(mine)}: stages of "
                            "different depth cannot be averaged; recover from a replica or a checkpoint")
    return {m: tensors[t] for t, m in zip(theirs, mine)}


def load_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(weights[n].to(p.device, p.dtype))


def load_adam_state(opt: torch.optim.Optimizer, module: nn.Module, flat: dict[str, torch.Tensor]) -> None:
    """A replica's AdamW state (names `<param>.<key>`, as served) into `opt`."""
    for n, p in module.named_parameters():
        st = {k: flat[f"{n}.{k}"].to(p.device) for k in ("exp_avg", "exp_avg_sq")}
        st["step"] = flat[f"{n}.step"].to(torch.float32).cpu().reshape(())
        opt.state[p] = st


def apply_recovery(module: nn.Module, r: Rebuilt, optim: InnerConfig, lr_scale: float):
    """Load `r` into `module`; returns (optimizer, LR scheduler) positioned at step r.iteration.
    A replica copy keeps the donor's AdamW state and LR; every other rule gets a fresh AdamW at
    lr_scale x the configured LR (never compounding: always from `optim.lr`)."""
    load_weights(module, r.weights)
    params = list(module.parameters())
    if r.checkpoint is not None:           # weights and AdamW state as written; the LR schedule at the run's step
        opt = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                weight_decay=optim.weight_decay)
        opt.load_state_dict(r.checkpoint["parts"]["optimizer"])
        return opt, inner_lr_scheduler(opt, optim, start_step=r.iteration)
    if r.optimizer is not None:
        opt = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                weight_decay=optim.weight_decay)
        load_adam_state(opt, module, r.optimizer)
        return opt, inner_lr_scheduler(opt, optim, start_step=r.iteration)
    opt = fresh_optimizer(params, optim, lr_scale)
    scaled = optim.model_copy(update={"lr": lr_scale * optim.lr})
    return opt, inner_lr_scheduler(opt, scaled, start_step=r.iteration)


def stage_checkpoint_dir(root: str | Path, stage: int) -> Path:
    return Path(root).expanduser() / f"stage-{stage}"


def newest_checkpoint(root: str | Path, stage: int, fmt: str, cfg_hash: str) -> dict | None:
    """The newest readable checkpoint of `stage` under `<root>/stage-<s>/<peer>/` (any replica's;
    by iteration), as `Checkpointer.read` returns it, or None."""
    best = None
    base = stage_checkpoint_dir(root, stage)
    if not base.is_dir():
        return None
    for sub in sorted(p for p in base.iterdir() if p.is_dir()):
        try:
            state = Checkpointer(sub, fmt, cfg_hash).read(required=("stage", "optimizer"))
        except CheckpointError as exc:
            log.warning("skipping checkpoint in %s: %s", sub, exc)
            continue
        newer = best is None or state is not None and state["meta"].get("iteration", -1) > best["meta"].get("iteration", -1)
        if state is not None and newer:
            best = state
    return best


def rebuilt_from_checkpoint(state: dict, stage: int, iteration: int) -> Rebuilt:
    """A stage from its checkpoint (weights and AdamW state as written), joining at the survivors'
    `iteration`; `norms` records the checkpoint's age in iterations under key -1."""
    weights = {n: t.float() for n, t in state["parts"]["stage"].items()}
    age = float(iteration - state["meta"]["iteration"])
    return Rebuilt(stage, "checkpoint", iteration, weights, None, {}, {-1: age},
                   warn=f"stage {stage} restored from {state['path']} (iteration {state['meta']['iteration']}, "
                        f"{iteration - state['meta']['iteration']} iterations old)", checkpoint=state)


# ---------------------------------------------------------------------------------- gRPC glue
async def coordinator_status(channel: grpc.aio.Channel, run_id: str, timeout: float = 5.0):
    stub = pipeline_pb2_grpc.ScheduleStub(channel)
    return await stub.Status(pipeline_pb2.GetScheduleRequest(run_id=run_id), timeout=timeout)


class StageRecovery:
    """One replacement's recovery. `build(stage)` builds a stage module (any device), `cfg_hash_of(stage)`
    is the cfg hash stage nodes of that index publish, `status()` returns `Schedule.Status`."""

    def __init__(self, *, ctx, me: str, n_stages: int, cfg: CheckFreeConfig, build: Callable[[int], nn.Module],
                 cfg_hash_of: Callable[[int], str], status, has_checkpoint: Callable[[int], bool] = lambda s: False,
                 offload=None, coordinator_outage_s: float = 900.0):
        self.ctx, self.me, self.n_stages, self.cfg = ctx, me, n_stages, cfg
        self.coordinator_outage_s = coordinator_outage_s   # stage.coordinator_outage_s
        self.build, self.cfg_hash_of, self.status = build, cfg_hash_of, status
        self.has_checkpoint, self.offload = has_checkpoint, offload
        self.run_id = ctx.config.run_id
        self.quarantined: set[str] = set()     # the coordinator's quarantined stage nodes: never a donor
        self._skeletons: dict[int, asyncio.Future] = {}

    async def skeleton(self, stage: int) -> nn.Module:
        """`stage`'s module on the meta device (names and shapes, no memory), built once per stage
        in a worker thread: torch's first meta build imports its meta kernels (1-13 s on a loaded
        2-core machine), which on the event loop would stall the node (its health answers too).
        The build is shared: a rebuild asking while the warm-up builds the same stage awaits it."""
        fut = self._skeletons.get(stage)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            def build() -> nn.Module:
                with torch.device("meta"):
                    return self.build(stage)
            fut = self._skeletons[stage] = asyncio.ensure_future(asyncio.to_thread(build))
        return await asyncio.shield(fut)

    def warm_up(self, stages: range) -> None:
        """Build the skeletons of `stages` one after another in the background (a replacement does
        it while it waits for a vacancy, so the rebuild starts fetching at once). A failure is left
        for the rebuild to meet again. Short-lived: it ends once every skeleton is built."""
        async def build_all() -> None:
            for i in stages:
                await self.skeleton(i)
        warm = asyncio.ensure_future(build_all())
        warm.add_done_callback(lambda f: f.cancelled() or f.exception())   # resurfaces in the rebuild

    async def names(self, stage: int) -> list[str]:
        return [n for n, _ in (await self.skeleton(stage)).named_parameters()]

    async def vacancy(self, prefer: int | None = None) -> tuple[int, object]:
        """(stage to take, the coordinator's status) once the coordinator names one; `prefer` (a
        stage node restarted into a run underway: its own stage) is taken whenever it is lost and
        no other replacement claimed it, before the coordinator's pick."""
        t0 = time.monotonic()
        deadline = t0 + max(self.cfg.wait_s, 60.0)
        gone_since: float | None = None          # the coordinator stopped answering (a restart, a takeover)
        last = None
        short_since: dict[int, float] = {}       # a hot spare: stage -> when it was first seen short
        while self.cfg.standby or time.monotonic() < deadline:
            try:
                st = await self.status()
                last, gone_since = st, None
                now = time.monotonic()
                short_since = {s: short_since.get(s, now) for s in st.short_stages}
                # a lost stage or replica first; with none, join the least-replicated stage (a replica
                # copy) only after SUSPEND_WAIT_S, so a replacement started at the failure does not race
                # detection; a hot spare refills a short stage once it has stayed short (standby_refill_s)
                patient = self.cfg.standby or now - t0 < min(self.cfg.wait_s, SUSPEND_WAIT_S)
                refill = (not self.cfg.standby or (self.cfg.standby_refill_s > 0 and st.vacancy in short_since
                                                   and now - short_since[st.vacancy] >= self.cfg.standby_refill_s))
                needed = st.suspended or (st.vacancy in st.short_stages and refill)
                if prefer is not None and st.epoch > 0 and prefer in st.missing_stages \
                        and prefer not in st.claimed_stages:
                    return prefer, st
                if st.vacancy >= 0 and st.epoch > 0 and (needed or not patient):
                    return st.vacancy, st
            except grpc.aio.AioRpcError as exc:
                log.info("coordinator status not available yet: %s", exc.details())
                # no coordinator to name a vacancy: the wait for one does not count against wait_s,
                # up to coordinator_outage_s (a restarted bootstrap or a standby takes over meanwhile)
                now = time.monotonic()
                gone_since = now if gone_since is None else gone_since
                if now - gone_since <= self.coordinator_outage_s:
                    deadline = max(deadline, now + RETRY_S + 1.0)
            await asyncio.sleep(RETRY_S)
        if gone_since is not None:
            raise RecoveryError(f"the coordinator did not answer for {time.monotonic() - gone_since:.0f} s "
                                f"(stage.coordinator_outage_s={self.coordinator_outage_s:.0f}); start the "
                                "replacement again once a bootstrap answers")
        raise RecoveryError(f"the coordinator named no stage to take (last status: {last}); start the replacement "
                            "once a schedule runs")

    async def claim_holds(self, stage: int, timeout_s: float = 6.0) -> bool:
        """After publishing the claim on `stage`: False when another replacement with a lower peer ID
        claimed it too (this one then picks again); True once the coordinator shows the claim
        uncontested, or when it does not show it within `timeout_s` (go ahead)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                st = await self.status()
            except grpc.aio.AioRpcError:
                st = None
            if st is not None and st.claims.get(self.me) == stage:
                return not any(p < self.me for p, s in st.claims.items() if s == stage)
            await asyncio.sleep(RETRY_S)
        return True

    @staticmethod
    def _alive(stage: int, status) -> set[int]:
        """Stages with a live node, for rebuilding `stage`: a stage lost in the same incident counts
        as lost even if rebuilt meanwhile (P23)."""
        return set(status.live_stages) - (set(status.down_stages) - {stage})

    def decide(self, stage: int, status) -> Recovery:
        alive = self._alive(stage, status)
        replicas = dict(status.replicas)
        r = choose_recovery(stage, self.n_stages - 1, alive, replica_alive=replicas.get(stage, 0) > 0,
                            plus=self.cfg.plus, allow_edge_copy=self.cfg.allow_edge_copy,
                            has_checkpoint=self.has_checkpoint(stage))
        lost_adjacent = sorted(s for s in (stage - 1, stage + 1) if 0 < s < self.n_stages and s not in alive)
        if lost_adjacent and r.rule not in ("replica",):
            emit(log, "adjacent_failure", "stage {stage} and its neighbour(s) {lost} are lost together: {action}",
                 level=logging.ERROR, stage=stage, lost=lost_adjacent, rule=r.rule,
                 action="restoring the newest checkpoint" if r.rule == "checkpoint" else
                 f"rule {r.rule} from stages {r.sources} (no averaging with missing weights)")
        return r

    async def decide_and_rebuild(self, stage: int, status, max_decisions: int = 4) -> tuple[Recovery, Rebuilt | None]:
        """`decide` then `rebuild`, watching the coordinator meanwhile: a source stage found lost after
        the decision (a second failure detected a probe later than the first, as when two adjacent
        stages die together) stops the fetch, and the rule is decided again with the new status
        (P23: an adjacent loss goes to the checkpoint, never to an average with a dead neighbour).
        Returns (rule, rebuilt); rebuilt is None for the checkpoint rule, which the caller restores."""
        for _ in range(max_decisions):
            r = self.decide(stage, status)
            if r.rule == "checkpoint":
                return r, None
            task = asyncio.create_task(self.rebuild(stage, r))
            lost: list[int] = []
            while not lost:
                done, _ = await asyncio.wait({task}, timeout=RETRY_S)
                if done:
                    return r, task.result()
                try:
                    now = await self.status()
                except grpc.aio.AioRpcError:
                    continue
                lost = [s for s in r.sources if s not in self._alive(stage, now)]
                status = now
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, RecoveryError):
                pass
            emit(log, "recovery_redecide", "stage {stage}: source stage(s) {lost} of rule {rule} were lost during "
                 "the rebuild; deciding again", level=logging.WARNING, stage=stage, lost=lost, rule=r.rule)
        raise RecoveryError(f"stage {stage}: its sources kept failing over {max_decisions} decisions; check the "
                            "coordinator's stage_down events and restart the run from a checkpoint")

    async def live_iteration(self) -> int:
        """The iteration the surviving stage nodes are at (their cards' `iteration`, the largest)."""
        views = await read_cards(self.ctx.membership.dht, self.run_id)
        its = [card_int(v, "iteration") for v in views if v.card.role == "stage" and v.card.state == "ready"]
        its = [i for i in its if i is not None]
        if not its:
            raise RecoveryError("no live stage node publishes its iteration: cannot place a checkpoint restore")
        return max(its)

    async def _donor_views(self, stage: int):
        """Live nodes of `stage`, most advanced first, less any the coordinator quarantined (a
        replacement for a quarantined replica must copy its honest twin, not the attacker)."""
        if self.status is not None:
            try:
                self.quarantined = set((await self.status()).quarantined)
            except grpc.aio.AioRpcError as exc:
                log.info("coordinator status not available (%s): no donor this try (its quarantine list is "
                         "needed first)", exc.details())
                return []
        views = await read_cards(self.ctx.membership.dht, self.run_id)
        return [v for v in order_donors(views, role="stage", cfg_hash=self.cfg_hash_of(stage), progress_key="iteration",
                                        exclude=self.me) if v.peer_id not in self.quarantined]

    async def fetch(self, stage: int, *, optimizer: bool, min_iteration: int = 0, holder: int | None = None):
        """(meta, weights under `stage`'s own names, optimizer or None, donor peer ID) from a live
        node of `stage` (or, with `holder`, the copy of `stage` that live nodes of stage `holder`
        keep); tries each candidate (dead cards fail fast) until `wait_s` passes."""
        spec_mod = await self.skeleton(stage)
        me_names = [n for n, _ in spec_mod.named_parameters()]
        deadline = time.monotonic() + self.cfg.wait_s
        errors: list[str] = []
        served_by = stage if holder is None else holder
        while True:
            for v in await self._donor_views(served_by):
                try:
                    meta, tensors = await fetch_state(
                        v.card.grpc_addr, self.run_id, self.me, self.cfg_hash_of(served_by), param_spec(spec_mod),
                        optimizer=optimizer_spec(spec_mod) if optimizer else None, stage=stage,
                        timeout=FETCH_TIMEOUT_S, offload=self.offload, peer_id=v.peer_id)
                except StateFetchError as exc:
                    errors.append(str(exc))
                    continue
                if int(meta.get("iteration", -1)) < min_iteration:
                    errors.append(f"{v.peer_id[:16]} is at iteration {meta.get('iteration')} < {min_iteration}")
                    continue
                weights, opt = split_optimizer(tensors)
                return meta, {n: weights[n] for n in me_names}, (opt if optimizer else None), v.peer_id
            if time.monotonic() > deadline:
                what = f"stage {stage}" if holder is None else f"stage {holder} (its copy of stage {stage})"
                raise RecoveryError(f"no live node of {what} served its state within {self.cfg.wait_s:.0f} s "
                                    f"({errors[-3:]}); check that stage's nodes")
            await asyncio.sleep(RETRY_S)

    async def rebuild(self, stage: int, r: Recovery, min_iteration: int = 0) -> Rebuilt:
        """Apply rule `r` from the live sources, at their completed iteration `min_iteration` or later
        (a replacement whose stage was rebuilt while the pipeline kept running redoes it at the
        iteration the pipeline asks it to run)."""
        mine = await self.names(stage)
        t0 = time.monotonic()
        if r.rule == "replica":
            meta, w, opt, donor = await self.fetch(stage, optimizer=True, min_iteration=min_iteration)
            out = Rebuilt(stage, "replica", int(meta["iteration"]), w, opt, {stage: donor})
        elif r.rule in ("average", "nearest") and len(r.sources) == 2:
            out = await self._average(stage, r, mine, min_iteration)
        elif r.rule == "embed_copy":
            out = await self._embed_copy(stage, r.sources[0])
        elif r.rule in ("copy_partner", "copy_neighbour", "nearest"):
            src = r.sources[0]
            if src == 0 or stage == 0:
                raise RecoveryError(f"stage {stage} cannot be rebuilt from stage {src} (stage 0 holds the "
                                    "embedding and head, no transformer blocks): restart from a checkpoint")
            meta, w, _, donor = await self.fetch(src, optimizer=False, min_iteration=min_iteration)
            out = Rebuilt(stage, r.rule, int(meta["iteration"]), relabel(w, await self.names(src), mine),
                          None, {src: donor}, {src: float(meta.get("grad_norm", "nan"))}, warn=r.warn)
        else:
            raise RecoveryError(f"rule {r.rule!r} for stage {stage} is handled by the caller (checkpoint)")
        out.fetch_s = time.monotonic() - t0
        if r.warn:
            emit(log, "recovery_warning", "{warning}", level=logging.WARNING, warning=r.warn, stage=stage,
                 rule=r.rule)
        return out

    async def _embed_copy(self, stage: int, holder: int) -> Rebuilt:
        """Stage 0 from the copy a stage-`holder` node keeps (`stage.checkfree.embed_copy_every`),
        joining at the holder's iteration: only stage 0's weights roll back, by the copy's age
        (`norms[-1]`, as for a checkpoint)."""
        meta, w, _, donor = await self.fetch(stage, optimizer=False, holder=holder)
        copied, now = int(meta["iteration"]), int(meta.get("holder_iteration", meta["iteration"]))
        if now < copied:
            raise RecoveryError(f"stage {holder} node {donor[:16]} serves a copy of iteration {copied} but is itself at "
                                f"{now}: a broken peer; restart the run from a checkpoint")
        return Rebuilt(stage, "embed_copy", now, w, None, {holder: donor}, {-1: float(now - copied)})

    async def _average(self, stage: int, r: Recovery, mine: list[str], min_iteration: int = 0) -> Rebuilt:
        """Both sources at the same completed iteration (P18), then the weighted average (P17)."""
        left, right = r.sources
        deadline = time.monotonic() + self.cfg.wait_s
        key = "grad_norm" if self.cfg.norm == "pre" else "grad_norm_clipped"
        floor = min_iteration
        while True:
            (ml, wl, _, dl), (mr, wr, _, dr) = await asyncio.gather(
                self.fetch(left, optimizer=False, min_iteration=floor),
                self.fetch(right, optimizer=False, min_iteration=floor))
            il, ir = int(ml["iteration"]), int(mr["iteration"])
            if il == ir:
                break
            if time.monotonic() > deadline:
                raise RecoveryError(f"stages {left} and {right} stayed at different iterations ({il}, {ir}) for "
                                    f"{self.cfg.wait_s:.0f} s: cannot average; check those stages' logs")
            floor = max(il, ir)
            await asyncio.sleep(RETRY_S)
        nl, nr = float(ml.get(key, "nan")), float(mr.get(key, "nan"))
        if il == 0:      # no step yet: no norms; the midpoint
            nl = nr = 0.0
        names_l, names_r = await self.names(left), await self.names(right)
        weights = average_neighbours(relabel(wl, names_l, mine), relabel(wr, names_r, mine),
                                     left_norm=nl, right_norm=nr, left_iteration=il, right_iteration=ir,
                                     power=self.cfg.norm_power)
        return Rebuilt(stage, r.rule, il, weights, None, {left: dl, right: dr}, {left: nl, right: nr}, warn=r.warn)


__all__ = ["Rebuilt", "StageRecovery", "apply_recovery", "coordinator_status", "load_adam_state", "newest_checkpoint",
           "optimizer_spec", "param_spec", "rebuilt_from_checkpoint", "relabel", "stage_checkpoint_dir"]
