"""The coordinator's replica-integrity audits (docs/pipeline.md, 'Quarantine and audits').

Owns the weight commits the coordinator has seen on the scheduled stage nodes' cards, the audits
it starts (a stage whose replicas published different commits; an unreplicated stage at random
times), their verdicts, and the alert raised when an audit cannot run. The replay itself is pure
(pipeline/stage_audit.py); the state downloads are node/state_sync.py's `fetch_state`, signed with
this node's key like every outgoing call (in token mode the coordinator's own key is its
credential: security/admission.py `token_check`). Quarantining a replica and re-planning without it
stay with pipeline/coordinator.py, which passes `quarantine(peer, stage, why)` in.

An audit that cannot run is never silent: the audited node refused the download (its answer names
the gRPC status) or the audit of one replica stayed inconclusive `INCONCLUSIVE_ALERT_AFTER` times
in a row. Then the `audit_blocked` event says why and what to check, the
`swarmnode_pipeline_audits_blocked` gauge counts the replicas in that state,
`swarmnode_pipeline_audits_total{outcome}` counts every verdict, and the coordinator's `/readyz`
lists them under `details.stage_audits`. A later audit of the replica that runs clears its alert.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from node import ready_details
from node.card import CardView
from node.integrity_metrics import count_flags
from node.logs import emit
from node.state_sync import StateFetchError, fetch_state, split_optimizer
from pipeline import stage_metrics as M
from pipeline.stage_audit import RESIDUAL_LR, commit_of, replay_outputs, replay_residual, step_gradient
from pipeline.stage_evidence import Entry, fetch_evidence
from protocol.channels import ChannelPool
from security.stage_integrity import CheckResult, compare_commits

log = logging.getLogger("swarmnode.pipeline.coordinator")

COMMITS_KEPT = 16
"""Published commits remembered per stage node (card detail `commit` = "<iteration>:<sha256[:16]>")."""
INCONCLUSIVE_ALERT_AFTER = 3
"""Consecutive inconclusive audits of one replica (its state raced on, a timeout) that raise the
alert; a refused download raises it at once."""
EPOCHS_KEPT = 16
"""Schedule epochs whose replica counts are remembered (an audited iteration is a few epochs old at most)."""
REFUSED = ("PERMISSION_DENIED", "UNAUTHENTICATED")
"""Statuses of a download refused by the audited node's call guard (not a race: the audit cannot run)."""
REPLICA_COMMIT = "replica_commit"
"""The quarantine reason of a replica whose weights left its twins' (the reason string starts with it):
its twin carried the same stage honestly, so the coordinator keeps the optimizers' moments for it."""


@dataclass(frozen=True)
class StageAuditSpec:
    """What the coordinator needs to audit a stage replica: `stage_spec(index)` -> (weights spec,
    optimizer spec, cfg_hash) for fetch_state, and the AdamW hyper-parameters every stage uses."""

    stage_spec: Callable[[int], tuple]
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    module: Callable[[int], Any] | None = None
    """`module(index)` -> a fresh module of stage `index` (fp32, CPU): what an unreplicated stage's
    outputs and gradients are recomputed with (pipeline/stage_audit.py `replay_outputs`); None =
    only its step is replayed."""


def parse_commit(value: Any) -> tuple[int, str] | None:
    """`"12:ab34..."` -> (12, "ab34..."); None for anything else (a card detail is untrusted input)."""
    if not isinstance(value, str) or ":" not in value:
        return None
    it, _, sha = value.partition(":")
    if not it.isdigit() or len(it) > 12 or not (1 <= len(sha) <= 64) or any(c not in "0123456789abcdef" for c in sha):
        return None
    return int(it), sha


def parse_commits(value: Any) -> list[tuple[int, str]]:
    """A card's `commit` detail, "<it>:<sha>,<it-1>:<sha>,..." (newest first, at most 8), parsed;
    malformed entries are skipped."""
    if not isinstance(value, str):
        return []
    return [c for c in (parse_commit(v) for v in value.split(",")[:8]) if c is not None]


