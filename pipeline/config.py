"""`ScheduleConfig` and `StageConfig`: the knobs of the SkipPipe scheduler and of one stage node (docs/pipeline.md, 'Configuration').

Owns the pydantic schema and its validation, and turns it into `PathRules` for
pipeline/search.py. The coordinator (bootstrap role hook) and `benchmarks/skippipe.py` read it;
`StageConfig` is the `[stage]` section of pipeline/stage_role.py (its optimizer table is
models/optim.py's `InnerConfig`; its run knobs, `exit_after`, `eval_every`, `checkpoint_every`
and `torch_threads`, come from node/run_settings.py's `RunSettings`, as in every training role).
Imports no grpc or hivemind code; of node/, only the run-settings model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.optim import InnerConfig
from node.run_settings import RunSettings
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
    nodes x memory x mb_per_path must cover the visits: lower it (or raise mb_per_path) if
    planning fails with R5. 3 is OURS (with mb_per_path = 1); the PAPER runs 6 (with 2). Ours
    kept as default: the simulated time per microbatch is the same within 3%, an iteration (a
    demo, a test) takes half as long, and CheckFree+ needs mb_per_path = 1 (docs/pipeline.md,
    'Defaults that differ from the paper'). Raise it for bigger steps per iteration."""

    mb_per_path: int = Field(1, ge=1)
    """Microbatches one scheduled path carries back to back (the next leaves its data node once
    the previous one's backward is home); the memory cap counts paths. 1 = OURS (default): every
    microbatch is its own path, so a node takes at most `memory` microbatches per iteration and
    each one can take another route. 2 = the paper's scheduler (with mb_per_origin = 6 and
    memory = 3: 6 microbatch visits per stage node, 3 at once), the PAPER's. Raise it to run more
    microbatches per iteration on the same replicas without deferrals; keep 1 with
    `checkfree_plus`, which refuses more. mb_per_origin must be a multiple of it."""

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
    """R5: route at most `memory` paths (`memory x mb_per_path` microbatches) through a stage
    node per iteration, so no forward is ever deferred there (the paper's scheduler caps paths
    the same way). Turn off only with mb_per_origin larger than the stage nodes' memory allows,
    accepting deferrals."""

    time_budget_s: float = Field(30.0, gt=0)
    """Wall-clock budget of one planning run; the best schedule found so far is used. If the
    coordinator log shows the search stopping on budget with a makespan still falling, raise
    it (planning runs only when stage membership changes)."""

    seed: int = 0
    """Seed of allocation and path search (same inputs + seed -> same schedule, unless the
    time budget cut the search)."""

    method: Literal["skippipe", "random", "full"] = "skippipe"
    """Which schedule the coordinator builds: "skippipe" (collision-aware search), "random"
    (random legal balanced paths) or "full" (every stage in order, no skipping). Change it only
    to run a baseline."""

    expect_nodes: int = Field(0, ge=0)
    """The coordinator plans only once this many stage nodes (stage 0 included) publish cards
    (0 = as soon as every stage has a node). Set it to the swarm's size so the first schedule
    already uses every replica instead of re-planning as each one arrives. Only the first plan
    waits for it: after a lost stage the coordinator re-plans over whoever is live. Read by the
    coordinator (the bootstrap), not by the stage nodes: set it there. A node that misses the
    first plan and is still at its initial weights once the pipeline is past iteration 2 is not
    planned at all (`stage_node_late`)."""

    loss_trend_window: int = Field(5, ge=0)
    """The coordinator watches the data nodes' training loss (pipeline/loss_trend.py): when the
    mean over this many iterations rises 2% above its lowest, every unreplicated stage is audited
    at once (a stage that tampers with its outputs or gradients shows there first). Raise it when
    a noisy loss brings audits forward often; 0 = off (only the random audits run)."""

    solo_audit_every_s: float = Field(30.0, ge=0)
    """Mean seconds between integrity audits of a transformer stage with a single node in the plan
    (no replica to compare weight commits with): the coordinator replays one of its steps, picked at
    random (keyed, unpredictable to the node), from its served states, and quarantines it when the
    step does not replay; a hot spare then rebuilds the stage from its neighbours (CheckFree). Each
    audit downloads the stage's weights twice and its AdamW state once: raise it for large stages
    or slow links; 0 = never (an edit outside the gradient path on an unreplicated stage goes
    unnoticed)."""

    probe_timeout_s: float = Field(10.0, gt=0)
    """Seconds a stage node has to answer the coordinator's stage probe (one forward of a probe
    microbatch over its tensor stream) before it enters a plan, and again after a stall. Raise it
    when honest nodes show up in `stage_probe_failed` lines with "no answer" (a busy or slow
    accelerator); a node that fails is retried with backoff and left out of plans meanwhile."""

    stall_s: float = Field(120.0, ge=0)
    """Seconds without a step by any node of the published schedule (their cards' `iteration`)
    after which the coordinator treats the pipeline as stalled: it probes every planned node again
    and drops, for good, those that fail, then re-plans. Keep it above the slowest honest iteration
    (validation included) and below `stage.iteration_timeout_s`, so the coordinator acts before the
    nodes give up; 0 turns the watch off."""

    settle_s: float = Field(2.0, ge=0)
    """Stage membership must stay unchanged this long before the coordinator re-plans. Raise
    it when nodes join in bursts; each re-plan bumps the epoch."""

    checkfree_plus: bool = False
    """CheckFree+ (docs/pipeline.md, 'CheckFree+'): every odd microbatch of each data node visits transformer
    stages 1 and 2 swapped, and the last two swapped, so each edge stage's partner learns to
    stand in for it and a lost edge stage is rebuilt by copying the partner. Needs stages >= 5;
    the published schedule's rules allow the two swaps (pipeline/schedule.py
    `checkfree_plus_paths`). Set `stage.checkfree.plus` on the stage nodes too."""

    compute_s: float = Field(0.05, gt=0)
    """Forward seconds per stage assumed for a node whose card gives no `compute_s`. Only the
    ratios matter to the search."""

    default_latency_ms: float = Field(1.0, ge=0)
    """Link latency assumed between two stage nodes that `[netem]` (matrix, links, default)
    does not describe."""

    def rules(self) -> PathRules:
        return PathRules.from_skip_ratio(self.stages, self.skip_ratio, max_jump=self.max_jump,
                                         max_swaps=self.max_swaps,
                                         max_total_swap_distance=self.max_total_swap_distance,
                                         cap_visits_by_memory=self.cap_visits_by_memory,
                                         mb_per_path=self.mb_per_path)

    @model_validator(mode="after")
    def _rules_valid(self) -> "ScheduleConfig":
        if self.checkfree_plus and self.stages < 5:
            raise ValueError(f"schedule.checkfree_plus needs stages >= 5 (4 transformer stages), got {self.stages}")
        if self.mb_per_origin % self.mb_per_path:
            raise ValueError(f"schedule.mb_per_origin={self.mb_per_origin} is not a multiple of "
                             f"schedule.mb_per_path={self.mb_per_path}; change either")
        if self.checkfree_plus and self.mb_per_path != 1:
            raise ValueError("schedule.checkfree_plus swaps every odd microbatch, which splits "
                             "paths carrying several; set schedule.mb_per_path = 1")
        try:
            self.rules()
        except ValueError as exc:
            raise ValueError(f"schedule settings do not form valid path rules: {exc}; "
                             "change stages or skip_ratio") from exc
        return self


