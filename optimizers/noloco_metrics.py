"""Prometheus series of the ``noloco`` role (names shared by NoLoCo and DiLoCo; noloco.md §3.8).

Declared once against the node's isolated registry. Set from the role's loop and the compute
thread (prometheus-client is thread-safe); nothing here blocks training.
"""

from prometheus_client import Counter, Gauge, Histogram

from node.metrics import REGISTRY

TRAIN_STEPS = Counter("swarmnode_train_steps_total", "Inner optimizer steps taken.", registry=REGISTRY)
TRAIN_TOKENS = Counter("swarmnode_train_tokens_total", "Tokens trained on.", registry=REGISTRY)
TRAIN_LOSS = Gauge("swarmnode_train_loss", "Training loss of the latest inner step.", registry=REGISTRY)
TRAIN_LOSS_INITIAL = Gauge("swarmnode_train_loss_initial", "Training loss of this node's first inner step.",
                           registry=REGISTRY)
STEP_SECONDS = Histogram("swarmnode_train_step_duration_seconds", "Duration of one inner step.",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=REGISTRY)
LAST_STEP = Gauge("swarmnode_last_step_timestamp_seconds", "Unix time of the latest inner step.", registry=REGISTRY)
EVAL_LOSS = Gauge("swarmnode_eval_loss", "Validation loss of this worker's slow weights (phi).", registry=REGISTRY)
EVAL_LOSS_INITIAL = Gauge("swarmnode_eval_loss_initial", "Validation loss when this worker started.",
                          registry=REGISTRY)
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
UPDATE_NORM = Gauge("swarmnode_outer_update_norm", "L2 norm of the latest outer update of phi.", registry=REGISTRY)
STATE_DOWNLOADS = Counter("swarmnode_state_downloads_total", "State downloads by a joiner, by outcome.", ["outcome"],
                          registry=REGISTRY)
CHECKPOINTS = Counter("swarmnode_checkpoints_total", "Checkpoints written or loaded, by outcome.", ["outcome"],
                      registry=REGISTRY)
