"""``pip install -e '.[bench]'`` installs everything a benchmark imports.

Every third-party module that ``benchmarks/*.py`` imports (at the top or inside a function) must
come from a distribution named in ``[project] dependencies`` or in the ``bench`` extra; the test
reads the imports from the source (no benchmark runs) and maps them to distributions through the
installed metadata.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = {"node", "protocol", "security", "models", "optimizers", "pipeline", "rl", "benchmarks"}


def _dist_name(requirement: str) -> str:
    """``"safetensors>=0.4"`` -> ``"safetensors"`` (PEP 503 normalised)."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, wherever it sits in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_bench_extra_covers_every_benchmark_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = {_dist_name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["bench"]]}
    dists = packages_distributions()
    missing = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for module in _imported_modules(path) - OWN - set(sys.stdlib_module_names):
            provided_by = {_dist_name(d) for d in dists.get(module, [module])}
            if not provided_by & allowed:
                missing.setdefault(module, []).append(path.name)
    assert not missing, (f"benchmarks import modules that `pip install -e '.[bench]'` does not install: {missing}; "
                         "add their distributions to [project.optional-dependencies] bench in pyproject.toml")


def test_the_checkfree_benchmark_needs_safetensors_from_the_bench_extra():
    """The case a newcomer hit: safetensors used to be in [test] only."""
    assert "safetensors" in _imported_modules(ROOT / "benchmarks" / "checkfree.py")
    bench = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    assert "safetensors" in {_dist_name(r) for r in bench}
