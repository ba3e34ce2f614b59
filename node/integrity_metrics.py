"""Prometheus series of the stage-integrity checks (the checks: security/stage_integrity.py).

Declared once, on the node's isolated registry, so the stage role (its own checks and peer
audits) and the coordinator (``ReportAnomaly``) count into the same series. It lives in
``node``, beside that registry: the security layer below never imports the node. Only declares
and counts; which checks run and what happens to a flagged node is the caller's business
(security/stage_integrity.py for the checks, the stage role and coordinator for the response).
Importing this module adds the series to a node's registry: whoever imports it first in a role
must also drop ``swarmnode_security_flags_total`` from ``PENDING_METRICS`` in deploy/dashboards.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter

from node.metrics import REGISTRY
from security.stage_integrity import CHECKS, CheckResult

SECURITY_FLAGS = Counter(
    "swarmnode_security_flags_total",
    "Stage-integrity flags raised, by check (replica_sketch, replica_commit, update_bound, update_drift, "
    "spot_check, commit_mismatch, nonfinite_output, stage_replay). A steady trickle of one check on honest nodes means its tolerance is too "
    "tight for this hardware mix (see UpdateMonitor / compare_sketches); a burst names a suspect to quarantine.",
    ["check"], registry=REGISTRY)
for _check in CHECKS:       # every check shows 0 from the start (dashboards and alerts see "no flags", not "no data")
    SECURITY_FLAGS.labels(check=_check)


def count_flags(results: Iterable[CheckResult]) -> int:
    """Add every flag of `results` to swarmnode_security_flags_total{check}; return how many."""
    n = 0
    for result in results:
        for flag in result.flags:
            if flag.check not in CHECKS:
                raise ValueError(f"unknown check {flag.check!r}; add it to security.stage_integrity.CHECKS")
            SECURITY_FLAGS.labels(check=flag.check).inc()
            n += 1
    return n


__all__ = ["SECURITY_FLAGS", "count_flags"]
