"""NoLoCo vs DiLoCo on a simulated heterogeneous WAN swarm: real training, virtual time.

One process, discrete-event simulation (docs/noloco.md, 'Benchmarks'; complements noloco_convergence.py
and noloco_swarm.py). W workers
(4, 8, 16) each hold their own copy of the tiny `models/` LLaMA (same seed init), their own IID
data shard (`models.corpus.batches(shard=w, num_shards=W)`), a real inner Adam (warm-up + cosine,
clip 1.0) and the real outer optimizer (`optimizers.noloco.NoLoCoOuter` /
`optimizers.diloco.DiLoCoOuter`). The "exchange" is an exact in-memory mean; only *time* is
modelled:

* **Compute (modelled).** Worker w's inner step takes ``c_w`` virtual seconds; the ``c_w`` are
  spread evenly over [1x, 2x] of ``base_step_s`` and assigned to workers by a seeded shuffle;
  each round's H steps are further scaled by a seeded factor ``U(1 - jitter, 1 + jitter)``
  (default jitter 0.1) so the arrival order is not frozen.
* **Links (modelled).** A symmetric `node.netem.LinkMatrix` with one-way latency ``U(20, 150)``
  ms and bandwidth ``U(50, 500)`` Mbit/s per pair (seeded). A NoLoCo pair swaps one model copy
  each way in parallel: ``max(transfer_s(a->b), transfer_s(b->a))``. DiLoCo's all-reduce is
  ``node.netem.modelled_allreduce_s(bytes, W, <all pair links of the group>)``
  = 2*max latency + 2(W-1)/W * bytes / min bandwidth. The bytes used for *timing* are
  ``timing_bytes`` (default 64 MiB = a 16.7M-parameter fp32 model, the size the exchange
  benchmark moves), not the tiny trained model, so communication is not negligible.
  Matchmaking / roster overheads (DHT lookups, hivemind's min_matchmaking_time) are NOT
  modelled for either method (``match_overhead_s`` adds a fixed cost to both if wanted).
* **NoLoCo schedule** mimics the real protocol (no global barrier): a worker that finishes round
  r's H steps becomes *waiting*; if other workers are waiting with |round difference| <=
  max_round_skew it pairs with one of them at once (same round preferred, else uniformly at
  random among the candidates; seeded): both finish at max(arrivals) + pair transfer time.
  Otherwise it waits up to ``round_timeout`` and then takes the solo step. Tied consensus, so
  only theta is averaged. (optimizers/exchange.py as written pairs only workers of the SAME
  round, from that round's roster; a timing-only variant with max_round_skew = 0 is reported
  as ``blocked_s_same_round_only`` / ``blocked_ratio_same_round_only_per_W``.)
* **DiLoCo schedule** (heavy-ball, eta 0.7, mu 0.3 as in the spec's defaults, but with the SAME H
  as NoLoCo so both take equal inner steps per outer round; the spec's heavy-ball H is 100): a
  global barrier every round; every worker's round ends at max(arrivals) + all-reduce time.
* **local**: no averaging (reference for the loss).

blocked = round finish - own arrival (waiting for partner/barrier + transfer). Every worker runs
the same number of inner steps ("equal inner steps"): fast NoLoCo workers therefore finish
early, and the slow ones' last rounds may find nobody to pair with (solo after the timeout);
blocked-time stats are reported over all rounds and over the *steady state* (rounds that ended
before the first worker finished).

Eval: at checkpoints (every ``eval_every_rounds`` outer rounds and at the end) the validation
loss (`models.corpus.evaluate` on fixed batches) of the worker-mean of phi and the mean of the
per-replica losses, with the virtual time at which the slowest worker completed that round.

Deterministic for a seed (torch thread count fixed). Commands (2 CPU cores)::

    python benchmarks/noloco_swarm_sim.py --quick --out /tmp/swarm_sim_quick.json   # ~2-3 min
    python benchmarks/noloco_swarm_sim.py --out /tmp/swarm_sim_full.json            # ~1 h
From code: ``from benchmarks.noloco_swarm_sim import run_sim; res = run_sim(quick=True)``.
The scheduling logic is pure (``schedule_noloco``, ``schedule_diloco``) and unit-tested in
tests/unit/test_swarm_sim.py.
"""

