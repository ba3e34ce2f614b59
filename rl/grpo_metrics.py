"""Prometheus series of the ``grpo`` role (grpo.md §7), declared once on the node registry.

Only the GRPO series live here; train loss/steps/tokens are the shared ``node/metrics.py``
series (set through ``record_train_step``). Set from the role's round loop and its compute
thread (prometheus-client is thread-safe). No per-peer labels: per-sender figures go to logs.
"""

from prometheus_client import Counter, Gauge, Histogram

from node.metrics import REGISTRY

ROLLOUTS = Counter("swarmnode_grpo_rollouts_total",
                   "Completions used in GRPO steps, by source (local = own, peer = foreign).",
                   ["source"], registry=REGISTRY)
REJECTED = Counter("swarmnode_grpo_rollouts_rejected_total",
                   "Rollout batches, shards or completions refused, by reason (signature, stale, "
                   "config, schema, digest, quota, logit_check, judge).", ["reason"], registry=REGISTRY)
REWARD = Gauge("swarmnode_grpo_reward", "Mean local reward of this peer's own completions, last round.",
               registry=REGISTRY)
REWARD_INITIAL = Gauge("swarmnode_grpo_reward_initial", "Mean reward of this peer's first GRPO round.",
                       registry=REGISTRY)
ACCURACY = Gauge("swarmnode_grpo_heldout_accuracy",
                 "Held-out accuracy (mean local reward at the round temperature on fixed held-out prompts).",
                 registry=REGISTRY)
ACCURACY_INITIAL = Gauge("swarmnode_grpo_heldout_accuracy_initial",
                         "Held-out accuracy after the warm-up, before the first GRPO round.", registry=REGISTRY)
ROUND = Gauge("swarmnode_grpo_round", "Latest round this peer trained on.", registry=REGISTRY)
ROUNDS = Counter("swarmnode_grpo_rounds_total", "Rounds by outcome (ok: with peers' rollouts, solo, skipped).",
                 ["outcome"], registry=REGISTRY)
FILTERED_FRAC = Gauge("swarmnode_grpo_ftis_filtered_fraction",
                      "Share of the last step's samples the F-TIS KL filter dropped.", registry=REGISTRY)
FILTERED = Counter("swarmnode_grpo_ftis_filtered_total", "Samples dropped by the F-TIS KL filter.",
                   registry=REGISTRY)
WEIGHT_MEAN = Gauge("swarmnode_grpo_ftis_weight_mean",
                    "Mean truncated importance weight over foreign tokens, last step (1 when none).",
                    registry=REGISTRY)
TRUNCATED_RATIO = Gauge("swarmnode_grpo_ftis_truncated_ratio",
                        "Share of foreign tokens whose importance ratio exceeded C, last step.", registry=REGISTRY)
KL_GEN_LOCAL = Gauge("swarmnode_grpo_kl_gen_local", "Mean KL(generator || local) of foreign samples, last step.",
                     registry=REGISTRY)
WIRE_BYTES = Counter("swarmnode_grpo_wire_bytes_total", "Rollout payload bytes, by direction (sent, received).",
                     ["direction"], registry=REGISTRY)
WIRE_TOKENS = Counter("swarmnode_grpo_wire_tokens_total", "Completion tokens in rollout payloads, by direction.",
                      ["direction"], registry=REGISTRY)
BYTES_PER_TOKEN = Gauge("swarmnode_grpo_wire_bytes_per_token",
                        "Payload bytes per completion token of the last published batch (header included).",
                        registry=REGISTRY)
ROUND_SECONDS = Histogram("swarmnode_grpo_round_duration_seconds",
                          "Seconds from a round's start to the end of its step.",
                          buckets=(0.25, 0.5, 1, 2, 3, 5, 8, 13, 30, 60), registry=REGISTRY)
PEERS_SEEN = Gauge("swarmnode_grpo_peers_seen", "Peers whose valid batch arrived for the last round.",
                   registry=REGISTRY)
PEERS_SEEN_HIST = Histogram("swarmnode_grpo_peers_per_round", "Peers whose valid batch arrived, per round.",
                            buckets=(0, 1, 2, 3, 4, 8, 16, 32), registry=REGISTRY)

BANS = Counter("swarmnode_grpo_sender_bans_total",
               "Senders banned from this peer's groups for a sustained content-check rejection rate.",
               registry=REGISTRY)
MARKER_RATE = Gauge("swarmnode_grpo_attack_marker_rate",
                    "Share of this peer's held-out completions containing a known attack marker (last evaluation).",
                    registry=REGISTRY)
JUDGE_CALLS = Counter("swarmnode_grpo_judge_calls_total", "Judge verdicts, by outcome (safe, unsafe, cached).",
                      ["outcome"], registry=REGISTRY)

# Every label value a dashboard or alert expects exists from the start (at 0): rate() and
# increase() then see the first event, and the panels show 0 instead of "no data".
for _source in ("local", "peer"):
    ROLLOUTS.labels(source=_source)
for _reason in ("logit_check", "judge", "schema", "stale", "quota", "digest"):
    REJECTED.labels(reason=_reason)
for _outcome in ("ok", "solo", "skipped"):
    ROUNDS.labels(outcome=_outcome)
for _direction in ("sent", "received"):
    WIRE_BYTES.labels(direction=_direction)
    WIRE_TOKENS.labels(direction=_direction)
