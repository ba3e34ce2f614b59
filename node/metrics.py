"""Node-level Prometheus metrics on an isolated registry (never the global one).

Owns the registry, the node/DHT/gRPC/rejection series (docs/operations.md, 'Metrics and dashboards') and the series every
training role shares (train loss/tokens/steps/step time, eval loss, state downloads,
checkpoints; set them through :func:`record_train_step` and :func:`count_rejection`). A series may
be declared only once per registry, so roles import these and declare only their own
(e.g. ``optimizers/noloco_metrics.py``) against :data:`REGISTRY`. Nothing here waits on I/O in
the training path: values are set in memory and read by the ops HTTP thread at scrape time.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from node.lifecycle import READINESS_REASONS, State

log = logging.getLogger("swarmnode.metrics")

REGISTRY = CollectorRegistry(auto_describe=True)

NODE_INFO = Gauge("swarmnode_node_info", "Identity of this node (value 1).",
                  ["run", "role", "version", "peer_id"], registry=REGISTRY)
BUILD_INFO = Gauge("swarmnode_build_info", "Versions of swarmnode and its key dependencies (value 1).",
                   ["version", "torch", "hivemind", "protobuf"], registry=REGISTRY)
STATE = Enum("swarmnode_state", "Lifecycle state of this node.", states=[s.value for s in State],
             registry=REGISTRY)
READINESS_REASON = Enum("swarmnode_readiness_reason", "Why the node is (not) ready.",
                        states=list(READINESS_REASONS), registry=REGISTRY)
START_TIME = Gauge("swarmnode_start_time_seconds", "Unix time the node process started.", registry=REGISTRY)
TASK_FAILURES = Counter("swarmnode_task_failures_total", "Supervised background task failures.", ["task"],
                        registry=REGISTRY)
PREEMPTION_NOTICES = Counter("swarmnode_preemption_notices_total", "Spot preemption notices received.",
                             ["source"], registry=REGISTRY)
DRAIN_DURATION = Gauge("swarmnode_drain_duration_seconds", "Duration of the last drain.", registry=REGISTRY)
BOOTSTRAP_ATTEMPTS = Counter("swarmnode_dht_bootstrap_attempts_total", "Attempts to join through initial peers.",
                             ["outcome"], registry=REGISTRY)
DHT_REQUESTS = Counter("swarmnode_dht_requests_total", "DHT operations issued by this node.", ["op", "outcome"],
                       registry=REGISTRY)
DHT_REQUEST_SECONDS = Histogram("swarmnode_dht_request_duration_seconds", "Duration of DHT operations.", ["op"],
                                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=REGISTRY)
GRPC_HANDLED = Counter("swarmnode_grpc_server_handled_total", "gRPC calls handled by this node's server.",
                       ["service", "method", "code"], registry=REGISTRY)
GRPC_HANDLING_SECONDS = Histogram("swarmnode_grpc_server_handling_seconds", "gRPC server handling time.",
                                  ["service", "method"], registry=REGISTRY)
TRANSFER_BYTES = Counter("swarmnode_transfer_bytes_total", "Bytes of tensor streams sent or received.",
                         ["direction", "kind"], registry=REGISTRY)
OPS_CONNECTIONS = Gauge("swarmnode_ops_connections", "Connections open on the ops HTTP port (capped by "
                        "ops.max_connections).", registry=REGISTRY)
OPS_CONNECTIONS_CLOSED = Counter("swarmnode_ops_connections_closed_total", "Ops HTTP connections closed, by why: "
                                 "answered, idle_timeout, evicted (over ops.max_connections), bad_request, "
                                 "client_closed.", ["reason"], registry=REGISTRY)
REVOKED_TOKENS = Gauge("swarmnode_admission_revoked", "Entries (serials and peer IDs) in the run's revocation "
                       "list as this node last read it (token mode).", registry=REGISTRY)
RPC_REJECTED = Counter("swarmnode_rpc_rejected_total", "Requests rejected before handling.", ["reason"],
                       registry=REGISTRY)
TENSORS_REJECTED = Counter("swarmnode_tensors_rejected_total", "Received tensors rejected.", ["reason"],
                           registry=REGISTRY)
# ---- series every training role shares (declared here once: a second declaration raises)
TRAIN_STEPS = Counter("swarmnode_train_steps_total", "Inner optimizer steps taken.", registry=REGISTRY)
TRAIN_TOKENS = Counter("swarmnode_train_tokens_total", "Tokens trained on.", registry=REGISTRY)
TRAIN_LOSS = Gauge("swarmnode_train_loss", "Training loss of the latest step.", registry=REGISTRY)
TRAIN_LOSS_INITIAL = Gauge("swarmnode_train_loss_initial", "Training loss of this node's first step.",
                           registry=REGISTRY)
STEP_SECONDS = Histogram("swarmnode_train_step_duration_seconds", "Duration of one training step.",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=REGISTRY)
LAST_STEP = Gauge("swarmnode_last_step_timestamp_seconds", "Unix time of the latest training step.",
                  registry=REGISTRY)
EVAL_LOSS = Gauge("swarmnode_eval_loss", "Validation loss of the weights this node evaluates (its role says which).",
                  registry=REGISTRY)
EVAL_LOSS_INITIAL = Gauge("swarmnode_eval_loss_initial", "Validation loss when this node started.",
                          registry=REGISTRY)
STATE_DOWNLOADS = Counter("swarmnode_state_downloads_total", "State downloads by a joiner, by outcome.", ["outcome"],
                          registry=REGISTRY)
STATE_DONORS_REJECTED = Counter("swarmnode_state_donors_rejected_total",
                                "Downloaded donor states not adopted because they disagree with the other donors "
                                "(outlier: far from the majority's; no_majority: no two donors agreed).", ["reason"],
                                registry=REGISTRY)
CHECKPOINTS = Counter("swarmnode_checkpoints_total", "Checkpoints written or loaded, by outcome.", ["outcome"],
                      registry=REGISTRY)


class DhtCollector(Collector):
    """Asks the hivemind DHT process at scrape time: peer count and records rejected by our
    validator. A slow or dead DHT process is skipped (1 s timeout) and counted, never blocks.

    The validator runs in the forked DHT process, so its counts live there: ``probe`` runs
    ``security.records.read_rejections`` inside that process (``dht.run_coroutine``) and returns
    the running totals per reason, exported as ``swarmnode_dht_records_rejected_total{validator=
    "signed_record", reason}`` (a counter: the totals only grow while the DHT process lives)."""

    def __init__(self, probe: Callable[[float], tuple[int, dict[str, int]] | None]):
        self._probe = probe
        self._timeouts = 0

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        try:
            result = self._probe(1.0)
        except Exception:  # noqa: BLE001 - a scrape must never fail because of the DHT
            result = None
        peers = GaugeMetricFamily("swarmnode_dht_peers", "Peers in this node's DHT routing table.")
        rejected = CounterMetricFamily("swarmnode_dht_records_rejected",
                                       "DHT records rejected by validators, by why (security.records.REASONS).",
                                       labels=["validator", "reason"])
        timeouts = CounterMetricFamily("swarmnode_dht_scrape_timeouts", "Scrapes that could not ask the DHT process.")
        if result is None:
            self._timeouts += 1
        else:
            n_peers, rejections = result
            peers.add_metric([], n_peers)
            for reason, count in sorted(rejections.items()):
                rejected.add_metric(["signed_record", reason], count)
            yield peers
            yield rejected
        timeouts.add_metric([], self._timeouts)
        yield timeouts


def set_identity(run: str, role: str, version: str, peer_id: str) -> None:
    NODE_INFO.labels(run=run, role=role, version=version, peer_id=peer_id).set(1)
    START_TIME.set(time.time())
    versions = {"torch": "", "hivemind": "", "protobuf": ""}
    from importlib.metadata import PackageNotFoundError, version as pkg_version
    for name in versions:
        try:
            versions[name] = pkg_version(name)
        except PackageNotFoundError:
            versions[name] = "missing"
    BUILD_INFO.labels(version=version, **versions).set(1)


def follow_lifecycle(state: State, reason: str, detail: str) -> None:
    """Lifecycle listener: keep the state enums current."""
    STATE.state(state.value)
    READINESS_REASON.state(reason if reason in READINESS_REASONS else ("ready" if state is State.READY else "role_init"))


_first_loss_set = False


def record_train_step(loss: float, tokens: int, seconds: float) -> None:
    """One training step done: loss (and the first loss once), tokens, steps, duration, time."""
    global _first_loss_set
    if not _first_loss_set:
        _first_loss_set = True
        TRAIN_LOSS_INITIAL.set(loss)
    TRAIN_STEPS.inc()
    TRAIN_TOKENS.inc(tokens)
    TRAIN_LOSS.set(loss)
    STEP_SECONDS.observe(seconds)
    LAST_STEP.set(time.time())


TENSOR_REASONS = frozenset({"nonfinite", "checksum", "shape", "dtype", "size", "truncated", "norm", "distance"})
RPC_REASONS = ("auth", "stale", "size", "rate", "schema")
"""The request rejection reasons (docs/operations.md, 'Metrics and dashboards'; others, e.g. ``banned``, appear when first counted)."""

# Every label value a dashboard or alert expects exists from the start (at 0): rate() and
# increase() then see the first rejection, and panels show 0 instead of "no data".
for _reason in sorted(TENSOR_REASONS):
    TENSORS_REJECTED.labels(reason=_reason)
for _reason in RPC_REASONS:
    RPC_REJECTED.labels(reason=_reason)


def count_rejection(reason: str) -> None:
    """Peer input rejected: tensor problems by codec reason (``swarmnode_tensors_rejected_total``),
    header problems as stale (stale/future round) or schema (``swarmnode_rpc_rejected_total``)."""
    if reason in TENSOR_REASONS:
        TENSORS_REJECTED.labels(reason=reason).inc()
    else:
        RPC_REJECTED.labels(reason="stale" if reason in ("stale", "future") else "schema").inc()