from __future__ import annotations

import argparse
import copy
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/noloco_swarm_sim.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.netem import LinkMatrix, LinkSpec, modelled_allreduce_s, transfer_s  # noqa: E402

MiB = 1 << 20
METHODS = ("noloco", "diloco", "local")
QUICK = dict(W=(4, 8, 16), steps=120, H=20, d_model=32, n_layers=1, n_heads=2, seq_len=64,
             batch_size=8, eval_batches=4, eval_every_rounds=2, max_train_bytes=1_000_000,
             warmup=20, local_W=(4,))
FULL = dict(W=(4, 8, 16), steps=1000, H=50, d_model=64, n_layers=2, n_heads=4, seq_len=128,
            batch_size=16, eval_batches=8, eval_every_rounds=2, max_train_bytes=8_000_000,
            warmup=100, local_W=(4, 8, 16))


# ============================================================================ pure scheduling

@dataclass
class RoundRecord:
    """One worker's outer round in virtual time."""
    worker: int
    round: int            # 1-based: round r ends after r*H inner steps
    arrival: float        # finished the round's H inner steps
    finish: float         # outer step done, next round's compute starts
    blocked: float        # finish - arrival (less what was computed meanwhile, with overlap)
    group: list[int]      # workers averaged together (incl. this one); [worker] when solo
    outcome: str          # "pair" | "solo" | "allreduce" | "local"
    partner_round: int | None = None


@dataclass
class Schedule:
    method: str
    records: list[RoundRecord] = field(default_factory=list)
    # exchange events in the order they happen: (time, [(worker, round), ...], outcome)
    events: list[tuple[float, list[tuple[int, int]], str]] = field(default_factory=list)

    def of(self, w: int) -> list[RoundRecord]:
        return sorted((r for r in self.records if r.worker == w), key=lambda r: r.round)


def make_speeds(W: int, seed: int, base_step_s: float, spread: tuple[float, float] = (1.0, 2.0)
                ) -> list[float]:
    """Seconds per inner step for each worker: evenly over [spread] x base, seeded shuffle."""
    lo, hi = spread
    vals = [base_step_s * (lo + (hi - lo) * i / max(1, W - 1)) for i in range(W)]
    random.Random(f"speeds:{seed}:{W}").shuffle(vals)
    return vals


def round_durations(speeds: Sequence[float], rounds: int, H: int, seed: int,
                    jitter: float = 0.1) -> list[list[float]]:
    """dur[w][r-1] = virtual compute seconds of worker w's round r (H steps, +-jitter)."""
    rng = random.Random(f"jitter:{seed}:{len(speeds)}")
    return [[H * c * (1.0 + rng.uniform(-jitter, jitter)) for _ in range(rounds)] for c in speeds]


def make_links(W: int, seed: int, latency_ms: tuple[float, float] = (20.0, 150.0),
               bandwidth_mbps: tuple[float, float] = (50.0, 500.0)) -> LinkMatrix:
    """Symmetric seeded WAN matrix over nodes w00..w{W-1}."""
    rng = random.Random(f"links:{seed}:{W}")
    lat = [[0.0] * W for _ in range(W)]
    bw = [[math.inf] * W for _ in range(W)]
    for i in range(W):
        for j in range(i + 1, W):
            lat[i][j] = lat[j][i] = round(rng.uniform(*latency_ms), 3)
            bw[i][j] = bw[j][i] = round(rng.uniform(*bandwidth_mbps), 3)
    return LinkMatrix(nodes=[f"w{i:02d}" for i in range(W)], latency_ms=lat, bandwidth_mbps=bw)


def link(links: LinkMatrix, a: int, b: int) -> LinkSpec | None:
    return links.link(links.nodes[a], links.nodes[b])