def commit_disagreements(scheduled: list[tuple], commits: dict[str, dict[int, str]]) -> dict[int, int]:
    """stage -> the latest iteration at which two of its scheduled nodes published different commits."""
    out: dict[int, int] = {}
    by_stage: dict[int, list[str]] = {}
    for m in scheduled:
        by_stage.setdefault(m[1], []).append(m[0])
    for s, peers in by_stage.items():
        seen: dict[int, set[str]] = {}
        for p in peers:
            for it, sha in commits.get(p, {}).items():
                seen.setdefault(it, set()).add(sha)
        bad = [it for it, shas in seen.items() if len(shas) > 1]
        if bad:
            out[s] = max(bad)
    return out


class Matched(NamedTuple):
    """What `match_evidence` found."""

    samples: list[tuple]
    """(input it received, output it sent, gradient of that output it received, gradient it sent upstream or None)"""
    missing: str
    """what is missing ("" if nothing)"""
    epoch: int | None
    """the schedule epoch of the samples (None without evidence)"""
    paths: tuple[int, ...] = ()
    """the path ID of each sample"""


def match_evidence(entries: list[Entry]) -> Matched:
    """The audited node's microbatches of the newest schedule epoch in its neighbours' evidence
    (each entry from the answering node's side): (input it received, output it sent, gradient of that output it
    received, gradient it sent upstream or None) per path, what is missing ("" if nothing), that
    epoch (None without evidence) and the paths."""
    sent = [e.ep for e in entries if e.way == "sent" and e.kind == "fwd"]
    ep = max(sent, default=None)          # an iteration aborted by a re-plan ran again on a newer epoch
    by: dict[tuple[str, str], dict[int, Tensor]] = {}
    for e in entries:
        if e.ep == ep:
            by.setdefault((e.way, e.kind), {}).setdefault(e.p, e.tensor)
    xs, ys, gys, gxs = (by.get(k, {}) for k in (("sent", "fwd"), ("recv", "fwd"), ("sent", "bwd"), ("recv", "bwd")))
    if not xs:
        return Matched([], "no evidence of its microbatches", ep)
    lacking = sorted(p for p in xs if p not in ys or p not in gys)
    if lacking:
        return Matched([], f"its neighbours kept no output or gradient of paths {lacking}", ep)
    return Matched([(xs[p], ys[p], gys[p], gxs.get(p)) for p in sorted(xs)], "", ep, tuple(sorted(xs)))


def refused(exc: Exception) -> bool:
    """Did the audited node's call guard refuse the download (the audit cannot run at all)?"""
    return isinstance(exc, StateFetchError) and any(code in str(exc) for code in REFUSED)


