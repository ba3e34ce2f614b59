"""What ``swarmnode demo --role grpo`` needs to know about the grpo role (entry point ``swarmnode.demos``).

Owns the grpo demo's defaults: three heterogeneous peers (the embedded decoder at three sizes,
one byte tokenizer), the per-node ``--set`` overrides, the progress figures (reward and held-out
accuracy per peer) and which log event carries a peer's final figures. Imported by the demo
*parent* process: standard library only (no torch, nothing else from ``rl``). The contract every
demo module follows is in ``node/demo.py``.

    swarmnode demo --role grpo                 # bootstrap + 3 peers, 60 rounds
    swarmnode demo --role grpo --steps 30 --json
"""

from __future__ import annotations

DEFAULT_STEPS = 60
"""GRPO rounds per peer when ``swarmnode demo`` gets no ``--steps``."""

DEFAULT_NODES = 3
"""Peers (besides the bootstrap) when ``swarmnode demo`` gets no ``--nodes``."""

STEP_NAME = "rounds"
"""What one ``--steps`` unit is: a GRPO round (generate, exchange, one F-TIS update)."""

SIZES = ((32, 2, 4), (48, 2, 4), (64, 3, 4))
"""(d_model, n_layers, n_heads) of peer i (cycled): heterogeneous models, one tokenizer."""


def node_settings(steps: int) -> list[str]:
    """``--set`` overrides every peer gets (the user's own ``--set`` come after and win)."""
    # sums of two operands 0-5 (36 problems): learnable by RL within tens of rounds on a CPU
    return ["grpo.torch_threads=1", "grpo.round_s=2", "grpo.eval_every=10", "grpo.max_operand=5",
            "model.max_seq_len=64", "card.ttl_s=10", "card.refresh_s=2", f"grpo.exit_after={steps}"]


def worker_settings(index: int) -> list[str]:
    """Per-peer overrides: peer ``index`` gets the ``SIZES[index % 3]`` model and its own seed."""
    d, layers, heads = SIZES[index % len(SIZES)]
    return [f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}",
            f"grpo.model_seed={index}"]


PROGRESS_METRICS = {
    "rounds": "swarmnode_train_steps_total", "reward_end": "swarmnode_grpo_reward",
    "reward_start": "swarmnode_grpo_reward_initial", "accuracy_end": "swarmnode_grpo_heldout_accuracy",
    "accuracy_start": "swarmnode_grpo_heldout_accuracy_initial", "peers": "swarmnode_grpo_peers_seen",
}
"""Progress-row key -> the metric it is read from (the grpo role's series, rl/grpo_metrics.py)."""

PROGRESS_COLUMNS = {"reward": "reward_end", "accuracy": "accuracy_end", "peers": "peers"}
"""Label -> row key of what each progress line shows per peer after its round count."""

COUNT_KEYS = ("peers",)
"""Row keys that are counts: the progress lines print them as integers (``peers 2``)."""

FIGURES = ("rounds",)
"""The role-neutral summary keys a grpo peer has: its rounds. It has no held-out loss (held-out
accuracy and reward instead: ``SUMMARY_KEYS``), no outer rounds, and its GRPO surrogate loss does
not measure progress (advantages are centred per group, so it sits near 0 whatever the policy
learned): those keys stay out of ``--json`` instead of reading as 0."""

FINISHED_EVENT = "training_finished"
"""The log event a peer writes once, with its exact final figures, when training ends."""

FINISHED_FIELDS = {
    "steps": "step", "rounds": "rounds", "accuracy_start": "accuracy_start", "accuracy_end": "accuracy_end",
    "reward_start": "reward_start", "reward_end": "reward_end",
}
"""Progress-row key -> field of the ``FINISHED_EVENT`` record that holds its final value."""

SUMMARY_KEYS = ("accuracy_start", "accuracy_end", "reward_start", "reward_end")
"""Row keys the demo summary reports as their mean over peers (``--json``)."""


def summary_text(summary: dict) -> str:
    """The demo's closing line: held-out accuracy and reward, start -> end, mean over peers."""
    def f(key: str) -> str:
        v = summary.get(key)
        return "-" if v is None else f"{v:.3f}"
    return (f"{summary['nodes']} peers, {summary['rounds']} rounds each: held-out accuracy "
            f"{f('accuracy_start')} -> {f('accuracy_end')}, reward {f('reward_start')} -> "
            f"{f('reward_end')} (mean over peers)")
