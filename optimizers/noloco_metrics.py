"""Prometheus series of the ``noloco`` role's outer loop (names shared by NoLoCo and DiLoCo; noloco.md §3.8).

Only the outer-step series live here; the series every training role shares (train loss,
tokens, step time, eval loss, state downloads, checkpoints) are in ``node/metrics.py``.
Declared once against the node's isolated registry. Set from the role's loop and the compute
thread (prometheus-client is thread-safe); nothing here blocks training.
"""

from prometheus_client import Counter, Gauge, Histogram

from node.metrics import REGISTRY

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
UPDATE_NORM = Gauge("swarmnode_outer_update_norm", "L2 norm of the latest outer update of phi.", registry=REGISTRY)

# Every outcome exists from the start (at 0): rate() and increase() then see the first failed
# round, and the dashboards and alerts (deploy/) show 0 instead of "no data".
for _outcome in ("ok", "solo", "failed"):
    OUTER_ROUNDS.labels(outcome=_outcome)
