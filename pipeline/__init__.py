"""pipeline: SkipPipe scheduling and simulation (pure), the `stage` role and its executor.

Pure, network-free modules (stdlib only; no grpc, hivemind, node or torch code):
- `pipeline.cluster`: `Cluster` cost model (w, c, memory; latency split, replica gradient
  times), `comm_matrix` from latency/bandwidth.
- `pipeline.paths`: `PathRules` (R1-R4 limits, memory cap), `stage_violation`, `enumerate_paths`.
- `pipeline.allocation`: `allocate` (DP + 2*PP score; brute force N <= 8, else GCMA-lite; TSP
  stage order).
- `pipeline.schedule`: `Schedule` (canonical JSON + sha256, successor/predecessor maps),
  `validate_schedule` raising `ScheduleViolation(rule=...)`.
- `pipeline.search`: `plan`, `skippipe_schedule` (collision-aware search), `random_schedule`,
  `full_pipeline_schedule`.
- `pipeline.simulator`: `simulate` (makespan, idle, queueing, deferrals, per-node trace) and
  `iteration_period` (iterations chained through the replica gradient exchange).
- `pipeline.geo`: a modelled 12-region cost model and `compare` (`python -m pipeline.geo`).

The stage role (torch): `stage_msgs` (messages, tensor checks, step records), `stage_exec`
(the transport-free executor), `stage_eval` (in-order validation), `stage_timing` (a node's
forward time), `stage_transport` (open tensor streams, netem, hop timing), `stage_parts` (settings,
cfg hash, building a stage), `stage_progress` (a node's figures and card), `stage_role` (the round
policy on node/training.py's TrainingRole), `coordinator` (the bootstrap's schedule service) and
`coordinator_link` (a node's side of it), `config`, `stage_metrics`, `stage_demo`. CheckFree:
`checkfree` (the rules, pure), `recovery` (fetching donors' state, the rebuild), `replacement` (a
replacement node's start-up), `embed_copy` (stage 1's copy of stage 0); `stage_audit` (replaying a
replica's step for the coordinator's audits). Test and benchmark harness: `backdoor` (weight-edit
attacks; the role only offers the executor's `after_step` hook).
The model split is models/stages.py (models/ never imports pipeline/).
"""

from pipeline.cluster import Cluster, comm_matrix
from pipeline.paths import PathRules, enumerate_paths, stage_violation
from pipeline.schedule import Schedule, ScheduleViolation, validate_schedule
from pipeline.search import full_pipeline_schedule, plan, random_schedule, skippipe_schedule
from pipeline.simulator import SimResult, SimulationDeadlock, simulate

__all__ = [
    "Cluster", "PathRules", "Schedule", "ScheduleViolation", "SimResult", "SimulationDeadlock",
    "comm_matrix", "enumerate_paths", "full_pipeline_schedule", "plan", "random_schedule",
    "simulate", "skippipe_schedule", "stage_violation", "validate_schedule",
]
