"""What ``swarmnode demo --role stage`` needs to know about the stage role (entry point ``swarmnode.demos``).

Owns the pipeline demo's defaults: 3 data nodes (stage 0) and 3 transformer stages x 2 replicas
on 127.0.0.1, a tiny byte-level model cut into 4 stages, skip ratio 1/3 (each microbatch visits
2 of the 3 transformer stages), which stage each worker serves, and which log event carries a
node's exact final figures. Imported by the demo *parent* process: standard library only. The
contract every demo module follows is in ``node/demo.py``.
"""

from __future__ import annotations

DEFAULT_STEPS = 20
"""Pipeline iterations when ``swarmnode demo --role stage`` gets no ``--steps``."""

DEFAULT_NODES = 9
"""Stage nodes besides the bootstrap: 3 data nodes + 3 stages x 2 replicas."""

STAGES = 4
"""Stage 0 (data, embedding, the first block, head) + 3 transformer stages of one block each: 4
blocks, stage 0 holding a stage's worth (`stage.stage0_layers` unset), so no path skips block 0."""

LAYOUT = (0, 1, 2, 3, 0, 1, 2, 3, 0)
"""Stage index of worker i (i >= 9 repeats it): any 4 or more workers cover every stage."""

MB_PER_ORIGIN, PATH_STAGES = 3, 2
"""Microbatches per data node per iteration; transformer stages each one visits (of 3)."""


def node_settings(steps: int) -> list[str]:
    """``--set`` overrides every node gets, the bootstrap (coordinator) included."""
    return [f"schedule.stages={STAGES}", "schedule.skip_ratio=0.3333333333333333",
            f"schedule.mb_per_origin={MB_PER_ORIGIN}", "schedule.settle_s=1.0", "schedule.time_budget_s=3.0",
            "model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.max_seq_len=32", "data.seq_len=32",
            "data.batch_size=4", "data.max_train_bytes=400000", "data.max_val_bytes=40000", "stage.torch_threads=1",
            "stage.eval_every=5", "stage.optim.lr=0.003", "stage.optim.warmup=0", f"stage.exit_after={steps}"]


def swarm_settings(nodes: int) -> list[str]:
    """The coordinator waits for all `nodes` workers before planning, and each node's memory
    window takes the visits its stage's share asks for (R5 caps visits per node by it)."""
    if nodes < STAGES:
        raise ValueError(f"the pipeline demo needs at least {STAGES} workers (one per stage), got {nodes}")
    stages = [LAYOUT[i % len(LAYOUT)] for i in range(nodes)]
    origins = stages.count(0)
    visits = origins * MB_PER_ORIGIN * PATH_STAGES // (STAGES - 1)       # per transformer stage
    replicas = min(stages.count(s) for s in range(1, STAGES))
    return [f"schedule.expect_nodes={nodes}", f"schedule.memory={max(3, -(-visits // replicas))}"]


def worker_settings(i: int) -> list[str]:
    """The stage worker i serves."""
    return [f"stage.index={LAYOUT[i % len(LAYOUT)]}"]


FINISHED_EVENT = "training_finished"
"""The log event a node writes once, with its exact final figures, when the run ends."""

FINISHED_FIELDS = {
    "steps": "iterations", "iterations": "iterations",
    "loss_start": "train_loss_start", "loss": "train_loss_end",
    "eval_loss_start": "eval_loss_start", "eval_loss": "eval_loss_end",
}
"""Progress-row key -> field of the ``FINISHED_EVENT`` record that holds its final value."""

SUMMARY_KEYS = ("iterations",)
"""Row keys whose mean over nodes ``--json`` adds to the summary."""

FIGURES = ("loss_start", "loss_end", "eval_loss_start", "eval_loss_end")
"""The role-neutral summary keys a pipeline has: train and eval loss (data nodes); no outer rounds."""
