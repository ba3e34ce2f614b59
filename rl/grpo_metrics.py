"""Prometheus series of the ``grpo`` role, declared once on the node registry, and the figures a
peer keeps over its rounds (:class:`Tally`).

Only the GRPO series live here; train loss/steps/tokens are the shared ``node/metrics.py``
series (the role's per-round report sets them). Set from the role's round loop and its compute
thread (prometheus-client is thread-safe). No per-peer labels: per-sender figures go to logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from node.metrics import REGISTRY

if TYPE_CHECKING:  # pragma: no cover
    from rl.learner import TrainStats

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
KL_GEN_LOCAL = Gauge("swarmnode_grpo_kl_gen_local",
                     "Mean per-token KL(generator || local) of foreign samples (mean over their tokens), last step.",
                     registry=REGISTRY)
KL_GEN_LOCAL_SEQ = Gauge("swarmnode_grpo_kl_gen_local_sequence",
                         "Mean per-sequence KL(generator || local) of foreign samples (sum over their tokens: "
                         "the F-TIS paper's statistic), last step.", registry=REGISTRY)
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
JUDGE_CALLS = Counter("swarmnode_grpo_judge_calls_total", "Judge verdicts, by outcome (safe, unsafe, unparsed, cached).",
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


@dataclass
class Tally:
    """What a peer counts over its rounds: the figures of its ``training_finished`` event."""

    trained: int = 0
    """Rounds this peer trained (or, as the test harness's attacker, published) on."""
    skipped: int = 0
    """Rounds it was not ready for in time (``grpo.start_slack_frac``)."""
    next_round: int = 0
    """The next round of the clock this peer may take."""
    rewards: list[float] = field(default_factory=list)
    accuracy_start: float | None = None
    accuracy_last: float | None = None
    warmup_steps: int = 0

    def reward_span(self) -> tuple[float, float]:
        """Mean local reward of the first and of the last (up to) 5 rounds."""
        k = max(1, min(5, len(self.rewards) // 4))
        return sum(self.rewards[:k]) / k, sum(self.rewards[-k:]) / k


def record_sent(n_bytes: int, n_tokens: int) -> float:
    """A published batch; returns its payload bytes per completion token."""
    WIRE_BYTES.labels(direction="sent").inc(n_bytes)
    WIRE_TOKENS.labels(direction="sent").inc(n_tokens)
    per_token = n_bytes / max(n_tokens, 1)
    BYTES_PER_TOKEN.set(per_token)
    return per_token


def record_received(senders: int, tokens: int) -> None:
    """The round's validated foreign batches: how many peers, how many tokens."""
    PEERS_SEEN.set(senders)
    PEERS_SEEN_HIST.observe(senders)
    WIRE_TOKENS.labels(direction="received").inc(tokens)


def record_step(st: "TrainStats", r: int, first: bool) -> None:
    """One trained round's step figures (``first``: also the initial reward)."""
    if first:
        REWARD_INITIAL.set(st.reward_local)
    REWARD.set(st.reward_local)
    ROUND.set(r)
    ROUNDS.labels(outcome="ok" if st.n_foreign else "solo").inc()
    ROLLOUTS.labels(source="local").inc(st.n_local)
    ROLLOUTS.labels(source="peer").inc(st.n_foreign)
    FILTERED_FRAC.set(st.filtered_frac)
    FILTERED.inc(st.filtered)
    WEIGHT_MEAN.set(st.weight_mean)
    TRUNCATED_RATIO.set(st.truncated_frac)
    KL_GEN_LOCAL.set(st.kl_foreign)
    KL_GEN_LOCAL_SEQ.set(st.kl_seq_foreign)


def record_eval(accuracy: float, marker_rates: dict[str, float]) -> None:
    ACCURACY.set(accuracy)
    MARKER_RATE.set(max(marker_rates.values(), default=0.0))
