"""node/demo.py finds its training role through the ``swarmnode.demos`` entry points.

The demo parent stays torch-free, the role's demo module drives the per-node settings and the
final figures, and a role without a demo module gives a membership-only demo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from node import demo


def test_default_role_is_an_installed_role_with_a_demo_module():
    role = demo._default_role()
    mod = demo.demo_module(role)
    assert mod is not None, f"no swarmnode.demos module for {role!r}: pip install -e . (entry points)"
    assert mod.node_settings(60)[-1].endswith("=60") and mod.DEFAULT_STEPS > 0 and mod.DEFAULT_NODES > 0
    assert demo.demo_module("bootstrap") is None      # membership-only


def test_demo_parent_imports_no_torch():
    code = ("import sys, node.cli, node.demo; node.demo.demo_module(node.demo._default_role()); "
            "print(sorted(m for m in ('torch', 'hivemind', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_demo_source_names_no_role():
    src = Path(demo.__file__).read_text()
    for ep in demo.entry_points(group=demo.DEMO_GROUP):
        assert f'"{ep.name}' not in src and f"'{ep.name}" not in src, ep.name


class _Node:
    """A finished worker: exited, its log holds one end-of-training record."""

    name, extra = "w0", {}

    def __init__(self, record: dict):
        self.text = "not json: a stray stderr line\n" + json.dumps(record) + "\n"

    def readyz(self):
        return None

    def alive(self):
        return False

    def metrics(self):
        return {}

    def log_text(self):
        return self.text


def test_final_figures_come_from_the_demo_modules_event():
    mod = demo.demo_module(demo._default_role())
    record = {"event": mod.FINISHED_EVENT, **{field: float(i + 1) for i, field in enumerate(mod.FINISHED_FIELDS.values())}}
    row = demo.node_progress(_Node(record), mod)
    assert row["state"] == "finished"
    assert {key: row[key] for key in mod.FINISHED_FIELDS} == {k: record[f] for k, f in mod.FINISHED_FIELDS.items()}
    assert demo.node_progress(_Node(record))["state"] == "exited"   # no demo module: no training figures


class _Running(_Node):
    """A live worker whose /metrics carry a role's own series."""

    def __init__(self, metrics: dict):
        super().__init__({})
        self._metrics = metrics

    def alive(self):
        return True

    def metrics(self):
        return self._metrics


def test_a_demo_module_adds_its_own_progress_figures(capsys):
    mod = demo.demo_module("grpo")
    assert mod is not None and getattr(mod, "DEMO_ORDER", 100) > 0      # noloco stays the default demo
    metrics = {"swarmnode_train_steps_total": 7.0, "swarmnode_grpo_reward": 0.25,
               "swarmnode_grpo_heldout_accuracy": 0.4, 'swarmnode_grpo_peers_seen': 2.0}
    row = demo.node_progress(_Running(metrics), mod)
    assert row["rounds"] == 7 and row["reward_end"] == 0.25 and row["accuracy_end"] == 0.4
    assert row["accuracy_start"] is None                  # not exported yet: shown as "-"
    demo.print_progress([row], 1.0, mod.PROGRESS_COLUMNS, mod.COUNT_KEYS)
    assert "w0: step 7 reward 0.250 accuracy 0.400 peers 2\n" in capsys.readouterr().out   # a count: no decimals
    demo.print_progress([row], 1.0)                       # the role-neutral default columns
    assert "w0: step 7 loss - rounds 7" in capsys.readouterr().out
    summary = {"nodes": 3, "rounds": 7, "accuracy_start": 0.2, "accuracy_end": 0.4, "reward_start": 0.1,
               "reward_end": None}
    assert mod.summary_text(summary) == ("3 peers, 7 rounds each: held-out accuracy 0.200 -> 0.400, "
                                         "reward 0.100 -> - (mean over peers)")


def test_noloco_rows_show_blocked_fraction_and_a_blank_before_the_first_step(capsys):
    mod = demo.demo_module("noloco")
    fresh = demo.node_progress(_Running({"swarmnode_train_steps_total": 0.0, "swarmnode_train_loss": 0.0}), mod)
    demo.print_progress([fresh], 1.0, mod.PROGRESS_COLUMNS)
    out = capsys.readouterr().out
    assert "w0:starting" in out and "loss" not in out                 # not "loss 0.000"
    metrics = {"swarmnode_train_steps_total": 40.0, "swarmnode_train_loss": 2.5,
               'swarmnode_outer_rounds_total{outcome="ok"}': 1.0, 'swarmnode_outer_rounds_total{outcome="solo"}': 1.0,
               "swarmnode_outer_blocked_seconds_sum": 1.5, "swarmnode_outer_training_seconds": 12.0}
    row = demo.node_progress(_Running(metrics), mod)
    assert row["blocked_fraction"] == 0.125
    demo.print_progress([row], 1.0, mod.PROGRESS_COLUMNS)
    assert "w0: step 40 loss 2.500 rounds 2 blocked 0.125" in capsys.readouterr().out
    other = dict(row, blocked_s=0.5, train_s=28.0)
    summary = demo.summarize([row, other], 2, 30.0)
    assert demo._ratio([r["blocked_s"] for r in (row, other)], [r["train_s"] for r in (row, other)]) == 0.05
    assert summary["nodes"] == 2


def test_first_error_line_names_the_failure():
    log = "\n".join([json.dumps({"level": "info", "msg": "starting"}),
                     json.dumps({"level": "error", "msg": "bad [stage] config: n_stages=0", "exc": ""}),
                     json.dumps({"level": "error", "msg": "later"})])
    assert demo.first_error_line(log) == "bad [stage] config: n_stages=0"
    assert demo.first_error_line("boot\nTraceback (most recent call last):\n  x\nValueError: y\n").startswith("Traceback")
    assert demo.first_error_line("only a line\n") == "only a line"
    assert demo.first_error_line("") == "(empty log)"


def test_summary_skips_the_nan_losses_of_pipeline_stages_that_compute_none():
    """A pipeline's transformer stages export NaN losses: the summary averages the data nodes' losses."""
    from node.demo import summarize
    rows = [{"steps": 20, "loss_start": 5.3, "loss": 3.5, "eval_loss_start": None, "eval_loss": None,
             "rounds": None, "rounds_ok": None},
            {"steps": 20, "loss_start": float("nan"), "loss": float("nan"), "eval_loss_start": float("nan"),
             "eval_loss": float("nan"), "rounds": None, "rounds_ok": None}]
    s = summarize(rows, 2, 1.0)
    assert (s["loss_start"], s["loss_end"]) == (5.3, 3.5)
    assert s["eval_loss_end"] is None


def test_summary_leaves_out_the_figures_a_role_does_not_have():
    """grpo has no eval loss and no outer rounds: its --json has neither key (not 0, not null)."""
    rows = [{"steps": 8, "loss_start": 0.1, "loss": 0.05, "eval_loss_start": 0.0, "eval_loss": 0.0,
             "rounds": 8, "rounds_ok": None}]
    grpo = demo.demo_module("grpo")
    s = demo.summarize(rows, 1, 1.0, grpo.FIGURES)
    assert "rounds" in s
    assert not {"loss_start", "loss_end", "eval_loss_start", "eval_loss_end", "rounds_ok"} & set(s)
    full = demo.summarize(rows, 1, 1.0)                    # the default: every role-neutral figure
    assert set(demo.DEFAULT_FIGURES) <= set(full) and full["eval_loss_end"] == 0.0
    stage = demo.summarize(rows, 1, 1.0, demo.demo_module("stage").FIGURES)
    assert "eval_loss_end" in stage and "rounds" not in stage
