"""Validation of the full in-order model across the pipeline (docs/pipeline.md, 'Stage execution': evaluation always
runs every stage, in order, whatever paths training takes).

Owns one evaluation pass: the evaluating originator embeds each fixed validation batch, sends it
through the first node of every stage 1..S-1 in stage order (no autograd graph), and on its
return applies the head and the loss; the result is the token-weighted mean loss over the
batches. Relaying nodes check that an `ev` message comes from the stage before theirs (or from a
stage-0 originator) and is addressed to them. Meta of an `ev` message: `it` (the step count
whose weights it must see: the executor holds it until it gets there), `ep`, `e` (batch), `h`
(the stage it goes to; S = back at the origin), `o` (the origin's node index). Transport-free,
like pipeline/stage_exec.py, which hands `ev` messages here.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.llama import lm_loss
from pipeline.schedule import Schedule
from pipeline.stage_msgs import BadInput, Msg, Out, as_hidden


@dataclass
class EvalResult:
    iteration: int
    """Optimizer steps taken by the weights that were evaluated."""
    loss: float
    """Token-weighted mean next-token loss over the validation batches."""


class InOrderEval:
    """The validation pass of one node: started on an originator, relayed by stage nodes."""

    def __init__(self, module: nn.Module, device: torch.device, eval_data: list[tuple[Tensor, Tensor]],
                 dropped: Counter, autocast: Callable[[], contextlib.AbstractContextManager]):
        self.module, self.device, self.data = module, device, eval_data
        self.dropped, self.autocast = dropped, autocast
        self._run: dict | None = None

    @property
    def running(self) -> bool:
        return self._run is not None

    def start(self, sched: Schedule, me: int, iteration: int) -> list[Out]:
        """Originator `me`: evaluate the weights after `iteration` steps."""
        if not self.data:
            raise RuntimeError("no validation batches on this node (only stage-0 nodes hold data)")
        self._run = {"it": iteration, "i": 0, "total": 0.0, "count": 0, "ep": sched.epoch, "o": me}
        return self._send_batch(sched)

    def move_to(self, sched: Schedule, me: int | None) -> list[Out]:
        """A newer schedule while a pass is in flight: send the current batch again along the new
        schedule's in-order path (a node of the old path may be gone, and the pass would wait on it
        for ever); a late reply from the old path is dropped by its epoch."""
        if self._run is None or me is None or self._run["ep"] >= sched.epoch:
            return []
        self._run["ep"], self._run["o"] = sched.epoch, me
        return self._send_batch(sched)

    def _send_batch(self, sched: Schedule) -> list[Out]:
        run = self._run
        x, _ = self.data[run["i"]]
        with torch.no_grad(), self.autocast():
            h = self.module.embed_forward(x.to(self.device))
        meta = {"it": run["it"], "ep": run["ep"], "e": run["i"], "h": 1, "o": run["o"]}
        return [Out(sched.names[sched.partitions[1][0]], "ev", meta, h.float())]

    def on_message(self, sched: Schedule, msg: Msg, sender: int, me: int) -> tuple[list[Out], EvalResult | None]:
        """Relay an `ev` message to the next stage, or (back at the origin) score it."""
        h, n_stages = msg.meta.get("h", -1), len(sched.partitions)
        if h == n_stages:
            return self._on_return(sched, msg, sender, me)
        if h == 1:
            ok = sender == msg.meta.get("o", -1) and sender in sched.origins
        else:
            ok = 1 < h < n_stages and sender == sched.partitions[h - 1][0]
        if not ok or sched.partitions[h][0] != me:
            self.dropped["unknown_path"] += 1
            return [], None
        with torch.no_grad(), self.autocast():
            try:
                y = self.module(as_hidden(msg.tensor, self.device))
            except ValueError as exc:
                raise BadInput("shape", str(exc)) from None
        nxt = sched.partitions[h + 1][0] if h + 1 < n_stages else msg.meta["o"]
        return [Out(sched.names[nxt], "ev", dict(msg.meta, h=h + 1), y.float())], None

    def _on_return(self, sched: Schedule, msg: Msg, sender: int, me: int) -> tuple[list[Out], EvalResult | None]:
        run = self._run
        if run is None or msg.meta.get("o") != me or msg.meta.get("e") != run["i"] or msg.meta.get("ep") != run["ep"] \
                or msg.meta.get("it") != run["it"] or sender != sched.partitions[-1][0]:
            self.dropped["unknown_path"] += 1
            return [], None
        _, y = self.data[run["i"]]
        with torch.no_grad(), self.autocast():
            try:
                logits = self.module.head_forward(as_hidden(msg.tensor, self.device))
            except ValueError as exc:
                raise BadInput("shape", str(exc)) from None
            loss = lm_loss(logits.float(), y.to(self.device))
        run["total"] += float(loss) * y.numel()
        run["count"] += y.numel()
        run["i"] += 1
        if run["i"] < len(self.data):
            return self._send_batch(sched), None
        self._run = None
        return [], EvalResult(run["it"], run["total"] / run["count"])


__all__ = ["EvalResult", "InOrderEval"]
