"""The layer contracts in pyproject.toml ([tool.importlinter]) are live: `lint-imports` passes on
this tree, and a copy of the tree with one forbidden import per contract turns it red (issue 6)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "protocol", "security", "models", "optimizers", "pipeline", "rl")
LINT = Path(sys.executable).with_name("lint-imports")


def _copy_tree(dst: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the copy, not the editable install, is analysed
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_ci_runs_lint_imports_before_the_tests():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "lint-imports" in script and script.index("lint-imports") < script.index("pytest")
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("module,line,contract", [
    ("node/averaging.py", "import optimizers.noloco", "Infrastructure (node, protocol, security, models)"),
    ("protocol/varint.py", "import rl.grpo", "Infrastructure (node, protocol, security, models)"),
    ("optimizers/diloco.py", "import pipeline.schedule", "Method packages (optimizers, pipeline, rl)"),
    ("rl/grpo.py", "import grpc", "Method modules are pure"),
    ("pipeline/schedule.py", "import node.metrics", "Method modules are pure"),
])
def test_a_forbidden_import_turns_lint_imports_red(tmp_path, module, line, contract):
    _copy_tree(tmp_path)
    clean = _lint(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy itself is clean
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # a layer violation\n")
    broken = _lint(tmp_path)
    assert broken.returncode != 0
    assert "BROKEN" in broken.stdout and contract in broken.stdout, broken.stdout
    assert module.replace("/", ".").removesuffix(".py") in broken.stdout
