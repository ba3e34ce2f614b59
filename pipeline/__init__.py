"""pipeline: SkipPipe scheduling and simulation (pure), and later the `stage` role.

Pure, network-free modules (stdlib only; no grpc, hivemind, node or torch code):
- `pipeline.cluster`: `Cluster` cost model (w, c, memory), `comm_matrix` from latency/bandwidth.
- `pipeline.paths`: `PathRules` (R1-R4 limits, memory cap), `stage_violation`, `enumerate_paths`.
- `pipeline.allocation`: `allocate` (DP + 2*PP score; brute force N <= 8, else GCMA-lite; TSP
  stage order).
- `pipeline.schedule`: `Schedule` (canonical JSON + sha256, successor/predecessor maps),
  `validate_schedule` raising `ScheduleViolation(rule=...)`.
- `pipeline.search`: `plan`, `skippipe_schedule` (collision-aware search), `random_schedule`,
  `full_pipeline_schedule`.
- `pipeline.simulator`: `simulate` (makespan, idle, queueing, deferrals, per-node trace).
- `pipeline.geo`: a modelled 12-region cost model and `compare` (`python -m pipeline.geo`).

The model split the stage role runs is in models/stages.py (models/ never imports pipeline/).
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