def pair_transfer_s(links: LinkMatrix, a: int, b: int, nbytes: int) -> float:
    """A pair swap: one copy each way, both directions in parallel."""
    return max(transfer_s(link(links, a, b), nbytes), transfer_s(link(links, b, a), nbytes))


def group_allreduce_s(links: LinkMatrix, group: Sequence[int], nbytes: int) -> float:
    ls = [link(links, a, b) for a in group for b in group if a < b]
    return modelled_allreduce_s(nbytes, len(group), [x for x in ls if x is not None])


def schedule_diloco(dur: Sequence[Sequence[float]], allreduce_s: float,
                    match_overhead_s: float = 0.0) -> Schedule:
    """Global barrier: round r ends for everyone at max(arrivals) + all-reduce time."""
    W, R = len(dur), len(dur[0])
    sched = Schedule("diloco")
    start = [0.0] * W
    for r in range(1, R + 1):
        arr = [start[w] + dur[w][r - 1] for w in range(W)]
        end = max(arr) + match_overhead_s + allreduce_s
        for w in range(W):
            sched.records.append(RoundRecord(w, r, arr[w], end, end - arr[w], list(range(W)),
                                             "allreduce" if W > 1 else "solo", r))
        sched.events.append((end, [(w, r) for w in range(W)], "allreduce" if W > 1 else "solo"))
        start = [end] * W
    return sched


def schedule_local(dur: Sequence[Sequence[float]]) -> Schedule:
    sched = Schedule("local")
    for w, ds in enumerate(dur):
        t = 0.0
        for r, d in enumerate(ds, 1):
            t += d
            sched.records.append(RoundRecord(w, r, t, t, 0.0, [w], "local"))
    return sched


def pick_partner(waiting: dict[int, tuple[int, float]], r: int, max_round_skew: int,
                 rng: random.Random) -> int | None:
    """Partner for a worker arriving at round r among `waiting` {worker: (round, arrival)}:
    only |round - r| <= max_round_skew; the same round preferred; else uniform at random."""
    cands = sorted(p for p, (pr, _) in waiting.items() if abs(pr - r) <= max_round_skew)
    same = [p for p in cands if waiting[p][0] == r]
    pool = same or cands
    return pool[rng.randrange(len(pool))] if pool else None


def schedule_noloco(dur: Sequence[Sequence[float]], pair_s: Callable[[int, int], float],
                    round_timeout: float | Sequence[float], max_round_skew: int = 2, seed: int = 0,
                    match_overhead_s: float = 0.0, overlap_s: Sequence[float] | None = None) -> Schedule:
    """Barrier-free pairing in virtual time (see the module docstring).

    Events are processed in (time, kind, worker) order: arrivals (kind 0) before timeouts
    (kind 1) at the same instant, so a partner arriving exactly at the deadline still pairs.
    On arrival a worker pairs with a waiting worker within `max_round_skew` rounds, preferring
    the same round, uniformly at random among candidates (seeded `random.Random`).
    `round_timeout`: one wait for everyone, or one per worker (the role's waiting policy
    bounds each worker's wait by its own pace: benchmarks/noloco_swarm.py). ``overlap_s``: per
    worker, the seconds of the next round's compute it may run while it waits and exchanges
    (the role's ``overlap_fraction``): that part of the wait is not blocked and the next round's
    compute is shorter by it."""
    W = len(dur)
    overlap = [0.0] * W if overlap_s is None else [float(x) for x in overlap_s]
    waits = [float(round_timeout)] * W if isinstance(round_timeout, (int, float)) else [float(x) for x in round_timeout]
    rng = random.Random(f"pairing:{seed}:{W}")
    sched = Schedule("noloco")
    heap: list[tuple[float, int, int, int]] = []   # (time, kind, worker, round)
    for w in range(W):
        heapq.heappush(heap, (dur[w][0], 0, w, 1))
    waiting: dict[int, tuple[int, float]] = {}     # worker -> (round, arrival)

    def finish_round(w: int, r: int, arrival: float, end: float, group: list[int],
                     outcome: str, pr: int | None) -> None:
        ahead = min(end - arrival, overlap[w])     # computed while waiting (next round's steps)
        sched.records.append(RoundRecord(w, r, arrival, end, end - arrival - ahead, group, outcome, pr))
        if r < len(dur[w]):                         # rounds per worker (equal in benchmarks)
            heapq.heappush(heap, (end + max(0.0, dur[w][r] - ahead), 0, w, r + 1))

    while heap:
        t, kind, w, r = heapq.heappop(heap)
        if kind == 1:                               # timeout
            if w in waiting and waiting[w][0] == r:
                _, arrival = waiting.pop(w)
                sched.events.append((t, [(w, r)], "solo"))
                finish_round(w, r, arrival, t, [w], "solo", None)
            continue
        p = pick_partner(waiting, r, max_round_skew, rng)
        if p is None:
            waiting[w] = (r, t)
            heapq.heappush(heap, (t + waits[w], 1, w, r))
            continue
        pr, p_arrival = waiting.pop(p)
        end = t + match_overhead_s + pair_s(w, p)   # t = max(arrivals): p was already waiting
        grp = sorted([w, p])
        sched.events.append((end, [(p, pr), (w, r)], "pair"))
        finish_round(p, pr, p_arrival, end, grp, "pair", r)
        finish_round(w, r, t, end, grp, "pair", pr)
    sched.events.sort(key=lambda e: (e[0], e[1]))
    return sched