class ReplicaAudits:
    """The audits of one coordinator. `note(views, members, scheduled)` every poll."""

    def __init__(self, ctx: Any, spec: StageAuditSpec, solo_audit_every_s: float, stages: int,
                 quarantine: Callable[[str, int, str], None]):
        self.ctx, self.spec, self.solo_every, self.stages = ctx, spec, solo_audit_every_s, stages
        self.quarantine = quarantine
        self.commits: dict[str, dict[int, str]] = {}     # stage node -> iteration -> published commit prefix
        self._tasks: dict[int, asyncio.Task] = {}        # stage -> its running audit
        self._audited: dict[int, int] = {}               # stage -> latest disagreeing iteration audited
        self._solo_rng = random.Random(os.urandom(16))   # when unreplicated stages are audited: unpredictable
        self._solo_due: dict[int, float] = {}            # unreplicated stage -> loop time of its next audit
        self._inconclusive: dict[str, int] = {}          # peer -> consecutive inconclusive audits
        self.blocked: dict[str, dict] = {}               # peer -> the alert (stage, why, since)
        self._detail: dict = {"blocked": {}}             # /readyz, replaced whole (read on the ops thread)
        self._pool: ChannelPool | None = None            # the evidence downloads (unreplicated stages)
        self._now = False                                # audit every unreplicated stage at the next poll
        self._warm = False                               # the audit modules were built ahead
        self._solo_seen: dict[int, tuple[str, int]] = {}  # stage -> (node, newest commit) at its last audit
        self._solo_first: set[str] = set()               # unreplicated nodes audited at least once
        self._served: dict[int, dict[str, tuple[int, frozenset]]] = {}  # epoch -> node -> (stage, its paths)
        ready_details.provide("stage_audits", lambda: self._detail)

    def published(self, epoch: int, served: dict[str, tuple[int, frozenset]]) -> None:
        """The coordinator published schedule `epoch`, node `n` serving stage `served[n][0]` on the
        path IDs `served[n][1]`. A solo audit compares the gradient a node stepped on only for an
        iteration it ran alone (with replicas it stepped on their mean) and with the evidence of
        every one of its paths (a neighbour that died since took its side of a path with it: a
        gradient recomputed from fewer microbatches points elsewhere)."""
        self._served[epoch] = dict(served)
        for old in [e for e in self._served if e <= epoch - EPOCHS_KEPT]:
            del self._served[old]

    def step_checkable(self, stage: int, peer: str, epoch: int | None, seen: set[int]) -> str:
        """"" when the step of `peer` (stage `stage`) on `epoch` can be compared with the gradient
        recomputed from the evidence of paths `seen`; otherwise why not."""
        served = self._served.get(epoch) if epoch is not None else None
        if served is None:
            return f"epoch {epoch} is no longer remembered"
        if sum(1 for st, _ in served.values() if st == stage) != 1:
            return f"epoch {epoch}: it had replicas, so it stepped on their mean"
        paths = served.get(peer, (stage, frozenset()))[1]
        if set(paths) != set(seen):
            return f"epoch {epoch}: evidence of paths {sorted(seen)} of its {sorted(paths)}"
        return ""

    def note(self, views: list[CardView], members: list[tuple], scheduled: list[tuple]) -> None:
        """Remember every live node's published commit; audit a stage whose replicas disagree, and
        unreplicated stages at random."""
        if not self._warm:                  # at the first poll, long before the first schedule
            self._warm = True
            asyncio.get_running_loop().run_in_executor(None, self._warm_up)
        live = {m[0] for m in members}
        for v in views:
            if v.peer_id not in live:
                continue
            hist = self.commits.setdefault(v.peer_id, {})
            for it, sha in parse_commits(v.card.details.get("commit")):
                hist.setdefault(it, sha)
            if hist:
                for old in sorted(hist)[:-COMMITS_KEPT]:
                    del hist[old]
        scheduled = [m for m in scheduled if m[0] in live]
        for stage, it in commit_disagreements(scheduled, self.commits).items():
            task = self._tasks.get(stage)
            if (task is None or task.done()) and it > self._audited.get(stage, -1):
                self._audited[stage] = it
                peers = [m for m in scheduled if m[1] == stage]
                self._start(stage, self.audit_stage(stage, it, peers))
        self._audit_unreplicated(scheduled)

    def _warm_up(self) -> None:
        """Worker thread, from the first poll on: build what an audit of each transformer stage
        needs (state specs, the recomputation module), so the first audits do not pay for it
        while the pipeline runs on (a first audit that built them took seconds on a loaded box:
        a dozen iterations of a tampering node)."""
        try:
            for stage in range(1, self.stages):
                self.spec.stage_spec(stage)
                if self.spec.module is not None:
                    self.spec.module(stage)
        except Exception as exc:  # noqa: BLE001 - an audit builds them again and says what fails
            log.info("audit warm-up failed: %r", exc)

    def _start(self, stage: int, coro) -> None:
        self._tasks[stage] = asyncio.get_running_loop().create_task(coro, name=f"audit_stage{stage}")

    def _next_gap(self, every: float) -> float:
        return self._solo_rng.expovariate(1.0 / every) if math.isfinite(every) else math.inf

    def audit_now(self) -> None:
        """Audit every unreplicated stage at the next poll (the pipeline's loss rises), even with
        random audits off (`solo_audit_every_s` = 0)."""
        self._now = True

    def _audit_unreplicated(self, scheduled: list[tuple]) -> None:
        """A transformer stage with one node has no replica to disagree with: audit it as soon as
        it has a step to replay (a node that tampers from the start is caught early), then at
        random times, `solo_audit_every_s` apart on average, and at once after `audit_now` (stage
        0, data and embedding, is not rebuilt live, so it is not audited here)."""
        every = self.solo_every
        now_asked, self._now = self._now, False
        if every <= 0 and not now_asked:
            return
        every = every if every > 0 else math.inf
        now = asyncio.get_running_loop().time()
        counts = {s: sum(1 for m in scheduled if m[1] == s) for s in range(self.stages)}
        peers_of = lambda s: [m for m in scheduled if m[1] == s]  # noqa: E731
        for stage, n in counts.items():
            if n != 1 or stage == 0:
                self._solo_due.pop(stage, None)
                continue
            due = self._solo_due.setdefault(stage, now + self._next_gap(every))
            newest = max(self.commits.get(peers_of(stage)[0][0], {}) or [-1])
            if now_asked or (newest >= 2 and peers_of(stage)[0][0] not in self._solo_first):
                due = self._solo_due[stage] = now     # a new node is audited as soon as it has a step to replay
            task = self._tasks.get(stage)
            if now < due or (task is not None and not task.done()):
                continue
            self._solo_due[stage] = now + self._next_gap(every)
            peers = [m for m in scheduled if m[1] == stage]
            it = max(self.commits.get(peers[0][0], {}) or [-1])
            if self._solo_seen.get(stage) == (peers[0][0], it):
                continue                   # it has not stepped since its last audit (a suspended pipeline)
            self._solo_seen[stage] = (peers[0][0], it)
            self._solo_first.add(peers[0][0])
            others = [m for m in scheduled if m[1] != stage]
            self._start(stage, self.audit_stage(stage, it, peers, solo=True, others=others))

    async def audit_stage(self, stage: int, it: int, peers: list[tuple], solo: bool = False,
                          others: list[tuple] = ()) -> None:
        """Replay each replica's last step from its own served states (pipeline/stage_audit.py);
        quarantine those that do not replay, as long as one replica of the stage does (`solo`: the
        stage's only node, audited at random; a failure quarantines it and the stage is rebuilt by
        CheckFree from its neighbours)."""
        if solo:
            emit(log, "solo_audit", "stage {stage} has one node: auditing its step (random sample)", stage=stage,
                 iteration=it, peers=[m[0] for m in peers])
        else:
            emit(log, "replica_commit_mismatch", "stage {stage} replicas published different weight commits at "
                 "iteration {iteration}: auditing {n} replicas", level=logging.WARNING, stage=stage, iteration=it, n=len(peers),
                 peers=[m[0] for m in peers])
        verdicts: dict[str, tuple | None] = {}
        for m in peers:
            try:
                verdicts[m[0]] = await (self.audit_solo(stage, m, others) if solo else self.audit_one(stage, m))
            except (StateFetchError, KeyError, ValueError) as exc:
                log.info("audit of %s (stage %d) inconclusive: %s", m[0][:16], stage, exc)
                verdicts[m[0]] = None
                self._cannot_run(m[0], stage, exc)
            else:
                self._ran(m[0], verdicts[m[0]][0])
        passed = [p for p, v in verdicts.items() if v is not None and v[0]]
        failed = {p: v for p, v in verdicts.items() if v is not None and not v[0]}
        emit(log, "replica_audit", "stage {stage} audit: {n_passed} replay, {n_failed} do not, {n_inconclusive} "
             "inconclusive", stage=stage, iteration=it, n_passed=len(passed), n_failed=len(failed),
             n_inconclusive=len(verdicts) - len(passed) - len(failed), passed=passed,
             failed={p: v[1] for p, v in failed.items()}, notes={p: verdicts[p][1] for p in passed})
        if solo:
            for peer, (_, why, t, *check) in failed.items():
                result = CheckResult(check[0] if check else "update_drift", peer, t)
                result.flag(f"its step {t} does not replay from its own served states: {why}")
                count_flags([result])
                self.quarantine(peer, stage, f"solo_audit@{t}: {why}")
            return
        if not passed or not failed:
            return                      # nothing attributable: look again when they disagree at a later iteration
        good = self.commits.get(passed[0], {}).get(it, "")
        for peer, (_, why, t) in failed.items():
            count_flags([compare_commits(peer, t, good, self.commits.get(peer, {}).get(it, "?"))])
            self.quarantine(peer, stage, f"{REPLICA_COMMIT}@{t}: {why}")

    async def audit_one(self, stage: int, m: tuple) -> tuple[bool, str, int]:
        """(replays, why, iteration) for one replica."""
        weights_spec, opt_spec, cfg_hash = self.spec.stage_spec(stage)
        fetch = lambda it: fetch_state(m[2], self.ctx.config.run_id, self.ctx.peer_id, cfg_hash,  # noqa: E731
                                       weights_spec, optimizer=opt_spec if it == 0 else None, stage=stage,
                                       iteration=it, timeout=20, peer_id=m[0])
        meta, tensors = await fetch(0)
        t = int(meta.get("iteration", "0"))
        after, opt = split_optimizer(tensors)
        lr = float(meta.get("lr", "nan"))
        if t < 1 or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"nothing to replay yet (iteration {t}, lr {lr})")
        meta0, before = await fetch(t - 1)
        if int(meta0.get("iteration", "-1")) != t - 1:
            raise ValueError(f"its state of iteration {t - 1} is no longer kept (it serves {meta0.get('iteration')})")
        published = self.commits.get(m[0], {})
        for i, w in ((t, after), (t - 1, before)):
            sha = commit_of(w)
            if i in published and not sha.startswith(published[i]):
                return False, f"served weights of iteration {i} ({sha[:12]}) differ from its published commit", t
        res, tensor = await asyncio.to_thread(replay_residual, before, after, opt, lr, self.spec.betas,
                                              self.spec.eps, self.spec.weight_decay)
        if not res <= RESIDUAL_LR:
            return False, f"step {t} does not replay: {tensor} off by {res:.3g} lr (limit {RESIDUAL_LR})", t
        return True, f"step {t} replays ({res:.2g} lr)", t

    async def audit_solo(self, stage: int, m: tuple, others: list[tuple]) -> tuple[bool, str, int, str]:
        """(passes, why, iteration, check) for the only node of a stage: its step T-1 -> T replays
        from its served states (`update_drift`), and its microbatches of iteration T-1 recompute
        from what its neighbours kept (`stage_replay`: outputs, the gradient sent upstream, the
        gradient it stepped on). T is its newest published commit; both states and the evidence are
        fetched at once, so a node that runs on while a slow download lasts still serves them
        (it keeps KEEP_SNAPSHOTS states, its neighbours `stage.evidence_iterations` iterations)."""
        weights_spec, opt_spec, cfg_hash = self.spec.stage_spec(stage)
        fetch = lambda it: fetch_state(m[2], self.ctx.config.run_id, self.ctx.peer_id, cfg_hash,  # noqa: E731
                                       weights_spec, optimizer=opt_spec, stage=stage, iteration=it, timeout=20,
                                       peer_id=m[0])
        fetch_plain = lambda it: fetch_state(m[2], self.ctx.config.run_id, self.ctx.peer_id, cfg_hash,  # noqa: E731
                                             weights_spec, stage=stage, iteration=it, timeout=20, peer_id=m[0])
        published = self.commits.get(m[0], {})
        t = max(published, default=0)
        if t < 2:
            raise ValueError(f"nothing to replay yet (newest published commit: iteration {t})")
        t0 = time.monotonic()
        (meta, tensors), (meta0, tensors0), evidence = await asyncio.gather(
            fetch(t), self._fetch_before(fetch, fetch_plain, t - 1), self._evidence(m[0], t - 1, others))
        for want, got in ((t, meta), (t - 1, meta0)):
            if int(got.get("iteration", "-1")) != want:
                raise ValueError(f"its state of iteration {want} is no longer kept (it serves {got.get('iteration')})")
        after, opt = split_optimizer(tensors)
        before, opt0 = split_optimizer(tensors0)
        lr = float(meta.get("lr", "nan"))
        for i, w in ((t, after), (t - 1, before)):
            if i in published and not commit_of(w).startswith(published[i]):
                return False, f"served weights of iteration {i} differ from its published commit", t, "update_drift"
        res, tensor = await asyncio.to_thread(replay_residual, before, after, opt, lr, self.spec.betas,
                                              self.spec.eps, self.spec.weight_decay)
        if not res <= RESIDUAL_LR:
            return False, f"step {t} does not replay: {tensor} off by {res:.3g} lr (limit {RESIDUAL_LR})", t, \
                "update_drift"
        if self.spec.module is None:
            return True, f"step {t} replays ({res:.2g} lr)", t, "update_drift"
        samples, missing, ep, paths = match_evidence(evidence)
        if missing:
            return True, f"step {t} replays ({res:.2g} lr); outputs not checked: {missing}", t, "stage_replay"
        unchecked = self.step_checkable(stage, m[0], ep, set(paths))
        stepped = None if unchecked else step_gradient(opt0, opt, list(before), self.spec.betas[0])
        t1 = time.monotonic()
        ok, why = await asyncio.to_thread(replay_outputs, self.spec.module(stage), before, samples, stepped)
        why = f"{why}; downloads {t1 - t0:.2f} s, recomputation {time.monotonic() - t1:.2f} s" + \
            (f"; its step not compared ({unchecked})" if unchecked else "")
        if ok is False:
            return False, f"iteration {t - 1}: {why}", t - 1, "stage_replay"
        return True, f"step {t} replays ({res:.2g} lr); iteration {t - 1}: {why}", t, "stage_replay"

    @staticmethod
    async def _fetch_before(fetch, fetch_plain, it: int) -> tuple[dict, dict]:
        """The state before the audited step, with its AdamW moments; without them when it had
        not stepped yet (its moments are then zero: pipeline/stage_audit.py `step_gradient`)."""
        try:
            return await fetch(it)
        except StateFetchError as exc:
            if "lacks ['optimizer/" not in str(exc):
                raise
            return await fetch_plain(it)

    async def _evidence(self, peer: str, it: int, others: list[tuple]) -> list[Entry]:
        """What the other scheduled nodes kept of iteration `it` about `peer` (a node that does
        not answer adds nothing: the audit then finds its evidence incomplete)."""
        if self.spec.module is None:
            return []
        if self._pool is None:
            self._pool = ChannelPool()
        got = await asyncio.gather(*(fetch_evidence(self._pool, run_id=self.ctx.config.run_id, me=self.ctx.peer_id,
                                                    peer_id=o[0], addr=o[2], about=peer, it=it) for o in others),
                                   return_exceptions=True)
        out: list[Entry] = []
        for o, g in zip(others, got):
            if isinstance(g, BaseException):
                log.info("evidence from %s about %s unavailable: %r", o[0][:16], peer[:16], g)
                continue
            out.extend(g)
        return out

    # ------------------------------------------------------------------ the alert
    def _ran(self, peer: str, replays: bool) -> None:
        M.AUDITS.labels(outcome="replays" if replays else "fails").inc()
        self._inconclusive.pop(peer, None)
        if self.blocked.pop(peer, None) is not None:
            emit(log, "audit_unblocked", "audits of {peer} run again", peer=peer)
            self._publish()

    def _cannot_run(self, peer: str, stage: int, exc: Exception) -> None:
        is_refused = refused(exc)
        M.AUDITS.labels(outcome="refused" if is_refused else "inconclusive").inc()
        n = self._inconclusive[peer] = self._inconclusive.get(peer, 0) + 1
        if not is_refused and n < INCONCLUSIVE_ALERT_AFTER:
            return
        why = str(exc)[:300]
        first = peer not in self.blocked
        self.blocked[peer] = {"stage": stage, "why": why, "inconclusive_in_a_row": n}
        self._publish()
        if first or n % 10 == 0:
            emit(log, "audit_blocked", "the integrity audit of stage {stage} node {short} cannot run ({why}): its "
                 "replicas go unchecked. {hint}", level=logging.ERROR, stage=stage, peer=peer, short=peer[:16],
                 why=why, refused=is_refused, inconclusive_in_a_row=n,
                 hint=("Its call guard refuses this coordinator: check that the node's security.coordinator_peer_id "
                       "names this node's key and that this node runs with that key" if is_refused else
                       "Its served states race on or time out: check its load and the coordinator's link to it"))

    def _publish(self) -> None:
        M.AUDITS_BLOCKED.set(len(self.blocked))
        self._detail = {"blocked": {p[:16]: dict(v) for p, v in self.blocked.items()}}

    def forget(self, peer: str) -> None:
        """A node that left the schedule for good (quarantined, gone): no alert for it any more."""
        self._inconclusive.pop(peer, None)
        if self.blocked.pop(peer, None) is not None:
            self._publish()


__all__ = ["COMMITS_KEPT", "EPOCHS_KEPT", "INCONCLUSIVE_ALERT_AFTER", "REPLICA_COMMIT", "ReplicaAudits", "StageAuditSpec", "commit_disagreements",
           "Matched", "match_evidence", "parse_commit", "parse_commits", "refused"]
