"""The layer contracts in pyproject.toml ([tool.importlinter]) are live: `lint-imports` passes on
this tree, and a copy of the tree with one forbidden import per contract turns it red."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "protocol", "security", "models", "optimizers", "pipeline", "rl")
LINT = Path(sys.executable).with_name("lint-imports")
PURE = "Method modules are pure"


def _copy_tree(dst: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dst / "tests").mkdir()
    for name in ("__init__.py", "lint_contracts.py"):  # the custom contract type lint-imports loads
        shutil.copy(ROOT / "tests" / name, dst / "tests" / name)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the copy, not the editable install, is analysed
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("clean")
    _copy_tree(src)
    clean = _lint(src)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy itself is clean
    return src


@pytest.fixture
def tree(clean_copy, tmp_path) -> Path:
    shutil.copytree(clean_copy, tmp_path / "tree")
    return tmp_path / "tree"


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_ci_runs_lint_imports_before_the_tests():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "lint-imports" in script and script.index("lint-imports") < script.index("pytest")
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_infrastructure_layers_are_a_contract_and_nothing_is_ignored():
    contracts = _contracts()
    layers = [c for c in contracts if c["type"] == "layers"]
    assert [c["layers"] for c in layers] == [["node", "security", "protocol"]]
    assert any(c["type"] == "acyclic_siblings" and set(PACKAGES) <= set(c["ancestors"]) for c in contracts)
    assert not any("ignore_imports" in c for c in contracts)
    pure = next(c for c in contracts if c["name"].startswith(PURE))
    assert pure["type"] == "pure_by_default" and pure["packages"] == ["optimizers", "pipeline", "rl"]


@pytest.mark.parametrize("module,line,contract", [
    ("node/averaging.py", "import optimizers.noloco", "Infrastructure (node, protocol, security, models)"),
    ("protocol/varint.py", "import rl.grpo", "Infrastructure (node, protocol, security, models)"),
    ("protocol/varint.py", "import security.keys", "Infrastructure layers: node > security > protocol"),
    ("security/limits.py", "import node.metrics", "Infrastructure layers: node > security > protocol"),
    ("models/config.py", "import protocol.varint", "Models stand alone: no node, security or protocol"),
    ("node/identity.py", "import models.config", "Models stand alone: the infrastructure imports no model"),
    ("node/errors.py", "import node.config", "No import circles inside any package"),
    ("optimizers/diloco.py", "import pipeline.schedule", "Method packages (optimizers, pipeline, rl)"),
    ("rl/grpo.py", "import grpc", PURE),
    ("pipeline/schedule.py", "import node.metrics", PURE),
    ("rl/brand_new_helper.py", "import hivemind", PURE),  # a new module is pure without being listed
])
def test_a_forbidden_import_turns_lint_imports_red(tree, module, line, contract):
    target = tree / module
    before = target.read_text() if target.exists() else '"""A new module."""\n'
    target.write_text(before + f"\n{line}  # a layer violation\n")
    broken = _lint(tree)
    assert broken.returncode != 0
    assert "BROKEN" in broken.stdout and contract in broken.stdout, broken.stdout
    if contract.startswith("No import circles"):
        assert "No cycles are allowed in node." in broken.stdout, broken.stdout
    else:
        assert module.replace("/", ".").removesuffix(".py") in broken.stdout


@pytest.mark.parametrize("glue,says", [
    ("rl.grpo", "rl.grpo is listed in glue_modules but imports none of grpc, hivemind, node"),
    ("rl.no_such_module", "rl.no_such_module is listed in glue_modules but does not exist"),
])
def test_the_glue_list_cannot_rot(tree, glue, says):
    """A module listed as glue must exist and reach transport; otherwise it must leave the list
    (and be checked as pure from then on)."""
    text = (tree / "pyproject.toml").read_text()
    listed = re.sub(r"(glue_modules = \[)", rf'\1"{glue}", ', text, count=1)
    assert listed != text
    (tree / "pyproject.toml").write_text(listed)
    broken = _lint(tree)
    assert broken.returncode != 0
    assert f"{PURE}: no gRPC, hivemind or node code BROKEN" in broken.stdout and says in broken.stdout, broken.stdout