def _pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def blocked_stats(sched: Schedule, steady_only: bool = False) -> dict[str, Any]:
    """Seconds blocked per (worker, round): mean, p50, p95, max; outcome counts."""
    recs = sched.records
    if steady_only and recs:
        first_done = min(max(r.finish for r in sched.of(w)) for w in {r.worker for r in recs})
        recs = [r for r in recs if r.finish < first_done] or recs
    xs = [r.blocked for r in recs]
    outcomes: dict[str, int] = {}
    for r in recs:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {"mean": statistics.fmean(xs) if xs else 0.0, "p50": _pct(xs, 0.5),
            "p95": _pct(xs, 0.95), "max": max(xs, default=0.0), "n": len(xs),
            "outcomes": outcomes}


def partner_repeat_ratio(sched: Schedule) -> float | None:
    """Share of rounds (after a worker's first) with the same group as its previous round."""
    same = total = 0
    for w in {r.worker for r in sched.records}:
        rs = sched.of(w)
        for a, b in zip(rs, rs[1:]):
            total += 1
            same += a.group == b.group and len(b.group) > 1
    return same / total if total else None


def build_schedule(method: str, W: int, rounds: int, H: int, seed: int, base_step_s: float,
                   jitter: float, timing_bytes: int, round_timeout: float, max_round_skew: int,
                   match_overhead_s: float = 0.0) -> tuple[Schedule, dict[str, Any]]:
    speeds = make_speeds(W, seed, base_step_s)
    dur = round_durations(speeds, rounds, H, seed, jitter)
    links = make_links(W, seed)
    info: dict[str, Any] = {"step_s": speeds}
    if method == "diloco":
        ar = group_allreduce_s(links, list(range(W)), timing_bytes)
        info["allreduce_s_modelled"] = ar
        return schedule_diloco(dur, ar, match_overhead_s), info
    if method == "noloco":
        return schedule_noloco(dur, lambda a, b: pair_transfer_s(links, a, b, timing_bytes),
                               round_timeout, max_round_skew, seed, match_overhead_s), info
    if method == "local":
        return schedule_local(dur), info
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


# ============================================================================ training replay

