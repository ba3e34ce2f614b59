"""``TrainingRole``: what every training role shares, so a role is an engine plus its round policy.

A training role subclasses :class:`TrainingRole` and writes only what is its own: the engine it
builds (transport-free, on the compute thread), what one round does, and what it reports. The
base owns the rest, the same way for every role:

- the compute thread (``self.compute``, node/compute.py) and the device (``self.place()``);
- the run knobs of its config section (:class:`node.run_settings.RunSettings`: ``exit_after``,
  ``eval_every``, ``checkpoint_every``, ``torch_threads``) and what they do;
- the supervised round loop: ``setup()`` once, then ``one_round()`` as a supervised task the
  drain can wait for, ``checkpoint_if_due()`` after each, and ``finish()`` once ``progress()``
  reaches ``exit_after`` (evaluate, log ``training_finished`` with ``summary()``, drain);
- the drain within budget: stop, let the round in flight end if it ends in time (else cancel
  it), ``close_transport()``, a final checkpoint on the compute thread, close the thread;
- checkpoints (node/checkpoint.py) and state served to peers (node/state_sync.py) from the
  engine's ``parts()`` / ``snapshot()``, and a joiner's download (``download_state``);
- the one loopback-only guard of test harnesses (:func:`require_loopback`);
- one per-round report (:meth:`TrainingRole.report`): shared train metrics, the typed card
  details (:class:`node.run_settings.TrainingCard`) and one structured event (node/logs.py ``emit``).

The smallest complete role (tests/integration/test_toy_role.py has it running)::

    class ToySection(RunSettings):
        lr: float = 0.1

    class ToySettings(BaseModel):
        toy: ToySection

    @register
    class Toy(TrainingRole):
        name, Settings, run_section, checkpoint_format = "toy", ToySettings, "toy", "swarmnode-toy-v1"

        def __init__(self, ctx, settings):
            super().__init__(ctx, settings)
            self.engine, self.cfg_hash = ToyEngine(self.cfg.lr), "toy-v1"

        async def setup(self):
            await self.resume()
            await self.ctx.set_role_ready(True, "ready", "")

        async def one_round(self):
            loss = await self.compute.run(self.engine.steps, 10)
            await self.take_snapshot()
            self.report("toy_round_done", "round {round}: loss {loss:.4f}", round=self.progress(), loss=loss)

        def progress(self): return self.engine.rounds
        def parts(self): return {"model": self.engine.model, "optimizer": self.engine.opt}
        def restore(self, meta): self.engine.rounds = int(meta["round"])
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import ABCMeta, abstractmethod
from typing import Any, ClassVar, Iterable, Mapping

import torch

from node.card import CardView
from node.checkpoint import CheckpointError, Checkpointer, Stateful
from node.compute import Compute
from node.checked_download import Downloaded, download_checked
from node.device import device_details, record_memory, resolve_device
from node.donor_choice import DonorCheckSettings
from node.logs import emit
from node.roles import NodeContext, RoleBase, Service
from node.round_report import TrainStep, report_round, update_card
from node.run_settings import RunSettings, TrainingCard, require_loopback
from node.state_sync import Expected, StateServicer, StateSnapshot, add_state_service, fetch_state, order_donors

__all__ = ["TrainStep", "TrainingRole", "require_loopback"]


class TrainingRole(RoleBase, metaclass=ABCMeta):
    """Base of every training role: subclass it, set the class attributes, write the hooks.

    Class attributes: ``name``, ``Settings`` (as every role), ``run_section`` (the field of
    ``Settings`` whose model derives from :class:`RunSettings`: it becomes ``self.cfg``),
    ``Card`` (the role's :class:`TrainingCard`), ``checkpoint_format`` (None: no checkpoints),
    ``serves_state`` (register ``WeightService.Fetch`` over :meth:`snapshot`), ``progress_key``
    (the name of ``progress()`` in checkpoints, snapshots and cards), ``finished_msg``.

    Hooks: :meth:`setup` and :meth:`one_round` (async), :meth:`progress` (required);
    :meth:`summary`, :meth:`parts`, :meth:`restore`, :meth:`snapshot`, :meth:`checkpoint_meta`,
    :meth:`close_transport`, :meth:`round_wait_s`, :meth:`final_checkpoint` (optional).
    """

    run_section: ClassVar[str]
    """The ``Settings`` field holding this role's section (a :class:`RunSettings` subclass)."""
    Card: ClassVar[type[TrainingCard]] = TrainingCard
    """The role's typed card details (:meth:`update_card` takes only this model)."""
    checkpoint_format: ClassVar[str | None] = None
    """File format name of this role's checkpoints (``"swarmnode-<role>-v1"``; bump it when the
    parts change); None: the role writes none and ``checkpoint_every`` is ignored."""
    serves_state: ClassVar[bool] = False
    """Serve :meth:`snapshot` to peers over ``WeightService.Fetch`` (joiners, replicas)."""
    progress_key: ClassVar[str] = "round"
    """What :meth:`progress` is called in checkpoint metadata, snapshots and the card."""
    finished_msg: ClassVar[str] = "training finished; draining"
    """The ``training_finished`` line, a template over :meth:`summary`'s fields (which get
    ``progress_key: progress()`` when they lack it)."""
    drain_reserve_s: ClassVar[float] = 2.0
    """Seconds of the drain budget kept for closing the transport and the final checkpoint."""
    log: ClassVar[logging.Logger] = logging.getLogger("swarmnode.training")
    """``swarmnode.<name>``: set for each role class."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return  # an intermediate base: checked where a concrete role names itself
        cls.log = logging.getLogger(f"swarmnode.{cls.name}")
        section = getattr(cls, "run_section", None)
        field = cls.Settings.model_fields.get(section) if isinstance(section, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, RunSettings)):
            raise TypeError(f"{cls.__name__}.run_section must name a field of {cls.Settings.__name__} whose model "
                            f"derives from node.run_settings.RunSettings (got {section!r})")
        missing = [h for h in ("setup", "one_round", "progress")
                   if getattr(getattr(cls, h), "__isabstractmethod__", False)]
        if missing:
            raise TypeError(f"training role {cls.name!r} ({cls.__name__}) must define {missing}: the engine build, "
                            "one round, and the count exit_after compares with")
        if not issubclass(cls.Card, TrainingCard):
            raise TypeError(f"{cls.__name__}.Card must derive from node.run_settings.TrainingCard")

    def __init__(self, ctx: NodeContext, settings: Any):
        super().__init__(ctx, settings)
        self.cfg: RunSettings = getattr(settings, self.run_section)
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        self.compute = Compute(self.name)          # every whole-model pass runs on its one thread
        self.device = torch.device("cpu")          # until place() (after the DHT is up: no CUDA before)
        self._stop = asyncio.Event()               # set by finish() and drain(): rounds end
        self._round: asyncio.Task | None = None    # the round in flight (the drain may wait for it)
        self._snapshot: StateSnapshot | None = None
        self._state: StateServicer | None = None
        self._cfg_hash = ""
        self.rejected_donors: set[str] = set()     # donors whose state disagreed with the majority: never asked again

    # ---------------------------------------------------------------- hooks
    @abstractmethod
    async def setup(self) -> None:
        """Once, before the first round: build the engine (``await self.compute.run(...)``),
        ``await self.resume()`` / a state download, publish the card, report ready."""

    @abstractmethod
    async def one_round(self) -> None:
        """One round of the role's policy (a supervised task: the drain waits for it while it
        ends within budget, else cancels it). Return early when ``self.stopping`` is set."""

    @abstractmethod
    def progress(self) -> int:
        """How far this node got, in the unit ``exit_after`` (and, by default, ``eval_every`` and
        ``checkpoint_every``) count: trained rounds, inner steps, iterations. Must answer from
        ``__init__`` on (a drain may come before :meth:`setup` ends)."""

    def cadence(self) -> int:
        """The count ``eval_every`` and ``checkpoint_every`` are in (default :meth:`progress`;
        e.g. outer rounds where ``exit_after`` counts inner steps)."""
        return self.progress()

    async def summary(self) -> dict[str, Any]:
        """The ``training_finished`` fields, including a final evaluation when the role has one
        (leave out what does not apply rather than write 0)."""
        return {}

    def parts(self) -> dict[str, Stateful]:
        """The engine's named stateful parts (``state_dict`` / ``load_state_dict``) a checkpoint holds."""
        return {}

    def checkpoint_meta(self) -> dict[str, Any]:
        """The metadata saved with the parts (and served with a snapshot): progress and counters."""
        return {self.progress_key: self.progress()}

    def restore(self, meta: Mapping[str, Any]) -> None:
        """Compute thread, after a checkpoint's parts were loaded: take the counters from ``meta``
        (it has every key :meth:`checkpoint_meta` writes)."""

    def snapshot(self) -> StateSnapshot | None:
        """Compute thread: what peers download (host copies taken at a consistent point). The
        default serves the ``model`` part's tensors with :meth:`checkpoint_meta`."""
        model = self.parts().get("model")
        if model is None:
            return None
        weights = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
        return StateSnapshot(self.checkpoint_meta(), weights)

    async def close_transport(self) -> None:
        """Drain: close the role's clients and streams, after the round in flight ended."""

    def round_wait_s(self, budget_s: float) -> float:
        """Drain: how long the round in flight may still run (then it is cancelled)."""
        return max(0.0, budget_s - self.drain_reserve_s)

    def final_checkpoint(self) -> None:
        """Compute thread, at the drain: the last checkpoint (override to first step back to the
        last consistent state, e.g. out of an abandoned round)."""
        self.save_checkpoint()

    # ---------------------------------------------------------------- the loop
    async def start(self) -> None:
        await self.ctx.set_role_ready(False, "role_init", "building the engine")
        # The DHT is up (hivemind forked first): CUDA may be touched now, on the compute thread that
        # runs every CUDA call after it. A missing GPU raises ConfigError here, so the node stops at
        # start with the message (exit 2), never from inside the training task (exit 1).
        self.device = await self.compute.run(resolve_device, self.ctx.config.device)
        self.ctx.supervisor.spawn(f"{self.name}_train", self.train, restart=False)

    async def train(self) -> None:
        """``setup()``, then rounds until stopped or ``exit_after`` is reached, then ``finish()``."""
        await self.setup()
        if self.checkpoints_on():
            await self.compute.run(self.check_checkpoint_dir)
        round_task = f"{self.name}_round"
        while not self.stopping:
            self._round = self.ctx.supervisor.spawn(round_task, self.one_round, restart=False)
            try:
                await asyncio.shield(self._round)
            except asyncio.CancelledError:
                self._round.cancel()
                raise
            if self.ctx.supervisor.failed == round_task:
                return  # reported by the supervisor (task_failed); the node exits 1
            if self.stopping:
                return
            await self.checkpoint_if_due()
            if self.exit_reached():
                await self.finish()
                return

    @property
    def stopping(self) -> bool:
        """True once the role finishes or drains: a round returns at its next check."""
        return self._stop.is_set()

    def stop(self) -> None:
        """End the rounds (finish, drain): waits in :meth:`pause` return at once."""
        self._stop.set()

    async def pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` (e.g. until the next round on a clock) unless the role stops first;
        True when it stopped."""
        try:
            await asyncio.wait_for(self._stop.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            return False
        return True

    def exit_reached(self) -> bool:
        return bool(self.cfg.exit_after) and self.progress() >= self.cfg.exit_after

    def eval_due(self, count: int | None = None) -> bool:
        """An evaluation is due after this round (``count``: default :meth:`cadence`); never on
        the last round, where :meth:`finish` evaluates."""
        count = self.cadence() if count is None else count
        return bool(self.cfg.eval_every) and count % self.cfg.eval_every == 0 and not self.exit_reached()

    async def finish(self) -> None:
        """``exit_after`` reached: stop, log ``training_finished`` with :meth:`summary`, drain."""
        if self.stopping:
            return
        self.stop()
        fields = await self.summary()
        fields.setdefault(self.progress_key, self.progress())
        emit(self.log, "training_finished", self.finished_msg, **fields)
        self.ctx.request_drain("finished")

    # ---------------------------------------------------------------- drain
    async def drain(self, budget_s: float) -> None:
        """Stop; let the round in flight end if it does within :meth:`round_wait_s`, else cancel
        it; close the transport; a final checkpoint when checkpoints are on; close the thread."""
        self.stop()
        self.compute.stop()
        task = self._round
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.round_wait_s(budget_s))
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - leaving mid-round is allowed
                task.cancel()
        await self.close_transport()
        idle = await self.compute.drain(max(0.1, budget_s / 4))
        try:
            if self.checkpoints_on() and self.progress() > 0:
                if idle:
                    await self.compute.run(self.final_checkpoint)
                else:
                    emit(self.log, "checkpoint_skipped", "compute thread still busy: no final checkpoint",
                         level=logging.WARNING)
        except Exception as exc:  # noqa: BLE001 - a failed final checkpoint is reported, not fatal
            emit(self.log, "checkpoint_failed", "final checkpoint failed: {error}", level=logging.WARNING,
                 error=repr(exc))
        finally:
            self.compute.close()

    # ---------------------------------------------------------------- device
    def place(self) -> dict[str, Any]:
        """Compute thread, in :meth:`setup`: the card details (``TrainingCard`` fields) of
        ``self.device``, which :meth:`start` resolved from ``[device]``. Override to move the
        engine there (call this first)."""
        record_memory(self.device)
        return device_details(self.device)

    # ---------------------------------------------------------------- checkpoints
    @property
    def cfg_hash(self) -> str:
        """Hash of the settings this node's state depends on: checkpoints and downloads from
        another hash are refused. Set it in :meth:`setup` (or ``__init__``) once known."""
        return self._cfg_hash

    @cfg_hash.setter
    def cfg_hash(self, value: str) -> None:
        self._cfg_hash = value
        if self._state is not None:
            self._state.cfg_hash = value

    def checkpoint_dir(self) -> Any:
        """Where this node's checkpoints live (default: the node's ``state_dir``)."""
        return self.ctx.config.state_dir

    @property
    def checkpoints(self) -> Checkpointer:
        return Checkpointer(self.checkpoint_dir(), self.checkpoint_format or "", self.cfg_hash)

    def checkpoints_on(self) -> bool:
        return self.checkpoint_format is not None and bool(self.cfg.checkpoint_every)

    def save_checkpoint(self) -> None:
        """Compute thread: write :meth:`parts` and :meth:`checkpoint_meta` atomically; logs
        ``checkpoint_written`` with the file and its digest (a resume logs the digest it loaded)."""
        ckpt = self.checkpoints
        path = ckpt.save(self.parts(), self.checkpoint_meta())
        emit(self.log, "checkpoint_written", "checkpoint written at {progress_key} {progress}",
             progress_key=self.progress_key, progress=self.progress(), path=str(path), digest=ckpt.last_digest)

    async def write_checkpoint(self) -> bool:
        """A checkpoint now, on the compute thread. A write that fails for the disk (full, not
        writable, gone) is logged as ``checkpoint_failed`` with what to do and the node trains
        on: the previous checkpoints stay as they were. False then."""
        try:
            await self.compute.run(self.save_checkpoint)
        except OSError as exc:
            emit(self.log, "checkpoint_failed", "checkpoint not written to {dir}: {error}; training goes on and "
                 "the previous checkpoints are kept. Free space there or point state_dir at a writable disk",
                 level=logging.ERROR, dir=str(self.checkpoints.dir), error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    async def checkpoint_if_due(self, count: int | None = None) -> bool:
        """A checkpoint every ``checkpoint_every`` (``count``: default :meth:`cadence`); the
        loop calls it after each round."""
        count = self.cadence() if count is None else count
        if not (self.checkpoints_on() and count > 0 and count % self.cfg.checkpoint_every == 0):
            return False
        await self.write_checkpoint()
        return True

    def check_checkpoint_dir(self) -> bool:
        """Compute thread, at start when checkpoints are on: can this node write its checkpoint
        directory? If not, say so now (``checkpoint_dir_unwritable``) rather than at the first
        checkpoint; the node trains on without checkpoints."""
        d = self.checkpoints.dir
        probe = d / f".write-probe.{os.getpid()}"
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            emit(self.log, "checkpoint_dir_unwritable", "cannot write checkpoints to {dir} ({error}): this node "
                 "trains without them and a restart starts from a peer's state or fresh. Point state_dir at a "
                 "writable directory (or set checkpoint_every = 0 to silence this)", level=logging.ERROR,
                 dir=str(d), error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Compute thread: load the latest checkpoint into :meth:`parts`, then :meth:`restore`;
        its metadata, or None (no checkpoint, or an unusable one: logged, nothing changed)."""
        ckpt = self.checkpoints
        try:
            state = ckpt.read(required=tuple(self.parts()))
            if state is None:
                emit(self.log, "checkpoint_none", "no checkpoint in {dir}: starting fresh", dir=str(ckpt.dir))
                return None
            lacking = [k for k in self.checkpoint_meta() if k not in state["meta"]]
            if lacking:
                raise CheckpointError(f"checkpoint {state['path']} lacks metadata {lacking}; it was not loaded",
                                      "incomplete")
            for path, error in state["skipped"]:
                emit(self.log, "checkpoint_skipped", "newer checkpoint {path} not used: {error}", level=logging.WARNING,
                     path=path, error=error)
            ckpt.apply(state, self.parts())
        except CheckpointError as exc:
            emit(self.log, "checkpoint_mismatch" if exc.reason == "mismatch" else "checkpoint_corrupt",
                 "checkpoint not loaded: {error}", level=logging.ERROR, error=str(exc), reason=exc.reason)
            return None
        self.restore(state["meta"])
        emit(self.log, "resume", "resumed from checkpoint at {progress_key} {progress}", source="checkpoint",
             progress_key=self.progress_key, progress=self.progress(), path=state["path"], digest=state["digest"])
        return state["meta"]

    async def resume(self) -> dict[str, Any] | None:
        """In :meth:`setup`: the checkpoint's metadata when ``resume`` is on and one loaded."""
        if self.checkpoint_format is None or not self.ctx.config.resume:
            return None
        return await self.compute.run(self.load_checkpoint)

    # ---------------------------------------------------------------- state served to peers
    def services(self) -> list[Service]:
        if not self.serves_state:
            return []
        if self._state is None:
            self._state = self.make_state_servicer()
        return [Service(add_state_service, self._state, "swarmnode.WeightService")]

    def make_state_servicer(self) -> StateServicer:
        """The ``WeightService`` over :attr:`last_snapshot` (override to add ``history`` /
        ``copies``: node/state_sync.py)."""
        return StateServicer(self.ctx.config.run_id, self.cfg_hash, lambda: self._snapshot, self.ctx.netem)

    @property
    def last_snapshot(self) -> StateSnapshot | None:
        """What peers download now (the last :meth:`take_snapshot`), or None before the first."""
        return self._snapshot

    async def take_snapshot(self) -> StateSnapshot | None:
        """Refresh what peers download (taken on the compute thread): call it after each step
        that peers may adopt."""
        self._snapshot = await self.compute.run(self.snapshot)
        return self._snapshot

    async def download_state(self, views: Iterable[CardView], expected: Expected, *,
                             optimizer: Expected | None = None, min_progress: int = 1, tries: int = 3,
                             max_jump: int | None = None, timeout: float = 60.0, ahead: int = 0,
                             check: DonorCheckSettings | None = None, request: Mapping[str, int] | None = None
                             ) -> Downloaded | None:
        """The state to adopt from the READY peers of this role and ``cfg_hash`` among ``views``
        (node cards) at or past ``min_progress``, checked against other donors first
        (node/checked_download.py): up to ``check.donors_compared`` are downloaded at once and
        the one the majority agrees with is adopted, at the progress at least
        ``check.round_label_quorum`` of them served; disagreeing donors are rejected (counted,
        logged) and never asked again by this node. None when no donor could be downloaded
        (``tries`` more after the first wave) or none agreed. A served progress may be up to
        ``ahead`` past the donor's card; tensors come back as :func:`node.state_sync.fetch_state`
        returns them (host tensors, checked); ``request`` adds fields to the fetch request
        (e.g. ``round``)."""
        check = check or DonorCheckSettings()
        donors = [v for v in order_donors(views, role=self.name, cfg_hash=self.cfg_hash,
                                          progress_key=self.progress_key, exclude=self.ctx.peer_id,
                                          min_progress=min_progress, max_jump=max_jump)
                  if v.peer_id not in self.rejected_donors]

        async def fetch(view: CardView):
            return await fetch_state(view.card.grpc_addr, self.ctx.config.run_id, self.ctx.peer_id, self.cfg_hash,
                                     expected, optimizer=optimizer, offload=self.compute.run,
                                     max_message_bytes=self.ctx.config.grpc.max_message_bytes,
                                     peer_id=view.peer_id, timeout=timeout, **dict(request or {}))

        got = await download_checked(donors, fetch, list(expected), log=self.log, progress_key=self.progress_key,
                                     min_progress=min_progress, ahead=ahead, compare=check.donors_compared,
                                     tries=tries, max_distance=check.donor_max_distance,
                                     quorum=check.round_label_quorum, offload=self.compute.run)
        if got is not None:
            self.rejected_donors.update(got.rejected)
        return got

    # ---------------------------------------------------------------- reports
    def update_card(self, details: TrainingCard, publish: bool = False) -> None:
        """Set the role's card details from its typed :attr:`Card` (unset fields untouched, None
        removes one); ``publish=True`` when peers act on the value at once."""
        update_card(self.ctx.card, self.Card, details, publish)

    def report(self, event: str, msg: str, *, round: int | None = None,
               steps: TrainStep | Iterable[TrainStep] = (), card: TrainingCard | None = None,
               publish: bool = False, **fields: Any) -> None:
        """The per-round report, one call: the shared train series for each of ``steps``, the
        ``card`` details, the log context's ``round`` and one structured event ``event`` (``msg``
        is a template over ``round`` and ``fields``; node/logs.py ``emit``). Role-specific series
        are set by the role's metrics module before it reports."""
        if card is not None:
            self.update_card(card, publish)
        report_round(self.log, event, msg, round=round, steps=steps, **fields)