class CheckFreeConfig(BaseModel):
    """``[stage.checkfree]``: how a lost stage is rebuilt (docs/pipeline.md, 'CheckFree recovery'; pipeline/recovery.py)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    recover: bool = False
    """Start as a replacement: this node holds no weights, asks the coordinator which stage
    lost its nodes (`Schedule.Status` vacancy; `stage.index` is then ignored) and rebuilds it
    (a live same-stage replica is copied, else the neighbours are averaged by their gradient
    norms, else the CheckFree+ partner copied), then joins the schedule."""

    standby: bool = False
    """With `recover`: a hot spare. Wait (without a stage, unplanned) until the coordinator reports
    a stage with no live node and rebuild that one, or (see `standby_refill_s`) one that stays a
    replica short; never join a live stage only to add a replica."""

    standby_refill_s: float = Field(5.0, ge=0)
    """A hot spare also refills a stage that has stayed below the replicas it had in the plan (a
    replica lost or quarantined) for this many seconds, by copying a live replica. Long enough for
    the second replica of a stage losing both to be detected too (detection takes ~2-3 s), so the
    spare rebuilds the lost stage instead of copying a dying replica. 0 = only lost stages (keep
    every spare for the worse failure)."""

    lr_scale: float = Field(1.1, gt=0)
    """A rebuilt stage restarts with a fresh AdamW at lr_scale x the configured LR (official: 1.1
    for 124M/1.5B, 1.2 for 500M); always from the configured LR, so it never compounds."""

    norm_power: float = Field(1.0, gt=0)
    """p in w = |grad norm|^p + 1e-4 (the official code: 1)."""

    norm: Literal["pre", "post"] = "pre"
    """Which neighbour gradient norm weighs the average: before clipping (default) or after
    (official HEAD; with both clipped at 1 the rule degrades to a midpoint)."""

    plus: bool = False
    """CheckFree+: an edge stage (1 or T) is rebuilt by copying its swap partner (2 or T-1).
    Set the same on every node and give the schedule `checkfree_plus` so the partners see each
    other's inputs."""

    allow_edge_copy: bool = False
    """Without CheckFree+, rebuild a lost edge stage by copying its neighbour (a larger loss
    jump, logged as a WARN) instead of refusing."""

    embed_copy_every: int = Field(10, ge=0)
    """Stage-1 nodes keep a copy of stage 0's weights (embedding, final norm, head), fetched from a
    data node whenever the copy is this many iterations old, so a swarm that loses every data node
    rebuilds stage 0 from it with a fresh optimizer (the copy is at most this old, plus one fetch). 0 = no
    copy (a lost stage 0 then needs `checkpoint_dir`). Each refresh downloads stage 0's weights
    once: raise it when they are large and data nodes rarely fail."""

    wait_s: float = Field(20.0, gt=0)
    """How long a replacement waits for both neighbours to report the same completed iteration
    (and for a vacancy) before it gives up with an error."""


