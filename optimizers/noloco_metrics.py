"""Prometheus series of the ``noloco`` role's outer loop (names shared by NoLoCo and DiLoCo; docs/noloco.md, 'Metrics').

Only the outer-step series live here; the series every training role shares (train loss,
tokens, step time, eval loss, state downloads, checkpoints) are in ``node/metrics.py``.
Declared once against the node's isolated registry. Set from the role's loop and the compute
thread (prometheus-client is thread-safe); nothing here blocks training. ``Tally`` keeps the
per-round counts these series are computed from.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from node.metrics import REGISTRY, TRANSFER_BYTES

OUTER_ROUND = Gauge("swarmnode_outer_round", "Current outer round of this worker.", registry=REGISTRY)
OUTER_ROUNDS = Counter("swarmnode_outer_rounds_total", "Outer rounds by outcome (ok / solo / failed).",
                       ["outcome"], registry=REGISTRY)
SOLO_ROUNDS = Counter("swarmnode_outer_solo_rounds_total", "Solo outer steps by reason.", ["reason"],
                      registry=REGISTRY)
ROUND_CATCH_UPS = Counter("swarmnode_outer_round_catch_ups_total",
                          "Times this worker adopted a live peer's higher round label (noloco.catch_up).",
                          registry=REGISTRY)
GROUP_SIZE = Histogram("swarmnode_outer_group_size", "Group size of each outer step (1 = solo).",
                       buckets=(1, 2, 3, 4, 8, 16, 32, 64), registry=REGISTRY)
BLOCKED_SECONDS = Histogram("swarmnode_outer_blocked_seconds", "Seconds the worker waited for its group per round.",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=REGISTRY)
SENT_BYTES = Counter("swarmnode_outer_sent_bytes_total", "Bytes sent in outer exchanges.", registry=REGISTRY)
RECEIVED_BYTES = Counter("swarmnode_outer_received_bytes_total", "Bytes received in outer exchanges.",
                         registry=REGISTRY)
PARTNER_REPEAT = Gauge("swarmnode_outer_partner_repeat_ratio",
                       "Share of the last 20 rounds whose partner set equals the previous round's.", registry=REGISTRY)
REPLICA_SPREAD = Gauge("swarmnode_replica_spread",
                       "RMS distance per parameter between this worker's theta and its group mean (pre-step).",
                       registry=REGISTRY)
TRAINING_SECONDS = Gauge("swarmnode_outer_training_seconds",
                         "Wall seconds since this worker started training (inner phases plus outer steps).",
                         registry=REGISTRY)
BLOCKED_FRACTION = Gauge("swarmnode_outer_blocked_fraction",
                         "Seconds blocked in outer exchanges / seconds training, since training started.",
                         registry=REGISTRY)
WAIT_BOUND = Gauge("swarmnode_outer_wait_bound_seconds",
                   "The waiting policy's current bound on waiting for a partner (noloco.wait_fraction).",
                   registry=REGISTRY)
EXTRA_STEPS = Counter("swarmnode_outer_wait_compute_steps_total",
                      "Inner steps added to rounds instead of waiting alone (noloco.compute_while_waiting).",
                      registry=REGISTRY)
CLIP_FACTOR = Histogram("swarmnode_outer_partner_clip_factor",
                        "Clip factor of each partner contribution (1 = used as sent; noloco.robust).",
                        buckets=(0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0), registry=REGISTRY)
CLIPPED = Counter("swarmnode_outer_partners_clipped_total",
                  "Partner contributions clipped (soft: factor in [0.5, 1), hard: below 0.5).", ["severity"],
                  registry=REGISTRY)
CLIP_RADIUS = Gauge("swarmnode_outer_clip_radius", "The robust averaging radius of the latest clipped-or-not "
                    "partner contribution (noloco.robust_multiplier).", registry=REGISTRY)
CLIP_CHARGES = Counter("swarmnode_outer_partners_charged_clipped_total",
                       "Partners charged (skipped as partners) for repeated hard clips (noloco.robust_strikes).",
                       registry=REGISTRY)
UPDATE_NORM = Gauge("swarmnode_outer_update_norm", "L2 norm of the latest outer update of phi.", registry=REGISTRY)
LEAD_STEPS = Counter("swarmnode_outer_lead_steps_total",
                     "Inner steps dropped from a next phase after being left out of a round's pairs, to arrive "
                     "before the peers due at the next label (NoLoCo).", registry=REGISTRY)

# Every outcome exists from the start (at 0): rate() and increase() then see the first failed
# round, and the dashboards and alerts (deploy/) show 0 instead of "no data".
for _outcome in ("ok", "solo", "failed"):
    OUTER_ROUNDS.labels(outcome=_outcome)
for _severity in ("soft", "hard"):
    CLIPPED.labels(severity=_severity)


def record_clip(factor: float, radius: float, hard: bool, charged: bool = False) -> None:
    """One partner contribution judged by the robust clip (``optimizers/robust.py``);
    ``charged``: this one got the partner charged."""
    CLIP_FACTOR.observe(factor)
    if charged:
        CLIP_CHARGES.inc()
    CLIP_RADIUS.set(radius)
    if factor < 1.0:
        CLIPPED.labels(severity="hard" if hard else "soft").inc()


@dataclass
class Tally:
    """The worker's running account of its rounds: its pace (what the waiting policy scales
    with), blocked time and partners behind the series above, and the final report's counts."""

    eval_start: float | None = None
    """Evaluation loss when training started (the final report's start figure)."""
    step_s: float | None = None
    """Measured seconds per inner step (moving average); None before the first round."""
    eval_s: float = 0.0
    """Duration of the last evaluation (predicts when the worker next exchanges)."""
    t0: float | None = None
    """Monotonic time training started (the blocked fraction's denominator runs from here)."""
    blocked_s: float = 0.0
    rounds_ok: int = 0
    """Outer steps taken with a partner."""
    outer_steps: int = 0
    """Outer steps taken here (the round label can jump: catch_up)."""
    partners: deque = field(default_factory=lambda: deque(maxlen=21))

    def pace(self, seconds: float, steps: int) -> None:
        """``steps`` inner steps took ``seconds``: update the moving average."""
        per_step = seconds / steps
        self.step_s = per_step if self.step_s is None else 0.5 * self.step_s + 0.5 * per_step

    def train_s(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def record(self, *, rnd: int, n: int, outcome: str, reason: str | None, partners: list[str], blocked_s: float,
               sent_bytes: int, received_bytes: int, norm: float, spread: float | None) -> None:
        """One kept outer step (round label now ``rnd``) into the counts and the series."""
        if spread is not None:
            REPLICA_SPREAD.set(spread)
        OUTER_ROUNDS.labels(outcome=outcome if n > 1 else ("solo" if outcome == "ok" else outcome)).inc()
        if n == 1:
            SOLO_ROUNDS.labels(reason=reason or "no_partner").inc()
        GROUP_SIZE.observe(n)
        self.rounds_ok += n > 1
        self.outer_steps += 1
        BLOCKED_SECONDS.observe(blocked_s)
        self.blocked_s += blocked_s
        TRAINING_SECONDS.set(self.train_s())
        BLOCKED_FRACTION.set(self.blocked_s / max(1e-6, self.train_s()))
        SENT_BYTES.inc(sent_bytes)
        RECEIVED_BYTES.inc(received_bytes)
        TRANSFER_BYTES.labels(direction="sent", kind="outer").inc(sent_bytes)
        TRANSFER_BYTES.labels(direction="received", kind="outer").inc(received_bytes)
        UPDATE_NORM.set(norm)
        OUTER_ROUND.set(rnd)
        self.partners.append(tuple(sorted(partners)))
        pairs = list(self.partners)
        if len(pairs) > 1:
            repeats = sum(a == b and a != () for a, b in zip(pairs, pairs[1:]))
            PARTNER_REPEAT.set(repeats / (len(pairs) - 1))
