"""`ScheduleConfig`: the knobs of the SkipPipe scheduler (pipeline.md §2.1-2.3).

Owns the pydantic schema and its validation, and turns it into `PathRules` for
pipeline/search.py. The coordinator (bootstrap role hook) and `benchmarks/skippipe.py` read it;
`StageConfig` and `CheckFreeConfig` join this module with the stage role. Imports no torch,
grpc, hivemind or node code.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.paths import PathRules


class ScheduleConfig(BaseModel):
    """How SkipPipe paths are planned for one run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    stages: int = Field(6, ge=2, le=10)
    """S: pipeline stages including stage 0 (the data/embedding/head nodes). Must match the
    model split (models/stages.py) every stage node runs."""

    skip_ratio: float = Field(1 / 3, ge=0.0, lt=1.0)
    """k: fraction of stages a microbatch skips; L = round(S * (1 - k)) stages per path,
    stage 0 included (S = 6, k = 1/3 -> L = 4). 0 = the full in-order pipeline. Raise it for
    shorter iterations; the validation loss per iteration degrades slowly (paper: 7% ppl at
    half the model)."""

    mb_per_origin: int = Field(3, ge=1)
    """Microbatches each stage-0 node starts per iteration. With the memory cap on, stage
    nodes x memory must cover the visits: lower it if planning fails with R5."""

    memory: int = Field(3, ge=1)
    """Microbatches a node keeps in flight (activations held for backward). Raise it on
    nodes with spare accelerator memory; planning uses each node card's value when given."""

    max_jump: int = Field(4, ge=1)
    """R4: most stages a hop may go past the furthest stage visited so far."""

    max_swaps: int = Field(2, ge=0)
    """R3: adjacent swaps allowed per path. 0 keeps every path in stage order."""

    max_total_swap_distance: int = Field(2, ge=0)
    """R3: total swap distance per path."""

    cap_visits_by_memory: bool = True
    """R5: route at most `memory` microbatches through a stage node per iteration, so no
    forward is ever deferred there (official scheduler). Turn off only with mb_per_origin
    larger than the stage nodes' memory allows, accepting deferrals."""

    time_budget_s: float = Field(30.0, gt=0)
    """Wall-clock budget of one planning run; the best schedule found so far is used. If the
    coordinator log shows the search stopping on budget with a makespan still falling, raise
    it (planning runs only when stage membership changes)."""

    seed: int = 0
    """Seed of allocation and path search (same inputs + seed -> same schedule, unless the
    time budget cut the search)."""

    def rules(self) -> PathRules:
        return PathRules.from_skip_ratio(self.stages, self.skip_ratio, max_jump=self.max_jump,
                                         max_swaps=self.max_swaps,
                                         max_total_swap_distance=self.max_total_swap_distance,
                                         cap_visits_by_memory=self.cap_visits_by_memory)

    @model_validator(mode="after")
    def _rules_valid(self) -> "ScheduleConfig":
        try:
            self.rules()
        except ValueError as exc:
            raise ValueError(f"schedule settings do not form valid path rules: {exc}; "
                             "change stages or skip_ratio") from exc
        return self
