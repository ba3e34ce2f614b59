"""Grafana dashboards and Prometheus rules, checked without a running swarm (issue 16).

- the committed dashboard JSON is exactly what ``deploy/dashboards.py`` generates;
- dashboard hygiene: fixed uids, ``"id": null``, unique panel IDs, datasource by uid, a unit and a
  description on every panel, ``$__rate_interval`` in every rate, the ``$run``/``$role``/``$instance``
  variables, no hard-coded instance;
- every metric a panel, variable or rule names exists in a node's real registry (the node's own
  series, every installed role's, the event bus's, the DHT collector's and the bootstrap's swarm
  view), except the few the specs name whose code has not landed (``PENDING_METRICS``), which must
  still be missing;
- ``promtool check rules``/``check config`` and ``promtool test rules`` (input series -> expected
  alerts), and a broken rule makes that test fail.

The same PromQL runs against a real Prometheus scraping a real swarm in
``tests/integration/test_observability.py``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy_tools import deploy_tool

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "swarmnode.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests" / "swarmnode.test.yml"
METRIC = re.compile(r"\b(swarmnode_[a-z0-9_]+)\b")
RANGE_FN = re.compile(r"\b(rate|increase|irate|delta|changes|max_over_time|min_over_time|avg_over_time)\(")


def load_generator():
    spec = importlib.util.spec_from_file_location("swarmnode_dashboards", DEPLOY / "dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen():
    return load_generator()


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))}


def panel_exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label values such as a job name left out)."""
    return set(METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))


def rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def registry_names() -> set[str]:
    """Every series name a fully loaded node can expose (sample names, e.g. ``x_total``, ``x_bucket``)."""
    import node.device  # noqa: F401 - device series join the registry on import
    import node.eventbus.metrics  # noqa: F401
    import node.call_guard  # noqa: F401 - ban series
    from node import metrics, swarm_metrics
    from node.roles import load_installed_roles

    assert load_installed_roles(), "no role is installed: pip install -e ."
    families = [*metrics.REGISTRY.collect(), *swarm_metrics.SWARM_REGISTRY.collect(),
                *metrics.DhtCollector(lambda timeout: (1, {"forged": 1})).collect()]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
                "summary": ("", "_sum", "_count")}
    names = set()
    for fam in families:
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


# ---- generated JSON ---------------------------------------------------------------------

def test_committed_dashboards_are_what_the_code_generates(gen, dashboards, tmp_path, monkeypatch):
    assert set(dashboards) == set(gen.DASHBOARDS), "a dashboard file without code (or code without a file)"
    for name, d in gen.DASHBOARDS.items():
        text = (DEPLOY / "grafana" / "dashboards" / f"{name}.json").read_text()
        assert text == gen.render(d), f"{name}.json differs from deploy/dashboards.py: run it and commit the JSON"
    assert gen.main(["--check"]) == 0
    # --check catches a hand edit
    monkeypatch.setattr(gen, "OUT", tmp_path)
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    edited = json.loads((tmp_path / "swarm.json").read_text())
    edited["panels"][0]["title"] = "edited in the UI"
    (tmp_path / "swarm.json").write_text(json.dumps(edited))
    assert gen.main(["--check"]) == 1


