"""Cost of being a swarm node: a noloco worker's inner-step throughput inside a running node
against a bare torch loop training the same model the same way (issue 9).

    python -m benchmarks.node_overhead --out node_overhead.json [--quick] [--device cpu|cuda]

1. Starts a real swarm on 127.0.0.1 (``node.localswarm.LocalSwarm``): a bootstrap and one
   ``noloco`` worker (its own hivemind DHT process, p2pd, gRPC server, ops HTTP /metrics, card
   heartbeat, solo outer rounds every ``inner_steps``; evaluation and checkpoints off so that
   nothing but the node's own machinery runs beside the inner steps).
2. Starts the *bare* loop in a plain child process (``--bare-worker``): the model, AdamW, LR
   schedule, batches, torch threads, device and precision come from the very same settings
   (``NoLoCoRole.validate_config`` of the same ``--set`` list), and each step is timed exactly as
   the role times it (``perf_counter`` around fetching the batch + ``models.optim.inner_step``),
   with the node daemon's malloc tuning (``tune_allocator``; ``--malloc default`` turns it off on
   both sides), so the ratio isolates the node's machinery, not a process-wide setting.
3. Alternates phases of ``--phase-s`` seconds, ABBA order, ``--repeats`` times: while one side
   runs the other is idle (the node's whole process group is SIGSTOPped; the bare process waits
   on its stdin). A node phase is measured from ``/metrics``: the deltas of
   ``swarmnode_train_tokens_total`` and ``swarmnode_train_step_duration_seconds_sum`` between a
   scrape taken ``SETTLE_S`` after SIGCONT (so a step cut by the pause is never counted) and one
   at the end of the phase. A bare phase reports the same two sums.
4. ``tokens/s = tokens / step seconds`` for each phase; the summary ratio is the median of the
   per-repeat ratios (each node phase over its adjacent bare phase, so slow drifts of the
   machine's load cancel), with their range and median(node) / median(bare) beside it. ``uptime`` load averages before and after are recorded: the
   machine may be shared, so judge the figure by its range and re-measure on a quiet host.

Target (issue 9): ``summary.train_throughput_ratio_node_vs_bare`` >= 0.95 on CPU. ``--quick``
(CI-sized) finishes in well under 5 minutes. Every process it starts is stopped by PID /
process group.
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

TARGET_RATIO = 0.95
SETTLE_S = 1.5
READY_TIMEOUT_S = 180.0


def node_sets(threads: int, device: str, precision: str) -> list[str]:
    """The ``--set`` list both sides are built from."""
    return [f"noloco.torch_threads={threads}", "noloco.inner_steps=100", "noloco.round_timeout=1.0",
            "noloco.eval_every=0", "noloco.checkpoint_every=0", "noloco.join_from_peers=false",
            f"device.device={device}", f"device.precision={precision}"]


def _overrides(sets: list[str]) -> dict[str, Any]:
    from node.config import parse_set

    return {"role": "noloco", **parse_set(sets)}


# ---- the bare loop (child process) ---------------------------------------------------------
def bare_worker(sets: list[str]) -> int:
    """Plain process: build exactly what the role builds, then on each ``run S`` line of stdin
    train for S seconds and print one JSON line {tokens, step_s, steps}. ``quit`` ends it."""
    import torch

    from models.corpus import batches, load_corpus
    from models.hf_adapter import build_from_config
    from models.optim import build_optimizer, inner_lr_scheduler, inner_step
    from node.config import load_config
    from node.device import autocast, grad_scaler, resolve_device, to_device
    from optimizers.noloco_role import NoLoCoRole
    from protocol.grpc_options import tune_allocator

    tuned = tune_allocator()  # the node daemon does this at start (run_node); same malloc on both sides
    cfg = load_config(None, _overrides(sets), environ={})
    s = NoLoCoRole.validate_config(cfg)
    w = s.noloco
    if w.torch_threads:
        torch.set_num_threads(w.torch_threads)
    dev = resolve_device(cfg.device)
    model = build_from_config(s.model, seed=w.seed).to(dev)
    params = [p for _, p in model.named_parameters()]
    opt = build_optimizer(params, w.inner)
    sched = inner_lr_scheduler(opt, w.inner)
    scaler = grad_scaler(dev, cfg.device.precision)
    corpus = load_corpus(s.data)
    it = batches(corpus.train, s.data.batch_size, s.data.seq_len, w.seed, shard=0, num_shards=w.data_shards)
    model.train()
    print(json.dumps({"ready": True, "device": str(dev), "threads": torch.get_num_threads(), "malloc_tuned": tuned}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        seconds = float(cmd[1])
        tokens = steps = 0
        step_s = 0.0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            batch = next(it)
            if dev.type != "cpu":
                batch = (to_device(batch[0], dev), to_device(batch[1], dev))
            inner_step(model, batch, opt, sched, params, w.inner.clip_norm,
                       autocast=autocast(dev, cfg.device.precision), scaler=scaler)
            step_s += time.perf_counter() - t0
            tokens += batch[0].numel()
            steps += 1
        print(json.dumps({"tokens": tokens, "step_s": step_s, "steps": steps}), flush=True)
    return 0


# ---- harness -------------------------------------------------------------------------------
def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _scrape(node) -> tuple[float, float, float]:
    m = node.metrics()
    return (m.get("swarmnode_train_tokens_total", 0.0), m.get("swarmnode_train_step_duration_seconds_sum", 0.0),
            m.get("swarmnode_train_step_duration_seconds_count", 0.0))


def _pause(node, stop: bool) -> None:
    try:
        os.killpg(node.pid, signal.SIGSTOP if stop else signal.SIGCONT)
    except ProcessLookupError:
        pass


def node_phase(node, seconds: float) -> dict[str, float]:
    _pause(node, False)
    time.sleep(SETTLE_S)  # a step cut by the last pause completes (and is recorded) before the baseline
    t0, s0, c0 = _scrape(node)
    w0 = time.perf_counter()
    time.sleep(seconds)
    t1, s1, c1 = _scrape(node)
    wall = time.perf_counter() - w0
    _pause(node, True)
    if c1 <= c0:
        raise RuntimeError(f"the worker took no inner step in {seconds} s; see {node.log_path}")
    return {"tokens": t1 - t0, "step_s": s1 - s0, "steps": c1 - c0, "wall_s": wall}


def bare_phase(proc: subprocess.Popen, seconds: float) -> dict[str, float]:
    proc.stdin.write(f"run {seconds}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the bare loop exited ({proc.poll()})")
    out = json.loads(line)
    out["wall_s"] = seconds
    return out


def tps(p: dict[str, float]) -> float:
    return p["tokens"] / p["step_s"] if p["step_s"] > 0 else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from node.localswarm import LocalSwarm

    sets = node_sets(args.threads, args.device, args.precision)
    repeats = args.repeats or (6 if args.quick else 10)
    phase_s = args.phase_s or (4.0 if args.quick else 10.0)
    load_before = _load()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t_start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.malloc == "default":
        env["SWARMNODE_MALLOC"] = "default"  # both sides untuned (protocol.grpc_options.tune_allocator)
    bare = subprocess.Popen([sys.executable, "-m", "benchmarks.node_overhead", "--bare-worker", "--sets",
                             json.dumps(sets)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[1]), env=env, start_new_session=True)
    phases: list[dict[str, Any]] = []
    try:
        with LocalSwarm(run_id="node-overhead", common_set=[], env=env) as swarm:
            swarm.start("bootstrap", name="bootstrap")
            worker = swarm.start("noloco", name="worker", extra_set=sets)
            swarm.wait_ready(timeout=READY_TIMEOUT_S)
            hello = json.loads(bare.stdout.readline() or "{}")
            if not hello.get("ready"):
                raise RuntimeError(f"the bare loop did not start (exit {bare.poll()})")
            # warm-up both sides (allocator, first-step costs), not recorded
            deadline = time.monotonic() + 60
            while _scrape(worker)[2] < 20 and time.monotonic() < deadline:
                time.sleep(0.2)
            _pause(worker, True)
            bare_phase(bare, 2.0)
            for r in range(repeats):
                order = ("node", "bare") if r % 2 == 0 else ("bare", "node")
                for side in order:
                    p = node_phase(worker, phase_s) if side == "node" else bare_phase(bare, phase_s)
                    p.update(side=side, repeat=r, tokens_per_s=round(tps(p), 1), load=_load())
                    phases.append(p)
                    print(f"repeat {r} {side:4s}: {p['tokens_per_s']:10.1f} tok/s  ({int(p['steps'])} steps, "
                          f"load {p['load'][0]})", flush=True)
            _pause(worker, False)
            log_tail = worker.log_text()[-2000:] if not worker.alive() else ""
    finally:
        try:
            bare.stdin.write("quit\n")
            bare.stdin.flush()
            bare.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            os.killpg(bare.pid, signal.SIGKILL)
            bare.wait(timeout=10)
    node_t = [p["tokens_per_s"] for p in phases if p["side"] == "node"]
    bare_t = [p["tokens_per_s"] for p in phases if p["side"] == "bare"]
    per_repeat = []
    for r in range(repeats):
        n = next(p for p in phases if p["repeat"] == r and p["side"] == "node")
        b = next(p for p in phases if p["repeat"] == r and p["side"] == "bare")
        per_repeat.append(round(n["tokens_per_s"] / b["tokens_per_s"], 4) if b["tokens_per_s"] else 0.0)
    of_medians = statistics.median(node_t) / statistics.median(bare_t) if bare_t and statistics.median(bare_t) else 0.0
    ratio = statistics.median(per_repeat) if per_repeat else 0.0
    import torch

    return {
        "benchmark": "node_overhead",
        "summary": {
            "train_throughput_ratio_node_vs_bare": round(ratio, 4),
            "ratio_per_repeat": per_repeat,
            "ratio_of_medians": round(of_medians, 4),
            "ratio_range": [min(per_repeat), max(per_repeat)] if per_repeat else [],
            "node_tokens_per_s_median": round(statistics.median(node_t), 1) if node_t else 0.0,
            "bare_tokens_per_s_median": round(statistics.median(bare_t), 1) if bare_t else 0.0,
            "meets_target": ratio >= TARGET_RATIO,
        },
        "targets": {"train_throughput_ratio_node_vs_bare": f">= {TARGET_RATIO} on CPU"},
        "setup": {"device": args.device, "precision": args.precision, "torch_threads": args.threads,
                  "phase_s": phase_s, "repeats": repeats, "settle_s": SETTLE_S, "quick": bool(args.quick),
                  "node_sets": sets, "bare_device": hello.get("device"), "bare_threads": hello.get("threads"),
                  "malloc": args.malloc, "bare_malloc_tuned": hello.get("malloc_tuned"),
                  "measure": "tokens / summed inner-step seconds (batch fetch + inner_step), node from /metrics"},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform(), "uptime_before": uptime_before,
                    "load_before": load_before, "load_after": _load(),
                    "note": "shared machine: load averages above show what else ran; re-measure on a quiet host"},
        "phases": phases,
        "worker_log_tail_if_exited": log_tail,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--quick", action="store_true", help="6 repeats of 4 s phases (well under 5 minutes)")
    ap.add_argument("--repeats", type=int, default=0, help="ABBA repeats (default 10; 6 with --quick)")
    ap.add_argument("--phase-s", type=float, default=0.0, help="seconds per phase (default 10; 4 with --quick)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on both sides")
    ap.add_argument("--device", default="cpu", help="device.device for both sides (cpu, cuda, cuda:N)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--malloc", default="tuned", choices=("tuned", "default"),
                    help="glibc malloc settings on both sides: the node daemon's tuning (default) or glibc's own")
    ap.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sets", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_worker:
        return bare_worker(json.loads(args.sets))
    if not args.out:
        ap.error("--out FILE is required")
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    print(f"node {s['node_tokens_per_s_median']} tok/s vs bare {s['bare_tokens_per_s_median']} tok/s: ratio "
          f"{s['train_throughput_ratio_node_vs_bare']} (per repeat {s['ratio_per_repeat']}; target >= {TARGET_RATIO})"
          f" in {result['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
