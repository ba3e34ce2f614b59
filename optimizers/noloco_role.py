"""The ``noloco`` role: a data-parallel worker trained with NoLoCo (or the DiLoCo baseline).

    swarmnode run --role noloco --initial-peers /ip4/…/p2p/12D3KooW… [--set noloco.inner_steps=50]

Round policy only. What the worker computes is ``optimizers/noloco_engine.py`` (model, inner
optimizer, phi/m, data; pure torch); the exchange ``optimizers/exchange.py`` (pairing through
the DHT roster); the waiting rules ``optimizers/waiting.py``. ``node.training.TrainingRole``
gives the compute thread, device placement, the round loop, ``exit_after``, finish, drain,
checkpoints, state serving and the per-round report.

Loop per round r: H inner Adam steps on the compute thread (the event loop stays free to serve
peers) -> exchange theta with a random live partner (NoLoCo) or everyone (DiLoCo) within
``round_timeout`` -> outer step, its check and the good-state snapshot in one compute call (solo
when no valid partner: never a hang; a refused step is rolled back) -> report (metrics, card,
``averaging_round_done``) -> evaluation when due; the base checkpoints every
``checkpoint_every`` rounds. NoLoCo trains on while its exchange is in flight
(``overlap_fraction``: the next round's first steps; theta <- phi + the progress since the
tensors were sent), so waiting for a partner costs little. A joiner downloads phi from several READY
peers, adopts the state the majority agrees with at a round at least two of them reached
(node/checked_download.py) and starts there with fresh Adam state and m = 0.

Devices (the ``[device]`` section): the base resolves the device on the compute thread once the
DHT is up (hivemind forked before any CUDA call); the engine gets a placement: the forward pass
under the configured precision, phi and m in fp32 on the device or, with
``noloco.outer_state_device = "host"``, on the host; on a GPU the tensors to send are staged in
reusable pinned host buffers. On the CPU every one of these is a no-op.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from functools import partial

from node import metrics as NM
from node.card import CardView, card_int, peers, read_cards
from node.device import PinnedPool, autocast, grad_scaler, outer_state_device, record_memory
from node.logs import emit
from node.metrics import count_rejection
from node.roles import NodeContext, Service, register
from node.donor_choice import LabelSupport, supported_label
from node.state_sync import StateServicer, StateSnapshot
from node.training import TrainingRole
from optimizers import noloco_metrics as M
from optimizers.exchange import ExchangeResult, OuterExchange, add_exchange_to_server
from optimizers.exchange_common import TensorBounds
from optimizers.noloco_engine import NoLoCoEngine, Placement
from optimizers.noloco_join import join_from_peers
from optimizers.noloco_settings import NoLoCoCard, RoleSettings, WorkerConfig
from optimizers.partner_share import PartnerShare
from optimizers.robust import ClipVerdict, PartnerClip
from optimizers.roster import ROSTER
from optimizers.waiting import FINISHING, PeerPlan, lead_steps, someone_can_meet, steps_to_wait, wait_bound

log = logging.getLogger("swarmnode.noloco")

JOIN_WAIT_S = 60.0
"""A starting worker waits at most this long for its DHT join before looking for a state donor."""
MAX_PAIR_TRIES = 4
"""Tries at pairing in one round (a try ends early when the peers move to a later round label:
the worker waits on there); the wait bound covers all of them together."""
WATCH_POLL_S = 0.25
"""Seconds between card reads while waiting for a partner (one DHT read per waiting worker)."""
LEFT_OUT = ("missed", "nobody", "wait_bound")
"""Solo reasons after which the worker checks whether it arrived after the peers of its next
label (``_lead_after_missed``)."""


def peer_plan(view: CardView) -> PeerPlan:
    """What the waiting rules read of a peer's card (its round label range-checked)."""
    return PeerPlan.from_details(view.card.details, card_int(view, "round"))