def test_dashboard_hygiene(dashboards):
    assert set(dashboards) == {"swarm", "noloco", "pipeline", "grpo"}
    uids = [d["uid"] for d in dashboards.values()]
    assert uids == [f"swarmnode-{name}" for name in dashboards] and len(set(uids)) == len(uids)
    for name, d in dashboards.items():
        assert d["id"] is None, f"{name}: provisioning assigns the id"
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids), f"{name}: panel ids"
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert set(variables) == {"run", "role", "instance"}, name
        for v in variables.values():
            assert v["datasource"] == {"type": "prometheus", "uid": "prometheus"}
            assert v["includeAll"] and v["allValue"] == ".*"
        for panel in d["panels"]:
            where = f"{name}/{panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, where
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
            assert len(panel.get("description", "")) > 20, f"{where}: no description"
            assert panel["targets"], where
            for t in panel["targets"]:
                assert t["datasource"] == {"type": "prometheus", "uid": "prometheus"}, where
                expr = t["expr"]
                assert not re.search(r'instance\s*=~?\s*"(?!\$instance")', expr), f"{where}: hard-coded instance"
                for m in RANGE_FN.finditer(expr):
                    window = re.match(r"[^\[]*\[([^\]]+)\]", expr[m.end():])
                    assert window and window.group(1) == "$__rate_interval", f"{where}: {expr}"
                if "swarmnode_swarm_" not in expr and "up{" not in expr:
                    # per-node series: filtered by $run/$role/$instance through swarmnode_node_info
                    assert "swarmnode_node_info{run=~\"$run\"" in expr, f"{where}: not filtered by $run"
                else:
                    assert '$run' in expr or 'up{' in expr, f"{where}: not filtered by $run"
    role_defaults = {n: {v["name"]: v.get("current", {}).get("value") for v in d["templating"]["list"]}["role"]
                     for n, d in dashboards.items()}
    assert role_defaults == {"swarm": None, "noloco": ["noloco"], "pipeline": ["stage"], "grpo": ["grpo"]}


def test_provisioned_datasource_is_the_one_the_dashboards_name(dashboards):
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    uids = {d["uid"] for d in ds}
    used = {json.dumps(p["datasource"]) for d in dashboards.values() for p in d["panels"]}
    assert uids == {"prometheus"} and used == {json.dumps({"type": "prometheus", "uid": "prometheus"})}


# ---- metric names against a node's real registry --------------------------------------------

def test_every_metric_in_panels_variables_and_rules_exists(gen, dashboards):
    known = registry_names()
    pending = set(gen.PENDING_METRICS)
    assert not pending & known, (f"{sorted(pending & known)} now exist in the registry: remove them from "
                                 "PENDING_METRICS in deploy/dashboards.py so the live test covers their panels")
    sources = [(f"{n}/{t}", e) for n, d in dashboards.items() for t, e in panel_exprs(d)]
    sources += [(f"{n}/${v['name']}", v["query"]) for n, d in dashboards.items() for v in d["templating"]["list"]]
    sources += [(f"rule {n}", e) for n, e in rule_exprs()]
    missing = {(where, m) for where, expr in sources for m in metric_names(expr) if m not in known | pending}
    assert not missing, f"metrics no node exposes (renamed?): {sorted(missing)}"
    # the check has teeth: the names really come from the registry
    assert "swarmnode_outer_rounds_total" in known and "swarmnode_outer_round_total" not in known


# ---- Prometheus rules --------------------------------------------------------------------

def promtool() -> str:
    return deploy_tool("promtool", "prometheus")


def run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_checks_rules_and_config():
    out = run(promtool(), "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    n = len(rule_exprs())
    assert f"SUCCESS: {n} rules found" in out.stdout
    out = run(promtool(), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rule_unit_tests_pass_and_catch_a_broken_rule(tmp_path):
    out = run(promtool(), "test", "rules", str(RULE_TESTS))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    # every alert is exercised by at least one case
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {n for n, _ in rule_exprs() if not n.startswith("swarmnode:")}
    # break one rule (the killed-node alert stops firing) -> the same tests fail
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    broken = RULES.read_text().replace('expr: up{job=~"swarmnode|swarmnode_swarm"} == 0',
                                       'expr: up{job=~"swarmnode|swarmnode_swarm"} == 2')
    assert broken != RULES.read_text()
    (tmp_path / "rules" / RULES.name).write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / "tests" / RULE_TESTS.name)
    out = run(promtool(), "test", "rules", str(tmp_path / "tests" / RULE_TESTS.name))
    assert out.returncode != 0 and "SwarmnodeTargetDown" in out.stdout + out.stderr, out.stdout + out.stderr
