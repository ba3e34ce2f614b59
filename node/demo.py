"""``swarmnode demo``: a whole swarm on 127.0.0.1 with embedded defaults, progress on the terminal.

    swarmnode demo                       # bootstrap + the installed training demo's workers
    swarmnode demo --nodes 2 --steps 60 --json
    swarmnode demo --role bootstrap --nodes 3 --duration 20   # membership only, no training

Starts real node processes (``node/localswarm.py``), prints one line per node every few
seconds (state, and for training roles: steps, loss, outer rounds, eval loss) and a summary at
the end. Training roles stop by themselves after ``--steps``; ``--duration`` or Ctrl-C stop
earlier. Everything runs from the embedded defaults: nothing is downloaded.

A role takes part as a *training* demo by registering a module under the ``swarmnode.demos``
entry-point group (name = role name). That module is imported by this (parent) process, so it
must import only the standard library (no torch: ``swarmnode demo`` starts in well under a
second). Its attributes:

- ``DEFAULT_STEPS: int`` and ``DEFAULT_NODES: int``: used without ``--steps`` / ``--nodes``;
- ``node_settings(steps) -> list[str]``: ``--set`` overrides for every node (the user's win);
- ``FINISHED_EVENT: str``: the log event a worker writes once with its final figures;
- ``FINISHED_FIELDS: dict[str, str]``: progress-row key -> field of that event;
- optional ``worker_settings(i) -> list[str]``: extra ``--set`` for worker i (heterogeneous
  peers), ``swarm_settings(nodes) -> list[str]``: extra ``--set`` every node gets for a swarm
  of ``nodes`` workers (e.g. how many the coordinator waits for), ``SUMMARY_KEYS``: row keys
  whose mean over workers the summary (``--json``) adds, and ``DEMO_ORDER: int``: without
  ``--role`` the demo with the lowest order runs (default 100), and ``STEP_NAME: str``: what
  one of its steps is called in the header line (default "inner steps");
- optional ``PROGRESS_METRICS: dict[str, str]``: row key -> metric name (summed over its labels)
  for figures the role-neutral metrics lack (they override a default key of the same name),
  ``PROGRESS_COLUMNS: dict[str, str]``: label -> row key of the figures each progress line shows
  after the step (default loss and rounds; a figure the role lacks is left out),
  ``RATIOS: dict[str, tuple[str, str]]``: key -> (numerator, denominator) row keys; each row
  gets the ratio, the summary the ratio of the sums over workers (e.g. seconds blocked /
  seconds training), and ``summary_text(summary) -> str``: the closing line;
- optional ``FIGURES: tuple[str, ...]``: which of the role-neutral summary keys
  (``DEFAULT_FIGURES``: train loss, eval loss, outer rounds) the role has; the others are left
  out of the summary and ``--json`` instead of reported as 0 or null (default: all of them);
- optional ``COUNT_KEYS: tuple[str, ...]``: row keys that are counts (e.g. peers seen), shown
  as integers on the progress lines like ``steps`` and ``rounds`` (others: 3 decimals).

Progress lines show a worker's state, not figures, until its first step (and, for a node whose
readiness says it waits for its coordinator, for how long: ``stage-0:joining (awaits
coordinator 42 s)``). When every node has exited the demo stops at once; if one failed, it
prints that node's first error line and exits non-zero.

The default progress figures come from the role-neutral metrics (``swarmnode_train_*``,
``swarmnode_eval_*``, ``swarmnode_outer_rounds_total``). Without any demo module installed (or
with ``--role`` naming a role that has none) the demo is membership-only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from node.localswarm import LocalSwarm, NodeProc

DEMO_GROUP = "swarmnode.demos"


def demo_module(role: str) -> ModuleType | None:
    """The role's demo module (``swarmnode.demos`` entry point), or None: membership-only."""
    found = entry_points(group=DEMO_GROUP, name=role)
    return next(iter(found)).load() if found else None


def _default_role() -> str:
    """The installed role whose demo module has the lowest ``DEMO_ORDER`` (100 when unset; ties
    by name), else a membership-only demo. Demo modules are standard-library only, so loading
    them keeps this process torch-free; the roles themselves run in other processes."""
    roles = {ep.name for ep in entry_points(group="swarmnode.roles")}
    demos = [ep for ep in entry_points(group=DEMO_GROUP) if ep.name in roles]
    if not demos:
        return "bootstrap"
    return min(demos, key=lambda ep: (getattr(ep.load(), "DEMO_ORDER", 100), ep.name)).name


def _m(metrics: dict[str, float], name: str) -> float | None:
    for key, value in metrics.items():
        if key == name or key.startswith(name + "{"):
            return value
    return None


