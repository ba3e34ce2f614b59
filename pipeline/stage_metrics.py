"""Prometheus series of the `stage` role (docs/pipeline.md, 'Metrics').

Only the pipeline series live here; the series every training role shares (train loss and
steps, eval loss, rejections) are in node/metrics.py. Declared once on the node's registry.
"""

from prometheus_client import Counter, Gauge, Histogram

from node.metrics import REGISTRY

MICROBATCHES = Counter("swarmnode_pipeline_microbatches_total",
                       "Microbatch computes on this node by direction (forward / backward).", ["direction"],
                       registry=REGISTRY)
ITERATION_SECONDS = Histogram("swarmnode_pipeline_iteration_seconds", "Wall seconds per pipeline iteration.",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=REGISTRY)
IDLE_SECONDS = Counter("swarmnode_pipeline_idle_seconds_total",
                       "Seconds this node waited for a message while an iteration was open.", registry=REGISTRY)
IDLE_FRACTION = Gauge("swarmnode_pipeline_idle_fraction", "Idle share of the latest iteration.", registry=REGISTRY)
IN_FLIGHT = Gauge("swarmnode_pipeline_in_flight", "Microbatches held for backward right now.", registry=REGISTRY)
DEFERRED = Counter("swarmnode_pipeline_deferred_total", "Forwards deferred for lack of a memory slot.",
                   registry=REGISTRY)
DROPPED = Counter("swarmnode_pipeline_dropped_total",
                  "Pipeline messages dropped (stale_iteration, unknown_path, duplicate, ...).", ["reason"],
                  registry=REGISTRY)
ERRORS_SENT = Counter("swarmnode_pipeline_errors_answered_total",
                      "Messages answered with an error (wrong shape, malformed).", ["reason"], registry=REGISTRY)
SCHEDULE_EPOCH = Gauge("swarmnode_pipeline_schedule_epoch", "Schedule epoch of the current iteration.",
                       registry=REGISTRY)
STAGE_INDEX = Gauge("swarmnode_pipeline_stage_index", "Pipeline stage this node serves.", registry=REGISTRY)
ITERATION = Gauge("swarmnode_pipeline_iteration", "Optimizer steps taken by this stage node.", registry=REGISTRY)
HOP_SECONDS = Histogram("swarmnode_pipeline_hop_seconds",
                        "Seconds from a message being queued at the sender to its arrival here (emulated link + "
                        "codec + gRPC; wall clocks of the two nodes, so sync them across machines).",
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=REGISTRY)
HOP_LINK_SECONDS = Counter("swarmnode_pipeline_hop_link_seconds_total",
                           "Emulated-link seconds ([netem]) of the messages received here; hop seconds minus this is "
                           "the transport's share.", registry=REGISTRY)
SEND_RETRIES = Counter("swarmnode_pipeline_send_retries_total",
                       "Failed attempts to deliver a pipeline message (each is retried on a fresh stream). If it "
                       "keeps rising, the peer named in the WARN log is unreachable.", registry=REGISTRY)

# CheckFree (docs/pipeline.md, 'CheckFree recovery'; issue 11): `swarmnode_checkfree_recovery_seconds` is one histogram
# with a `phase` label: `detect` is observed by the coordinator (bootstrap: last good health probe
# -> stage noticed down), `fetch` (downloading the donors' state) and `apply` (loading the rebuilt
# weights, fresh optimizer) by the replacement node. The counter's label is `rule` (the spec's and
# the alert rules' name for the issue's "kind"); `recovery_duration_seconds` is the total per
# recovery on the replacement (the dashboard's p95).
RECOVERY_RULES = ("replica", "average", "copy_partner", "copy_neighbour", "checkpoint", "nearest")
RECOVERIES = Counter("swarmnode_checkfree_recoveries_total",
                     "Stages rebuilt on this node, by rule (the kind of recovery: replica, average, copy_partner, "
                     "copy_neighbour, checkpoint, nearest).", ["rule"], registry=REGISTRY)
