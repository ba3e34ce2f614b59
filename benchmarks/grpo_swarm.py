"""Collaborative GRPO: F-TIS sharing (both topologies) vs training alone vs uncorrected sharing (docs/grpo.md, 'Benchmarks').

Measured on real swarms: for every seed and every arm (``solo``, ``uncorrected``, ``ftis`` in the
``horizontal`` topology and ``ftis`` in the ``vertical`` one: ``grpo.topology``, docs/grpo.md,
'Topologies') a
bootstrap and three ``grpo`` peers of different sizes (the embedded decoder at three widths and
depths, one byte tokenizer) run as node processes on 127.0.0.1 and exchange signed rollout
batches through the DHT index + gRPC Fetch, for the same number of rounds, from the same warmed-up
weights (the same ``grpo.model_seed`` per peer in every arm: the warm-up is computed once per
peer and seed, before the swarms start, and loaded from ``grpo.warmup_cache_dir``). The arms of
one seed run side by side (four swarms at once, one run ID: the same prompts every round in the
horizontal arms; vertical peers draw their own from it), seeds one after the other.

Every peer logs its held-out accuracy (mean local reward of ``eval_samples`` completions per
held-out prompt at the round temperature, fixed sampling seed) after the warm-up, every
``eval_every`` rounds and at the end; the curves per peer, mode and seed go into the JSON.

The top-level ``summary`` holds:
  reward_gain_ftis_vs_solo            final held-out accuracy, F-TIS / solo, per peer (mean over
                                      seeds of each), mean over the three peers, F-TIS in the
                                      default topology (``GRPOConfig().topology``)   target >= 1.2
  reward_ratio_ftis_vs_uncorrected    the same, F-TIS (default topology) / uncorrected sharing
                                      (horizontal)                                    target >= 1.05
  by_topology.{vertical,horizontal}   reward_gain_ftis_vs_solo (and its per-peer ratios) of F-TIS
                                      in each topology, against the same solo runs
plus the per-peer ratios, final accuracies per mode, bytes per token on the wire, the F-TIS
filtered fraction and mean weight, rounds trained and skipped. A PNG next to ``--out`` plots the
mean accuracy curves per mode and peer when matplotlib is importable (``pip install -e '.[bench]'``).

Commands (2 CPU cores; repository root, venv active; under the shared lock on a shared box)::

    python benchmarks/grpo_swarm.py --quick --out /tmp/grpo_swarm_quick.json   # 2 seeds, < 5 min
    python benchmarks/grpo_swarm.py --out /tmp/grpo_swarm.json                 # 3 seeds, longer runs
    python benchmarks/grpo_swarm.py --quick --topologies horizontal --out F     # the three-swarm run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # allow `python benchmarks/grpo_swarm.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.localswarm import LocalSwarm  # noqa: E402
from rl.grpo_config import GRPOConfig  # noqa: E402
from rl.grpo_demo import SIZES  # noqa: E402  (the demo's three heterogeneous peers)

MODES = ("solo", "uncorrected", "ftis")
TOPOLOGIES = ("horizontal", "vertical")
ARMS: dict[str, tuple[str, str]] = {"solo": ("solo", "horizontal"), "uncorrected": ("uncorrected", "horizontal"),
                                    "ftis_horizontal": ("ftis", "horizontal"), "ftis_vertical": ("ftis", "vertical")}
"""arm -> (grpo.mode, grpo.topology). One solo arm serves both topologies (a solo peer trains on
its own groups only; the topology would change which prompts it draws, not how it learns)."""
TARGETS = {"reward_gain_ftis_vs_solo": 1.2, "reward_ratio_ftis_vs_uncorrected": 1.05}

QUICK = {"rounds": 32, "round_s": 1.5, "eval_every": 32, "seeds": 2}
"""The quick run: 2 seeds, 32 rounds, held-out accuracy at the start and the end only (each
evaluation is 800 completions per peer; with 16 node processes on 2 cores the evaluations, not the
rounds, are most of a run's wall time): under 5 minutes on an idle 2-core machine."""
FULL = {"rounds": 150, "round_s": 2.0, "eval_every": 25, "seeds": 3}

GRPO: dict[str, Any] = {"max_operand": 5, "eval_samples": 8}
"""[grpo] settings every peer of every run shares on top of the role's defaults (the effective
section is recorded in the JSON); the modes differ only in ``grpo.mode``. Sums of two operands
0-5 (36 problems, as in ``swarmnode demo --role grpo``): the tiny CPU models learn them by RL
within tens of rounds, so a 2-core quick run shows the comparison; 8 samples per held-out
prompt (800 completions per evaluation) keep the evaluation noise near 0.015."""


def peer_settings(mode: str, seed: int, index: int, rounds: int, round_s: float, eval_every: int,
                  cache: str, topology: str = "horizontal") -> list[str]:
    d, layers, heads = SIZES[index]
    grpo = {**GRPO, "mode": mode, "topology": topology, "model_seed": 1000 * seed + index, "exit_after_rounds": rounds,
            "round_s": round_s, "eval_every": eval_every, "torch_threads": 1, "warmup_cache_dir": cache,
            "collect_frac": 0.5}
    return ([f"grpo.{k}={v}" for k, v in grpo.items()]
            + [f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}",
               "model.max_seq_len=64", "card.ttl_s=10", "card.refresh_s=2"])


