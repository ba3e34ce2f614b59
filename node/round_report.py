"""One per-round report for every training role: the shared train series, the typed card
details and one structured event (``TrainingRole.report`` calls these; node/training.py).

    report_round(log, "grpo_round_done", "round {round}: reward {reward:.3f}", round=r, reward=x,
                 steps=TrainStep(loss, tokens, seconds))
    update_card(ctx.card, GRPOCard, GRPOCard(round=r, reward=0.41))

Role-specific Prometheus series stay in the role's metrics module (set before the report).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from node import metrics as NM
from node.logs import emit, set_context
from node.run_settings import TrainingCard

if TYPE_CHECKING:  # pragma: no cover
    from node.card import CardPublisher


@dataclass(frozen=True)
class TrainStep:
    """One training step for the shared train series (``swarmnode_train_*``): its loss, the
    tokens it trained on and how long it took."""

    loss: float
    tokens: int
    seconds: float


def update_card(card: "CardPublisher", model: type[TrainingCard], details: TrainingCard,
                publish: bool = False) -> None:
    """Set card details from the role's typed ``model`` (unset fields untouched, None removes
    one); TypeError for anything but an instance of ``model``."""
    if not isinstance(details, model):
        raise TypeError(f"card details of this role are a {model.__name__}, not a {type(details).__name__}: "
                        f"build them as {model.__name__}(...)")
    card.update(publish=publish, **details.details())


def report_round(log: logging.Logger, event: str, msg: str, *, round: int | None = None,
                 steps: TrainStep | Iterable[TrainStep] = (), **fields: Any) -> None:
    """Record ``steps`` in the shared train series, stamp ``round`` on later log lines (the log
    context) and write the event (``msg``: a template over ``round`` and ``fields``)."""
    for st in (steps,) if isinstance(steps, TrainStep) else steps:
        NM.record_train_step(st.loss, st.tokens, st.seconds)
    if round is not None:
        set_context(round=round)
        fields = {"round": round, **fields}
    emit(log, event, msg, **fields)