def _train(sched: Schedule, method: str, W: int, H: int, rounds: int, seed: int, model_cfg,
           corpus, val, inner, batch_size: int, seq_len: int, eval_rounds: set[int]
           ) -> dict[str, Any]:
    """Replay `sched` with real training. Each exchange event first runs the members' H inner
    steps of that round (lazily, in event order, which is causal), then the exact group mean of
    theta and every member's outer step. Snapshots of phi at `eval_rounds` are evaluated once
    every worker has passed that round."""
    import torch

    from models.corpus import batches, evaluate
    from models.llama import build_model
    from models.optim import build_optimizer, inner_lr_scheduler, inner_step
    from optimizers.diloco import DiLoCoOuter
    from optimizers.noloco import NoLoCoOuter, copy_into, replica_spread

    base = build_model(model_cfg, seed)
    models = [copy.deepcopy(base) for _ in range(W)]
    params = [list(m.parameters()) for m in models]
    adams = [build_optimizer(ps, inner) for ps in params]
    scheds = [inner_lr_scheduler(a, inner) for a in adams]
    streams = [batches(corpus.train, batch_size, seq_len, seed=seed, shard=w, num_shards=W)
               for w in range(W)]
    if method == "noloco":
        outers = [NoLoCoOuter(ps, 0.7, 0.5, "tied") for ps in params]
    elif method == "diloco":
        outers = [DiLoCoOuter(ps, 0.7, 0.3, "heavyball") for ps in params]
    else:
        outers = None
    done_rounds = [0] * W
    train_loss: list[list[float]] = [[] for _ in range(W)]
    snaps: dict[int, dict[int, list]] = {r: {} for r in eval_rounds}
    scratch = copy.deepcopy(base)
    finish = {(rec.worker, rec.round): rec.finish for rec in sched.records}
    curve: list[dict[str, Any]] = []

    def evaluate_snapshot(r: int, reps: dict[int, list]) -> dict[str, Any]:
        reps_list = [reps[w] for w in range(W)]
        losses = []
        for ps in reps_list:
            copy_into(list(scratch.parameters()), ps)
            losses.append(evaluate(scratch, val))
        mean = [torch.stack(col).mean(0) for col in zip(*reps_list)]
        copy_into(list(scratch.parameters()), mean)
        return {"round": r, "inner_steps": r * H,
                "virtual_time_s": max(finish[(w, r)] for w in range(W)) if r else 0.0,
                "eval_loss_mean_model": evaluate(scratch, val),
                "eval_loss_replica_mean": statistics.fmean(losses),
                "replica_spread": replica_spread(reps_list)}

    def snapshot(w: int) -> None:
        r = done_rounds[w]
        if r in snaps:
            snaps[r][w] = [p.detach().clone() for p in params[w]]
            if len(snaps[r]) == W:
                curve.append(evaluate_snapshot(r, snaps.pop(r)))

    def inner_round(w: int, r: int) -> None:
        assert done_rounds[w] == r - 1, (w, r, done_rounds[w])
        m = models[w]
        for _ in range(H):
            train_loss[w].append(inner_step(m, next(streams[w]), adams[w], scheds[w], params[w], inner.clip_norm))

    curve.append(evaluate_snapshot(0, {w: [p.detach().clone() for p in params[w]]
                                       for w in range(W)}))
    snaps.pop(0, None)
    if outers is None:
        for w in range(W):
            for r in range(1, rounds + 1):
                inner_round(w, r)
                done_rounds[w] = r
                snapshot(w)
    else:
        for _, members, _ in sched.events:
            for w, r in members:
                inner_round(w, r)
            sent = [outers[w].exchange_tensors(params[w]) for w, _ in members]
            n = len(members)
            means = [torch.stack(col).mean(0) for col in zip(*sent)] if n > 1 else None
            for w, r in members:
                theta_bar, phi_bar = outers[w].split_means(means) if means else (None, None)
                new_phi = outers[w].outer_step(params[w], theta_bar, phi_bar, n)
                copy_into(params[w], new_phi)           # theta <- phi; Adam state kept
                done_rounds[w] = r
                snapshot(w)
    curve.sort(key=lambda c: c["round"])
    return {"curve": curve,
            "final_train_loss": statistics.fmean(statistics.fmean(tl[-H:]) for tl in train_loss)}