for _rule in RECOVERY_RULES:          # every rule's series exists from the start (0), so rates and alerts see it
    RECOVERIES.labels(rule=_rule)
RECOVERY_DURATION = Histogram("swarmnode_checkfree_recovery_duration_seconds",
                              "Seconds a replacement took from asking the coordinator for a stage to holding the "
                              "rebuilt weights (fetch + apply + waiting for donors; detection is the "
                              "coordinator's `phase=\"detect\"`).",
                              buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120), registry=REGISTRY)
RECOVERY_SECONDS = Histogram("swarmnode_checkfree_recovery_seconds",
                             "Seconds per recovery phase: detect (coordinator), fetch and apply (replacement node).",
                             ["phase"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60), registry=REGISTRY)
STAGES_DOWN = Counter("swarmnode_checkfree_stages_down_total",
                      "Stages the coordinator found with no live node (the schedule was suspended).",
                      registry=REGISTRY)
ADJACENT_FAILURES = Counter("swarmnode_checkfree_adjacent_failures_total",
                            "Recoveries that found a neighbouring stage lost too (no averaging with missing weights: "
                            "checkpoint or nearest-stage fallback).", registry=REGISTRY)
WEIGHTS_VERSION = Gauge("swarmnode_stage_weights_version",
                        "Completed iteration the stage's weights belong to (steps taken; a recovered stage starts "
                        "at its donors' iteration).", registry=REGISTRY)
WEIGHTS_RECOVERED = Gauge("swarmnode_checkfree_weights_recovered_at",
                          "Iteration at which this node's weights were last rebuilt by a recovery (-1 = never).",
                          registry=REGISTRY)
WEIGHTS_RECOVERED.set(-1)
QUARANTINED = Gauge("swarmnode_pipeline_quarantined_replicas",
                    "Stage replicas the coordinator left out of the schedule after a failed integrity audit "
                    "(`swarmnode status` says which and why).", registry=REGISTRY)
EMBED_COPY_ITERATION = Gauge("swarmnode_checkfree_embed_copy_iteration",
                             "Stage 1: the iteration of the copy of stage 0 (embedding, head) this node keeps "
                             "for a stage-0 rebuild (-1: none yet).", registry=REGISTRY)
EMBED_COPY_ITERATION.set(-1)

# Coordinator (bootstrap): the integrity audits (pipeline/replica_audits.py) and admission probes
# (pipeline/stage_probe.py) of the stage nodes it plans over.
AUDITS = Counter("swarmnode_pipeline_audits_total",
                 "Replica audits by outcome: replays (honest step), fails (quarantined), inconclusive (raced "
                 "on, timed out), refused (the audited node refused the coordinator's download).", ["outcome"],
                 registry=REGISTRY)
AUDITS_BLOCKED = Gauge("swarmnode_pipeline_audits_blocked",
                       "Stage nodes whose integrity audit cannot run (refused, or inconclusive several times in a "
                       "row): their replicas go unchecked; the coordinator's audit_blocked log line says why.",
                       registry=REGISTRY)
for _outcome in ("replays", "fails", "inconclusive", "refused"):
    AUDITS.labels(outcome=_outcome)
PROBES = Counter("swarmnode_pipeline_probes_total",
                 "Stage probes the coordinator sent (admission and after a stall), by outcome (passed, failed). "
                 "Failures on honest nodes mean schedule.probe_timeout_s is too short for their load.", ["outcome"],
                 registry=REGISTRY)
STALLS = Counter("swarmnode_pipeline_stalls_total",
                 "Times no node of the published schedule stepped for schedule.stall_s (the coordinator re-probed "
                 "them and dropped those that failed).", registry=REGISTRY)
for _outcome in ("passed", "failed"):
    PROBES.labels(outcome=_outcome)
