"""What one `stage` node does with a microbatch: the transport-free SkipPipe executor (docs/pipeline.md, 'Stage execution').

Owns the per-iteration state of one node: the memory window (at most `memory` microbatches in
flight, later forwards deferred), source routing by (path ID, hop) against the iteration's
schedule, the predecessor each gradient goes back to, visit counts, the end-of-iteration
barrier, the replica gradient exchange (visit-normalised: the stage gradient is the mean over
the microbatches that visited the stage, whichever replica they visited) and the single clipped
optimizer step per iteration; on stage-0 nodes also the data, embedding, head and loss.
It keeps a record per step (`records`: norms before/after clipping, visits, weight hash) and serves
a consistent snapshot of weights + optimizer state (`snapshot`). Validation is pipeline/stage_eval.py;
messages and tensor checks pipeline/stage_msgs.py. Torch only: messages come in as `Msg` and go out
as `Out`; pipeline/stage_transport.py moves them. Bad input raises `BadInput` (answered with an
error by the caller); stale, duplicate or unroutable messages are dropped and counted in `dropped`.

Message kinds (meta values are ints; `it` iteration, `ep` schedule epoch):
- ``fwd``  activation; `p` path ID, `h` the receiver's hop (len(path) = back at the origin)
- ``bwd``  gradient of that activation; `h` the receiver's hop (0 = the origin)
- ``eoi``  an origin finished all its microbatches of `it`
- ``grad`` a replica's flat gradient sum of `it` with its visit count `v` (and `ne`, the newest
  schedule epoch it knows: stage 0 starts the next iteration on the largest)
- ``ev``   validation along the full in-order path (pipeline/stage_eval.py)
- ``fin``  the run is over (sent by the evaluating origin after the final validation)

`fwd`, `bwd`, `eoi` and `grad` also carry `pe`, the epoch the sender's previous iteration ran on:
a rebuilt stage tells from it whether the pipeline stepped its iteration without it (`missed`).
Messages of a later iteration are kept until this node gets there; of an earlier one dropped.

A newer schedule that drops a node of the running iteration's schedule (a lost stage or
replica; CheckFree, docs/pipeline.md, 'CheckFree recovery', in-flight iteration) aborts that iteration here
(`maybe_abort`, from `add_schedule` or from a message of the newer epoch): its activations,
deferred forwards, end-of-iteration marks and replica gradients are dropped and the gradients
zeroed; no stage has stepped on it, so every node still holds W(t), and the origins restart it on
the new epoch (an `Aborted` event). Messages of older epochs are dropped from then on.
Replicas exchange whole flat gradients and sum them in ascending peer-ID order (node/averaging.py),
so every replica of a stage takes bitwise the same step."""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from models.llama import lm_loss
from models.stages import check_hidden
from node.averaging import mean_of
from pipeline.schedule import Schedule
from pipeline.stage_eval import EvalResult, InOrderEval
from pipeline.stage_msgs import BadInput, Msg, OriginDone, Out, StepResult, as_hidden, placeholder, weights_sha256
from pipeline.stage_state import host_adam_state, host_weights

FUTURE_ITERATIONS = 2
"""Messages at most this many iterations ahead are kept for later; further ones are dropped."""
RECORDS_KEPT = 64
"""Step records kept per node (CheckFree reads neighbours' norms of a recent common iteration)."""
KINDS = ("fwd", "bwd", "eoi", "grad", "ev")


def _members(sched: Schedule) -> set[str]:
    return {sched.names[x] for g in sched.partitions for x in g}


@dataclass(frozen=True)
class Aborted:
    """The running iteration was dropped because `new_epoch` no longer names `lost`; an origin
    that had started it (`had_state`) starts it again on `new_epoch`."""

    iteration: int
    old_epoch: int
    new_epoch: int
    lost: tuple[str, ...]
    had_state: bool


@dataclass
class _Iter:
    epoch: int | None = None
    inflight: dict[int, dict] = field(default_factory=dict)
    deferred: deque = field(default_factory=deque)
    finished: set[int] = field(default_factory=set)
    eoi: set[int] = field(default_factory=set)
    visits: int = 0
    grads: dict[str, tuple[int, Tensor, int]] = field(default_factory=dict)
    grads_sent: bool = False
    # originator
    seqs: deque = field(default_factory=deque)
    n_mine: int = 0
    done: int = 0
    losses: list[float] = field(default_factory=list)


