"""Node start-up time and idle memory against a bare hivemind floor.

    python -m benchmarks.node_startup --out node_startup.json [--quick]

1. Starts a bootstrap (``node.localswarm.LocalSwarm``) and waits until it is READY.
2. Starts one more node (role ``bootstrap``, ``--initial-peers`` = the bootstrap) and measures
   the seconds from ``Popen`` to ``/readyz`` 200, polled every 50 ms. Median over 3 runs (1 with
   ``--quick``); every run is reported.
3. Idle memory: after READY plus ``IDLE_S`` seconds of idling, the PSS of the node's whole
   process tree (main process, hivemind's DHT process, p2pd, any other child; found through
   ``/proc/<pid>/task/*/children``), from ``/proc/<pid>/smaps_rollup``.
4. Floor, measured in the same run after the node is stopped: a bare ``python -c`` process that
   imports torch, grpc and hivemind, starts one ``hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
   start=True)`` and idles; its tree PSS is measured the same way.

Writes ``{"summary": {...}, "targets": {...}, "runs": [...], "memory": {...}}`` to ``--out``
and prints a short table. Targets: ready <= 5 s, idle PSS <= 1.25 x the floor. Every process
it starts lives in its own session and is stopped by PID / process group.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.localswarm import LocalSwarm, http_get  # noqa: E402

READY_TARGET_S = 5.0
PSS_RATIO_TARGET = 1.25
IDLE_S = 5.0
POLL_S = 0.05
START_TIMEOUT_S = 120.0

FLOOR_SCRIPT = r"""
import sys, time
import torch, grpc, hivemind
dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
print("FLOOR_READY", flush=True)
try:
    while True:
        time.sleep(1)
finally:
    dht.shutdown()
