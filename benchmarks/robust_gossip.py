"""Robust averaging against Byzantine partners on REAL processes (issue 32; docs/noloco.md,
'Robust averaging'). Writes one JSON.

Per outer mode (NoLoCo pairs, DiLoCo global average): a bootstrap, W honest ``noloco`` workers
and, in the attacked runs, one attacker process (``python -m tests.integration.attacker``: its
own key, an open-mode member that pairs, or joins the DiLoCo average as a member). Every run
trains the same inner steps (``exit_after``); the attacker starts once the workers are ready and
attacks until they finish. Runs: clean with the defence (``noloco.robust=clip``), clean without
(``noloco.robust=off``), each attacker with the defence (``recipe``: the issue's
``0.55 theta + 0.835 perm(theta)``; ``adaptive``: reads the victim's theta first and sits just
inside the rule in force, every round: 0.95 x ``robust_backward`` own moves against the victim's
progress and the rest of 0.95 x the clip radius across it; ``rare``: poisons one exchange in 5;
DiLoCo only, ``root``: the lowest peer ID, so the root, sending every member the recipe of the
true mean), and the recipe without the defence (the "today" figure; DiLoCo also the root).

Summary, per mode (``summary.noloco``, ``summary.diloco``) and worst of both at the top:
  eval_loss_ratio_under_attack_vs_clean    honest workers' mean final eval loss, worst attack
                                           with the defence / clean with it        target <= 1.05
  eval_loss_ratio_defense_vs_none_clean    clean, defence on / off                 target <= 1.01
  honest_partner_clip_rate                 honest contributions clipped (factor < 1) / judged,
                                           over every defended run                 target <= 0.05
  rounds_to_ban_attacker                   per attack: the attacker's contributions the first
                                           worker to charge it judged before charging it (None:
                                           never charged; root: its means refused) (report)
  eval_loss_ratio_no_defense_under_attack_vs_clean   recipe without the defence / clean without
  honest_pulled_back                       clean run with the defence: how far honest partners
                                           pulled a worker back along its own move (own moves;
                                           p50 / p95 / max), what ``robust_backward`` must allow

Where the numbers come from: each worker's own log (``training_finished`` eval_loss_end,
``averaging_round_done`` partners, ``partner_clipped``, ``partner_charged``). A contribution is
judged by the side that averages it: both sides of a pair, the root of a DiLoCo group (the
lowest peer ID) for each member.

    python benchmarks/robust_gossip.py --quick --out /tmp/robust_gossip.json   # < 5 min on 2 cores
    python benchmarks/robust_gossip.py --out /tmp/robust_gossip_full.json      # 5-minute attacks
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/robust_gossip.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.localswarm import LocalSwarm, NodeProc  # noqa: E402
from optimizers.config import NoLoCoConfig  # noqa: E402

MODEL = dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
COMMON = [
    "noloco.eval_every=0", "noloco.eval_batches=8", "noloco.checkpoint_every=0", "noloco.torch_threads=1",
    "noloco.inner.lr=0.003", "noloco.inner.warmup=10", "noloco.round_timeout=4",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=10", "security.known_peers_refresh_s=2",
]
# FULL: W=4 honest workers, inner phases of ~1.5 s, 5 minutes of training (and attack) per run.
ALL_RUNS = ("clean_on", "clean_off", "recipe_on", "adaptive_on", "rare_on", "recipe_off")
# DiLoCo also: a root (lowest peer ID) that sends every member a poisoned mean
FULL = dict(W=4, H=10, steps=2000, delay_s=0.15, parallel=1,
            runs={"noloco": ALL_RUNS, "diloco": (*ALL_RUNS, "root_on", "root_off")})
QUICK = dict(W=4, H=10, steps=100, delay_s=0.1, parallel=3,
             runs={"noloco": ("clean_on", "clean_off", "recipe_on", "adaptive_on", "recipe_off"),
                   "diloco": ("clean_on", "recipe_on", "root_on")})
QUICK_REDUCED = ("100 inner steps (about 15 s of training and attack) per run instead of 5 minutes; the rare "
                 "attacker left out; DiLoCo runs only clean, the recipe and the root attack with the defence (so its "
                 "defence-on/off ratio and no-defence figure are absent); three swarms run at once")
TARGETS = {"eval_loss_ratio_under_attack_vs_clean": 1.05, "eval_loss_ratio_defense_vs_none_clean": 1.01,
           "honest_partner_clip_rate": 0.05}


def records(node: NodeProc, event: str | None = None) -> list[dict]:
    out = []
    for line in node.log_text().splitlines():
        if line.startswith("{") and (event is None or f'"event": "{event}"' in line):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def judged(rec: dict, me: str, outer: str) -> list[str]:
    """The partners whose contributions ``me`` averaged in one ``averaging_round_done`` record."""
    if rec.get("outcome") != "ok":
        return []
    partners = list(rec.get("partners") or [])
    if outer == "noloco":
        return partners
    return partners if partners and me < min(partners) else []  # the DiLoCo root judges each member


def worker_figures(node: NodeProc, outer: str, honest: set[str], attacker: str | None) -> dict[str, Any]:
    recs = records(node)
    done = [r for r in recs if r.get("event") == "training_finished"]
    if not done:
        raise RuntimeError(f"{node.name} did not finish training; log tail:\n{node.log_text()[-2000:]}")
    judged_honest = judged_att = clipped_honest = hard_honest = 0
    clipped_att = hard_att = means_refused = 0
    to_charge = None  # attacker contributions clipped before the first charge
    for r in recs:
        ev = r.get("event")
        if ev == "averaging_round_done":
            means_refused += r.get("reason") == "robust_mean"
            ps = judged(r, node.peer_id, outer)
            judged_honest += sum(p in honest for p in ps)
            judged_att += sum(p == attacker for p in ps)
        elif ev == "partner_clipped":
            if r.get("peer") in honest:
                clipped_honest += 1
                hard_honest += bool(r.get("hard"))
            elif attacker and r.get("peer") == attacker:
                clipped_att += 1
                hard_att += bool(r.get("hard"))
        elif ev == "partner_charged" and attacker and r.get("peer") == attacker and r.get("reason") == "clipped":
            if to_charge is None:
                to_charge = clipped_att
        elif ev == "partner_charged" and attacker and r.get("peer") == attacker and r.get("reason") == "robust_mean":
            if to_charge is None:  # a DiLoCo root's means: charged at the first one refused
                to_charge = means_refused
    rounds = [r for r in recs if r.get("event") == "averaging_round_done"]
    # float(): a diverged worker logs its loss as "nan" (JSON has no NaN)
    return {"name": node.name, "eval_loss_end": float(done[-1]["eval_loss_end"]), "steps": done[-1].get("step"),
            "rounds": len(rounds), "rounds_ok": sum(r.get("outcome") == "ok" for r in rounds),
            "rounds_with_attacker": sum(attacker in (r.get("partners") or []) for r in rounds if attacker),
            "honest_judged": judged_honest, "honest_clipped": clipped_honest, "honest_clipped_hard": hard_honest,
            "attacker_judged_ok": judged_att, "attacker_clipped": clipped_att, "attacker_clipped_hard": hard_att,
            "attacker_clipped_before_charge": to_charge,
            "means_refused": means_refused,  # DiLoCo: group means refused by the robust rule (a bad root)
            # a clean run's contributions are all honest: how far each pulled us back along our own
            # move (noloco.robust_backward cuts above it), in own moves
            "honest_pulled_back": [b for r in rounds if not attacker and r.get("outcome") == "ok"
                                   for b in (r.get("pulled_back") or [])],
            "attacker_charges": sum(1 for r in recs if r.get("event") == "partner_charged"
                                    and attacker and r.get("peer") == attacker),
            "rollbacks": sum(1 for r in recs if r.get("event") == "outer_rollback")}


def run_swarm(outer: str, name: str, cfg: dict, seed: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """One run: bootstrap + W honest workers (+ an attacker) until every worker did ``steps``."""
    kind, defence = name.rsplit("_", 1)
    settings = [*COMMON, f"noloco.inner_steps={cfg['H']}", f"noloco.exit_after={cfg['steps']}",
                f"noloco.seed={seed}", f"noloco.compute_delay_s={cfg['delay_s']}",
                f"noloco.robust={'clip' if defence == 'on' else 'off'}"] + \
        (["noloco.outer=diloco"] if outer == "diloco" else []) + \
        ([f"noloco.robust_backward={cfg['backward']}"] if cfg.get("backward") is not None else []) + \
        ([f"noloco.robust_multiplier={cfg['multiplier']}"] if cfg.get("multiplier") is not None else [])
    t0 = time.monotonic()
    run_id = f"robust-{outer}-{name}".replace("_", "-")
    with LocalSwarm(run_id=run_id, workdir=workdir, common_set=settings) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=180)
        proc, tally = None, None
        if kind != "clean":  # in place before the workers train: it waits for their cards
            out = workdir / "attacker.json"
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.attacker", "--bootstrap", swarm.bootstrap_maddr,
                 "--run-id", run_id, "--model", json.dumps(MODEL), "--kind", kind, "--outer", outer,
                 "--seconds", str(timeout_s), "--round-timeout", "4", "--seed", str(seed), "--out", str(out),
                 "--after-round", str(cfg.get("attack_after_round", 0)),
                 "--backward", str(cfg.get("attacker_backward", cfg.get("backward") or NoLoCoConfig().robust_backward)),
                 "--multiplier", str(cfg.get("multiplier") or NoLoCoConfig().robust_multiplier)],
                stdout=subprocess.PIPE, stderr=open(workdir / "attacker.log", "w"), text=True,
                start_new_session=True)
            if proc.stdout.readline().strip() != "loaded":  # its imports take long on a loaded machine
                proc.kill()
                proc.wait()
                raise RuntimeError(f"the attacker did not start:\n{(workdir / 'attacker.log').read_text()[-2000:]}")
        workers = [swarm.start("noloco", name=f"w{i}") for i in range(cfg["W"])]
        try:
            deadline = time.monotonic() + timeout_s
            while any(w.alive() for w in workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{outer} {name}: workers still running after {timeout_s:.0f} s")
                time.sleep(0.5)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    text, _ = proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    text, _ = proc.communicate()
                lines = [ln for ln in text.splitlines() if ln.startswith("{")]
                tally = json.loads(lines[-1]) if lines else {"error": (workdir / "attacker.log").read_text()[-2000:]}
        bad = [w for w in workers if w.proc.returncode != 0]
        if bad:
            raise RuntimeError(f"{bad[0].name} exited {bad[0].proc.returncode}:\n{bad[0].log_text()[-2000:]}")
        honest = {w.peer_id for w in workers}
        attacker = tally.get("peer_id") if tally else None
        per = [worker_figures(w, outer, honest, attacker) for w in workers]
    return run_figures(outer, name, per, tally, round(time.monotonic() - t0, 1))


def run_figures(outer: str, name: str, per: list[dict], tally: dict | None, wall_s: float) -> dict[str, Any]:
    """One run's figures from its workers' (``worker_figures``): a worker whose eval loss is not
    finite (diverged: the undefended recipe) makes the run's mean inf, and is counted."""
    charged = [p["attacker_clipped_before_charge"] for p in per if p["attacker_clipped_before_charge"] is not None]
    losses = [p["eval_loss_end"] for p in per]
    diverged = sum(not math.isfinite(x) for x in losses)
    return {"outer": outer, "run": name, "wall_s": wall_s,
            "eval_loss_end_mean": math.inf if diverged else statistics.fmean(losses),
            "workers_diverged": diverged,
            "honest_judged": sum(p["honest_judged"] for p in per),
            "honest_clipped": sum(p["honest_clipped"] for p in per),
            "attacker_judged_ok": sum(p["attacker_judged_ok"] for p in per),
            "attacker_clipped_hard": sum(p["attacker_clipped_hard"] for p in per),
            "rounds_to_ban_attacker": min(charged) if charged else None,
            "workers_that_charged_attacker": len(charged),
            "attacker": tally, "workers": per}