# ============================================================================ driver

def _growth(per_W: dict[int, float]) -> dict[str, float | None]:
    Ws = sorted(per_W)
    ys = [per_W[w] for w in Ws]
    if len(Ws) < 2:
        return {"slope_s_per_worker": None, "ratio_max_vs_min_W": None}
    mx, my = statistics.fmean(Ws), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(Ws, ys)) / sum((x - mx) ** 2 for x in Ws)
    return {"slope_s_per_worker": slope,
            "ratio_max_vs_min_W": ys[-1] / ys[0] if ys[0] > 0 else None,
            "W_min": Ws[0], "W_max": Ws[-1]}


def run_sim(quick: bool = True, W: Sequence[int] | None = None, methods: Sequence[str] = METHODS,
            steps: int | None = None, H: int | None = None, seed: int = 0,
            base_step_s: float = 1.0, jitter: float = 0.1, timing_bytes: int = 64 * MiB,
            round_timeout: float = 10.0, max_round_skew: int = 2, match_overhead_s: float = 0.0,
            lr: float = 3e-3, threads: int = 1, local_W: Sequence[int] | None = None,
            train: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the simulation; returns a JSON-able dict with `summary`, `per_W` and `runs`.

    quick=True: W 4/8/16, 120 inner steps, H 20, d_model 32, 1 layer, seq 64, batch 8 (local-only
    reference at W 4 only). quick=False: 1000 steps, H 50, d 64, 2 layers, seq 128, batch 16.
    train=False only builds the schedules (timing figures, no losses)."""
    import torch

    from models.config import DataConfig, ModelConfig
    from models.corpus import eval_batches, load_corpus
    from models.optim import InnerConfig

    preset = QUICK if quick else FULL
    W_list = tuple(W or preset["W"])
    steps = steps or preset["steps"]
    H = H or preset["H"]
    if steps % H:
        raise ValueError(f"steps={steps} must be a multiple of H={H} (whole outer rounds)")
    rounds = steps // H
    local_W = tuple(local_W if local_W is not None else preset["local_W"])
    t0 = time.perf_counter()
    torch.set_num_threads(threads)
    model_cfg = ModelConfig(d_model=preset["d_model"], n_layers=preset["n_layers"],
                            n_heads=preset["n_heads"], max_seq_len=preset["seq_len"])
    data_cfg = DataConfig(seq_len=preset["seq_len"], batch_size=preset["batch_size"],
                          max_train_bytes=preset["max_train_bytes"], max_val_bytes=200_000)
    inner = InnerConfig(lr=lr, warmup=min(preset["warmup"], steps), total_steps=steps,
                        min_lr_ratio=0.1)
    corpus = val = None
    if train:
        corpus = load_corpus(data_cfg)
        val = eval_batches(corpus.val, preset["batch_size"], preset["seq_len"],
                           preset["eval_batches"])
    ev = preset["eval_every_rounds"]
    eval_rounds = {r for r in range(0, rounds + 1, ev)} | {rounds}
    from models.llama import build_model
    P = build_model(model_cfg, seed).num_params() if train else None

    runs: list[dict[str, Any]] = []
    for w_count in W_list:
        for method in methods:
            if method == "local" and w_count not in local_W:
                continue
            sched, info = build_schedule(method, w_count, rounds, H, seed, base_step_s, jitter,
                                         timing_bytes, round_timeout, max_round_skew,
                                         match_overhead_s)
            n_ex = {"noloco": 1.0, "diloco": 2 * (w_count - 1) / w_count}.get(method, 0.0)
            copies = sum(n_ex for r in sched.records if len(r.group) > 1) / w_count
            entry: dict[str, Any] = {
                "method": method, "W": w_count, "H": H, "rounds": rounds, "inner_steps": steps,
                "blocked_s": blocked_stats(sched),
                "blocked_s_steady_state": blocked_stats(sched, steady_only=True),
                "virtual_time_end_s": max(r.finish for r in sched.records),
                "virtual_time_first_done_s": min(max(r.finish for r in sched.of(w))
                                                 for w in range(w_count)),
                "partner_repeat_ratio": partner_repeat_ratio(sched) if method == "noloco" else None,
                "model_copies_sent_per_worker": copies,
                "timing_bytes_sent_per_worker": copies * timing_bytes,
                "trained_model_bytes_sent_per_worker": copies * 4 * P if P else None,
                **info,
            }
            if method == "noloco":   # timing-only variant: pair within the same round only
                same, _ = build_schedule(method, w_count, rounds, H, seed, base_step_s, jitter,
                                         timing_bytes, round_timeout, 0, match_overhead_s)
                entry["blocked_s_same_round_only"] = blocked_stats(same)
            if method == "diloco":
                entry["note"] = ("heavy-ball DiLoCo (0.7/0.3) at NoLoCo's H for equal inner "
                                 "steps per outer round")
            if train:
                t1 = time.perf_counter()
                tr = _train(sched, method, w_count, H, rounds, seed, model_cfg, corpus, val,
                            inner, preset["batch_size"], preset["seq_len"], eval_rounds)
                entry.update(tr)
                entry["final_eval_loss_mean_model"] = tr["curve"][-1]["eval_loss_mean_model"]
                entry["final_eval_loss_replica_mean"] = tr["curve"][-1]["eval_loss_replica_mean"]
                entry["train_wall_s"] = round(time.perf_counter() - t1, 2)
            b = entry["blocked_s"]
            log(f"W={w_count:2d} {method:7s} blocked/round mean={b['mean']:.2f}s p50={b['p50']:.2f}"
                f" p95={b['p95']:.2f} outcomes={b['outcomes']} end={entry['virtual_time_end_s']:.0f}s"
                + (f" eval(mean model)={entry['final_eval_loss_mean_model']:.4f}"
                   f" eval(replica mean)={entry['final_eval_loss_replica_mean']:.4f}"
                   f" wall={entry['train_wall_s']}s" if train else ""))
            runs.append(entry)

    def get(method: str, w_count: int) -> dict[str, Any] | None:
        return next((r for r in runs if r["method"] == method and r["W"] == w_count), None)

    per_W: dict[str, Any] = {}
    for w_count in W_list:
        nl, dl, lo = get("noloco", w_count), get("diloco", w_count), get("local", w_count)
        row: dict[str, Any] = {}
        if nl and dl:
            row["blocked_mean_s_noloco"] = nl["blocked_s"]["mean"]
            row["blocked_mean_s_diloco"] = dl["blocked_s"]["mean"]
            row["blocked_ratio_noloco_vs_diloco"] = (
                nl["blocked_s"]["mean"] / dl["blocked_s"]["mean"]
                if dl["blocked_s"]["mean"] > 0 else None)
            row["blocked_ratio_steady_state"] = (
                nl["blocked_s_steady_state"]["mean"] / dl["blocked_s_steady_state"]["mean"]
                if dl["blocked_s_steady_state"]["mean"] > 0 else None)
            row["blocked_mean_s_noloco_same_round_only"] = nl["blocked_s_same_round_only"]["mean"]
            row["virtual_time_end_s_noloco"] = nl["virtual_time_end_s"]
            row["virtual_time_end_s_diloco"] = dl["virtual_time_end_s"]
            if train:
                row["eval_loss_noloco"] = nl["final_eval_loss_mean_model"]
                row["eval_loss_diloco"] = dl["final_eval_loss_mean_model"]
                row["eval_loss_ratio_noloco_vs_diloco"] = (nl["final_eval_loss_mean_model"]
                                                           / dl["final_eval_loss_mean_model"])
                row["eval_loss_replica_mean_noloco"] = nl["final_eval_loss_replica_mean"]
        if lo and train:
            row["eval_loss_local"] = lo["final_eval_loss_mean_model"]
            row["eval_loss_local_replica_mean"] = lo["final_eval_loss_replica_mean"]
        per_W[str(w_count)] = row

    ratios = {w: per_W[str(w)].get("blocked_ratio_noloco_vs_diloco") for w in W_list}
    ratios = {w: v for w, v in ratios.items() if v is not None}
    loss_ratios = {w: per_W[str(w)].get("eval_loss_ratio_noloco_vs_diloco") for w in W_list}
    loss_ratios = {w: v for w, v in loss_ratios.items() if v is not None}
    summary: dict[str, Any] = {
        "eval_loss_ratio_noloco_vs_diloco": max(loss_ratios.values()) if loss_ratios else None,
        "eval_loss_ratio_per_W": {str(k): v for k, v in loss_ratios.items()},
        "blocked_ratio_noloco_vs_diloco": max(ratios.values()) if ratios else None,
        "blocked_ratio_per_W": {str(k): v for k, v in ratios.items()},
        "blocked_ratio_steady_state_per_W": {
            str(w): per_W[str(w)].get("blocked_ratio_steady_state") for w in W_list},
        "blocked_mean_s_per_W": {
            m: {str(w): get(m, w)["blocked_s"]["mean"] for w in W_list if get(m, w)}
            for m in ("noloco", "diloco") if m in methods},
        "blocked_ratio_same_round_only_per_W": {
            str(w): (get("noloco", w)["blocked_s_same_round_only"]["mean"]
                     / get("diloco", w)["blocked_s"]["mean"])
            for w in W_list if get("noloco", w) and get("diloco", w)},
        "blocked_growth": {
            m: _growth({w: get(m, w)["blocked_s"]["mean"] for w in W_list if get(m, w)})
            for m in ("noloco", "diloco") if m in methods},
        "note": ("eval loss of the worker-mean phi after equal inner steps; the loss ratio is "
                 "the largest over W. blocked = virtual seconds from finishing a round's H "
                 "inner steps to the end of its outer step (MODELLED time: seeded compute "
                 "speeds and a WAN link matrix, netem formulas)"),
    }
    return {
        "benchmark": "noloco_swarm_sim",
        "summary": summary,
        "per_W": per_W,
        "config": {"quick": quick, "W": list(W_list), "methods": list(methods), "steps": steps,
                   "H": H, "rounds": rounds, "seed": seed, "base_step_s": base_step_s,
                   "speed_spread": [1.0, 2.0], "jitter": jitter, "timing_bytes": timing_bytes,
                   "round_timeout_s": round_timeout, "max_round_skew": max_round_skew,
                   "match_overhead_s": match_overhead_s, "latency_ms": [20, 150],
                   "bandwidth_mbps": [50, 500], "lr": lr, "threads": threads,
                   "model": model_cfg.model_dump(), "trained_params": P,
                   "inner": inner.model_dump(), "eval_rounds": sorted(eval_rounds),
                   "corpus": corpus.source if corpus else None},
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size (~2-3 min on 2 cores)")
    ap.add_argument("--W", type=int, nargs="+")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--H", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-step-s", type=float, default=1.0)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--timing-mib", type=float, default=64.0,
                    help="model size (MiB, fp32) used for modelled transfer times")
    ap.add_argument("--round-timeout", type=float, default=10.0)
    ap.add_argument("--max-round-skew", type=int, default=2)
    ap.add_argument("--no-train", action="store_true", help="schedules only (timing figures)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = run_sim(quick=args.quick, W=args.W, methods=args.methods, steps=args.steps, H=args.H,
                  seed=args.seed, base_step_s=args.base_step_s, jitter=args.jitter,
                  timing_bytes=int(args.timing_mib * MiB), round_timeout=args.round_timeout,
                  max_round_skew=args.max_round_skew, threads=args.threads,
                  train=not args.no_train, log=lambda s: print(s, file=sys.stderr, flush=True))
    text = json.dumps(res, indent=1, default=float)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
