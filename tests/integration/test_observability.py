"""A real Prometheus scraping a real local swarm: every dashboard panel returns data, the rules
load (``promtool check rules``) and evaluate, and the alerts for a killed node fire (issue 16).

The swarm: a bootstrap and workers of every installed role, each started with its demo module's
settings (node/demo.py's contract; :data:`ROLE_NODES` says how many, and a new role must add
itself there). Prometheus (Debian's ``prometheus``,
installed by scripts/test.sh) runs the repository's ``deploy/prometheus/prometheus.yml`` adapted
to this host: the same jobs, paths and rule files, with the compose DNS names replaced by the
127.0.0.1 ports of the nodes of the same role, a 2 s scrape and 1 s evaluation interval and the alerts'
``for:`` shortened to 2 s. Every PromQL expression of every panel in
``deploy/grafana/dashboards/*.json`` is then run with the dashboard's default variables; panels
made only of ``PENDING_METRICS`` (specified, not built yet) are skipped. Finally one NoLoCo
worker is SIGKILLed: ``SwarmnodeTargetDown`` must fire for its target and, once its card expires,
``SwarmnodeSwarmBelowMinReady`` for its role from the bootstrap's card view. Every process is
stopped by PID.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from node.config import installed_roles
from node.demo import demo_module
from node.localswarm import LocalSwarm, free_port, http_get
from tests.deploy_tools import deploy_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCRAPE_S = 2          # scrape interval = timeout: nine nodes share two cores, a 1 s timeout drops scrapes
RATE_INTERVAL = "30s"  # $__rate_interval: many samples per window, so a slow scrape loses no rate
FOREVER = 10 ** 6      # steps/iterations/rounds: nobody stops on its own during the test
FAST_CARDS = ["card.ttl_s=10", "card.refresh_s=2"]
JOINS = {"swarmnode_node_info"}
"""Series panels only join on for labels: a panel whose own series are all pending is skipped."""


ROLE_NODES = {"noloco": 2, "stage": 4, "grpo": 2}
"""Workers per role: the fewest its demo layout accepts (2 for "below N ready" to fire on one kill)."""
ROLE_EXTRA = {"stage": ["stage.compute_delay_s=0.02"]}
"""Beyond the role's demo settings: stage nodes sleep a little so nine processes share two cores."""
COORDINATED = ("stage",)
"""Roles whose coordinator runs on the bootstrap: it gets their swarm-wide settings too."""


def role_settings(role: str) -> list[str]:
    """What ``swarmnode demo --role R --nodes N`` gives every node of the role (node/demo.py's
    contract), running until stopped, plus :data:`ROLE_EXTRA`."""
    demo = demo_module(role)
    sized = getattr(demo, "swarm_settings", None)
    return [*demo.node_settings(FOREVER), *(sized(ROLE_NODES[role]) if sized else []), *ROLE_EXTRA.get(role, [])]


def worker_settings(role: str, i: int) -> list[str]:
    per_node = getattr(demo_module(role), "worker_settings", None)
    return per_node(i) if per_node else []


