"""Compressed outer exchanges vs fp32 on REAL worker processes over emulated WAN links
(docs/noloco.md, 'Benchmarks'). Writes one JSON.

Per outer mode (NoLoCo pairs, DiLoCo group average) and compressor setting (``noloco.compression``
``int8`` / ``int4`` / ``sign`` / ``topk`` with ``compression_block`` / ``compression_topk``; NoLoCo sends its
phi int8 every ``compression_phi_every`` = 8 rounds): a bootstrap and W ``noloco`` role processes on
127.0.0.1 (real DHTs, real gRPC exchanges, real encoders), every link 100 Mbit/s and 40 ms one way
(``node/netem.py``, ``netem.default``: each sender paces its own exchange traffic), the same inner
steps (``exit_after``) and the same seed everywhere. Each arm of one seed reuses the same worker
keys, so the peer IDs, and with them the data shards and the DiLoCo root, are the same in every
arm: the arms differ only in what the exchange sends.

Model and phase, and why: the built-in Llama at ``d_model=256, n_layers=4`` (3.2 M parameters,
12.8 MB of fp32: about 1.0 s per direction at 100 Mbit/s, 12.5 MB/s) with batches of 2 x 32 tokens
and ``inner_steps=10``: a phase of compute (about 0.5-0.8 s with two workers on the 2 cores, an
evaluation every round) is shorter than one fp32 transfer, the setting compression is for (a
1 B-parameter model on a home uplink is far deeper in it: 4 GB per round). Two workers per arm
in both runs: a worker per core is what this machine hosts without the workers slowing each
other. With 4 workers on 2 cores (measured: ``--set`` did not change this) the CPU contention
spreads their arrivals; the slow fp32 exchange re-aligns them every round while the fast
compressed one does not, so compressed NoLoCo rounds went solo more often (14 of 80 vs 4 of 80
at ``wait_fraction`` 1; 28 of 80 vs 0 at the default 0.25) and its loss trailed fp32 by 3.5-5%,
an effect of pairing on a shared CPU rather than of the compression (at 76 of 76 paired the
loss ratio was 1.0004). ``noloco.wait_fraction=1`` in every arm (fp32 too) for the same reason.
Curves are on one clock per swarm (seconds since its first worker started training): a worker
that joins late starts from a downloaded state and must not be counted as having it at 0 s.
The wall-clock figure is noisy at this scale: the loss reaches a plateau within the run, and the
time to the worse arm's final loss is then decided by a loss gap of 1-2% (per seed 0.29-0.64 for
one setting). A cosine schedule that ends with the run (``--set noloco.inner.total_steps=200``)
does not help: it flattens the end of both curves further (worst ratio 0.57 instead of 0.50).
The time per inner step is the steadier measure of what compression saves (``train_s_mean``
per arm, compressed / fp32, six seeds over the two full runs: 0.39-0.49 for NoLoCo, 0.34-0.42
for DiLoCo). What compression cannot remove stays in the compressed round (the link's 40 ms per message,
card reads, the evaluation). ``--quick``: 120 inner steps, seed 0, the two best settings; the
full run: 200 inner steps, 3 seeds, and the sweep at seed 0 (26 swarms).

Measured per worker from its own log records (``averaging_round_done`` ``sent_bytes`` /
``outcome`` / ``group_size``, ``eval_done``, ``training_finished``); n_params is counted on the
model built from the run's ``model.*`` settings.

Summary (exact names the issue lists), each at the named best setting (``settings``):
  bytes_per_param_noloco            mean over ok pair rounds of sent_bytes / n_params (one way),
                                    mean over seeds                                 target <= 0.5
  bytes_per_param_diloco            per round label: sum of sent_bytes of the ok workers /
                                    (2 (group_size - 1)) / n_params (members to the root and the
                                    root back to each member), mean over labels and seeds
                                                                                    target <= 0.125
  eval_loss_ratio_compressed_vs_fp32_noloco / _diloco
                                    mean final validation loss over workers at equal inner steps,
                                    compressed / fp32 of the same seed, mean over seeds
                                                                                    target <= 1.02
  wallclock_ratio_compressed_vs_fp32
                                    wall-clock until the workers' mean validation loss reaches
                                    the higher of the two arms' final means, compressed / fp32
                                    (mean over seeds), WORST of the two outer modes (each is
                                    reported too: ``..._noloco`` / ``..._diloco``)  target <= 0.5
  fp32_bytes_per_param              the same byte measure for the fp32 arms: must be 4.0
                                    (``fp32_bytes_per_param_ok``: within 1%)
Plus ``sweep``: every compressor at 2-3 settings (int8 block 128; int4 block 128 and 64; topk
0.01 / 0.02 / 0.05; sign block 128, 1024, and 1024 holding back 5%), bytes per parameter vs eval loss ratio, for NoLoCo and DiLoCo, seed 0 only
(the full run; ``sweep_markdown`` is the README's table).

    python benchmarks/compression.py --quick --out /tmp/compression.json        # < 5 min on 2 cores
    python benchmarks/compression.py --out /tmp/compression_full.json           # 3 seeds + the sweep
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/compression.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.noloco_swarm import _count, _ratio, mean_curve, records, time_to, wait_finished, worker_figures  # noqa: E402
from node.localswarm import LocalSwarm  # noqa: E402

LINK = {"latency_ms": 40, "bandwidth_mbps": 100}
MODEL = dict(d_model=256, n_layers=4, n_heads=4, max_seq_len=64)
COMMON = [
    "noloco.eval_every=1", "noloco.eval_batches=4", "noloco.checkpoint_every=0", "noloco.torch_threads=1",
    "noloco.inner.lr=0.003", "noloco.inner.warmup=10", "noloco.round_timeout=20", "noloco.wait_fraction=1.0",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=32", "data.batch_size=2", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=10",
    "netem.enabled=true", "netem.default=" + json.dumps(LINK),
]
# compressor settings: name -> noloco.* overrides ("fp32" is the baseline every ratio divides by)
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {"compression": "none"},
    "int8_b128": {"compression": "int8", "compression_block": 128},
    "int4_b128": {"compression": "int4", "compression_block": 128},
    "int4_b64": {"compression": "int4", "compression_block": 64},
    "topk_0.01": {"compression": "topk", "compression_topk": 0.01},
    "topk_0.02": {"compression": "topk", "compression_topk": 0.02},
    "topk_0.05": {"compression": "topk", "compression_topk": 0.05},
    "sign_b128": {"compression": "sign", "compression_block": 128},
    "sign_b1024": {"compression": "sign", "compression_block": 1024},
    "sign_b1024_h5": {"compression": "sign", "compression_block": 1024, "compression_hold": 0.05},
}
PHI_EVERY = 8
# the summary's settings: 1-bit signs with error feedback move (nearly) every coordinate every
# round; DiLoCo holds back a rotating 5% to get under 1 bit per parameter (1/8 B of codes + the
# block scales is 0.129 without it). Top-k at 2% meets DiLoCo's byte target (0.10) but, applied
# to the whole update, trailed fp32 by 4% (2 workers) to 14% (4 workers, in one process) in loss
BEST = {"noloco": "sign_b1024", "diloco": "sign_b1024_h5"}
SWEEP = tuple(s for s in SETTINGS if s != "fp32")
QUICK = dict(W=2, H=10, steps=120, seeds=1, sweep=False, timeout_s=180.0)
FULL = dict(W=2, H=10, steps=200, seeds=3, sweep=True, timeout_s=600.0)
OUTERS = ("noloco", "diloco")
TARGETS = {"bytes_per_param_noloco": ("<=", 0.5), "bytes_per_param_diloco": ("<=", 0.125),
           "eval_loss_ratio_compressed_vs_fp32_noloco": ("<=", 1.02),
           "eval_loss_ratio_compressed_vs_fp32_diloco": ("<=", 1.02),
           "wallclock_ratio_compressed_vs_fp32": ("<=", 0.5)}


# ---------------------------------------------------------------- pure helpers (unit-tested)
def arm_settings(outer: str, setting: str) -> list[str]:
    """The ``--set`` items of one arm: its outer mode and its compressor."""
    items = [f"noloco.outer={outer}"] + [f"noloco.{k}={v}" for k, v in SETTINGS[setting].items()]
    if outer == "noloco" and SETTINGS[setting]["compression"] != "none":
        items.append(f"noloco.compression_phi_every={PHI_EVERY}")
    return items


def bytes_per_param_pairs(rounds: Sequence[dict], n_params: int) -> float | None:
    """NoLoCo: mean over ok rounds (all workers' records) of ``sent_bytes / n_params``: one way."""
    ok = [r["sent_bytes"] for r in rounds if r.get("outcome") == "ok" and r.get("sent_bytes") is not None]
    return statistics.fmean(ok) / n_params if ok else None


def bytes_per_param_groups(rounds: Sequence[dict], n_params: int) -> float | None:
    """DiLoCo: per round label, the ok workers' summed ``sent_bytes`` over the ``2 (g - 1)``
    one-way transfers of a group of g (each member to the root, the root back to each member),
    per parameter; mean over labels. ``rounds``: every worker's records."""
    by_label: dict[int, list[dict]] = {}
    for r in rounds:
        if r.get("outcome") == "ok" and r.get("sent_bytes") is not None and (r.get("group_size") or 1) > 1:
            by_label.setdefault(r["round"], []).append(r)
    per = [sum(r["sent_bytes"] for r in rs) / (2 * (max(r["group_size"] for r in rs) - 1)) / n_params
           for rs in by_label.values()]
    return statistics.fmean(per) if per else None


def bytes_per_param(outer: str, rounds: Sequence[dict], n_params: int) -> float | None:
    return (bytes_per_param_pairs if outer == "noloco" else bytes_per_param_groups)(rounds, n_params)


def seconds_to_common_loss(comp: Sequence[dict], fp32: Sequence[dict]) -> dict[str, float | None]:
    """Wall-clock until each arm's mean validation loss reaches the higher of the two arms'
    final means (``worker_figures`` dicts: ``eval_curve``, ``eval_loss_end``)."""
    target = max(statistics.fmean(p["eval_loss_end"] for p in comp), statistics.fmean(p["eval_loss_end"] for p in fp32))
    return {"target_eval_loss": target, "compressed": time_to(mean_curve(list(comp)), target),
            "fp32": time_to(mean_curve(list(fp32)), target)}


def compare(comp: dict, fp32: dict) -> dict[str, Any]:
    """One compressed arm against the fp32 arm of the same outer mode and seed (``run_arm`` dicts)."""
    t = seconds_to_common_loss(comp["workers"], fp32["workers"])
    return {"bytes_per_param": comp["bytes_per_param"],
            "eval_loss_ratio": _ratio(comp["eval_loss_end_mean"], fp32["eval_loss_end_mean"]),
            "wallclock_ratio": _ratio(t["compressed"], t["fp32"]), "seconds_to_target": t}


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if len(vals) == len(xs) and vals else None


def _meets(value: float | None, op: str, target: float) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return value <= target if op == "<=" else value < target


def summarize(runs: dict[str, dict[str, dict[int, dict]]], best: dict[str, str] = BEST) -> dict[str, Any]:
    """The summary from ``runs[outer][setting][seed]`` (``run_arm`` dicts, or ``{"error": ...}``).
    Per outer: the best setting against fp32 seed by seed, then the mean over the seeds; a seed
    whose either arm failed makes that outer's figures None."""
    s: dict[str, Any] = {"settings": {o: dict(SETTINGS[best[o]], **({"compression_phi_every": PHI_EVERY}
                                                                     if o == "noloco" else {}), name=best[o])
                                      for o in best}}
    fp32_bpp: dict[str, float | None] = {}
    per_seed: dict[str, list[dict]] = {}
    for o in best:
        fp, comp = runs.get(o, {}).get("fp32", {}), runs.get(o, {}).get(best[o], {})
        seeds = sorted(fp)
        cmp = [compare(comp[k], fp[k]) if "error" not in fp[k] and "error" not in comp.get(k, {"error": 1})
               else None for k in seeds]
        per_seed[o] = [c or {"error": True} for c in cmp]
        ok = [c for c in cmp if c is not None]
        full = bool(seeds) and len(ok) == len(seeds)
        s[f"bytes_per_param_{o}"] = _mean([c["bytes_per_param"] for c in ok]) if full else None
        s[f"eval_loss_ratio_compressed_vs_fp32_{o}"] = _mean([c["eval_loss_ratio"] for c in ok]) if full else None
        s[f"wallclock_ratio_compressed_vs_fp32_{o}"] = _mean([c["wallclock_ratio"] for c in ok]) if full else None
        fp_ok = [fp[k]["bytes_per_param"] for k in seeds if "error" not in fp[k]]
        fp32_bpp[o] = _mean(fp_ok) if fp_ok else None
    walls = [s.get(f"wallclock_ratio_compressed_vs_fp32_{o}") for o in best]
    s["wallclock_ratio_compressed_vs_fp32"] = max(walls) if walls and None not in walls else None
    s["wallclock_ratio_aggregate"] = "worst (max) of the outer modes' means over seeds"
    s["fp32_bytes_per_param"] = fp32_bpp
    s["fp32_bytes_per_param_ok"] = all(v is not None and abs(v - 4.0) <= 0.04 for v in fp32_bpp.values())
    s["per_seed"] = per_seed
    s["targets"] = {k: f"{op} {t}" for k, (op, t) in TARGETS.items()}
    s["targets_met"] = {k: _meets(s.get(k), op, t) for k, (op, t) in TARGETS.items()}
    return s


def sweep_rows(runs: dict[str, dict[str, dict[int, dict]]], seed: int = 0) -> list[dict[str, Any]]:
    """Every compressed setting of ``seed`` against fp32 of that seed: bytes/param and loss ratio."""
    rows = []
    for o in OUTERS:
        fp = runs.get(o, {}).get("fp32", {}).get(seed)
        for name in SWEEP:
            arm = runs.get(o, {}).get(name, {}).get(seed)
            if arm is None:
                continue
            row: dict[str, Any] = {"outer": o, "setting": name, "bytes_per_param": None, "eval_loss_ratio": None,
                                   "wallclock_ratio": None}
            if "error" in arm or fp is None or "error" in fp:
                row["error"] = arm.get("error") or "fp32 arm failed"
            else:
                c = compare(arm, fp)
                row.update(bytes_per_param=c["bytes_per_param"], eval_loss_ratio=c["eval_loss_ratio"],
                           wallclock_ratio=c["wallclock_ratio"])
            rows.append(row)
    return rows


def sweep_markdown(rows: Sequence[dict]) -> str:
    """The README table: one line per (outer, setting)."""
    def f(x: float | None, nd: int) -> str:
        return "-" if x is None else f"{x:.{nd}f}"
    lines = ["| outer | compressor | bytes / param (one way) | eval loss vs fp32 | wall-clock vs fp32 |",
             "|---|---|---|---|---|"]
    for r in rows:
        spec = SETTINGS[r["setting"]]
        what = spec["compression"] + (f" block {spec['compression_block']}" if "compression_block" in spec else "") + \
            (f" {spec['compression_topk']:g}" if "compression_topk" in spec else "") + \
            (f", hold {spec['compression_hold']:g}" if "compression_hold" in spec else "") + \
            (f", phi int8 every {PHI_EVERY}" if r["outer"] == "noloco" else "")
        lines.append(f"| {r['outer']} | {what} | {f(r['bytes_per_param'], 3)} | {f(r['eval_loss_ratio'], 4)} | "
                     f"{f(r['wallclock_ratio'], 2)} |" + (" failed |" if r.get("error") else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- processes
def _epoch_s(ts: str) -> float:
    """A log record's ``ts`` (``2026-05-01T12:00:00.123Z``, UTC) in seconds since the epoch."""
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def on_common_clock(per: list[dict], starts: Sequence[str]) -> list[dict]:
    """Shift each worker's ``eval_curve`` (seconds since ITS ``training_started``) onto one clock:
    seconds since the first worker of the swarm started training. A worker that joins late
    (it downloaded a partner's state) then shows its first, already trained, evaluation when it
    made it, not at 0 s, which would credit the swarm with loss it had not reached yet."""
    t = [_epoch_s(s) for s in starts]
    return [dict(p, eval_curve=[(x + ti - min(t), v) for x, v in p["eval_curve"]], start_offset_s=ti - min(t))
            for p, ti in zip(per, t)]


def count_params(model: dict[str, Any]) -> int:
    """Parameters the exchange carries for the ``model.*`` settings (tied weights once)."""
    from models.config import ModelConfig
    from models.hf_adapter import build_from_config

    return sum(p.numel() for p in build_from_config(ModelConfig(**model), seed=0).parameters())


def run_arm(outer: str, setting: str, cfg: dict, seed: int, workdir: Path, keys: Path, n_params: int) -> dict[str, Any]:
    """One swarm: bootstrap + W workers until each did ``steps`` inner steps. Worker keys come
    from ``keys`` (made by the first arm of the seed), so every arm has the same peer IDs."""
    settings = [*COMMON, f"noloco.inner_steps={cfg['H']}", f"noloco.exit_after={cfg['steps']}",
                f"noloco.seed={seed}", *arm_settings(outer, setting), *cfg.get("extra_set", [])]
    names = [f"w{i}" for i in range(cfg["W"])]
    workdir.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (keys / f"{n}.key").exists():
            shutil.copy2(keys / f"{n}.key", workdir / f"{n}.key")
    t0 = time.monotonic()
    with LocalSwarm(run_id=f"compress-{outer}-{setting}-{seed}".replace("_", "-").replace(".", ""),
                    workdir=workdir, common_set=settings) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=120)
        workers = [swarm.start("noloco", name=n) for n in names]
        for n in names:
            if not (keys / f"{n}.key").exists():
                shutil.copy2(workdir / f"{n}.key", keys / f"{n}.key")
        wait_finished(workers, cfg["timeout_s"], f"{outer} {setting}")
        per = on_common_clock([worker_figures(w, 0.0) for w in workers],
                              [records(w, "training_started")[-1]["ts"] for w in workers])
        rounds = [r for w in workers for r in records(w, "averaging_round_done")]
    for p in per:
        p.pop("compute_delay_s", None)  # no artificial delay here
    ok = [r for r in rounds if r["outcome"] == "ok"]
    streamed = [r["exchange_s"] for r in ok if r.get("exchange_s")]  # pairs time their stream; groups report 0
    return {"outer": outer, "setting": setting, "seed": seed, "wall_s_run": round(time.monotonic() - t0, 1),
            "bytes_per_param": bytes_per_param(outer, rounds, n_params),
            "rounds_ok": len(ok), "rounds_not_ok": len(rounds) - len(ok),
            "not_ok_reasons": _count(f"{r['outcome']}:{r.get('reason') or '-'}"
                                     for r in rounds if r["outcome"] != "ok"),
            "exchange_s_median": statistics.median(streamed) if streamed else None,
            "blocked_s_median": statistics.median(r["blocked_s"] for r in ok) if ok else None,
            # the codec's own cost per round (compute thread / worker thread), next to the blocked time
            "compress_s_median": statistics.median(r.get("compress_s") or 0.0 for r in ok) if ok else None,
            "decompress_s_median": statistics.median(r.get("decompress_s") or 0.0 for r in ok) if ok else None,
            "train_s_mean": statistics.fmean(p["wall_s"] for p in per),
            "eval_loss_end_mean": statistics.fmean(p["eval_loss_end"] for p in per), "workers": per}


def plan(cfg: dict, seeds: int, only: set[str] | None = None,
         outers: Sequence[str] = OUTERS) -> list[tuple[str, str, int]]:
    """(outer, setting, seed) in run order: per seed and outer fp32 first, then the best
    setting, then (seed 0, ``cfg["sweep"]``) the other settings. ``only``: the named
    ``OUTER-SETTING`` arms (and their outer's fp32) instead."""
    jobs = []
    for seed in range(seeds):
        for o in outers:
            if only is not None:
                named = [s for s in SETTINGS if s != "fp32" and f"{o}-{s}" in only]
                jobs += [(o, s, seed) for s in (["fp32", *named] if named else [])]
                continue
            names = ["fp32", BEST[o]] + ([s for s in SWEEP if s != BEST[o]] if cfg["sweep"] and seed == 0 else [])
            jobs += [(o, s, seed) for s in names]
    return jobs


def run(quick: bool, seeds: int | None, out: str | None, only: set[str] | None = None,
        keep: str | None = None, outers: Sequence[str] = OUTERS, extra_set: Sequence[str] = ()) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL, extra_set=list(extra_set))
    seeds = seeds or cfg["seeds"]
    n_params = count_params(MODEL)
    t0 = time.monotonic()
    runs: dict[str, dict[str, dict[int, dict]]] = {o: {} for o in OUTERS}
    with TemporaryDirectory(prefix="compression-") as tmp:
        root = Path(keep or tmp)
        for outer, setting, seed in plan(cfg, seeds, only, outers):
            keys = root / f"keys-seed{seed}"
            keys.mkdir(parents=True, exist_ok=True)
            print(f"running {outer} {setting} seed {seed} ...", file=sys.stderr, flush=True)
            try:
                r = run_arm(outer, setting, cfg, seed, root / f"{outer}-{setting}-s{seed}", keys, n_params)
                print(f"  {r['bytes_per_param']} B/param, eval loss {r['eval_loss_end_mean']:.4f}, {r['rounds_ok']} ok"
                      f" / {r['rounds_not_ok']} not ok {r['not_ok_reasons']}, blocked median {r['blocked_s_median']} s,"
                      f" training {r['train_s_mean']:.1f} s, {r['wall_s_run']} s", file=sys.stderr, flush=True)
            except Exception as exc:  # one broken setting must not lose the others
                r = {"outer": outer, "setting": setting, "seed": seed, "error": f"{type(exc).__name__}: {exc}"}
                print(f"  FAILED: {r['error'][:2000]}", file=sys.stderr, flush=True)
            runs[outer].setdefault(setting, {})[seed] = r
    summary = summarize(runs)
    rows = sweep_rows(runs)
    result = {"benchmark": "compression", "measured": True, "quick": quick, "seeds": seeds,
              "wall_s": round(time.monotonic() - t0, 1), "n_params": n_params,
              "config": {**cfg, "common_set": COMMON, "model": MODEL, "link": LINK, "phi_every": PHI_EVERY,
                         "fp32_seconds_per_direction": n_params * 4 / (LINK["bandwidth_mbps"] * 1e6 / 8)},
              "summary": summary, "sweep": rows, "sweep_markdown": sweep_markdown(rows),
              "runs": {f"{o}-{s}-s{k}": r for o in runs for s in runs[o] for k, r in runs[o][s].items()}}
    if out:
        Path(out).write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 workers, 120 inner steps, 1 seed, best settings only "
                    "(< 5 min on 2 cores)")
    ap.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: 1 quick, 3 full)")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--arms", help="comma-separated OUTER-SETTING arms besides fp32 (e.g. noloco-topk_0.05); "
                    f"settings: {', '.join(SETTINGS)}")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                    help="run every compressor setting (default: on in the full run, off with --quick)")
    ap.add_argument("--outer", action="append", choices=OUTERS, help="only this outer mode (repeatable)")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' logs under DIR")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more node setting for every worker, after the arm's own (repeatable), "
                    "e.g. noloco.exit_after=60 for a short look")
    args = ap.parse_args(argv)
    if args.sweep is not None:
        QUICK["sweep"] = FULL["sweep"] = args.sweep
    only = None
    if args.arms:
        only = {a.strip() for a in args.arms.split(",") if a.strip()}
        bad = [a for a in only if a.split("-", 1)[0] not in OUTERS or a.split("-", 1)[-1] not in SETTINGS]
        if bad:
            ap.error(f"unknown arms {bad}; use OUTER-SETTING with OUTER in {OUTERS} and SETTING in {list(SETTINGS)}")
    res = run(args.quick, args.seeds, args.out, only, args.keep, tuple(args.outer or OUTERS), args.set)
    print(json.dumps({k: v for k, v in res["summary"].items() if k != "per_seed"}, indent=1, default=str))
    print(res["sweep_markdown"], file=sys.stderr)
    print(f"wall {res['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