def _json_safe(x: Any) -> Any:
    """``x`` with each non-finite float written as the string "inf" / "nan" (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mode_summary(runs: dict[str, dict]) -> dict[str, Any]:
    ev = {k: r["eval_loss_end_mean"] for k, r in runs.items()}
    attacks = [k for k in runs if k.endswith("_on") and not k.startswith("clean")]
    under = {k: _ratio(ev[k], ev.get("clean_on")) for k in attacks}
    defended = [r for k, r in runs.items() if k.endswith("_on")]
    judged_h = sum(r["honest_judged"] for r in defended)
    out = {
        "eval_loss_ratio_under_attack_vs_clean": max((v for v in under.values() if v is not None), default=None),
        "eval_loss_ratio_under_attack_vs_clean_per_attack": under,
        "eval_loss_ratio_defense_vs_none_clean": _ratio(ev.get("clean_on"), ev.get("clean_off")),
        "honest_partner_clip_rate": sum(r["honest_clipped"] for r in defended) / judged_h if judged_h else None,
        "honest_contributions_judged": judged_h,
        "rounds_to_ban_attacker": {k.rsplit("_", 1)[0]: runs[k]["rounds_to_ban_attacker"] for k in attacks},
        "eval_loss_end_mean": ev,
    }
    back = sorted(b for w in runs.get("clean_on", {}).get("workers", []) for b in w.get("honest_pulled_back", []))
    if back:
        out["honest_pulled_back"] = {"n": len(back), "p50": back[len(back) // 2],
                                     "p95": back[min(len(back) - 1, int(0.95 * len(back)))], "max": back[-1]}
    undefended = {k: _ratio(ev[k], ev.get("clean_off")) for k in runs if k.endswith("_off") and k != "clean_off"}
    if undefended:  # the recipe (and DiLoCo's root) without the defence
        out["eval_loss_ratio_no_defense_under_attack_vs_clean"] = max(
            (v for v in undefended.values() if v is not None), default=None)
        out["eval_loss_ratio_no_defense_per_attack"] = undefended
    return out


def kept_run(outer: str, name: str, workdir: Path) -> dict[str, Any]:
    """A run's figures read back from its kept logs (``--keep``; ``--from-keep``): for a run whose
    swarms finished but whose summary was not written. wall_s is not known (None)."""
    workers = []
    for log_path in sorted(workdir.glob("w*.log")):
        text = log_path.read_text()
        first = next(json.loads(line) for line in text.splitlines() if line.startswith("{") and '"peer_id"' in line)
        workers.append(SimpleNamespace(name=log_path.stem, peer_id=first["peer_id"], log_text=lambda t=text: t))
    if not workers:
        raise SystemExit(f"no worker logs (w*.log) in {workdir}: pass the --keep DIR of a finished run")
    tally_path = workdir / "attacker.json"
    tally = json.loads(tally_path.read_text()) if tally_path.exists() else None
    honest = {w.peer_id for w in workers}
    attacker = tally.get("peer_id") if tally else None
    return run_figures(outer, name, [worker_figures(w, outer, honest, attacker) for w in workers], tally, None)


def run(quick: bool, seed: int, out: str | None, outers: Sequence[str], keep: str | None = None,
        from_keep: str | None = None) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    t0 = time.monotonic()
    runs: dict[str, dict[str, dict]] = {o: {} for o in outers}
    timeout = 240.0 if quick else 900.0
    jobs = [(o, name) for o in outers for name in cfg["runs"][o]]
    with TemporaryDirectory(prefix="robust-gossip-") as tmp:
        tmp = keep or tmp

        def one(job):
            o, name = job
            print(f"running {o} {name} ...", file=sys.stderr, flush=True)
            r = (kept_run(o, name, Path(from_keep) / f"{o}-{name}") if from_keep else
                 run_swarm(o, name, cfg, seed, Path(tmp) / f"{o}-{name}", timeout))
            print(f"  {o} {name}: eval loss {r['eval_loss_end_mean']:.4f}, honest clipped "
                  f"{r['honest_clipped']}/{r['honest_judged']}, attacker ok {r['attacker_judged_ok']} hard-clipped "
                  f"{r['attacker_clipped_hard']} charged after {r['rounds_to_ban_attacker']}, {r['wall_s']} s",
                  file=sys.stderr, flush=True)
            return job, r
        with ThreadPoolExecutor(max_workers=cfg["parallel"]) as pool:
            for (o, name), r in pool.map(one, jobs):
                runs[o][name] = r
    per_mode = {o: mode_summary(runs[o]) for o in outers}

    def worst(key: str) -> float | None:
        vals = [per_mode[o][key] for o in outers if per_mode[o].get(key) is not None]
        return max(vals) if vals else None
    summary: dict[str, Any] = {o: per_mode[o] for o in outers}
    for key in ("eval_loss_ratio_under_attack_vs_clean", "eval_loss_ratio_defense_vs_none_clean",
                "honest_partner_clip_rate", "eval_loss_ratio_no_defense_under_attack_vs_clean"):
        summary[key] = worst(key)
    summary["rounds_to_ban_attacker"] = {o: per_mode[o]["rounds_to_ban_attacker"] for o in outers}
    summary["targets_met"] = {k: summary[k] is not None and summary[k] <= t for k, t in TARGETS.items()}
    result = {"benchmark": "robust_gossip", "measured": True, "quick": quick, "seed": seed,
              "wall_s": None if from_keep else round(time.monotonic() - t0, 1),
              "from_keep": from_keep,  # rebuilt from a kept run's logs (its per-run wall times are lost)
              "quick_reduced": QUICK_REDUCED if quick else None,
              "config": {**{k: v for k, v in cfg.items()}, "common_set": COMMON, "model": MODEL},
              "summary": summary, "runs": runs}
    if out:
        Path(out).write_text(json.dumps(_json_safe(result), indent=1, default=str))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (< 5 min on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--outer", action="append", choices=("noloco", "diloco"),
                    help="only this outer mode (repeatable; default both)")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' logs under DIR")
    ap.add_argument("--parallel", type=int, help="swarms at once (default: 1 full, 3 quick)")
    ap.add_argument("--runs", help="comma-separated subset of the runs (e.g. clean_on,recipe_on), for a look")
    ap.add_argument("--backward", type=float, default=None,
                    help="noloco.robust_backward for the workers, and the cut the adaptive attacker assumes "
                         "(default: the workers' default, 1.5)")
    ap.add_argument("--multiplier", type=float, default=None,
                    help="noloco.robust_multiplier for the workers, and the radius the adaptive attacker assumes "
                         "(default: the workers' default)")
    ap.add_argument("--from-keep", metavar="DIR",
                    help="start no processes: rebuild the JSON from the logs a finished run kept with --keep DIR "
                         "(pass the same --quick, --outer, --runs and knobs)")
    args = ap.parse_args(argv)
    for key in ("backward", "multiplier"):
        if getattr(args, key) is not None:
            for c in (QUICK, FULL):
                c[key] = getattr(args, key)
    if args.runs:
        for c in (QUICK, FULL):
            c["runs"] = {o: tuple(args.runs.split(",")) for o in ("noloco", "diloco")}
    if args.parallel:
        for c in (QUICK, FULL):
            c["parallel"] = args.parallel
    res = run(args.quick, args.seed, args.out, args.outer or ["noloco", "diloco"], args.keep, args.from_keep)
    print(json.dumps(_json_safe(res["summary"]), indent=1))
    print(f"wall {res['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