def load_generator():
    spec = importlib.util.spec_from_file_location("swarmnode_dashboards", DEPLOY / "dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Prom:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}" if params else f"{self.base}{path}"
        code, body = http_get(url, timeout=10)
        doc = json.loads(body)
        assert code == 200 and doc["status"] == "success", f"{path} {params}: {code} {doc}"
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def local_config(tmp: Path, targets_by_role: dict[str, list[str]], prom_port: int) -> Path:
    """deploy/prometheus/prometheus.yml on this host: compose DNS names -> the nodes of that service's role."""
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]

    def role_of(service: str) -> str:
        cmd = services[service]["command"]
        return "bootstrap" if cmd[0] == "bootstrap" else cmd[cmd.index("--role") + 1]

    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval=f"{SCRAPE_S}s", scrape_timeout=f"{SCRAPE_S}s", evaluation_interval="1s")
    rules_dir = tmp / "rules"
    rules_dir.mkdir()
    for pattern in cfg["rule_files"]:
        for src in sorted((DEPLOY / "prometheus").glob(pattern)):
            text = re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 2s", src.read_text())
            (rules_dir / src.name).write_text(text)
    cfg["rule_files"] = [str(rules_dir / "*.yml")]
    for job in cfg["scrape_configs"]:
        sd = job.pop("dns_sd_configs", None)
        if sd is not None:
            names = [n for c in sd for n in c["names"]]
            targets = sorted({t for n in names for t in targets_by_role.get(role_of(n), [])})
            job["static_configs"] = [{"targets": targets}]
            job.pop("relabel_configs", None)  # they read DNS discovery's meta labels
        else:
            job["static_configs"] = [{"targets": [f"127.0.0.1:{prom_port}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def substitute(expr: str, variables: dict[str, str]) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, value in variables.items():
        out = out.replace(f"${name}", value)
    return out


def dashboard_variables(dash: dict) -> dict[str, str]:
    """Each variable at its default: the current value of a role dashboard's $role, else All (.*)."""
    out = {}
    for v in dash["templating"]["list"]:
        current = v.get("current", {}).get("value")
        out[v["name"]] = "|".join(current) if current else v["allValue"]
    return out


def test_dashboards_rules_and_alerts_on_a_live_swarm(tmp_path):
    prometheus = deploy_tool("prometheus", "prometheus")
    gen = load_generator()
    roles = [r for r in installed_roles() if r != "bootstrap"]
    unknown = [r for r in roles if r not in ROLE_NODES]
    assert not unknown, f"installed role(s) {unknown} have no entry in ROLE_NODES: add how to run them here"
    boot_settings = [s for r in roles if r in COORDINATED for s in role_settings(r)] + FAST_CARDS
    procs: list[subprocess.Popen] = []
    with LocalSwarm(run_id="obs", workdir=tmp_path / "swarm") as swarm:
        try:
            boot = swarm.start("bootstrap", name="bootstrap", extra_set=boot_settings)
            swarm.wait_ready([boot], timeout=60)
            workers = {r: [swarm.start(r, name=f"{r}-{i}", extra_set=[*role_settings(r), *worker_settings(r, i),
                                                                         *FAST_CARDS])
                           for i in range(ROLE_NODES[r])] for r in roles}
            swarm.wait_ready(timeout=120)

            targets = {"bootstrap": [f"127.0.0.1:{boot.ops_port}"]}
            for r, nodes in workers.items():
                targets[r] = [f"127.0.0.1:{n.ops_port}" for n in nodes]
            prom_port = free_port()
            config = local_config(tmp_path, targets, prom_port)
            promtool = deploy_tool("promtool", "prometheus")
            for check in (["rules", *sorted(str(p) for p in (DEPLOY / "prometheus" / "rules").glob("*.yml"))],
                          ["config", str(config)]):   # the repo's rules as written, the adapted config
                out = subprocess.run([promtool, "check", *check], capture_output=True, text=True, timeout=60)
                assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
            with open(tmp_path / "prometheus.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            prom = Prom(prom_port)

            def ready() -> bool:
                if procs[0].poll() is not None:
                    pytest.fail(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-3000:]}")
                try:
                    return http_get(f"{prom.base}/-/ready", timeout=2)[0] == 200
                except OSError:
                    return False
            wait_for("Prometheus ready", ready, timeout=30, every=0.5)
            scraping_since = time.monotonic()

            # ---- the rules load and evaluate without errors
            repo_rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "swarmnode.rules.yml").read_text())
            expected = {r.get("alert") or r["record"] for g in repo_rules["groups"] for r in g["rules"]}
            loaded = wait_for("the rule groups", lambda: prom.get("/api/v1/rules")["groups"], timeout=20)
            assert {r["name"] for g in loaded for r in g["rules"]} == expected

            # ---- every target scraped, every role working (a round / iteration done)
            n_targets = 1 + sum(len(v) for v in workers.values()) + 1 + 1   # nodes, the swarm view, Prometheus
            wait_for("every target up", lambda: len([t for t in prom.get("/api/v1/targets")["activeTargets"]
                                                     if t["health"] == "up"]) == n_targets, timeout=30)
            # (the bootstrap loads every role's module, so their series sit at 0 on it too: filter by role)
            progress = {"noloco": "min(sum by (instance) (swarmnode_outer_rounds_total{0}))",
                        "stage": "min(swarmnode_pipeline_iteration{0})", "grpo": "min(swarmnode_grpo_round{0})"}
            for r in roles:
                query = progress[r].format(f' and on(job, instance) swarmnode_node_info{{role="{r}"}}')
                try:
                    wait_for(f"{r} progress", lambda q=query: (prom.value(q) or 0) >= 1, timeout=120)
                except pytest.fail.Exception as exc:   # say where each node of the role stands
                    tails = {n.name: [json.loads(x).get("event") for x in n.log_path.read_text().splitlines()
                                      if x.startswith("{")][-6:] for n in [boot, *workers[r]]}
                    pytest.fail(f"{exc}; per node {prom.query(query.replace('min(', 'max by (instance) (', 1))}; "
                                f"last log events: {tails}")
            wait_for("the swarm view of every node",
                     lambda: prom.value('sum(swarmnode_swarm_nodes{run="obs", state="ready"})') == 1 + sum(
                         len(v) for v in workers.values()), timeout=30)
            time.sleep(max(0.0, scraping_since + 4 * SCRAPE_S - time.monotonic()))   # >= 2 samples per rate window
            errors = [(r["name"], r.get("lastError")) for g in prom.get("/api/v1/rules")["groups"]
                      for r in g["rules"] if r.get("health") == "err"]
            assert not errors, errors

            # ---- every PromQL expression of every panel returns data
            pending = set(gen.PENDING_METRICS)
            checked, skipped, failed = 0, [], []
            for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
                dash = json.loads(path.read_text())
                variables = dashboard_variables(dash)
                for var in dash["templating"]["list"]:   # label_values(metric{...}, label)
                    metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]).groups()
                    values = prom.get(f"/api/v1/label/{label}/values", **{"match[]": substitute(metric, variables)})
                    if not values:
                        failed.append((path.stem, f"${var['name']}", var["query"]))
                for panel in dash["panels"]:
                    for t in panel["targets"]:
                        names = set(re.findall(r"\bswarmnode_[a-z0-9_]+\b", re.sub(r'"[^"]*"', '""', t["expr"])))
                        if names - JOINS and names - JOINS <= pending:
                            skipped.append(f"{path.stem}/{panel['title']}")
                            continue
                        expr = substitute(t["expr"], variables)
                        result = wait_for(f"{path.stem}/{panel['title']}", lambda e=expr: prom.query(e) or [None],
                                          timeout=1, every=1)
                        if result == [None]:
                            try:   # slow-moving series get a few more seconds, once
                                wait_for(expr, lambda e=expr: prom.query(e), timeout=20)
                            except pytest.fail.Exception:
                                failed.append((path.stem, panel["title"], expr))
                        checked += 1
            assert not failed, f"panels without data: {failed}"
            assert checked >= 40, checked
            assert {s.split("/")[0] for s in skipped} <= {"pipeline"}, skipped

            # ---- label values the variables offer: this run, every role, every node
            assert "obs" in prom.get("/api/v1/label/run/values", **{"match[]": "swarmnode_node_info"})
            assert set(prom.get("/api/v1/label/role/values", **{"match[]": "swarmnode_node_info"})) == \
                {"bootstrap", *roles}

            # ---- a killed node: its target goes down, then its card expires and its role drops below 2
            victim = workers["noloco"][0]
            swarm.kill(victim)
            instance = f"127.0.0.1:{victim.ops_port}"

            def firing(name: str, **labels: str) -> bool:
                return any(a["labels"]["alertname"] == name and a["state"] == "firing"
                           and all(a["labels"].get(k) == v for k, v in labels.items())
                           for a in prom.get("/api/v1/alerts")["alerts"])

            wait_for("SwarmnodeTargetDown for the killed node",
                     lambda: firing("SwarmnodeTargetDown", instance=instance, job="swarmnode"), timeout=30)
            assert not firing("SwarmnodeTargetDown", instance=f"127.0.0.1:{boot.ops_port}")
            wait_for("SwarmnodeSwarmBelowMinReady for noloco",
                     lambda: firing("SwarmnodeSwarmBelowMinReady", role="noloco", run="obs"), timeout=60)
            assert prom.value('swarmnode_swarm_leaves_total{role="noloco", how="vanished"}') == 1
        finally:
            for p in procs:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
