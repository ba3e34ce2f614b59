"""What ``swarmnode demo --role grpo`` needs to know about the grpo role (entry point ``swarmnode.demos``).

Owns the grpo demo's defaults: three heterogeneous peers (the embedded decoder at three sizes,
one byte tokenizer), the per-node ``--set`` overrides, and which log event carries a peer's
final figures. Imported by the demo *parent* process: standard library only (no torch, nothing
else from ``rl``). The contract every demo module follows is in ``node/demo.py``.
"""

from __future__ import annotations

DEFAULT_STEPS = 30
"""GRPO rounds per peer when ``swarmnode demo`` gets no ``--steps``."""

DEFAULT_NODES = 3
"""Peers (besides the bootstrap) when ``swarmnode demo`` gets no ``--nodes``."""

SIZES = ((48, 1, 4), (64, 2, 4), (96, 3, 4))
"""(d_model, n_layers, n_heads) of peer i (cycled): heterogeneous models, one tokenizer."""


def node_settings(steps: int) -> list[str]:
    """``--set`` overrides every peer gets (the user's own ``--set`` come after and win)."""
    return ["grpo.torch_threads=1", f"grpo.exit_after_rounds={steps}", "grpo.round_s=3",
            "grpo.eval_every=10", "model.max_seq_len=64", "card.ttl_s=10", "card.refresh_s=2"]


def worker_settings(index: int) -> list[str]:
    """Per-peer overrides: peer ``index`` gets the ``SIZES[index % 3]`` model."""
    d, layers, heads = SIZES[index % len(SIZES)]
    return [f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}"]


FINISHED_EVENT = "training_finished"
"""The log event a peer writes once, with its exact final figures, when training ends."""

FINISHED_FIELDS = {
    "steps": "step", "rounds": "rounds", "accuracy_start": "accuracy_start", "accuracy_end": "accuracy_end",
    "reward_start": "reward_start", "reward_end": "reward_end",
}
"""Progress-row key -> field of the ``FINISHED_EVENT`` record that holds its final value."""

SUMMARY_KEYS = ("accuracy_start", "accuracy_end", "reward_start", "reward_end")
"""Row keys the demo summary reports as their mean over peers (``--json``)."""