@register
class NoLoCoRole(TrainingRole):
    name, Settings, run_section, Card, rendezvous = "noloco", RoleSettings, "noloco", NoLoCoCard, (ROSTER,)
    # checkpoints and snapshots are labelled by the outer round (exit_after counts inner steps)
    checkpoint_format, serves_state, progress_key = "swarmnode-noloco-v2", True, "round"
    finished_msg = ("reached {step} inner steps (round {round}, eval loss {eval_loss_start:.4f} -> "
                    "{eval_loss_end:.4f}): draining")

    cfg: WorkerConfig

    def __init__(self, ctx: NodeContext, settings: RoleSettings):
        super().__init__(ctx, settings)
        self.cfg_hash = hashlib.sha256(
            f"{self.cfg.cfg_hash()}|{settings.model.model_dump_json()}".encode()).hexdigest()[:12]
        # built here, on the CPU (no CUDA call before the DHT): the exchange needs its tensor specs
        self.engine = NoLoCoEngine(self.cfg, settings.model, compute_delay_s=self.cfg.compute_delay_s,
                                   on_step=NM.record_train_step,
                                   should_stop=lambda: self.stopping or self.compute.stopping)
        emit(log, "outer_config", "outer {outer}: {note}", outer=self.cfg.outer, note=self.cfg.outer_momentum_note,
             outer_momentum=self.cfg.outer_momentum)
        specs = [(n, dt, shape) for n, (dt, shape) in self.engine.specs().items()]
        if self.cfg.exchanges_phi:
            specs += [(f"phi.{n}", dt, shape) for n, dt, shape in specs]
        self.exchange = OuterExchange(
            run_id=ctx.config.run_id, peer_id=ctx.peer_id, cfg_hash=self.cfg_hash, grpc_addr=ctx.grpc_addr,
            dht=ctx.membership.dht, specs=specs, netem=ctx.netem, max_round_skew=self.cfg.max_round_skew,
            max_message_bytes=ctx.config.grpc.max_message_bytes, on_reject=count_rejection,
            bounds=TensorBounds(self.cfg.max_norm_ratio, self.cfg.max_distance_ratio, self.cfg.bound_floor_rms),
            robust=(None if self.cfg.robust == "off" else
                    PartnerClip(self.cfg.robust_multiplier, self.cfg.robust_window, strikes=self.cfg.robust_strikes,
                                backward=self.cfg.robust_backward, redescend=self.cfg.robust_redescend)),
            on_clip=self._on_clip, codec=self.engine.codec,
            share=(None if self.cfg.robust == "off" or self.cfg.robust_share is None else
                   PartnerShare(self.cfg.robust_share, self.cfg.robust_window)))
        self.tally = M.Tally()
        self._bad_rounds = 0  # outer steps refused in a row
        self._lead = 0        # inner steps dropped from the next phase (left out of a round's pairs)
        self._views_seen: list | None = None  # this round's newest card read (the wait polls refresh it)
        self._clipped_hard = 0  # partner contributions clipped hard (the card's ``clipped_hard``)
        self._judged: list[tuple[float, float]] = []  # this round's (clip factor, pulled back) per contribution

    def _on_clip(self, v: ClipVerdict) -> None:
        """A partner contribution judged by the robust clip: metrics, the round's log line
        (``clip_factors``, ``pulled_back``); a hard clip also counts on the node card
        (``clipped_hard``, published with the next round's card)."""
        M.record_clip(v.factor, v.radius, v.hard, v.charge)
        self._judged.append((round(v.factor, 4), round(v.pulled_back, 4)))
        if v.hard:
            self._clipped_hard += 1
            self.update_card(NoLoCoCard(clipped_hard=self._clipped_hard))

    # ---------------- what the base asks of the role ----------------

    def services(self) -> list[Service]:
        return [Service(add_exchange_to_server, self.exchange.servicer(), "swarmnode.NoLoCo"), *super().services()]

    def progress(self) -> int:
        return self.engine.round

    def exit_reached(self) -> bool:
        """``exit_after`` counts inner steps (rounds may take more or fewer of them)."""
        return bool(self.cfg.exit_after) and self.engine.step >= self.cfg.exit_after

    def parts(self) -> dict:
        return self.engine.parts()

    def checkpoint_meta(self) -> dict:
        return {"round": self.engine.round, "step": self.engine.step}

    def restore(self, meta) -> None:
        self.engine.restore(int(meta["step"]), int(meta["round"]))

    def snapshot(self) -> StateSnapshot | None:
        """phi at the last good outer step: the engine's host copies, served as they are."""
        good = self.engine.good
        return None if good is None else StateSnapshot({"round": good.round}, good.phi)

    def make_state_servicer(self) -> StateServicer:
        # the engine replaces its good state whole (never edits it), so serve it live: no copy per round
        return StateServicer(self.ctx.config.run_id, self.cfg_hash, self.snapshot, self.ctx.netem)

    async def close_transport(self) -> None:
        await self.exchange.close()

    def final_checkpoint(self) -> None:
        self.engine.rewind()  # an abandoned round: back to its last outer step
        self.save_checkpoint()

    async def summary(self) -> dict:
        eng, t = self.engine, self.tally
        final_eval = await self.compute.run(eng.evaluate)
        NM.EVAL_LOSS.set(final_eval)
        return {"step": eng.step, "round": eng.round, "eval_loss_start": t.eval_start, "eval_loss_end": final_eval,
                "train_loss_start": eng.first_loss, "train_loss_end": eng.last_loss, "rounds_ok": t.rounds_ok,
                "outer_steps": t.outer_steps, "blocked_s": round(t.blocked_s, 3), "train_s": round(t.train_s(), 3)}

    # ---------------- start-up ----------------
    def place(self) -> dict:
        """Resolve ``[device]`` (the base) and place the engine there (compute thread, before any
        training); returns the card details. On the CPU nothing moves."""
        details = super().place()
        device, precision = self.device, self.ctx.config.device.precision
        pool = PinnedPool(pin=device.type == "cuda")
        placement = Placement(device, outer_state_device(self.cfg.outer_state_device, device),
                              autocast=partial(autocast, device, precision), scaler=grad_scaler(device, precision),
                              to_host=partial(pool.to_host_all, copy=True))
        self.engine.place(placement)
        record_memory(device)
        emit(log, "device_ready", "training on {device} ({device_name}, {precision}), outer state on "
             "{outer_state_device}", device=str(device), precision=precision,
             outer_state_device=str(placement.outer_device), **details)
        return details

    async def setup(self) -> None:
        eng = self.engine
        self.update_card(NoLoCoCard(**await self.compute.run(self.place)))
        shard = int(hashlib.sha256(self.ctx.peer_id.encode()).hexdigest(), 16) % self.cfg.data_shards
        corpus = await self.compute.run(eng.load_data, self.settings.data, shard, self.cfg.data_shards)
        emit(log, "data_ready", "data ready: {source}, {train_tokens} train / {val_tokens} val tokens, shard {shard} "
             "of {shards}", source=corpus.source, train_tokens=int(corpus.train.numel()),
             val_tokens=int(corpus.val.numel()), shard=shard, shards=self.cfg.data_shards)
        if await self.resume() is None and self.cfg.join_from_peers:
            await self._join()
        eng.start_data()
        await self.compute.run(eng.mark_good)
        self.tally.eval_start = await self.compute.run(eng.evaluate)
        NM.EVAL_LOSS_INITIAL.set(self.tally.eval_start)
        NM.EVAL_LOSS.set(self.tally.eval_start)
        M.OUTER_ROUND.set(eng.round)
        self.update_card(NoLoCoCard(round=eng.round, outer=self.cfg.outer, cfg_hash=self.cfg_hash))
        await self.ctx.set_role_ready(True, "ready", "")
        self.tally.t0 = time.monotonic()
        emit(log, "training_started", "training from round {round} step {step} (eval loss {eval_loss:.4f})",
             round=eng.round, step=eng.step, eval_loss=self.tally.eval_start)

    # ---------------- joining and state downloads ----------------
    async def _join(self) -> None:
        await self.ctx.set_role_ready(False, "state_sync", "looking for a peer with the run's current state")
        if not await self.ctx.membership.wait_joined(JOIN_WAIT_S):
            emit(log, "join_wait_timeout", "not joined to the swarm after {wait_s:.0f} s: looking for a donor among "
                 "the peers seen so far", level=logging.WARNING, wait_s=JOIN_WAIT_S)

        async def trained() -> int:
            views = await self._read_views(timeout=10.0)
            return len([v for v in self._ready_peers(views or []) if (card_int(v, "round") or 0) >= 1])

        async def adopt(rnd: int, phi: list) -> None:
            await self.compute.run(self.engine.adopt, rnd, phi)
        await join_from_peers(lambda: self._fetch_from_donor(min_round=1), trained, adopt, self.ctx.config.card.ttl_s)

    async def _fetch_from_donor(self, min_round: int) -> tuple[int, list, str] | None:
        """(round, phi, donor) from the READY workers of this run (round >= min_round), checked
        before it is adopted (``TrainingRole.download_state``): up to ``donors_compared`` are
        downloaded, the state the majority agrees with wins and disagreeing donors are rejected;
        the round is the one at least ``round_label_quorum`` agreeing donors served. A donor may
        serve a round up to ``max_round_skew`` past its card: the card is published after the
        outer step, so a download can see the new state under the old card."""
        views = await self._read_views(timeout=10.0)
        if views is None:
            emit(log, "state_donor_unknown", "could not read node cards to find a state donor", level=logging.WARNING)
            return None
        expected = self.engine.specs()
        got = await self.download_state(views, expected, min_progress=min_round, ahead=self.cfg.max_round_skew,
                                        max_jump=self.cfg.max_round_jump,  # none past the robust frontier
                                        check=self.cfg, request={"round": self.engine.round})
        if got is None:
            return None
        return got.progress, [got.tensors[n] for n in expected], got.donor

    async def _resync_phi(self) -> None:
        """DiLoCo assumes identical phi: after a missed global round, take a peer's phi (and round);
        the Adam state and momentum stay local."""
        got = await self._fetch_from_donor(min_round=self.engine.round)
        if got is not None:
            rnd, phi, donor = got
            await self.compute.run(self.engine.resync, rnd, phi)
            emit(log, "phi_resync", "re-fetched phi at round {round} from {donor} after a missed DiLoCo round",
                 round=rnd, donor=donor)

    # ---------------- one round ----------------
    async def one_round(self) -> None:
        eng, t_round = self.engine, time.monotonic()
        # steps computed while the last exchange ran (past its outer step) belong to this round
        h = self._within_exit(max(1, self.cfg.inner_steps - (eng.step - eng.round_start_step) - self._lead),
                              at_least=1)
        led, self._lead = self._lead, 0
        step0, t0 = eng.step, time.perf_counter()
        loss, views, t_outer = await self._steps_then_views(h, self.cfg.outer == "noloco")
        # from t_outer (the end of the compute, before any wait for the card read) the worker
        # computes nothing: blocked time
        if eng.step > step0:  # the worker's own pace: what the waiting policy scales with
            self.tally.pace(t_outer - t0, eng.step - step0)
        if self.stopping:
            return
        self._views_seen = views
        rnd = self._label(views)
        room = self._within_exit(self.cfg.inner_steps + self.cfg.inner_steps // 2)  # at most half a phase more
        # a phase shortened to arrive before the peers is not lengthened again to meet them exactly
        extra = 0 if led else self._steps_until_partner(views, rnd, room)
        if extra:  # keep computing while waiting: nobody can meet us now, a peer is due soon
            emit(log, "compute_while_waiting", "round {round}: no partner within the wait bound; {extra_steps} more "
                 "inner steps until one is due", round=rnd, extra_steps=extra)
            M.EXTRA_STEPS.inc(extra)
            # partners plan on this card: say at once that we exchange later, not at the stale time
            self.update_card(NoLoCoCard(next_exchange_at=round(time.time() + extra * (self.tally.step_s or 0.0), 3)),
                             publish=True)
            loss, views, t_outer = await self._steps_then_views(extra, True)
            if self.stopping:
                return
            self._views_seen = views
            rnd = self._label(views)
        tensors = await self.compute.run(eng.outgoing)
        res, rnd, bound, waited, computing = await self._exchange(rnd, tensors, views)
        res.blocked_s = max(0.0, time.perf_counter() - t_outer - computing)  # trained on meanwhile: not blocked
        last = self.exit_reached()
        n = res.n if res.mean is not None and res.n > 1 else 1
        # the outer step uses the tensors sent; progress made while the exchange ran stays on top
        out = await self.compute.run(eng.outer_step, res.mean, n, tensors, rnd)
        if out.refused is not None:
            if n > 1:  # the partners' contribution made the step bad: do not pair with them for a while
                self.exchange.charge(res.partners, "rollback")
            await self._refused(rnd, out.refused, res.outcome, res.reason)
            return
        if self._bad_rounds:
            await self._recovered()
        record_memory(self.device)
        self.tally.record(rnd=eng.round, n=n, outcome=res.outcome, reason=res.reason, partners=res.partners,
                          blocked_s=res.blocked_s, sent_bytes=res.sent_bytes, received_bytes=res.received_bytes,
                          norm=out.norm, spread=out.spread)
        eval_due = self.eval_due()
        overlapped = eng.step - eng.round_start_step
        # finishing: this was the last round, no peer waits for it at a later label. Published at
        # once: peers waiting at our old label see that we paired elsewhere, and plan on our next time
        next_at = time.time() + (self.tally.step_s or 0.0) * max(1, self.cfg.inner_steps - overlapped) + \
            (self.tally.eval_s if eval_due else 0.0)
        if res.outcome == "solo" and res.reason in LEFT_OUT and self.cfg.outer == "noloco":
            next_at -= self._lead_after_missed(next_at, overlapped, res.reason == "missed")
        blocked = res.blocked_s / max(1e-6, time.monotonic() - t_round)
        why = f" ({res.reason})" if res.reason else ""
        self.report("averaging_round_done",
                    "round {round}: n={group_size} {outcome}" + why.replace("{", "{{").replace("}", "}}") +
                    " loss {train_loss:.4f} blocked {blocked_s:.2f} s", round=eng.round,
                    card=NoLoCoCard(round=eng.round, blocked=round(min(1.0, blocked), 3), finishing=last,
                                    next_exchange_at=round(next_at, 3)), publish=True,
                    group_size=n, outcome=res.outcome, reason=res.reason, partners=list(res.partners),
                    train_loss=loss, blocked_s=round(res.blocked_s, 3), step=eng.step,
                    wait_bound_s=None if bound is None else round(bound, 3), exchange_s=round(res.exchange_s, 3),
                    waited_s=round(waited, 3), overlap_steps=overlapped, train_s=round(self.tally.train_s(), 3),
                    sent_bytes=res.sent_bytes, received_bytes=res.received_bytes,
                    compress_s=round(eng.encode_s, 4), decompress_s=round(res.codec_s, 4),
                    clip_factors=[f for f, _ in self._judged], pulled_back=[b for _, b in self._judged])
        self._judged = []
        if eval_due:
            await self._evaluate()
        if self.cfg.outer == "diloco" and n == 1 and res.outcome != "ok":
            await self._resync_phi()

    async def _evaluate(self) -> None:
        t_eval = time.monotonic()
        ev = await self.compute.run(self.engine.evaluate)
        self.tally.eval_s = time.monotonic() - t_eval
        NM.EVAL_LOSS.set(ev)
        emit(log, "eval_done", "round {round}: eval loss {eval_loss:.4f}", round=self.engine.round,
             step=self.engine.step, eval_loss=ev, train_s=round(self.tally.train_s(), 3))

    async def _exchange(self, rnd: int, tensors: list, views: list | None):
        """This round's exchange -> (result, the round label it ended at, the wait bound or None,
        seconds waited, seconds spent computing inner steps meanwhile)."""
        if self.cfg.outer == "diloco":
            res = await self.exchange.group_average(rnd, tensors, self.cfg.round_timeout,
                                                    expected=await self._live_workers(), move=self.engine.last_move,
                                                    wire=self.engine.wire, origin=self.engine.last_origin)
            return res, rnd, None, 0.0, 0.0
        # waiting costs nothing while the worker can train on (overlap): wait that long too
        step_s = self.tally.step_s
        bound = min(self.cfg.round_timeout, max(wait_bound(step_s, self.cfg), self._overlap_room() * (step_s or 0.0)))
        if views is not None and not someone_can_meet(self._plans(views), rnd, by=time.time() + bound):
            return ExchangeResult(None, 1, [], "solo", "nobody"), rnd, bound, 0.0, 0.0  # nobody will come
        t_pair = time.perf_counter()
        res, rnd, computing = await self._pair_within_bound(rnd, tensors, bound)
        return res, rnd, bound, time.perf_counter() - t_pair, computing

    # ---------------- waiting policy ----------------
    async def _steps_then_views(self, n: int, want_views: bool) -> tuple[float, list | None, float]:
        """``n`` inner steps -> (loss, node cards or None, ``time.perf_counter()`` when the
        compute ended). With ``want_views`` the cards are read (DHT) while the last step
        computes (the view is at most one step old); a read that outlasts the step is idle time,
        so the caller counts blocked time from the returned compute end, not from the read."""
        steps = self.engine.inner_steps
        if not want_views:
            return await self.compute.run(steps, n), None, time.perf_counter()
        loss = await self.compute.run(steps, n - 1) if n > 1 else float("nan")
        if self.stopping:
            return loss, None, time.perf_counter()
        done: list[float] = []

        async def last_step() -> float:
            out = await self.compute.run(steps, 1)
            done.append(time.perf_counter())
            return out

        loss, views = await asyncio.gather(last_step(), self._read_views())
        return loss, views, done[0]

    def _within_exit(self, steps: int, at_least: int = 0) -> int:
        """``steps``, no more than are left before ``exit_after`` (when set), at least ``at_least``."""
        if not self.cfg.exit_after:
            return steps
        return max(at_least, min(steps, self.cfg.exit_after - self.engine.step))

    def _overlap_room(self) -> int:
        """Inner steps the worker may compute while its exchange is in flight."""
        return self._within_exit(math.ceil(self.cfg.overlap_fraction * self.cfg.inner_steps))

    def _lead_after_missed(self, next_at: float, overlapped: int, missed: bool) -> float:
        """Left out of this round's pairs: drop inner steps from the next phase so that it arrives
        before the peers due at its next label (``waiting.lead_steps``) -> the seconds dropped.
        Reads the cards the round already read (the wait's last poll: after a ``missed`` wait it
        shows the peers at their next label), so it costs no card read of its own."""
        step_s, views = self.tally.step_s, self._views_seen
        if views is None or not step_s:
            return 0.0
        room = max(0, self.cfg.inner_steps - overlapped - 1) // 2
        self._lead = lead_steps(self._plans(views), self.engine.round, next_at, step_s, room, missed=missed)
        if self._lead:
            M.LEAD_STEPS.inc(self._lead)
        return self._lead * step_s

    def _steps_until_partner(self, views: list | None, rnd: int, room: int) -> int:
        """Inner steps to add to this round instead of a solo step (``compute_while_waiting``)."""
        if views is None or self.cfg.outer != "noloco" or not self.cfg.compute_while_waiting:
            return 0
        step_s = self.tally.step_s
        idle = None if step_s is None else self.cfg.idle_steps * step_s
        return steps_to_wait(self._plans(views), rnd, time.time(), wait_bound(step_s, self.cfg), step_s, room,
                             idle_s=idle)

    async def _pair_within_bound(self, rnd: int, tensors: list, bound: float) -> tuple[ExchangeResult, int, float]:
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
            while room > 0 and not stop.is_set() and not self.stopping:
                t0 = time.perf_counter()
                await self.compute.run(self.engine.inner_steps, 1)
                computing += time.perf_counter() - t0
                room -= 1

        trainer = asyncio.create_task(train_on())  # this round's: stopped and awaited below
        try:
            for tries in range(1, MAX_PAIR_TRIES + 1):
                res, later = await self._pair_try(rnd, tensors, end_wall)
                if later is None or tries == MAX_PAIR_TRIES or time.time() >= end_wall:
                    break
                emit(log, "round_relabel", "round label {from_round} -> {round} while waiting: the peers moved on",
                     from_round=rnd, round=later)
                rnd = later
        finally:
            stop.set()  # the trainer ends after the step in flight, also when we are cancelled
        await trainer  # the outer step follows that step
        return res, rnd, computing

    async def _pair_try(self, rnd: int, tensors: list, end_wall: float) -> tuple[ExchangeResult, int | None]:
        """One wait at label ``rnd`` until ``end_wall`` -> (result, a later label to move to or None).
        The wait ends at ``end_wall`` on the clock ("wait_bound"), never later: a card read in
        flight does not hold it up."""
        later: list[int] = []
        timer = asyncio.get_running_loop().call_later(max(0.0, end_wall - time.time()), lambda: asyncio.ensure_future(
            self.exchange.stop_waiting(rnd, "wait_bound")))
        watch = asyncio.create_task(self._watch_wait(rnd, end_wall, later))  # this try's: cancelled below
        try:
            res = await self.exchange.pair_average(rnd, tensors, self.cfg.round_timeout, move=self.engine.last_move,
                                                   wire=self.engine.wire, origin=self.engine.last_origin)
        finally:
            timer.cancel()
            watch.cancel()
        relabel = res.outcome == "solo" and res.reason == "relabel" and later
        return res, (later[0] if relabel else None)

    async def _watch_wait(self, rnd: int, end_wall: float, later: list[int]) -> None:
        """Poll the node cards until ``end_wall``: end the wait when the peers moved to a later
        label ("relabel", noted in ``later``) or nobody can meet us by then ("nobody")."""
        while time.time() < end_wall:
            await asyncio.sleep(WATCH_POLL_S)
            views = await self._read_views(timeout=max(0.1, min(2.0, end_wall - time.time())))
            if views is None:
                continue
            self._views_seen = views
            frontier = self._frontier(views) if self._catches_up else None
            if frontier is not None and frontier > rnd:
                # peers paired at our label and moved on: whoever arrives next goes to their label;
                # when none can meet us there within the bound, this label's solo step keeps ours
                # in line with theirs (relabelled and alone, it ran one label ahead for good)
                if someone_can_meet(self._plans(views), frontier, by=end_wall):
                    later.append(frontier)
                    await self.exchange.stop_waiting(rnd, "relabel")
                else:
                    await self.exchange.stop_waiting(rnd, "missed")
                return
            if not someone_can_meet(self._plans(views), rnd, by=end_wall):
                await self.exchange.stop_waiting(rnd, "nobody")
                return

    async def _read_views(self, timeout: float | None = None) -> list | None:
        """The run's node cards, or None when the DHT gives no answer in time."""
        try:
            return await read_cards(self.ctx.membership.dht, self.ctx.config.run_id,
                                    timeout=timeout or min(2.0, self.cfg.round_timeout / 4))
        except Exception:  # noqa: BLE001 - no view of the swarm this time: callers keep their defaults
            return None

    # ---------------- a refused outer step ----------------
    async def _refused(self, rnd: int, why: str, outcome: str, reason: str | None) -> None:
        """The engine refused the outer step of label ``rnd`` and is back at its last good state:
        report not-ready ("recovering"); on the second refusal in a row re-download the state
        from a peer (then ready again)."""
        self._bad_rounds += 1
        if outcome != "ok" and why.startswith("out_of_bound"):  # no partner took part: our own step
            why += "; this was a solo step, so if honest rounds keep hitting this, raise noloco.max_update_ratio"
        M.OUTER_ROUNDS.labels(outcome="failed").inc()
        M.SOLO_ROUNDS.labels(reason="rolled_back").inc()
        now = self.engine.round
        emit(log, "outer_rollback", "outer step of round {bad_round} was {why} (exchange: {outcome} {reason}): "
             "rolled back to round {round}'s state", level=logging.ERROR, bad_round=rnd, why=why, outcome=outcome,
             reason=reason, round=now, bad_rounds=self._bad_rounds)
        await self.ctx.set_role_ready(False, "recovering", f"outer step of round {rnd} was {why}; rolled back "
                                                           f"to round {now}'s state")
        if self._bad_rounds < 2:
            return
        got = await self._fetch_from_donor(min_round=max(1, now))
        if got is None:
            emit(log, "recovery_download_failed", "no peer could give a fresh state; retrying after the next round",
                 level=logging.WARNING)
            return
        rnd2, phi, donor = got
        await self.compute.run(self.engine.adopt, rnd2, phi)
        emit(log, "resume", "recovered at round {round} with state from {donor}", source="peer", round=rnd2,
             donor=donor)
        self.update_card(NoLoCoCard(round=self.engine.round), publish=True)
        await self._recovered()

    async def _recovered(self) -> None:
        self._bad_rounds = 0
        emit(log, "recovered", "outer steps are good again: ready", round=self.engine.round)
        await self.ctx.set_role_ready(True, "ready", "")

    # ---------------- views of the swarm ----------------
    @property
    def _catches_up(self) -> bool:
        return self.cfg.catch_up and self.cfg.outer == "noloco"  # DiLoCo resyncs phi instead

    def _label(self, views: list | None) -> int:
        """The round label for this exchange: ours, or the label the live peers support if higher
        (``WorkerConfig.catch_up``: one that ``round_label_quorum`` peers reached). The engine's
        round moves only when the round completes."""
        own = self.engine.round
        support = self._support(views) if self._catches_up else None
        target = None if support is None else support.label
        if target is None or target <= own:
            return own
        emit(log, "round_catch_up", "round label {from_round} -> {round}: the swarm is ahead ({supporters} "
             "peer(s) there{lone})", from_round=own, round=target, supporters=support.support, lone_peer=support.lone,
             lone=", the only peer to follow" if support.lone else "", ignored=support.ignored)
        M.ROUND_CATCH_UPS.inc()
        return target

    def _frontier(self, views: list | None) -> int | None:
        """The highest round label the live peers support (None: no view, or no peer with a
        round): see :meth:`_support`."""
        support = self._support(views)
        return None if support is None else support.label

    def _support(self, views: list | None) -> LabelSupport | None:
        """The live peers' supported round label (``node.donor_choice.supported_label``): the
        highest one at least ``round_label_quorum`` READY workers reached, so one card cannot
        ratchet our label; range check first: a card more than ``max_round_jump`` past the
        peers' median is ignored. None without a view."""
        if views is None:
            return None
        labels = [card_int(v, "round") for v in self._ready_peers(views)]
        return supported_label(labels, own=self.engine.round, max_jump=self.cfg.max_round_jump,
                               quorum=self.cfg.round_label_quorum)

    async def _live_workers(self) -> int:
        """DiLoCo: how many workers to expect in the global average (READY or joining, not finishing)."""
        views = await self._read_views(timeout=10.0)
        if views is None:
            return 1  # unknown: assume just us and whoever shows up
        return max(1, len([v for v in peers(views, role=self.name, cfg_hash=self.cfg_hash,
                                            states=("ready", "joining"), unknown_cfg_ok=True)
                           if v.card.details.get(FINISHING) is not True]))

    def _ready_peers(self, views: list) -> list:
        """The other READY workers of our config: the peers this worker may take state from or
        follow to a higher round."""
        return peers(views, role=self.name, cfg_hash=self.cfg_hash, exclude=self.ctx.peer_id)

    def _plans(self, views: list) -> list[PeerPlan]:
        """The READY peers as the waiting rules read them."""
        return [peer_plan(v) for v in self._ready_peers(views)]
