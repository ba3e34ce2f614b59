"""README command 1: ``swarmnode demo`` trains a local swarm (real processes on 127.0.0.1).

Runs a small demo (2 workers, 60 steps) as its own process group and checks the contract of
the last line of ``--json``: the keys the issue names, a loss that went down, outer rounds
taken, and every node process gone when the demo exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _run_demo(tmp_path, *args: str) -> tuple[int, str, list[int]]:
    """Run ``swarmnode demo ARGS`` as its own process group; (exit code, output, node PIDs that
    were still running afterwards, all killed by now)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the demo keeps its node logs under TMPDIR
    proc = subprocess.Popen([sys.executable, "-m", "node.cli", "demo", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # stop what we started, by its own process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # the nodes run in sessions of their own (their command lines name the demo's folder):
        # whatever is left is stopped here by PID, even when the demo itself failed
        left = _processes_mentioning(str(tmp_path))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, out, left


def test_demo_trains_and_prints_the_json_summary(tmp_path):
    code, out, left = _run_demo(tmp_path, "--nodes", "2", "--steps", "60", "--json")
    assert code == 0, out[-3000:]
    lines = out.strip().splitlines()
    assert any(line.startswith("[") and "step" in line for line in lines), "no progress lines on the terminal"
    summary = json.loads(lines[-1])
    assert {"nodes", "steps", "loss_start", "loss_end", "eval_loss_start", "eval_loss_end", "rounds"} <= set(summary)
    assert summary["nodes"] == 2 and summary["steps"] == 60
    assert summary["eval_loss_end"] < summary["eval_loss_start"] - 0.3, summary
    assert summary["loss_end"] < summary["loss_start"], summary
    assert summary["rounds"] >= 1
    assert not left, f"demo left node processes running: {left}"
    # each worker logged the effective outer momentum at role start (issue 6: the form's default
    # applies unless set; the demo sets none, so the NoLoCo default 0.5 is the one in force)
    starts = [json.loads(line) for log in tmp_path.glob("swarmnode-demo-*/*.log")
              for line in log.read_text().splitlines() if '"event": "outer_config"' in line]
    assert len(starts) == 2 and all(e["outer_momentum"] == 0.5 and "default" in e["msg"] for e in starts), starts


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def test_grpo_demo_reports_reward_and_accuracy_per_peer(tmp_path):
    """``swarmnode demo --role grpo``: 3 heterogeneous peers and a bootstrap; progress lines show
    reward and held-out accuracy per peer; the JSON line holds the issue's keys."""
    code, out, left = _run_demo(tmp_path, "--role", "grpo", "--steps", "8", "--json",
                                "--set", f"grpo.warmup_cache_dir={tmp_path / 'warm'}")
    assert code == 0, out[-3000:]
    lines = out.strip().splitlines()
    assert any("reward" in line and "accuracy" in line and "grpo-2:" in line for line in lines if line.startswith("["))
    assert not any(re.search(r"peers \d+\.", line) for line in lines), "peer counts print as integers"
    assert any(re.search(r"peers [12]\b", line) for line in lines), "no peer ever saw another's rollouts"
    summary = json.loads(lines[-1])
    assert {"accuracy_start", "accuracy_end", "reward_start", "reward_end", "rounds"} <= set(summary)
    assert not {"eval_loss_start", "eval_loss_end", "loss_start", "loss_end", "rounds_ok"} & set(summary), summary
    assert summary["nodes"] == 3 and summary["rounds"] == 8
    assert all(0.0 <= summary[k] <= 1.0 for k in ("accuracy_start", "accuracy_end", "reward_start", "reward_end"))
    assert summary["accuracy_start"] > 0      # the warm-up gives a non-zero start
    assert not left, f"demo left node processes running: {left}"