class StageConfig(RunSettings):
    """``[stage]``: how one `stage` node runs (pipeline/stage_role.py). Its unit of progress is a
    pipeline iteration (one optimizer step of every stage)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    legacy_keys = {"iterations": "exit_after"}

    index: int = Field(0, ge=0)
    """The pipeline stage this node serves: 0 = a data node (data, embedding, head and loss),
    1..S-1 = a range of transformer blocks. Every node of one stage starts from the same weights
    (`seed`); give each stage at least one node."""

    exit_after: int = Field(0, ge=0)
    """Stop after this many iterations (0 = train until stopped; `iterations` is its older name).
    The first data node runs a final in-order validation and then tells every node to drain; the
    demo uses it."""

    optim: InnerConfig = Field(default_factory=InnerConfig)
    """AdamW of this stage (models/optim.py: lr, betas, weight decay, warm-up + cosine LR, and
    `clip_norm`, applied per stage to the visit-averaged gradient). Give every stage the same;
    the SkipPipe paper used lr 3e-4 and clip 1.0. One optimizer step per pipeline iteration, so
    `warmup` and `total_steps` count iterations: set `total_steps` to the run's length."""

    seed: int = 0
    """Initial-weight seed; the same on every node of the run so replicas start identical."""

    stage0_layers: int | None = Field(None, ge=0)
    """Transformer blocks stage 0 (the data nodes) keeps after its embedding. None (default) = a
    stage's worth, model.n_layers // schedule.stages, the split of the SkipPipe code (stage 0 holds
    the embedding and as many first blocks as every other stage). Stage 0 is on every path, so its
    blocks are never skipped, swapped or dropped: the first blocks, which the CheckFree paper calls
    critical, always run, in order. 0 = stage 0 holds no block (our earlier default): the first
    blocks then sit on stage 1, which paths skip and CheckFree+ swaps. A model with fewer blocks
    than stages leaves stage 0 with none; give it more blocks. Every node of a run needs the same
    value (it is part of the cfg hash)."""

    eval_every: int = Field(5, ge=0)
    """The first data node validates the full in-order model every this many iterations
    (and at the start and the end); 0 = only at the start and the end."""

    eval_batches: int = Field(2, ge=1)
    """Validation batches per evaluation (fixed windows of the validation stream)."""

    compute_delay_s: float = Field(0.0, ge=0)
    """Extra seconds slept per forward (1.5x per backward, 0.25x per loss), to emulate a slower
    accelerator in benchmarks. Also published as this node's `compute_s` for the scheduler."""

    checkpoint_every: int = Field(0, ge=0)
    """Write this node's weights and optimizer state to `state_dir` every this many iterations
    (node/checkpoint.py, the last 2 kept) and when it drains; 0 = only when `exit_after` ends the
    run. The final files are what `benchmarks/skippipe.py` reads the trained stages from."""

    checkpoint_dir: str = ""
    """A directory every stage node can read (a shared volume): with it, checkpoints go to
    `<checkpoint_dir>/stage-<index>/<peer ID>/` instead of `state_dir`, and a replacement
    rebuilding a stage whose neighbour is lost too restores that stage's newest checkpoint there
    (CheckFree's fallback: docs/pipeline.md, 'Which rule applies'). Set `checkpoint_every` with it."""

    max_activation_mb: float = Field(64.0, gt=0)
    """Largest tensor (activation, gradient or a replica's flat gradient) accepted on the
    pipeline stream, in MiB. Raise it for bigger models."""

    checkfree: CheckFreeConfig = Field(default_factory=CheckFreeConfig)
    """Recovery of lost stages (CheckFree / CheckFree+)."""

    attack_weight_edit: float = Field(0.0, ge=0)
    """ATTACK HARNESS, tests and benchmarks only (docs/pipeline.md, 'Stage-integrity checks'): after every optimizer step
    this node adds a fixed-direction edit of `attack_weight_edit * lr` per element to its own
    weights, outside the gradient path (a blunt stand-in for pipeline/backdoor.py's task vector).
    Refused unless every address this node binds/announces is loopback (127.0.0.1). 0 = honest."""

    evidence_iterations: int = Field(8, ge=0)
    """Iterations of sent and received activations and gradients this node keeps for the
    coordinator's audits of its unreplicated neighbours (pipeline/stage_evidence.py: the inputs
    an audit recomputes a stage's forward and gradients from). Costs that many iterations of
    microbatch tensors in host memory; 0 = keep none (the neighbours' audits then check only
    that their steps replay, not their outputs and gradients)."""

    attack_nonfinite: bool = False
    """ATTACK HARNESS, tests only (docs/pipeline.md, 'What is caught live'): every activation this
    node sends on (its forward output) is NaN. Loopback only, like `attack_weight_edit`."""

    attack_activation_noise: float = Field(0.0, ge=0)
    """ATTACK HARNESS, tests only: Gaussian noise of this many times the tensor's RMS is added to
    every activation this node sends on (its forward output; its own weights and state stay honest).
    Loopback only. 0 = honest."""

    attack_grad_flip: Literal["off", "params", "upstream", "both"] = "off"
    """ATTACK HARNESS, tests only: "params" negates this node's own parameter gradients before its
    optimizer step (it trains uphill; its optimizer state stays consistent with what it stepped on),
    "upstream" negates the gradient it sends back to its predecessor, "both" does both. Loopback
    only. "off" = honest."""

    iteration_timeout_s: float = Field(300.0, gt=0)
    """An iteration that makes no progress for this long is logged as stuck (`pipeline_stuck`, with
    what it still waits for); the node waits one more timeout for a new plan, then exits 1; check
    the peers named in the log."""

    coordinator_outage_s: float = Field(900.0, ge=0)
    """A stuck node whose coordinator does not answer waits this long for it (or a standby) to come
    back and re-plan, instead of exiting (`pipeline_stuck` with `action` `wait_for_coordinator`);
    then it exits 1. Raise it when a bootstrap restart can take longer; 0 = exit at once."""
