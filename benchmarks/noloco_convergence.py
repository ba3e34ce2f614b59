"""NoLoCo vs DiLoCo convergence, single process (docs/noloco.md, 'Benchmarks').

W replicas of the tiny `models/` LLaMA train side by side with the real inner optimizer
(models/optim.py: AdamW, warm-up + cosine, clip 1.0) and the real `optimizers/` outer code; the "exchange" is an exact in-memory group mean
(deterministic). Every run uses the same seed, initial weights, data shards and validation batches.

Runs (pick with --runs):
    allreduce        gradients averaged every inner step (one model; the per-step upper bound)
    diloco           DiLoCo heavy-ball (eta 0.7, mu 0.3), global group every H steps
    diloco_nesterov  DiLoCo Nesterov (eta 0.7, mu 0.9), global group every H steps
    noloco           NoLoCo, pairs (k 2), beta = gamma 0.7 (tied), alpha 0.5
    noloco_gamma0    ablation: consensus gamma = 0 (2-tensor exchange)
    noloco_k4        ablation: groups of 4
    noloco_fixed     ablation: the same pairs every round (frozen pairs)
    local            no averaging at all

Metrics: validation loss vs inner steps for the worker-mean model (average of the W replicas'
weights) and for each replica (pitfall 9: report both), replica spread
sqrt(sum_w ||theta_w - mean(theta)||^2 / (P*W)) (taken at outer steps, where theta = phi), and
bytes sent per worker (fp32: a group of n moves 2(n-1)/n copies of each exchanged buffer each way,
so a NoLoCo pair sends 1 model copy per round and a DiLoCo all-reduce 2(W-1)/W).

Commands (2 CPU cores):
    python benchmarks/noloco_convergence.py --quick --out /tmp/noloco_quick.json     # < 3 min
    python benchmarks/noloco_convergence.py --W 4 8 --seeds 0 1 2 --out full.json     # hours
From code: `from benchmarks.noloco_convergence import run; result = run(quick=True)`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # allow `python benchmarks/noloco_convergence.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.optim import InnerConfig, build_optimizer, inner_lr_scheduler, inner_step  # noqa: E402
from optimizers.diloco import DiLoCoOuter  # noqa: E402
from optimizers.grouping import groups_for_roster  # noqa: E402
from optimizers.noloco import NoLoCoOuter, copy_into, replica_spread  # noqa: E402

# name -> (outer kind, options, H in the full setting [the official code's defaults])
RUNS: dict[str, tuple[str, dict[str, Any], int]] = {
    "allreduce": ("allreduce", {}, 1),
    "diloco": ("diloco", {"momentum": "heavyball", "outer_lr": 0.7, "outer_momentum": 0.3}, 100),
    "diloco_nesterov": ("diloco", {"momentum": "nesterov", "outer_lr": 0.7,
                                   "outer_momentum": 0.9}, 100),
    "noloco": ("noloco", {"k": 2, "outer_lr": 0.7, "outer_momentum": 0.5, "consensus": "tied"}, 50),
    "noloco_gamma0": ("noloco", {"k": 2, "outer_lr": 0.7, "outer_momentum": 0.5,
                                 "consensus": 0.0}, 50),
    "noloco_k4": ("noloco", {"k": 4, "outer_lr": 0.7, "outer_momentum": 0.5,
                             "consensus": "tied"}, 50),
    "noloco_fixed": ("noloco", {"k": 2, "outer_lr": 0.7, "outer_momentum": 0.5,
                                "consensus": "tied", "fixed": True}, 50),
    "local": ("local", {}, 1),
}
QUICK = dict(W=(4,), steps=200, H=20, d_model=64, n_layers=2, n_heads=4, seq_len=64,
             batch_size=8, seeds=(0,), runs=("noloco", "diloco", "local", "allreduce"),
             eval_batches=4, max_train_bytes=2_000_000, warmup=20)
FULL = dict(W=(4, 8), steps=2000, H=None, d_model=128, n_layers=4, n_heads=4, seq_len=128,
            batch_size=16, seeds=(0, 1, 2),
            runs=("allreduce", "diloco", "diloco_nesterov", "noloco", "noloco_gamma0",
                  "noloco_k4", "noloco_fixed", "local"),
            eval_batches=8, max_train_bytes=8_000_000, warmup=100)


def _mean_params(models: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    cols = zip(*(list(m.parameters()) for m in models))
    return [torch.stack([p.detach().float() for p in col]).mean(0) for col in cols]


def _fp32_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(4 * t.numel() for t in tensors)


def _train_one(name: str, W: int, H: int, steps: int, seed: int, model_cfg, corpus, val_batches,
               inner: InnerConfig, batch_size: int, seq_len: int, eval_every: int,
               layout: str) -> dict[str, Any]:
    from models.corpus import batches, evaluate
    from models.llama import build_model, lm_loss

    kind, opts, _ = RUNS[name]
    t0 = time.perf_counter()
    base = build_model(model_cfg, seed)
    n_models = 1 if kind == "allreduce" else W
    models = [copy.deepcopy(base) for _ in range(n_models)]
    params = [list(m.parameters()) for m in models]
    P = sum(p.numel() for p in params[0])
    adams = [build_optimizer(ps, inner) for ps in params]
    scheds = [inner_lr_scheduler(a, inner) for a in adams]
    streams = [batches(corpus.train, batch_size, seq_len, seed=seed, shard=w, num_shards=W,
                       layout=layout) for w in range(W)]
    if kind == "noloco":
        outers = [NoLoCoOuter(ps, opts["outer_lr"], opts["outer_momentum"], opts["consensus"])
                  for ps in params]
    elif kind == "diloco":
        outers = [DiLoCoOuter(ps, opts["outer_lr"], opts["outer_momentum"], opts["momentum"])
                  for ps in params]
    else:
        outers = []
    ids = [f"worker{w:02d}" for w in range(W)]
    scratch = copy.deepcopy(base)
    curve: list[dict[str, Any]] = []
    sent_bytes = 0.0                       # per worker, fp32
    group_sizes: list[int] = []
    train_losses: list[float] = []

    def record(step: int) -> None:
        replica_losses = [evaluate(m, val_batches) for m in models]
        if len(models) > 1:
            copy_into(list(scratch.parameters()), _mean_params(models))
            mean_loss = evaluate(scratch, val_batches)
        else:
            mean_loss = replica_losses[0]
        curve.append({
            "step": step,
            "eval_loss_mean_model": mean_loss,
            "eval_loss_replicas": replica_losses,
            "eval_loss_replica_mean": statistics.fmean(replica_losses),
            "replica_spread": replica_spread(params) if len(models) > 1 else 0.0,
            "train_loss": statistics.fmean(train_losses[-H:]) if train_losses else None,
            "sent_bytes_per_worker": sent_bytes,
        })

    record(0)
    for step in range(1, steps + 1):
        if kind == "allreduce":
            adam, model = adams[0], models[0]
            adam.zero_grad(set_to_none=True)
            total = 0.0
            for w in range(W):
                x, y = next(streams[w])
                loss = lm_loss(model(x), y) / W
                loss.backward()
                total += loss.item()
            train_losses.append(total)
            if inner.clip_norm:
                torch.nn.utils.clip_grad_norm_(params[0], inner.clip_norm)
            adam.step()
            scheds[0].step()
            sent_bytes += 2 * (W - 1) / W * 4 * P       # gradient all-reduce each step
        else:
            step_losses = []
            for w in range(W):
                step_losses.append(inner_step(models[w], next(streams[w]), adams[w], scheds[w], params[w],
                                              inner.clip_norm))
            train_losses.append(statistics.fmean(step_losses))
        if outers and step % H == 0:
            r = step // H
            if kind == "diloco":
                groups = [list(range(W))]
            else:
                pairing_round = 0 if opts.get("fixed") else r
                groups = [[ids.index(p) for p in g]
                          for g in groups_for_roster(ids, pairing_round, seed, H, opts["k"])]
            plans = []
            for g in groups:                           # exact in-memory group means first ...
                sent = [outers[w].exchange_tensors(params[w]) for w in g]
                means = [torch.stack(col).mean(0) for col in zip(*sent)]
                n = len(g)
                for w in g:
                    theta_bar, phi_bar = outers[w].split_means(means)
                    plans.append((w, theta_bar, phi_bar, n))
                    sent_bytes += 2 * (n - 1) / n * _fp32_bytes(sent[0]) / W
                group_sizes.append(n)
            for w, theta_bar, phi_bar, n in plans:     # ... then every member steps
                new_phi = outers[w].outer_step(params[w], theta_bar, phi_bar, n)
                copy_into(params[w], new_phi)          # theta <- phi; Adam state kept
        if step % eval_every == 0 or step == steps:
            record(step)
    final = curve[-1]
    return {
        "run": name, "W": W, "H": H if outers else None, "seed": seed, "params": P,
        "options": {k: v for k, v in opts.items()},
        "curve": curve,
        "final_eval_loss_mean_model": final["eval_loss_mean_model"],
        "final_eval_loss_replica_mean": final["eval_loss_replica_mean"],
        "final_replica_spread": final["replica_spread"],
        "sent_bytes_per_worker": sent_bytes,
        "sent_bytes_per_worker_per_inner_step": sent_bytes / steps,
        "model_copies_sent_per_worker": sent_bytes / (4 * P),
        "mean_group_size": statistics.fmean(group_sizes) if group_sizes else None,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _agg(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def run(quick: bool = True, W: Sequence[int] | None = None, steps: int | None = None,
        H: int | None = None, seeds: Sequence[int] | None = None,
        runs: Sequence[str] | None = None, lr: float = 3e-3, threads: int = 1,
        layout: str = "interleaved", eval_every: int | None = None,
        log=print) -> dict[str, Any]:
    """Run the benchmark and return the result dict (also what `--out` writes).

    quick=True is the CI size (W 4, 200 steps, H 20 for every run, d 64, 2 layers, seq 64,
    batch 8, one seed). quick=False is the full setting (W 4 and 8, 2000 steps, d 128, 4 layers, seq 128,
    batch 16, 3 seeds, H from each run's recipe unless `H` is given). lr is the peak inner LR
    (3e-3 suits these tiny models; the 125M recipe's 6e-4 barely moves them in 200 steps)."""
    from models.config import DataConfig, ModelConfig
    from models.corpus import eval_batches, load_corpus

    preset = QUICK if quick else FULL
    W_list = tuple(W or preset["W"])
    steps = steps or preset["steps"]
    seeds = tuple(seeds if seeds is not None else preset["seeds"])
    runs = tuple(runs or preset["runs"])
    H_fixed = H if H is not None else preset["H"]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {sorted(RUNS)}")
    torch.set_num_threads(threads)
    model_cfg = ModelConfig(d_model=preset["d_model"], n_layers=preset["n_layers"],
                            n_heads=preset["n_heads"], max_seq_len=preset["seq_len"])
    data_cfg = DataConfig(seq_len=preset["seq_len"], batch_size=preset["batch_size"],
                          max_train_bytes=preset["max_train_bytes"])
    t0 = time.perf_counter()
    corpus = load_corpus(data_cfg)
    val = eval_batches(corpus.val, preset["batch_size"], preset["seq_len"], preset["eval_batches"])
    inner = InnerConfig(lr=lr, warmup=min(preset["warmup"], steps), total_steps=steps,
                        min_lr_ratio=0.1)
    results = []
    for w in W_list:
        for name in runs:
            kind, _, recipe_H = RUNS[name]
            h = 1 if kind in ("allreduce", "local") else (H_fixed or recipe_H)
            if kind == "noloco" and RUNS[name][1]["k"] > w:
                log(f"skip {name} at W={w}: group size exceeds W")
                continue
            ev = eval_every or H_fixed or 100
            for seed in seeds:
                res = _train_one(name, w, h, steps, seed, model_cfg, corpus, val, inner,
                                 preset["batch_size"], preset["seq_len"], ev, layout)
                results.append(res)
                log(f"W={w} {name:16s} seed={seed} H={res['H']} eval(mean model)="
                    f"{res['final_eval_loss_mean_model']:.4f} eval(replica mean)="
                    f"{res['final_eval_loss_replica_mean']:.4f} spread="
                    f"{res['final_replica_spread']:.2e} copies sent/worker="
                    f"{res['model_copies_sent_per_worker']:.1f} wall={res['wall_s']}s")

    table: dict[str, dict[str, Any]] = {}
    for res in results:
        key = f"W{res['W']}/{res['run']}"
        table.setdefault(key, {"runs": []})["runs"].append(res)
    for key, entry in table.items():
        rs = entry.pop("runs")
        entry.update({
            "eval_loss_mean_model": _agg([r["final_eval_loss_mean_model"] for r in rs]),
            "eval_loss_replica_mean": _agg([r["final_eval_loss_replica_mean"] for r in rs]),
            "replica_spread": _agg([r["final_replica_spread"] for r in rs]),
            "sent_bytes_per_worker": rs[0]["sent_bytes_per_worker"],
            "model_copies_sent_per_worker": rs[0]["model_copies_sent_per_worker"],
            "H": rs[0]["H"], "seeds": [r["seed"] for r in rs],
        })

    W0 = W_list[0]

    def final(name: str, field: str = "eval_loss_mean_model") -> float | None:
        entry = table.get(f"W{W0}/{name}")
        return entry[field]["mean"] if entry else None

    noloco, diloco = final("noloco"), final("diloco")
    summary = {
        "W": W0, "inner_steps": steps,
        "eval_loss_ratio_noloco_vs_diloco": (noloco / diloco) if noloco and diloco else None,
        "eval_loss_noloco": noloco,
        "eval_loss_diloco": diloco,
        "eval_loss_local": final("local"),
        "eval_loss_allreduce": final("allreduce"),
        "eval_loss_noloco_replica_mean": final("noloco", "eval_loss_replica_mean"),
        "replica_spread_noloco": final("noloco", "replica_spread"),
        "model_copies_sent_per_worker_noloco": (table.get(f"W{W0}/noloco") or {}).get(
            "model_copies_sent_per_worker"),
        "model_copies_sent_per_worker_diloco": (table.get(f"W{W0}/diloco") or {}).get(
            "model_copies_sent_per_worker"),
        "note": "eval_loss_* = validation loss of the worker-mean model after the last outer "
                "step (mean over seeds); ratio < 1 means NoLoCo ahead",
    }
    return {
        "benchmark": "noloco_convergence",
        "summary": summary,
        "config": {"quick": quick, "W": list(W_list), "steps": steps, "H": H_fixed,
                   "seeds": list(seeds), "runs": list(runs), "layout": layout,
                   "threads": threads, "model": model_cfg.model_dump(),
                   "data": data_cfg.model_dump(), "inner": inner.model_dump(),
                   "corpus": corpus.source, "val_batches": len(val)},
        "table": table,
        "results": results,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: W 4, 200 steps, H 20, < 3 min")
    ap.add_argument("--W", type=int, nargs="+", help="worker counts (default 4; full: 4 8)")
    ap.add_argument("--steps", type=int, help="inner steps per run")
    ap.add_argument("--H", type=int, help="inner steps per outer round for every run")
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--runs", nargs="+", choices=sorted(RUNS))
    ap.add_argument("--lr", type=float, default=3e-3, help="peak inner LR")
    ap.add_argument("--eval-every", type=int, help="inner steps between evaluations")
    ap.add_argument("--layout", choices=["interleaved", "contiguous"], default="interleaved",
                    help="contiguous = the non-IID variant (each worker its own files)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 avoids OpenMP oversubscription on a shared 2-core box)")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    args = ap.parse_args(argv)
    result = run(quick=args.quick, W=args.W, steps=args.steps, H=args.H, seeds=args.seeds,
                 runs=args.runs, lr=args.lr, threads=args.threads, layout=args.layout,
                 eval_every=args.eval_every,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    text = json.dumps(result, indent=1, default=float)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(math.isfinite(r["final_eval_loss_mean_model"])
                    for r in result["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