class StageExecutor:
    """One node's executor. `module` is models.stages.Stage0 (stage 0) or TransformerStage.

    `data()` (stage 0) returns the next training (tokens, targets); `eval_data` are the fixed
    validation batches (used by the origin that validates). `delay(kind)` (optional) is called
    before each forward/backward/loss compute to emulate a slower device. `scheduler` (optional)
    steps once per iteration after the optimizer; `clip` None disables clipping. `autocast()`
    returns the context forward passes run in (node.device.autocast; default none). `emit(outs)`
    (optional) sends messages that are ready while this call still has computes to do (the
    first microbatch leaves before the second is embedded, a gradient before a deferred
    forward runs), as the simulator assumes; what a call returns is the rest. `after_step(module,
    optimizer)` (optional) runs right after each optimizer step, `before_step(module)` right before
    it (after clipping): where test harnesses plug in (pipeline/backdoor.py `WeightEdit`,
    pipeline/live_attacks.py `LiveAttack`); production nodes leave them None."""

    def __init__(self, me: str, stage: int, module: nn.Module, optimizer: torch.optim.Optimizer, *,
                 memory: int, clip: float | None = 1.0, data: Callable[[], tuple[Tensor, Tensor]] | None = None,
                 eval_data: list[tuple[Tensor, Tensor]] | None = None,
                 delay: Callable[[str], None] | None = None, device: torch.device | str = "cpu",
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 emit: Callable[[list[Out]], None] | None = None,
                 after_step: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None,
                 before_step: Callable[[nn.Module], None] | None = None):
        if memory < 1:
            raise ValueError(f"memory={memory}: a node needs at least one microbatch slot")
        self.me, self.stage, self.module, self.opt, self.sched = me, stage, module, optimizer, scheduler
        self.memory, self.clip, self.data = memory, clip, data
        self.delay = delay or (lambda kind: None)
        self.emit, self.after_step, self.before_step = emit, after_step, before_step
        self.device, self.autocast = torch.device(device), autocast
        self.params = [p for _, p in module.named_parameters()]
        self.schedules: dict[int, Schedule] = {}
        self.epoch = 0                   # epoch this origin uses for its next iteration
        self.latest_epoch = 0            # newest epoch the role knows of
        self.floor_epoch = 0             # messages of older epochs belong to an aborted iteration
        self.pending: list[Out] = []     # messages a schedule change produced with no `emit` to send them
        self.iteration = 0               # = optimizer steps taken
        self.last_lr = float("nan")      # the LR of the last step: served in the snapshot (audits replay the step)
        self.prev_epoch = -1             # the epoch iteration - 1 ran on here (-1: not here: a fresh or rebuilt stage)
        self._it: dict[int, _Iter] = {}
        self._future: list[Msg] = []
        self.dropped: Counter = Counter()
        self.deferred_total = 0
        self.microbatches: Counter = Counter()   # direction -> count
        self.events: list = []
        self.records: deque[StepResult] = deque(maxlen=RECORDS_KEPT)
        self.finished = False
        self.evaluator = InOrderEval(module, self.device, eval_data or [], self.dropped, autocast)

    # ------------------------------------------------------------------ schedules
    def add_schedule(self, schedule: Schedule) -> None:
        """Register a validated schedule (the role validates before calling)."""
        self.schedules[schedule.epoch] = schedule
        self.latest_epoch = max(self.latest_epoch, schedule.epoch)
        if (self.iteration == 0 and not self._it) or self.epoch not in self.schedules:
            self.epoch = self.latest_epoch     # before training (or a recovered node): start on the newest
        else:
            self.maybe_abort(schedule.epoch)
        self._send_now(self.evaluator.move_to(schedule, self._idx(schedule, self.me)))   # an eval in flight follows

    def _running_epoch(self) -> int:
        st = self._it.get(self.iteration)
        return st.epoch if st is not None and st.epoch is not None else self.epoch

    def maybe_abort(self, epoch: int) -> bool:
        """If schedule `epoch` drops a node of the running iteration's schedule, abort that
        iteration (see the module docstring); True when it did."""
        cur_ep = self._running_epoch()
        new, cur = self.schedules.get(epoch), self.schedules.get(cur_ep)
        if new is None or cur is None or epoch <= cur_ep:
            return False
        lost = (_members(cur) - _members(new)) | new.renewed_since(cur)
        if not lost:
            return False
        st = self._it.get(self.iteration)
        if st is not None and st.grads_sent and set(self._replicas(cur)) - set(st.grads) <= lost:
            # every microbatch of the iteration is done and only lost replicas' gradients are
            # missing: the other stages have stepped on it, so step too, with the gradients that
            # are here (the mean over their visits; surviving replicas compute the same bits)
            self.dropped["degraded_step"] += 1
            self._send_now(self._maybe_step(st, cur, degraded=True))
            return self.maybe_abort(epoch)       # the next iteration may have started on the old epoch
        self._it.pop(self.iteration, None)
        self._future = [m for m in self._future if m.meta.get("ep", 0) >= epoch]
        self.opt.zero_grad(set_to_none=True)
        self.floor_epoch = epoch
        self.epoch = max(self.epoch, epoch)
        self.dropped["aborted_iteration"] += 1
        self.events.append(Aborted(self.iteration, cur_ep, epoch, tuple(sorted(lost)),
                                   st is not None and st.n_mine > 0))
        return True

    def _idx(self, sched: Schedule, name: str) -> int | None:
        try:
            return sched.names.index(name)
        except ValueError:
            return None

    def _state(self, it: int) -> _Iter:
        st = self._it.get(it)
        if st is None:
            st = self._it[it] = _Iter()
        return st

    @property
    def in_flight(self) -> int:
        st = self._it.get(self.iteration)
        return len(st.inflight) if st else 0

    def waiting_for(self) -> str:
        """What the current iteration still waits for (for the stuck-iteration log)."""
        st = self._it.get(self.iteration)
        if st is None:
            return "no message of this iteration yet"
        sched = self.schedules.get(st.epoch) if st.epoch is not None else None
        eoi = sorted(set(sched.origins) - st.eoi) if sched else "?"
        return (f"in flight {sorted(st.inflight)}, deferred {len(st.deferred)}, eoi missing from origins {eoi}, "
                f"replica grads from {sorted(st.grads)}")

    # ------------------------------------------------------------------ origin side
    def is_origin(self, sched: Schedule) -> bool:
        i = self._idx(sched, self.me)
        return i is not None and i in sched.origins

    def start_iteration(self) -> list[Out]:
        """Stage 0: start the current iteration's microbatches (up to `memory` at once)."""
        sched = self.schedules.get(self.epoch)
        if sched is None:
            raise RuntimeError(f"no schedule for epoch {self.epoch}; add_schedule first")
        me = self._idx(sched, self.me)
        if me is None or me not in sched.origins:
            raise RuntimeError("start_iteration on a node that is not a stage-0 originator of the schedule")
        st = self._state(self.iteration)
        if st.epoch is not None and st.epoch != self.epoch:
            raise RuntimeError(f"iteration {self.iteration} already runs on epoch {st.epoch}")
        st.epoch = self.epoch
        ids = sched.path_ids(me)
        st.seqs, st.n_mine = deque(range(len(ids))), len(ids)
        outs: list[Out] = []
        while st.seqs and len(st.inflight) < self.memory and self._path_free(st, sched, me):
            outs = self._flush(outs) + self._launch(st, sched, me)
        return outs + self._maybe_aggregate(st)

    def _send_now(self, outs: list[Out]) -> None:
        """Messages a schedule change produced: to `emit`, or to `pending` when there is none."""
        if outs:
            (self.emit or self.pending.extend)(outs)

    def _flush(self, outs: list[Out]) -> list[Out]:
        """Hand `outs` to `emit` now (more compute follows); returns what is left to return."""
        if self.emit is None or not outs:
            return outs
        self.emit(outs)
        return []

    def _hop_meta(self, st: _Iter, sched: Schedule, p: int, h: int) -> dict[str, int]:
        """Every pipeline message names (iteration, epoch, path ID, hop, originator, mb_seq) and
        `pe`, the epoch this node's previous iteration ran on."""
        origin = sched.paths[p][0]
        return {"ep": st.epoch, "p": p, "h": h, "o": origin, "q": sched.path_ids(origin).index(p),
                "pe": self.prev_epoch}

    @staticmethod
    def _path_free(st: _Iter, sched: Schedule, me: int) -> bool:
        """The next microbatch may leave: its path's previous microbatch (if any) is home."""
        return sched.previous_on_path(me, st.seqs[0]) in (None, *st.finished)

    def _launch(self, st: _Iter, sched: Schedule, me: int) -> list[Out]:
        seq = st.seqs.popleft()
        pid = sched.path_id(me, seq)
        tokens, targets = (t.to(self.device) for t in self.data())
        self.delay("forward")
        with self.autocast():
            h_out = self.module.embed_forward(tokens)
        st.inflight[pid] = {"h_out": h_out, "targets": targets, "phase": "out", "seq": seq}
        self.microbatches["forward"] += 1
        meta = {"it": self.iteration, **self._hop_meta(st, sched, pid, 1)}
        return [Out(sched.names[sched.successor(pid, 0)], "fwd", meta, h_out.detach().float())]

    def start_eval(self) -> list[Out]:
        """Origin: validate the full in-order model (weights after `iteration` steps)."""
        sched = self.schedules[self.epoch]
        return self.evaluator.start(sched, self._idx(sched, self.me), self.iteration)

    def fin_messages(self) -> list[Out]:
        """Origin: tell every node of the schedule that the run is over."""
        sched = self.schedules[self.epoch]
        return [Out(sched.names[x], "fin", {"it": self.iteration, "ep": sched.epoch}, placeholder())
                for g in sched.partitions for x in g if sched.names[x] != self.me]

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: Msg) -> list[Out]:
        """Process one message; returns what to send. Raises BadInput for unusable tensors."""
        it = msg.meta.get("it")
        if msg.kind == "fin":
            return self._on_fin(msg)
        if it is None or msg.kind not in KINDS:
            self.dropped["malformed"] += 1
            return []
        if it < self.iteration:
            self.dropped["stale_iteration"] += 1
            return []
        if msg.meta.get("ep", -1) < self.floor_epoch:
            self.dropped["aborted_epoch"] += 1
            return []
        if it > self.iteration:
            if it > self.iteration + FUTURE_ITERATIONS:
                self.dropped["future_iteration"] += 1
            else:
                self._future.append(msg)
            return []
        sched = self.schedules.get(msg.meta.get("ep", -1))
        if sched is None:
            self.dropped["unknown_epoch"] += 1
            return []
        sender, me = self._idx(sched, msg.sender), self._idx(sched, self.me)
        if sender is None or me is None:
            self.dropped["not_in_schedule"] += 1
            return []
        if msg.kind == "ev":
            outs, result = self.evaluator.on_message(sched, msg, sender, me)
            if result is not None:
                self.events.append(result)
            return outs
        if it == self.iteration and sched.epoch > self._running_epoch():
            self.maybe_abort(sched.epoch)
        st = self._state(it)
        if st.epoch is None:
            st.epoch = sched.epoch
        elif st.epoch != sched.epoch:
            self.dropped["epoch_mismatch"] += 1
            return []
        if msg.kind == "fwd":
            outs = self._on_forward(st, sched, msg, sender, me)
        elif msg.kind == "bwd":
            outs = self._on_backward(st, sched, msg, sender, me)
        elif msg.kind == "eoi":
            o = msg.meta.get("o")
            if o != sender or o not in sched.origins:
                self.dropped["unknown_origin"] += 1
                return []
            if o in st.eoi:
                self.dropped["duplicate"] += 1
                return []
            st.eoi.add(o)
            outs = []
        else:
            outs = self._on_grad(st, sched, msg)
        return outs + self._maybe_aggregate(st)

    def _on_fin(self, msg: Msg) -> list[Out]:
        sched = self.schedules.get(msg.meta.get("ep", -1))
        sender = self._idx(sched, msg.sender) if sched is not None else None
        if sender is None or sender not in sched.origins:
            self.dropped["unknown_origin"] += 1
            return []
        self.finished = True
        self.events.append("fin")
        return []

    def _route(self, sched: Schedule, msg: Msg, sender: int, me: int) -> tuple[int, int, tuple] | None:
        """(path ID, hop, path) if `msg` is where its path says it should be, from the node the
        path says should send it; else None."""
        p, h = msg.meta.get("p", -1), msg.meta.get("h", -1)
        if not 0 <= p < len(sched.paths):
            return None
        path = sched.paths[p]
        if msg.kind == "fwd":
            if 1 <= h < len(path):
                ok = path[h] == me and path[h - 1] == sender
            else:
                ok = h == len(path) and path[0] == me and path[-1] == sender
        else:  # bwd: from the node after me
            ok = 0 <= h < len(path) and path[h] == me and sched.successor(p, h) == sender
        seq_ok = "q" not in msg.meta or msg.meta["q"] == sched.path_ids(path[0]).index(p)
        if not ok or not seq_ok or msg.meta.get("o", path[0]) != path[0]:
            return None
        return p, h, path

    def _on_forward(self, st: _Iter, sched: Schedule, msg: Msg, sender: int, me: int) -> list[Out]:
        r = self._route(sched, msg, sender, me)
        if r is None:
            self.dropped["unknown_path"] += 1
            return []
        p, h, path = r
        if h == len(path):                      # back at the origin: head, loss, backward
            return self._loss(st, sched, msg, p, path)
        if p in st.inflight or p in st.finished or any(d.meta.get("p") == p for d in st.deferred):
            self.dropped["duplicate"] += 1
            return []
        try:                                   # refuse a bad tensor now, not when it leaves the queue
            check_hidden(as_hidden(msg.tensor, self.device), self.module.cfg)
        except ValueError as exc:
            raise BadInput(getattr(exc, "reason", "shape"), str(exc)) from None
        if len(st.inflight) >= self.memory:    # TC1: no free slot -> defer
            st.deferred.append(msg)
            self.deferred_total += 1
            return []
        return self._compute_forward(st, sched, msg, p, h, sender)

    def _loss(self, st: _Iter, sched: Schedule, msg: Msg, p: int, path: tuple) -> list[Out]:
        e = st.inflight.get(p)
        if e is None or e["phase"] != "out":
            self.dropped["duplicate"] += 1
            return []
        h_in = as_hidden(msg.tensor, self.device, e["h_out"].shape).requires_grad_()
        self.delay("loss")
        with self.autocast():
            try:
                logits = self.module.head_forward(h_in)
            except ValueError as exc:
                raise BadInput("shape", str(exc)) from None
        loss = lm_loss(logits.float(), e["targets"])
        loss.backward()
        st.losses.append(float(loss.detach()))
        e["phase"] = "back"
        self.microbatches["backward"] += 1
        meta = {"it": self.iteration, **self._hop_meta(st, sched, p, len(path) - 1)}
        return [Out(sched.names[path[-1]], "bwd", meta, h_in.grad.detach())]

    def _compute_forward(self, st: _Iter, sched: Schedule, msg: Msg, p: int, h: int, sender: int) -> list[Out]:
        x = as_hidden(msg.tensor, self.device).requires_grad_()
        self.delay("forward")
        with self.autocast():
            try:
                y = self.module(x)
            except ValueError as exc:
                raise BadInput("shape", str(exc)) from None
        st.inflight[p] = {"x": x, "y": y, "pred": sender}
        self.microbatches["forward"] += 1
        meta = {"it": self.iteration, **self._hop_meta(st, sched, p, h + 1)}
        return [Out(sched.names[sched.successor(p, h)], "fwd", meta, y.detach().float())]

    def _on_backward(self, st: _Iter, sched: Schedule, msg: Msg, sender: int, me: int) -> list[Out]:
        r = self._route(sched, msg, sender, me)
        if r is None:
            self.dropped["unknown_path"] += 1
            return []
        p, h, path = r
        e = st.inflight.get(p)
        if e is None or (h == 0) != ("h_out" in e) or (h == 0 and e["phase"] != "back"):
            self.dropped["duplicate"] += 1
            return []
        out_t = e["h_out"] if h == 0 else e["y"]
        g = as_hidden(msg.tensor, self.device, out_t.shape).to(out_t.dtype)
        self.delay("backward")
        out_t.backward(g)
        del st.inflight[p]
        st.finished.add(p)
        st.visits += 1
        self.microbatches["backward"] += 1
        outs: list[Out] = []
        if h > 0:                                # gradient to the exact predecessor, then a slot is free
            meta = {"it": self.iteration, **self._hop_meta(st, sched, p, h - 1)}
            outs.append(Out(sched.names[e["pred"]], "bwd", meta, e["x"].grad.detach()))
            while st.deferred and len(st.inflight) < self.memory:
                d = st.deferred.popleft()
                dp, dh, _ = self._route(sched, d, self._idx(sched, d.sender), me)
                outs = self._flush(outs) + self._compute_forward(st, sched, d, dp, dh, self._idx(sched, d.sender))
            return outs
        st.done += 1                             # origin: one of my microbatches is complete
        while st.seqs and len(st.inflight) < self.memory and self._path_free(st, sched, me):
            outs = self._flush(outs) + self._launch(st, sched, me)
        if st.done == st.n_mine:
            st.eoi.add(me)
            self.events.append(OriginDone(self.iteration))
            meta = {"it": self.iteration, "ep": st.epoch, "o": me, "pe": self.prev_epoch}
            outs += [Out(sched.names[x], "eoi", meta, placeholder()) for g in sched.partitions for x in g if x != me]
        return outs

    # ------------------------------------------------------------------ aggregation
    def _flat_grads(self) -> Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                          for p in self.params]).cpu()

    def _replicas(self, sched: Schedule) -> list[str]:
        return [sched.names[x] for x in sched.partitions[self.stage]]

    def _maybe_aggregate(self, st: _Iter) -> list[Out]:
        """All origins' EndOfIteration in and nothing of ours outstanding: send our gradient sum
        to every replica of the stage (and step once theirs are in)."""
        if st.grads_sent or st.epoch is None:
            return []
        sched = self.schedules[st.epoch]
        if set(sched.origins) - st.eoi or st.inflight or st.deferred:
            return []
        me = self._idx(sched, self.me)
        if sched.stage_of(me) != self.stage:
            raise RuntimeError(f"the schedule puts this node in stage {sched.stage_of(me)}, it holds stage "
                               f"{self.stage}")
        st.grads_sent = True
        flat = self._flat_grads()
        st.grads[self.me] = (st.visits, flat, self.latest_epoch)
        meta = {"it": self.iteration, "ep": st.epoch, "v": st.visits, "ne": self.latest_epoch, "pe": self.prev_epoch}
        outs = [Out(r, "grad", meta, flat) for r in self._replicas(sched) if r != self.me]
        return outs + self._maybe_step(st, sched)

    def _on_grad(self, st: _Iter, sched: Schedule, msg: Msg) -> list[Out]:
        if msg.sender not in self._replicas(sched) or msg.sender == self.me:
            self.dropped["not_a_replica"] += 1
            return []
        if msg.sender in st.grads:
            self.dropped["duplicate"] += 1
            return []
        n = sum(p.numel() for p in self.params)
        t = msg.tensor
        if t is None or t.dim() != 1 or t.numel() != n or t.dtype != torch.float32:
            raise BadInput("shape", f"replica gradient of shape {None if t is None else tuple(t.shape)} where "
                                    f"[{n}] fp32 was expected: the replica runs a different stage split")
        v = msg.meta.get("v", -1)
        if v < 0:
            raise BadInput("malformed", f"replica gradient with visit count {v}")
        st.grads[msg.sender] = (v, t, msg.meta.get("ne", 0))
        return self._maybe_step(st, sched) if st.grads_sent else []

    def _maybe_step(self, st: _Iter, sched: Schedule, degraded: bool = False) -> list[Out]:
        """Every replica's gradient sum is in: g = (sum over replicas) / (total visits), clip,
        and exactly one optimizer step. `degraded`: step with the gradients that are in (the
        missing replicas are lost)."""
        if not degraded and set(st.grads) != set(self._replicas(sched)):
            return []
        order = sorted(st.grads)                     # ascending peer ID: bitwise equal on every replica
        total = sum(st.grads[r][0] for r in order)
        mean, finite = mean_of([[st.grads[r][1]] for r in order])
        flat = mean[0]
        if total > 0:
            flat = flat * (len(order) / total)       # sum / visits: the mean over visiting microbatches
        norm = clipped = float("nan")
        reset = sched.reset_moments and self.prev_epoch != st.epoch
        if reset:                                    # first step on a plan made after a quarantine
            self.opt.state.clear()                   # AdamW starts its moments again (Schedule.reset_moments)
        if finite and total > 0:
            off = 0
            for p in self.params:
                k = p.numel()
                p.grad = flat[off:off + k].view_as(p).to(p.device, p.dtype).clone()
                off += k
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip else float("inf")))
            clipped = min(norm, self.clip) if self.clip else norm
            self.last_lr = float(self.opt.param_groups[0]["lr"])
            if self.before_step is not None:
                self.before_step(self.module)
            self.opt.step()                          # exactly once per iteration
            if self.after_step is not None:
                self.after_step(self.module, self.opt)
        else:
            self.dropped["nonfinite_grad" if not finite else "no_visits"] += 1
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        loss = sum(st.losses) / len(st.losses) if st.losses else None
        next_epoch = max(st.grads[r][2] for r in order)
        res = StepResult(self.iteration, st.visits, total, norm, clipped, weights_sha256(self.module), loss,
                         next_epoch, moments_reset=reset)
        del self._it[self.iteration]
        self.prev_epoch = st.epoch
        self.iteration += 1
        self.epoch = max(self.epoch, next_epoch)     # the role fetches it before start_iteration if unseen
        self.records.append(res)
        self.events.append(res)
        return self._replay()

    def missed(self, msg: Msg) -> bool:
        """True when `msg` shows the pipeline stepped this node's iteration without it (a stage
        rebuilt while the pipeline ran on through a quarantined node): a message two or more
        iterations ahead, or one ahead whose sender ran its previous iteration on a schedule that
        does not name this node (or that this node does not have: fetch `pe` first). A message one
        ahead from a schedule naming this node is only early: this node's part is still due (the
        origins' `eoi` of the iteration can arrive after a successor's first forward of the next)."""
        it = msg.meta.get("it", -1)
        if it <= self.iteration:
            return False
        if it > self.iteration + 1:
            return True
        sched = self.schedules.get(msg.meta.get("pe", -1))
        return sched is None or self.me not in sched.names

    def _replay(self) -> list[Out]:
        ready = [m for m in self._future if m.meta.get("it") == self.iteration]
        self._future = [m for m in self._future if m.meta.get("it") != self.iteration]
        outs: list[Out] = []
        for m in ready:
            try:
                outs = self._flush(outs) + self.handle(m)
            except BadInput:
                self.dropped["bad_input"] += 1
        return outs

    # ------------------------------------------------------------------ state
    def snapshot(self) -> tuple[dict, dict[str, Tensor], dict[str, Tensor]]:
        """(meta, weights, optimizer tensors) as host fp32 copies, consistent with the last step:
        what node/state_sync.py serves (a same-stage replica copies both, CheckFree averages the
        weights with the neighbours' norms from `meta`). Call between messages (compute thread)."""
        last = self.records[-1] if self.records else None
        meta = {"stage": self.stage, "iteration": self.iteration,
                "grad_norm": last.grad_norm if last else float("nan"),
                "grad_norm_clipped": last.grad_norm_clipped if last else float("nan"),
                "weights_sha256": last.weights_sha256 if last else weights_sha256(self.module),
                "lr": self.last_lr}
        return meta, host_weights(self.module), host_adam_state(self.module, self.opt)


__all__ = ["Aborted", "BadInput", "EvalResult", "Msg", "OriginDone", "Out", "StageExecutor", "StepResult", "weights_sha256"]
