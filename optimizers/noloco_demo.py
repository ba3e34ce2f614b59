"""What ``swarmnode demo`` needs to know about the noloco role (entry point ``swarmnode.demos``).

Owns the noloco demo's defaults: the per-node ``--set`` overrides and which log event carries a
worker's exact end-of-training figures. Imported by the demo *parent* process, which must start
fast: standard library only (no torch, no hivemind, nothing else from ``optimizers``). The
contract every demo module follows is in ``node/demo.py``.
"""

from __future__ import annotations

DEMO_ORDER = 0
"""``swarmnode demo`` without ``--role`` runs the installed demo with the lowest order: NoLoCo
is the README's main job."""

DEFAULT_STEPS = 200
"""Inner steps per worker when ``swarmnode demo`` gets no ``--steps``."""

DEFAULT_NODES = 4
"""Workers (besides the bootstrap) when ``swarmnode demo`` gets no ``--nodes``."""


def node_settings(steps: int) -> list[str]:
    """``--set`` overrides every worker gets (the user's own ``--set`` come after and win)."""
    # one torch thread per worker: several workers share this machine's cores
    return ["noloco.torch_threads=1", f"noloco.exit_after={steps}"]


FINISHED_EVENT = "training_finished"
"""The log event a worker writes once, with its exact final figures, when training ends."""

FINISHED_FIELDS = {
    "steps": "step", "rounds": "outer_steps", "rounds_ok": "rounds_ok",
    "loss_start": "train_loss_start", "loss": "train_loss_end",
    "eval_loss_start": "eval_loss_start", "eval_loss": "eval_loss_end",
    "blocked_s": "blocked_s", "train_s": "train_s",
}
"""Progress-row key -> field of the ``FINISHED_EVENT`` record that holds its final value."""

PROGRESS_METRICS = {"blocked_s": "swarmnode_outer_blocked_seconds_sum", "train_s": "swarmnode_outer_training_seconds"}
"""Seconds blocked in outer exchanges and seconds training so far, per worker."""

RATIOS = {"blocked_fraction": ("blocked_s", "train_s")}
"""``blocked_fraction``: seconds blocked / seconds training (per worker in the progress lines;
over all workers in the ``--json`` summary)."""

PROGRESS_COLUMNS = {"loss": "loss", "rounds": "rounds", "blocked": "blocked_fraction"}
