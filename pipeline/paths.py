"""SkipPipe path rules R1-R4 over stage sequences, and legal path enumeration (docs/pipeline.md, 'Path rules').

Owns `PathRules` (S, L, swap and jump limits, whether the memory window caps visits per node),
`stage_violation` (the first rule a stage sequence breaks, or None) and `enumerate_paths`. A path
here is the sequence of stages a microbatch visits, starting with stage 0 at its originator; the
return to the originator (loss, then backward down the reversed path) is implicit. Mapping stages
to nodes, balance (R5) and the schedule itself live in pipeline/schedule.py. Pure Python.

Swap (R3): a hop to a stage below the furthest stage visited so far (the frontier); its distance
is frontier - stage. Jump (R4): a hop to a stage above the frontier; its size is stage - frontier.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from itertools import combinations, permutations

RULE_NAMES = {
    "R1": "start and end at the same stage-0 originator; stage 0 never skipped",
    "R2": "exactly L distinct stages per path, no repeats",
    "R3": "swaps adjacent only, at most max_swaps per path, total swap distance bounded",
    "R4": "a hop goes at most max_jump stages past the frontier",
    "R5": "equal visits on every stage s >= 1 and at most `memory` paths per node (a path "
          "carries mb_per_path microbatches back to back)",
    "P5": "each hop is a node of the stage it claims; one successor per hop",
    "STRUCT": "schedule structure (partitions, microbatch table, rules)",
}


@dataclass(frozen=True)
class PathRules:
    """Limits a SkipPipe path must respect. S and L both count stage 0 (official convention)."""

    S: int = 6
    """Stages including stage 0."""
    L: int = 4
    """Stages per path including stage 0; skip ratio k = 1 - L/S. L = S means no skipping."""
    max_jump: int = 4
    """R4: most stages a hop may go past the frontier (1 = no skipping at all)."""
    max_swap_distance: int = 1
    """R3: a swap may go at most this far below the frontier (1 = adjacent only)."""
    max_swaps: int = 2
    """R3: most swaps per path."""
    max_total_swap_distance: int = 2
    """R3: most total swap distance per path."""
    cap_visits_by_memory: bool = True
    """R5: a node (stage >= 1) lies on at most `memory[node]` paths per iteration, so it never
    holds more than `memory` microbatches at once and a scheduled iteration never has to defer
    there. The paper's scheduler caps paths the same way, each path carrying `mb_per_path`
    microbatches back to back. Turn off for baselines such as the full pipeline, which then
    rely on deferral (TC1)."""
    mb_per_path: int = 1
    """Microbatches one path carries back to back: a path's next microbatch leaves its
    originator only once the previous one's backward is home, so the path holds one memory slot
    per node it visits and a node takes up to `memory x mb_per_path` microbatch visits. 1 is
    ours (every microbatch its own path: the cap counts microbatches); 2 is the paper's
    scheduler (gensyn-ai/skippipe create_schedule.py: 6 microbatches per data node on 3 paths,
    memory 3). Microbatch seq j of an originator with q = microbatches / mb_per_path paths
    rides its path j % q, after its seq j - q (pipeline/schedule.py)."""

    def __post_init__(self) -> None:
        if self.S < 2:
            raise ValueError(f"S={self.S}: need stage 0 and at least one transformer stage")
        if not 2 <= self.L <= self.S:
            raise ValueError(f"L={self.L} must be in [2, S={self.S}] (stage 0 plus >= 1 stage)")
        for name in ("max_jump", "max_swap_distance", "max_total_swap_distance"):
            if getattr(self, name) < (1 if name == "max_jump" else 0):
                raise ValueError(f"{name}={getattr(self, name)} is out of range")
        if self.max_swaps < 0:
            raise ValueError(f"max_swaps={self.max_swaps} must be >= 0")
        if self.mb_per_path < 1:
            raise ValueError(f"mb_per_path={self.mb_per_path} must be >= 1 (1: one microbatch "
                             "per path, ours; 2: the paper's scheduler)")

    @classmethod
    def from_skip_ratio(cls, S: int, skip_ratio: float, **kw) -> "PathRules":
        """L = round(S * (1 - skip_ratio)): S = 6, k = 1/3 -> L = 4; S = 4, k = 1/3 -> L = 3."""
        return cls(S=S, L=max(2, min(S, round(S * (1 - skip_ratio)))), **kw)

    @property
    def skip_ratio(self) -> float:
        return 1 - self.L / self.S

    def as_dict(self) -> dict:
        return asdict(self)


def stage_violation(stages: tuple[int, ...] | list[int], rules: PathRules) -> tuple[str, str] | None:
    """(rule id, detail) for the first rule R1-R4 that `stages` breaks, or None if legal."""
    stages = tuple(stages)
    if not stages or stages[0] != 0:
        return "R1", f"path {list(stages)} does not start at stage 0"
    if 0 in stages[1:]:
        return "R1", f"path {list(stages)} revisits stage 0 before the end"
    if any(not 0 <= s < rules.S for s in stages):
        return "R2", f"path {list(stages)} names a stage outside [0, {rules.S})"
    if len(set(stages)) != len(stages):
        return "R2", f"path {list(stages)} repeats a stage"
    if len(stages) != rules.L:
        return "R2", f"path {list(stages)} visits {len(stages)} stages, L={rules.L}"
    frontier, swaps, swap_total = 0, 0, 0
    for s in stages[1:]:
        if s > frontier:
            if s - frontier > rules.max_jump:
                return "R4", (f"path {list(stages)} jumps {s - frontier} stages past the "
                              f"frontier {frontier} > max_jump={rules.max_jump}")
            frontier = s
        else:
            dist = frontier - s
            swaps += 1
            swap_total += dist
            if dist > rules.max_swap_distance:
                return "R3", (f"path {list(stages)} swaps stage {s} {dist} below the frontier "
                              f"{frontier} > max_swap_distance={rules.max_swap_distance}")
            if swaps > rules.max_swaps:
                return "R3", f"path {list(stages)} has {swaps} swaps > max_swaps={rules.max_swaps}"
            if swap_total > rules.max_total_swap_distance:
                return "R3", (f"path {list(stages)} has total swap distance {swap_total} > "
                              f"max_total_swap_distance={rules.max_total_swap_distance}")
    return None


def swap_count(stages: tuple[int, ...]) -> int:
    frontier, swaps = 0, 0
    for s in stages[1:]:
        if s > frontier:
            frontier = s
        else:
            swaps += 1
    return swaps


@lru_cache(maxsize=64)
def _enumerate(rules: PathRules) -> tuple[tuple[int, ...], ...]:
    out = []
    for subset in combinations(range(1, rules.S), rules.L - 1):
        for order in permutations(subset):
            path = (0, *order)
            if stage_violation(path, rules) is None:
                out.append(path)
    return tuple(sorted(out, key=lambda p: (swap_count(p), p)))


def enumerate_paths(rules: PathRules) -> list[tuple[int, ...]]:
    """Every legal stage sequence under R1-R4, in-order ones first (fine for S <= 8)."""
    if rules.S > 10:
        raise ValueError(f"S={rules.S}: path enumeration is meant for S <= 10")
    return list(_enumerate(rules))


def orderings(stage_set: tuple[int, ...] | frozenset[int], rules: PathRules) -> list[tuple[int, ...]]:
    """Legal paths that visit exactly `stage_set` (stage 0 implied), in-order first."""
    want = frozenset(stage_set) | {0}
    return [p for p in _enumerate(rules) if frozenset(p) == want]
