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