def _sum(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def _finished_event(node: NodeProc, event: str) -> dict[str, Any] | None:
    """The worker's own end-of-training report (its last ``event`` log line)."""
    found = None
    for line in node.log_text().splitlines():
        if f'"event": "{event}"' in line:
            try:
                found = json.loads(line)
            except json.JSONDecodeError:
                pass
    return found


def node_progress(node: NodeProc, demo: ModuleType | None = None) -> dict[str, Any]:
    r = node.readyz() or {}
    m = node.metrics() if node.alive() else {}
    if m:
        node.extra["last_metrics"] = m
    m = m or node.extra.get("last_metrics", {})
    row = {"name": node.name, "state": r.get("state", "exited" if not node.alive() else "starting"),
           "reason": r.get("reason", ""), "steps": _m(m, "swarmnode_train_steps_total"),
           "loss": _m(m, "swarmnode_train_loss"), "eval_loss": _m(m, "swarmnode_eval_loss"),
           "eval_loss_start": _m(m, "swarmnode_eval_loss_initial"),
           "loss_start": _m(m, "swarmnode_train_loss_initial"),
           # outer steps taken (ok + solo + failed): a worker that caught up with the swarm has a
           # higher round label (swarmnode_outer_round) than steps taken
           "rounds": _sum(m, "swarmnode_outer_rounds_total") if _m(m, "swarmnode_outer_rounds_total") is not None
           else None,  # None: the role has no outer rounds (e.g. a pipeline)
           "rounds_ok": _m(m, 'swarmnode_outer_rounds_total{outcome="ok"}')}
    coordinator = ((r.get("details") or {}).get("coordinator") or {}) if r.get("reason") == "awaiting_coordinator" \
        else {}
    row["coordinator_wait_s"] = coordinator.get("waiting_s")   # None unless it waits for its coordinator
    for key, name in getattr(demo, "PROGRESS_METRICS", {}).items():
        row[key] = _sum(m, name) if _m(m, name) is not None else None
    done = _finished_event(node, demo.FINISHED_EVENT) if demo is not None and not node.alive() else None
    if done:  # exact final figures, even if the last scrape missed them
        row.update({key: done.get(field) for key, field in demo.FINISHED_FIELDS.items()}, state="finished")
    for key, (num, den) in getattr(demo, "RATIOS", {}).items():
        row[key] = _ratio([row.get(num)], [row.get(den)])
    return row


def _ratio(nums: list, dens: list) -> float | None:
    """sum(nums) / sum(dens) over the rows that have both, or None (nothing measured yet)."""
    pairs = [(a, b) for a, b in zip(nums, dens) if isinstance(a, (int, float)) and isinstance(b, (int, float))]
    den = sum(b for _, b in pairs)
    return sum(a for a, _ in pairs) / den if pairs and den > 0 else None


def first_error_line(text: str) -> str:
    """The first line of a node log that reports an error (a JSON record at level error or
    critical, a traceback, an ``...Error:`` line), else its last non-empty line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if '"level": "error"' in ln or '"level": "critical"' in ln:
            try:
                rec = json.loads(ln)
                return f"{rec.get('msg', '')} {rec.get('exc', '') or ''}".strip() or ln
            except json.JSONDecodeError:
                return ln
        if ln.startswith("Traceback") or "Error:" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else "(empty log)"


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


DEFAULT_COLUMNS = {"loss": "loss", "rounds": "rounds"}

DEFAULT_COUNT_KEYS = ("steps", "rounds")
"""Row keys that are counts on every role: progress lines print them as integers."""

DEFAULT_FIGURES = ("loss_start", "loss_end", "eval_loss_start", "eval_loss_end", "rounds", "rounds_ok")
"""The role-neutral summary keys; a demo module's ``FIGURES`` names the ones its role has."""


def print_progress(rows: list[dict[str, Any]], t: float, columns: dict[str, str] = DEFAULT_COLUMNS,
                   counts: tuple[str, ...] = ()) -> None:
    """One line for every node: its state before its first step, then its step and ``columns``
    (label -> row key); ``counts`` and ``DEFAULT_COUNT_KEYS`` print as integers (``peers 2``)."""
    ints = {*DEFAULT_COUNT_KEYS, *counts}
    parts = []
    for r in rows:
        if not r["steps"]:  # before the first step: its state, never "loss 0.000"
            waits = r.get("coordinator_wait_s")
            parts.append(f"{r['name']}:{r['state']}" + ("" if waits is None else f" (awaits coordinator {waits:.0f} s)"))
        else:
            figures = " ".join(f"{label} {_fmt(r.get(key), '.0f' if key in ints else '.3f')}"
                               for label, key in columns.items() if not (key == "rounds" and r.get(key) is None))
            parts.append(f"{r['name']}: step {int(r['steps'])} {figures}")
    print(f"[{t:6.1f}s] " + " | ".join(parts), flush=True)


def summarize(rows: list[dict[str, Any]], nodes: int, wall: float,
              figures: tuple[str, ...] = DEFAULT_FIGURES) -> dict[str, Any]:
    """The demo's summary: nodes, steps (the fewest any node took), wall time, the per-node rows,
    and those of the role-neutral ``figures`` the role has (means over nodes; rounds: the fewest)."""
    rounds = [r for r in rows if r.get("rounds") is not None]

    def mean(key: str) -> float | None:
        # a pipeline's transformer stages report NaN losses (they never compute one): skip them
        vals = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None
    known = {"loss_start": mean("loss_start"), "loss_end": mean("loss"),
             "eval_loss_start": mean("eval_loss_start"), "eval_loss_end": mean("eval_loss"),
             "rounds": int(min(r["rounds"] for r in rounds)) if rounds else None,
             "rounds_ok": int(sum((r["rounds_ok"] or 0) for r in rows))}
    return {"nodes": nodes, "steps": int(min((r["steps"] or 0) for r in rows)) if rows else 0,
            **{key: value for key, value in known.items() if key in figures},
            "wall_s": round(wall, 1), "per_node": rows}


def cmd_demo(args: argparse.Namespace) -> int:
    role = args.role or _default_role()
    demo = demo_module(role)
    training = demo is not None
    n = args.nodes if args.nodes is not None else (demo.DEFAULT_NODES if training else 3)
    steps = (args.steps or demo.DEFAULT_STEPS) if training else None
    common = list(args.set or [])
    if training:
        sized = getattr(demo, "swarm_settings", None)
        try:
            common = [*demo.node_settings(steps), *(sized(n) if sized else []), *common]
        except ValueError as exc:  # e.g. too few nodes for the role's demo layout
            print(f"swarmnode demo: {exc}", file=sys.stderr)
            return 2
    print(f"swarmnode demo: bootstrap + {n} {role} node(s) on 127.0.0.1"
          + (f", {steps} {getattr(demo, 'STEP_NAME', 'inner steps')} each" if training else ""), flush=True)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    workdir = tempfile.mkdtemp(prefix="swarmnode-demo-")  # kept: node logs stay readable afterwards
    with LocalSwarm(run_id="demo", common_set=common, workdir=workdir) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        print(f"bootstrap ready: {swarm.bootstrap_maddr}  (ops http://127.0.0.1:{boot.ops_port}/metrics)",
              flush=True)
        per_node = getattr(demo, "worker_settings", None) if training else None  # optional: per-node --set
        workers = [swarm.start(role, name=f"{role}-{i}", extra_set=per_node(i) if per_node else None)
                   for i in range(n)]
        for w in workers:
            print(f"  {w.name}: peer {w.peer_id[:20]}… grpc 127.0.0.1:{w.grpc_port} "
                  f"ops http://127.0.0.1:{w.ops_port}/metrics  log {w.log_path}", flush=True)
        try:
            next_print = time.monotonic() + 3.0
            while True:
                time.sleep(0.5)
                # every node gone (finished or failed): stop at once, nothing is left to watch
                finished = all(not w.alive() for w in workers)  # before reading: final rows
                timed_out = args.duration is not None and time.monotonic() - t0 >= args.duration
                if not (finished or timed_out or time.monotonic() >= next_print):
                    continue
                next_print = time.monotonic() + 3.0
                rows = [node_progress(w, demo) for w in workers]
                print_progress(rows, time.monotonic() - t0, getattr(demo, "PROGRESS_COLUMNS", DEFAULT_COLUMNS),
                               tuple(getattr(demo, "COUNT_KEYS", ())))
                if finished or timed_out:
                    break
        except KeyboardInterrupt:
            print("\nstopping (Ctrl-C): draining every node…", flush=True)
        failed = [w for w in workers if not w.alive() and w.proc.returncode not in (0, None)]
        boot_lost = None if boot.alive() else boot.proc.returncode
        swarm.stop_all()
    summary = summarize(rows, n, time.monotonic() - t0, tuple(getattr(demo, "FIGURES", DEFAULT_FIGURES)) if training
                        else ())  # membership only: no training figures
    for key in getattr(demo, "SUMMARY_KEYS", ()) if training else ():  # optional: role figures, mean over nodes
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        summary[key] = sum(vals) / len(vals) if vals else None
    for key, (num, den) in getattr(demo, "RATIOS", {}).items() if training else ():  # over all workers
        summary[key] = _ratio([r.get(num) for r in rows], [r.get(den) for r in rows])
    if training and hasattr(demo, "summary_text"):
        print(f"summary: {demo.summary_text(summary)}", flush=True)
    elif training:
        print(f"summary: {n} workers, {summary['steps']} steps, train loss {_fmt(summary.get('loss_start'))} -> "
              f"{_fmt(summary.get('loss_end'))}, eval loss {_fmt(summary.get('eval_loss_start'))} -> "
              f"{_fmt(summary.get('eval_loss_end'))}"
              + ("" if summary.get("rounds") is None else f", {summary['rounds']} outer rounds"), flush=True)
    else:
        print(f"summary: {n} {role} node(s) ran for {summary['wall_s']} s", flush=True)
    for w in failed:
        print(f"error: {w.name} exited with {w.proc.returncode}: {first_error_line(w.log_text())}  "
              f"(full log: {w.log_path})", file=sys.stderr)
    if boot_lost is not None:
        print(f"error: the bootstrap exited with {boot_lost} during the demo: the nodes lost their entry point and "
              f"coordinator (full log: {boot.log_path}; docs/operations.md, 'When the bootstrap is gone')",
              file=sys.stderr)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "per_node"}))
    return 1 if failed or boot_lost is not None else 0