def _prewarm_one(args: tuple[int, int, str]) -> dict[str, Any]:
    """One peer's warm-up, written to the cache the node will read (run in a worker process)."""
    seed, index, cache = args
    import torch

    from models import ModelConfig
    from rl.learner import Learner

    torch.set_num_threads(1)
    d, layers, heads = SIZES[index]
    cfg = GRPOConfig(**GRPO)
    t0 = time.perf_counter()
    learner = Learner(cfg, ModelConfig(d_model=d, n_layers=layers, n_heads=heads, max_seq_len=64),
                      1000 * seed + index, "prewarm", "prewarm")
    steps, acc = learner.warmup(cache)
    return {"seed": seed, "peer": index, "steps": steps, "accuracy": acc,
            "seconds": round(time.perf_counter() - t0, 1), "n_params": learner.n_params}


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{") and '"event"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _peer_result(text: str) -> dict[str, Any]:
    ev = _events(text)
    ready = next((e for e in ev if e.get("event") == "grpo_ready"), None)
    done = next((e for e in ev if e.get("event") == "training_finished"), None)
    rounds = [e for e in ev if e.get("event") == "grpo_round_done"]
    curve = ([[0, ready["accuracy"]]] if ready else []) + \
        [[e["trained"], e["accuracy"]] for e in ev if e.get("event") == "grpo_eval"]
    if done:
        curve.append([done["rounds"], done["accuracy_end"]])
    foreign = [e for e in rounds if e.get("n_foreign")]
    return {"accuracy_curve": curve, "accuracy_start": ready["accuracy"] if ready else None,
            "accuracy_end": done["accuracy_end"] if done else None,
            "reward_curve": [round(e["reward"], 4) for e in rounds],
            "rounds": done["rounds"] if done else len(rounds), "skipped": done["skipped"] if done else None,
            "peers_seen_mean": statistics.fmean([e["peers_seen"] for e in rounds]) if rounds else 0.0,
            "filtered_frac_mean": statistics.fmean([e["filtered_frac"] for e in foreign]) if foreign else 0.0,
            "weight_mean": statistics.fmean([e["weight_mean"] for e in foreign]) if foreign else None,
            "bytes_per_token": statistics.fmean([e["bytes_per_token"] for e in rounds]) if rounds else None,
            "finished": done is not None}


_SWARMS: list[LocalSwarm] = []


def _stop_everything(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT: the node processes run in sessions of their own; kill them by PID."""
    for swarm in list(_SWARMS):
        for node in swarm.nodes:
            swarm.kill(node)
    os._exit(128 + signum)


def run_swarm(arm: str, seed: int, p: dict[str, Any], cache: str, workdir: Path) -> dict[str, Any]:
    """Bootstrap + 3 peers for one (arm, seed); returns each peer's curves once all exited."""
    t0 = time.monotonic()
    mode, topology = ARMS[arm]
    # one run ID per seed: the arms' swarms (separate DHTs, side by side on one clock) see the same
    # prompts round by round (horizontal), so the arms differ in how they learn, not in what
    with LocalSwarm(run_id=f"grpo-bench-{seed}", workdir=workdir / f"{arm}-{seed}") as swarm:
        _SWARMS.append(swarm)
        # peers start with the bootstrap (they retry joining until it answers): saves a start-up
        boot = swarm.start("bootstrap", name="bootstrap")
        peers = [swarm.start("grpo", name=f"peer{i}",
                             extra_set=peer_settings(mode, seed, i, p["rounds"], p["round_s"], p["eval_every"], cache,
                                                     topology))
                 for i in range(len(SIZES))]
        deadline = time.monotonic() + 120 + p["rounds"] * p["round_s"] * 3
        while any(n.alive() for n in peers) and time.monotonic() < deadline:
            time.sleep(1.0)
        results = [_peer_result(n.log_text()) for n in peers]
        codes = [n.proc.poll() for n in peers]
        swarm.kill(boot)            # its job is done: no drain needed
    for r, code in zip(results, codes):
        r["exit_code"] = code
    return {"arm": arm, "mode": mode, "topology": topology, "seed": seed, "peers": results,
            "wall_s": round(time.monotonic() - t0, 1)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def summarize(runs: list[dict[str, Any]], seeds: Sequence[int], default: str = "horizontal") -> dict[str, Any]:
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    final = {a: [[None] * len(seeds) for _ in SIZES] for a in arms}   # final[arm][peer][seed]
    for run in runs:
        for i, peer in enumerate(run["peers"]):
            final[run["arm"]][i][seeds.index(run["seed"])] = peer["accuracy_end"]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if xs else None

    per_peer = {a: [mean(final[a][i]) for i in range(len(SIZES))] for a in arms}
    none = [None] * len(SIZES)
    by_topology = {}
    for topo in TOPOLOGIES:
        ftis = per_peer.get(f"ftis_{topo}")
        if ftis is None:
            continue
        gain = [_ratio(f, s) for f, s in zip(ftis, per_peer.get("solo", none))]
        ratio = [_ratio(f, u) for f, u in zip(ftis, per_peer.get("uncorrected", none))]
        by_topology[topo] = {"reward_gain_ftis_vs_solo": mean(gain), "gain_per_peer": gain,
                             "reward_ratio_ftis_vs_uncorrected": mean(ratio), "ratio_per_peer": ratio,
                             "final_accuracy_per_peer": ftis, "final_accuracy_mean": mean(ftis),
                             "ftis_filtered_frac_mean": mean([p["filtered_frac_mean"] for r in runs
                                                              if r["arm"] == f"ftis_{topo}" for p in r["peers"]]),
                             "ftis_weight_mean": mean([p["weight_mean"] for r in runs if r["arm"] == f"ftis_{topo}"
                                                       for p in r["peers"]])}
    shown = default if default in by_topology else next(iter(by_topology), default)  # --topologies without it
    head = by_topology.get(shown, {})
    shared = [p for r in runs if r["mode"] != "solo" for p in r["peers"]]
    summary = {
        "default_topology": default,
        "topology": shown,  # the topology of the top-level F-TIS figures
        "reward_gain_ftis_vs_solo": head.get("reward_gain_ftis_vs_solo"),
        "reward_ratio_ftis_vs_uncorrected": head.get("reward_ratio_ftis_vs_uncorrected"),
        "gain_per_peer": head.get("gain_per_peer"), "ratio_per_peer": head.get("ratio_per_peer"),
        "by_topology": by_topology,
        "final_accuracy_per_peer": per_peer,
        "final_accuracy_mean": {a: mean(per_peer[a]) for a in arms},
        "start_accuracy_per_peer": [mean([p["peers"][i]["accuracy_start"] for p in runs]) for i in range(len(SIZES))],
        "bytes_per_token_mean": mean([p["bytes_per_token"] for p in shared]),
        "ftis_filtered_frac_mean": head.get("ftis_filtered_frac_mean"),
        "ftis_weight_mean": head.get("ftis_weight_mean"),
        "peers_seen_mean": mean([p["peers_seen_mean"] for p in shared]),
        "rounds_min": min(p["rounds"] for r in runs for p in r["peers"]),
        "skipped_total": sum(p["skipped"] or 0 for r in runs for p in r["peers"]),
        "all_finished": all(p["finished"] for r in runs for p in r["peers"]),
    }
    summary["targets"] = {k: {">=": t, "met": summary[k] is not None and summary[k] >= t} for k, t in TARGETS.items()}
    return summary


def _plot(runs: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - the JSON says why no plot was written
        return {"written": False, "reason": f"matplotlib not importable ({exc!r}); pip install -e '.[bench]'"}
    fig, axes = plt.subplots(1, len(SIZES), figsize=(4.2 * len(SIZES), 3.4), sharey=True)
    colors = {"solo": "tab:gray", "uncorrected": "tab:orange", "ftis_horizontal": "tab:blue",
              "ftis_vertical": "tab:green"}
    for i, ax in enumerate(axes):
        for arm in [a for a in ARMS if any(r["arm"] == a for r in runs)]:
            curves = [r["peers"][i]["accuracy_curve"] for r in runs if r["arm"] == arm]
            points: dict[int, list[float]] = {}
            for c in curves:
                for step, acc in c:
                    points.setdefault(int(step), []).append(acc)
            xs = sorted(points)
            ax.plot(xs, [statistics.fmean(points[x]) for x in xs], marker="o", ms=3, label=arm, color=colors[arm])
        d, layers, _ = SIZES[i]
        ax.set_title(f"peer {i}: d_model {d}, {layers} layers")
        ax.set_xlabel("GRPO rounds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (mean over seeds)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"written": True, "path": str(path)}


def run(quick: bool, out: Path, seeds: Sequence[int], rounds: int | None = None,
        topologies: Sequence[str] = TOPOLOGIES) -> dict[str, Any]:
    p = dict(QUICK if quick else FULL)
    arms = [a for a, (mode, topo) in ARMS.items() if mode != "ftis" or topo in topologies]
    default = GRPOConfig().topology
    if rounds:
        p["rounds"] = rounds
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)           # before minutes of work, not after
    cache = str(Path(GRPOConfig().warmup_cache_dir).expanduser())   # deterministic: reused across runs
    workdir = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    with ProcessPoolExecutor(2) as pool:
        warm = list(pool.map(_prewarm_one, [(s, i, cache) for s in seeds for i in range(len(SIZES))]))
    print(f"warm-up: {len(warm)} peers in {time.monotonic() - t0:.0f} s, accuracy "
          + ", ".join(f"{w['accuracy']:.2f}" for w in warm), flush=True)
    runs = []
    for seed in seeds:
        with ThreadPoolExecutor(len(arms)) as ex:
            got = list(ex.map(lambda a: run_swarm(a, seed, p, cache, workdir), arms))
        for g in got:
            print(f"seed {seed} {g['arm']:>15}: final accuracy "
                  + " ".join(f"{q['accuracy_end'] if q['accuracy_end'] is not None else float('nan'):.3f}"
                             for q in g["peers"]) + f" ({g['wall_s']:.0f} s)", flush=True)
        runs.extend(got)
    summary = summarize(runs, list(seeds), default)
    result = {"summary": summary, "runs": runs, "warmup": warm,
              "config": {"quick": quick, **p, "seeds": list(seeds), "sizes": SIZES, "arms": {a: ARMS[a] for a in arms},
                         "grpo": GRPOConfig(**GRPO).model_dump(),
                         "transport": "DHT index + gRPC Fetch (real node processes on 127.0.0.1)"},
              "wall_s": round(time.monotonic() - t0, 1)}
    out.write_text(json.dumps(result, indent=1))             # the figures first: a failing plot loses nothing
    result["plot"] = _plot(runs, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=1))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (< 5 min on 2 cores)")
    ap.add_argument("--out", type=Path, required=True, help="JSON result file (a PNG is written next to it)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds, the same for every mode (default: 3, --quick 2; the headline wants 3)")
    ap.add_argument("--rounds", type=int, default=None, help="override the rounds per run")
    ap.add_argument("--grpo", action="append", default=[], metavar="KEY=VALUE",
                    help="a [grpo] setting for every peer of every arm on top of the benchmark's (repeatable), "
                         "e.g. --grpo steps_per_round=1")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES),
                    help="F-TIS arms to run, comma-separated (horizontal, vertical); solo and uncorrected always run")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_everything)
    signal.signal(signal.SIGINT, _stop_everything)
    for item in args.grpo:
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in GRPOConfig.model_fields:
            ap.error(f"--grpo {item!r}: use KEY=VALUE with a [grpo] field, e.g. steps_per_round=1")
        GRPO[key.strip()] = value.strip()       # validated below; read by the warm-up workers and every peer
    try:
        GRPOConfig(**GRPO)
    except ValueError as exc:
        ap.error(f"--grpo: {exc}")
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    if not topologies or set(topologies) - set(TOPOLOGIES):
        ap.error(f"--topologies {args.topologies!r}: use a comma-separated subset of {','.join(TOPOLOGIES)}")
    seeds = args.seeds or (QUICK if args.quick else FULL)["seeds"]
    res = run(args.quick, args.out, list(range(seeds)), args.rounds, topologies)
    s = res["summary"]
    print(json.dumps({k: s[k] for k in ("default_topology", "reward_gain_ftis_vs_solo",
                                        "reward_ratio_ftis_vs_uncorrected", "final_accuracy_mean",
                                        "bytes_per_token_mean")}))
    print(json.dumps({t: v["reward_gain_ftis_vs_solo"] for t, v in s["by_topology"].items()}))
    print(f"wrote {args.out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