"""


# ---- /proc helpers ----

def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return out


def tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += children(p)
    return seen


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB values of /proc/<pid>/smaps_rollup (Rss, Pss, Private_*, ...)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[-1] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1])
    except OSError:
        pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
    except OSError:
        return "?"
    if not parts:
        return "?"
    name = os.path.basename(parts[0])
    rest = " ".join(" ".join(parts[1:4]).split())  # one line, even for ``python -c <script>``
    return f"{name} {rest}"[:70]


def tree_memory(pid: int) -> dict[str, Any]:
    procs = []
    for p in tree(pid):
        r = smaps_rollup(p)
        if not r:
            continue
        procs.append({"pid": p, "cmd": cmdline(p), "pss_mb": r.get("Pss", 0) / 1024, "rss_mb": r.get("Rss", 0) / 1024,
                      "uss_mb": (r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)) / 1024,
                      "pss_anon_mb": r.get("Pss_Anon", 0) / 1024, "pss_file_mb": r.get("Pss_File", 0) / 1024})
    return {"pss_mb": round(sum(p["pss_mb"] for p in procs), 1),
            "uss_mb": round(sum(p["uss_mb"] for p in procs), 1),
            "rss_mb": round(sum(p["rss_mb"] for p in procs), 1),
            "processes": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in p.items()} for p in procs]}


def killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- measurements ----

PHASES = {"config_effective": "config_effective_s", "node_listening": "node_listening_s"}


def phases(log_text: str, started_wall: float) -> dict[str, float]:
    """Seconds from Popen to a few log events: where the start-up time goes."""
    from datetime import datetime

    out: dict[str, float] = {}
    for line in log_text.splitlines():
        try:
            rec = json.loads(line)
            ts = datetime.fromisoformat(rec["ts"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        out.setdefault("first_log_line_s", round(ts - started_wall, 3))
        key = PHASES.get(rec.get("event"))
        if rec.get("event") == "state_changed" and rec.get("to") == "ready":
            key = "state_ready_s"
        if key:
            out.setdefault(key, round(ts - started_wall, 3))
    return out


def time_to_ready(swarm: LocalSwarm, name: str) -> tuple[Any, float, float]:
    """Start a node; return (node, seconds from Popen to /readyz 200, wall-clock time of the Popen)."""
    wall0, t0 = time.time(), time.monotonic()
    node = swarm.start("bootstrap", name=name)  # initial_peers = the swarm's bootstrap
    url = f"http://127.0.0.1:{node.ops_port}/readyz"
    while True:
        if not node.alive():
            raise RuntimeError(f"{name} exited with {node.proc.returncode}:\n{node.log_text()[-3000:]}")
        try:
            code, _ = http_get(url, timeout=1.0)
        except OSError:
            code = 0
        if code == 200:
            return node, time.monotonic() - t0, wall0
        if time.monotonic() - t0 > START_TIMEOUT_S:
            raise TimeoutError(f"{name} not READY after {START_TIMEOUT_S:.0f} s: {node.readyz()}")
        time.sleep(POLL_S)


def floor_memory(workdir: Path) -> dict[str, Any]:
    log_path = workdir / "floor.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-c", FLOOR_SCRIPT], stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        t0 = time.monotonic()
        while b"FLOOR_READY" not in log_path.read_bytes():
            if proc.poll() is not None:
                raise RuntimeError(f"floor process exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise TimeoutError("floor process did not start its DHT in time")
            time.sleep(POLL_S)
        started_s = time.monotonic() - t0
        time.sleep(IDLE_S)
        mem = tree_memory(proc.pid)
        mem["start_seconds"] = round(started_s, 2)
        return mem
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        killpg(proc.pid)
        if proc.poll() is None:
            proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--quick", action="store_true", help="one run instead of three (under 2 minutes)")
    args = ap.parse_args(argv)
    n_runs = 1 if args.quick else 3
    t_all = time.monotonic()

    runs: list[dict[str, Any]] = []
    node_mem: dict[str, Any] = {}
    with LocalSwarm(run_id="bench-startup") as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        boot_ready = swarm.wait_ready([boot], timeout=START_TIMEOUT_S)
        for i in range(n_runs):
            node, ready_s, wall0 = time_to_ready(swarm, f"node-{i}")
            run: dict[str, Any] = {"run": i, "ready_seconds": round(ready_s, 3),
                                   "phases": phases(node.log_text(), wall0)}
            if i == n_runs - 1:  # idle memory once, on the last node
                time.sleep(IDLE_S)
                node_mem = tree_memory(node.pid)
            run["exit_code"] = swarm.stop(node, timeout=30)
            runs.append(run)
        floor = floor_memory(swarm.workdir)

    ready = statistics.median(r["ready_seconds"] for r in runs)
    ratio = node_mem["pss_mb"] / floor["pss_mb"] if floor.get("pss_mb") else float("nan")
    summary = {"ready_seconds": round(ready, 3), "idle_pss_mb": node_mem["pss_mb"], "floor_pss_mb": floor["pss_mb"],
               "idle_pss_ratio_vs_floor": round(ratio, 3)}
    targets = {"ready_seconds_max": READY_TARGET_S, "idle_pss_ratio_max": PSS_RATIO_TARGET,
               "ready_pass": ready <= READY_TARGET_S, "idle_pss_ratio_pass": ratio <= PSS_RATIO_TARGET}
    result = {"benchmark": "node_startup", "quick": args.quick, "summary": summary, "targets": targets,
              "runs": runs, "bootstrap_ready_seconds": round(boot_ready, 3),
              "memory": {"node": node_mem, "floor": floor, "idle_s": IDLE_S},
              "env": {"python": platform.python_version(), "cpus": os.cpu_count(),
                      "loadavg_1m": os.getloadavg()[0], "wall_seconds": round(time.monotonic() - t_all, 1)}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'metric':<28}{'value':>12}{'target':>12}  pass")
    print(f"{'ready_seconds (median)':<28}{ready:>12.2f}{'<= ' + str(READY_TARGET_S):>12}  {targets['ready_pass']}")
    print(f"{'  runs':<28}{', '.join(str(r['ready_seconds']) for r in runs):>12}")
    print(f"  phases of the last run (s from Popen): {runs[-1]['phases']}")
    print(f"{'idle_pss_mb (node tree)':<28}{node_mem['pss_mb']:>12.1f}")
    print(f"{'floor_pss_mb (bare DHT)':<28}{floor['pss_mb']:>12.1f}")
    print(f"{'idle_pss_ratio_vs_floor':<28}{ratio:>12.3f}{'<= ' + str(PSS_RATIO_TARGET):>12}  "
          f"{targets['idle_pss_ratio_pass']}")
    for label, mem in (("node", node_mem), ("floor", floor)):
        for p in mem["processes"]:
            print(f"  {label:<6}{p['pid']:>8}  pss {p['pss_mb']:>7.1f}  uss {p['uss_mb']:>7.1f}  "
                  f"rss {p['rss_mb']:>7.1f} MB  {p['cmd']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
