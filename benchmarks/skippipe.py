"""SkipPipe on real processes: full pipeline vs random legal skipping vs SkipPipe (docs/pipeline.md, 'Benchmarks').

The same swarm three times, one method each (``schedule.method``): a bootstrap (the schedule
coordinator) and 9 ``stage`` nodes as OS processes on 127.0.0.1: 3 data nodes (stage 0) and 3
transformer stages x 2 replicas, a tiny byte-level LLaMA (d 32, 4 blocks, 1 per stage: stage 0
holds the embedding, the first block and the head, as the paper's stage 0 holds a stage's worth), 3
microbatches of 4 x 32 tokens per data node per iteration, skip ratio 1/3 (SkipPipe and random
paths visit 2 of the 3 transformer stages; the full pipeline all 3, in order), memory 3.

The emulated network (the same in every run): each node sits in a cloud region (``REGIONS``);
links between them are ``pipeline/geo.py``'s modelled one-way latencies (unscaled) and
bandwidths scaled so that an activation's transfer time keeps its paper-scale ratio to compute,
applied per message by the sending node (``node/netem.py``, ``[netem.links]`` by peer ID); the
coordinator plans on the same matrix (``[netem.matrix]``). Compute: each node sleeps
``W_S x speed`` per forward (1.5x per backward, 0.25x per loss) on top of its real compute, as
the official emulation does; its card publishes its measured forward time plus that delay.

Measured (real processes) per method: iteration time step to step at the data nodes (median
over the iterations not preceded by a validation, and not the first); the makespan (first
microbatch leaving any data node to the last backward at one, from the data nodes' ``stage_step``
``started_at`` / ``done_at``); idle fraction; hop time split into emulated link, codec (timed in
this process on the same tensor) and the rest (gRPC, asyncio, stream credit); validation loss
of the full in-order model against iterations and training seconds. Predicted (a model,
``pipeline/simulator.py`` on the cost model the coordinator planned with and logged): the
iteration period (``iteration_period``: the makespan plus what the paper's simulator leaves out,
every stage's replica gradient exchange and the EndOfIteration messages between iterations)
and the makespan alone (``simulate``). After training, the final weights (each node's
checkpoint) are loaded here to report perplexity with 25% and 50% of the non-first stages
dropped at inference (the expectation over random sorted subsets; a fractional stage count
mixes the two nearest counts; stage 0 and its blocks are never dropped: `kept_stage_subsets`),
for the model trained with skipping (SkipPipe) and without (full pipeline).

The top-level "summary" holds: iteration_time_ratio_skippipe_vs_full (target <= 0.6),
iteration_time_ratio_skippipe_vs_random (< 1), predicted_time_error (largest over the three
methods of |measured - predicted| / predicted, <= 0.2), hop_overhead_ratio (hop / emulated link
over every message of the SkipPipe run, <= 2), eval_loss_ratio_skippipe_vs_full (final
validation loss at equal iterations, <= 1.05), and the dropped-stage perplexities.

    python benchmarks/skippipe.py --quick --out /tmp/skippipe_quick.json   # ~4 min on 2 cores
    python benchmarks/skippipe.py --out /tmp/skippipe.json                 # 40 iterations per method
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/skippipe.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from models.config import DataConfig, ModelConfig  # noqa: E402
from models.corpus import eval_batches, load_corpus  # noqa: E402
from models.llama import lm_loss  # noqa: E402
from models.stages import StageSet, stage0_share  # noqa: E402
from node.checkpoint import Checkpointer  # noqa: E402
from node.localswarm import LocalSwarm, NodeProc  # noqa: E402
from pipeline.cluster import Cluster  # noqa: E402
from pipeline.geo import ACTIVATION_BYTES, FORWARD_S, region_link  # noqa: E402
from pipeline.schedule import Schedule  # noqa: E402
from pipeline.simulator import iteration_period  # noqa: E402
from pipeline.stage_role import CHECKPOINT_FORMAT  # noqa: E402
from protocol.stream_wire import StreamAssembler, parse, tensor_frames  # noqa: E402
from security.keys import peer_id_str, write_key_file  # noqa: E402

TARGETS = {"iteration_time_ratio_skippipe_vs_full": ("<=", 0.6),
           "iteration_time_ratio_skippipe_vs_random": ("<", 1.0),
           "predicted_time_error": ("<=", 0.2),
           "hop_overhead_ratio": ("<=", 2.0),
           "eval_loss_ratio_skippipe_vs_full": ("<=", 1.05)}
METHODS = ("full", "random", "skippipe")

STAGES, MB_PER_ORIGIN, MEMORY = 4, 3, 3
LAYOUT = (0, 0, 0, 1, 1, 2, 2, 3, 3)
"""Stage of node i: 3 data nodes, then 2 replicas of each transformer stage."""
REGIONS = ("london", "belgium", "frankfurt", "netherlands", "iowa", "london", "tokyo", "frankfurt", "singapore")
"""Region of node i (pipeline/geo.py): data nodes in western Europe, each stage with a near and
a far (or slower) replica."""
SPEED = (1.0, 1.0, 1.0, 1.6, 0.7, 1.3, 1.0, 0.7, 1.6)
"""Forward time of node i relative to W_S (heterogeneous accelerators)."""
W_S = 0.05
"""Emulated forward seconds of one stage for one microbatch at speed 1 (paper scale: 1.76 s)."""
MODEL = dict(d_model=32, n_layers=4, n_heads=2, max_seq_len=32)
"""4 blocks over 4 stages: stage 0 keeps the first (`stage.stage0_layers` unset: a stage's worth)."""
DATA = dict(seq_len=32, batch_size=4, max_train_bytes=400_000, max_val_bytes=40_000)
ACT_BYTES = DATA["batch_size"] * DATA["seq_len"] * MODEL["d_model"] * 4
BW_SCALE = ACT_BYTES / ACTIVATION_BYTES * FORWARD_S / W_S
"""Bandwidths are scaled by this so that bytes / bandwidth keeps its paper-scale ratio to compute."""
PPL_BATCHES = 8


# ------------------------------------------------------------------------------------- the network

def links() -> tuple[list[list[float]], list[list[float]]]:
    """(one-way latency ms, bandwidth Mbit/s) between the nodes (diagonal 0 / inf)."""
    n = len(REGIONS)
    lat = [[0.0] * n for _ in range(n)]
    bw = [[math.inf] * n for _ in range(n)]
    for i, j in itertools.permutations(range(n), 2):
        ms, mbs = region_link(REGIONS[i], REGIONS[j])
        lat[i][j], bw[i][j] = ms, mbs * 8.0 * BW_SCALE
    return lat, bw


def node_settings(method: str, iterations: int, eval_every: int) -> list[str]:
    return [f"schedule.stages={STAGES}", "schedule.skip_ratio=0.3333333333333333", f"schedule.method={method}",
            f"schedule.mb_per_origin={MB_PER_ORIGIN}", f"schedule.memory={MEMORY}",
            f"schedule.expect_nodes={len(LAYOUT)}", "schedule.settle_s=1.0", "schedule.time_budget_s=10",
            *(f"model.{k}={v}" for k, v in MODEL.items()), *(f"data.{k}={v}" for k, v in DATA.items()),
            "stage.torch_threads=1", f"stage.iterations={iterations}", f"stage.eval_every={eval_every}",
            "stage.eval_batches=2", "stage.optim.lr=0.003", "stage.optim.warmup=0",
            f"stage.optim.total_steps={iterations}", "drain.budget_s=10"]


def _link_json(lat_ms: float, bw_mbps: float) -> dict:
    return {"latency_ms": round(lat_ms, 3), "bandwidth_mbps": None if math.isinf(bw_mbps) else round(bw_mbps, 4)}


def netem_settings(peers: list[str]) -> tuple[list[str], list[list[str]]]:
    """(the bootstrap's [netem.matrix] by peer ID, each stage node's own [netem.links])."""
    lat, bw = links()
    matrix = {"nodes": peers, "latency_ms": lat,
              "bandwidth_mbps": [[1e9 if math.isinf(v) else round(v, 4) for v in row] for row in bw]}
    boot = ["netem.enabled=false", f"netem.matrix={json.dumps(matrix)}"]
    per_node = [["netem.enabled=true", "netem.links=" + json.dumps(
        {peers[j]: _link_json(lat[i][j], bw[i][j]) for j in range(len(peers)) if j != i})]
        for i in range(len(peers))]
    return boot, per_node


# ------------------------------------------------------------------------------------- one run

def _events(node: NodeProc, event: str) -> list[dict]:
    return [json.loads(line) for line in node.log_text().splitlines() if f'"event": "{event}"' in line]


def run_method(method: str, iterations: int, eval_every: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """One swarm, one method; returns the raw records it logged."""
    workdir.mkdir(parents=True, exist_ok=True)
    names = [f"stage-{i}" for i in range(len(LAYOUT))]
    peers = []
    for name in names:                    # identities first (fixed: same peer order, same plan every run)
        key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"skippipe-bench/{name}".encode()).digest())
        write_key_file(workdir / f"{name}.key", key, overwrite=True)
        peers.append(peer_id_str(key.public_key()))
    boot_netem, node_netem = netem_settings(peers)
    t0 = time.monotonic()
    with LocalSwarm(run_id=f"skippipe-{method}", common_set=node_settings(method, iterations, eval_every),
                    workdir=workdir) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap", extra_set=boot_netem)
        swarm.wait_ready([boot], timeout=120)
        nodes = [swarm.start("stage", name=name, extra_set=[f"stage.index={LAYOUT[i]}",
                                                            f"stage.compute_delay_s={W_S * SPEED[i]}",
                                                            *node_netem[i]])
                 for i, name in enumerate(names)]
        deadline = time.monotonic() + timeout_s
        for n in nodes:
            rc = swarm.wait_exit(n, timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"{method}: {n.name} exited with {rc}; log {n.log_path}:\n{n.log_text()[-2000:]}")
        wall = time.monotonic() - t0
    published = _events(boot, "schedule_published")
    if len(published) != 1:
        raise RuntimeError(f"{method}: expected one schedule, the coordinator published {len(published)}")
    return {"wall_s": wall, "published": published[0], "steps": {n.name: _events(n, "stage_step") for n in nodes},
            "evals": [e for n in nodes for e in _events(n, "pipeline_eval")],
            "finished": {n.name: _events(n, "training_finished")[-1] for n in nodes},
            "dirs": {n.name: workdir / n.name for n in nodes}}


def _timed_iterations(iterations: int, eval_every: int) -> list[int]:
    """Iterations whose start no validation delayed (and not the first: streams open then)."""
    return [t for t in range(1, iterations) if not (eval_every and t % eval_every == 0)]


def analyze(raw: dict, iterations: int, eval_every: int) -> dict[str, Any]:
    """Measured vs predicted figures of one run (see the module doc for the definitions)."""
    timed = set(_timed_iterations(iterations, eval_every))
    data_nodes = [f"stage-{i}" for i, s in enumerate(LAYOUT) if s == 0]
    makespans, periods = [], []
    for t in sorted(timed):
        recs = [next(r for r in raw["steps"][n] if r["iteration"] == t) for n in data_nodes]
        makespans.append(max(r["done_at"] for r in recs) - min(r["started_at"] for r in recs))
        periods.append(statistics.mean(r["seconds"] for r in recs))
    idle = []
    for recs in raw["steps"].values():
        sel = [r for r in recs if r["iteration"] in timed]
        idle.append(sum(r["idle_s"] for r in sel) / sum(r["seconds"] for r in sel))
    pub = raw["published"]
    sched = Schedule.from_json(json.dumps(pub["schedule"]))
    cost = pub["cost_model"]
    model = iteration_period(Cluster(compute=cost["compute"], comm=cost["comm"], memory=cost["memory"],
                                     latency=cost["latency"], grad_s=cost["grad_s"]), sched.paths, sched.partitions)
    hops = sum(f["hops"] for f in raw["finished"].values())
    hop_s = sum(f["hop_s_mean"] * f["hops"] for f in raw["finished"].values())
    link_s = sum(f["link_s_mean"] * f["hops"] for f in raw["finished"].values())
    curve = sorted((e["iteration"], e["train_s"], e["eval_loss"]) for e in raw["evals"])
    measured, predicted = statistics.median(periods), pub["expected_period"]
    return {
        "measured": {"iteration_s": round(measured, 4), "iteration_s_each": [round(x, 4) for x in periods],
                     "makespan_s": round(statistics.median(makespans), 4),
                     "idle_fraction": round(statistics.mean(idle), 4), "wall_s": round(raw["wall_s"], 1)},
        "predicted": {"iteration_s": round(predicted, 4), "idle_fraction": round(model.idle_fraction, 4),
                      "makespan_s": round(pub["expected_makespan"], 4),
                      "makespan_error": round(abs(statistics.median(makespans) - pub["expected_makespan"])
                                              / pub["expected_makespan"], 4)},
        "predicted_time_error": round(abs(measured - predicted) / predicted, 4),
        "hops": {"count": hops, "hop_s_mean": hop_s / max(1, hops), "link_s_mean": link_s / max(1, hops)},
        "eval_loss": [{"iteration": it, "train_s": s, "loss": round(loss, 4)} for it, s, loss in curve],
        "final_eval_loss": curve[-1][2],
        "timed_iterations": sorted(timed),
        "schedule": {"stage_paths": [list(sched.stages(p)) for p in range(len(sched.paths))],
                     "node_paths": [list(p) for p in sched.paths], "partitions": [list(g) for g in sched.partitions],
                     "cost_model_compute_s": cost["compute"]},
        "dropped": {n: f["dropped"] for n, f in raw["finished"].items() if f["dropped"]},
        "send_retries": sum(f["send_retries"] for f in raw["finished"].values()),
    }


# ------------------------------------------------------------------------------------- hop split, perplexity

def codec_seconds(reps: int = 300) -> float:
    """Encode + verify-decode of one activation message through the stream codec, in this process."""
    tensor = torch.randn(DATA["batch_size"], DATA["seq_len"], MODEL["d_model"])
    meta = {"it": "12", "ep": "1", "p": "4", "h": "2", "o": "1", "q": "1", "ts": "1700000000000000", "lk": "51234"}
    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        asm = StreamAssembler(1 << 24)
        for frame in tensor_frames(0, "fwd", tensor, meta):
            asm.feed(parse(frame))
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def load_stages(dirs: dict[str, Path]) -> StageSet:
    """The trained model from the nodes' final checkpoints (one node per stage; replicas are identical)."""
    cfg = ModelConfig(**MODEL)
    stages = StageSet.build(cfg, 0, STAGES, stage0_layers=None)     # as the nodes split it: the [stage] default
    for s in range(STAGES):
        name = f"stage-{LAYOUT.index(s)}"
        state = Checkpointer(dirs[name], CHECKPOINT_FORMAT, "").read(required=("stage",), check_cfg=False)
        if state is None:
            raise RuntimeError(f"{name} wrote no checkpoint in {dirs[name]}")
        stages.stages[s].load_state_dict(state["parts"]["stage"])
    return stages


def kept_stage_subsets(n_stages: int, drop: int) -> list[tuple[int, ...]]:
    """Every stage path that drops `drop` of the transformer stages 1..n_stages-1 and keeps the
    others in order. Stage 0 (embedding, its own first blocks, head) leads every one: the
    omission never drops it, as SkipPipe never skips it."""
    if not 0 <= drop <= n_stages - 1:
        raise ValueError(f"cannot drop {drop} of {n_stages - 1} transformer stages")
    return [(0, *kept) for kept in itertools.combinations(range(1, n_stages), n_stages - 1 - drop)]


def dropped_stage_perplexity(stages: StageSet, batches, fraction: float) -> float:
    """exp(expected loss) with `fraction` of the non-first stages dropped: uniform over sorted
    subsets of the kept stages; a fractional count mixes floor and ceil by its remainder."""
    n = len(stages.stages) - 1
    k = fraction * n
    lo = math.floor(k)
    mix = [(lo, 1 - (k - lo))] + ([(lo + 1, k - lo)] if k > lo else [])
    total = 0.0
    for drop, weight in mix:
        losses = []
        for path in kept_stage_subsets(n + 1, drop):
            with torch.no_grad():
                losses.append(statistics.mean(float(lm_loss(stages.logits(x, path), y)) for x, y in batches))
        total += weight * statistics.mean(losses)
    return math.exp(total)


# ------------------------------------------------------------------------------------- main

def _meets(value: float | None, op: str, target: float) -> bool | None:
    if value is None or math.isnan(value):
        return None
    return value <= target if op == "<=" else value < target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 iterations per method (about 4 minutes on 2 cores)")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--iterations", type=int, help="pipeline iterations per method (default 10 quick, 40 full)")
    ap.add_argument("--workdir", help="where node logs and checkpoints go (default: next to --out)")
    args = ap.parse_args(argv)
    iterations = args.iterations or (10 if args.quick else 40)
    eval_every = 5 if iterations <= 20 else 10
    out = Path(args.out)
    workdir = Path(args.workdir) if args.workdir else out.with_suffix("").with_name(out.stem + "_nodes")
    t_start = time.monotonic()
    results, dirs = {}, {}
    for method in METHODS:
        print(f"[{time.monotonic() - t_start:6.1f}s] {method}: bootstrap + {len(LAYOUT)} stage nodes, "
              f"{iterations} iterations", flush=True)
        raw = run_method(method, iterations, eval_every, workdir / method, timeout_s=120 + 15 * iterations)
        results[method] = analyze(raw, iterations, eval_every)
        dirs[method] = raw["dirs"]
        m = results[method]
        print(f"[{time.monotonic() - t_start:6.1f}s] {method}: measured {m['measured']['iteration_s']:.3f} s/iteration, "
              f"predicted {m['predicted']['iteration_s']:.3f} s, final eval loss {m['final_eval_loss']:.4f}", flush=True)
    codec_s = codec_seconds()
    sp = results["skippipe"]
    hop, link = sp["hops"]["hop_s_mean"], sp["hops"]["link_s_mean"]
    hop_split = {"hop_s": round(hop, 5), "emulated_link_s": round(link, 5), "codec_s": round(codec_s, 6),
                 "grpc_and_rest_s": round(max(0.0, hop - link - codec_s), 5),
                 "note": "hop = queued at the sender -> in the receiver's inbox, mean over every message of the "
                         "SkipPipe run; codec timed in this process on one activation; the rest is gRPC, asyncio "
                         "and stream credit"}
    cfg_data = DataConfig(**DATA)
    batches = eval_batches(load_corpus(cfg_data).val, cfg_data.batch_size, cfg_data.seq_len, PPL_BATCHES)
    ppl = {}
    for trained, method in (("with_skipping", "skippipe"), ("without_skipping", "full")):
        stages = load_stages(dirs[method])
        ppl[trained] = {f"drop_{int(f * 100)}pct": round(dropped_stage_perplexity(stages, batches, f), 4)
                        for f in (0.0, 0.25, 0.5)}
        for key in ("drop_25pct", "drop_50pct"):
            ppl[trained][f"{key}_increase"] = round(ppl[trained][key] / ppl[trained]["drop_0pct"] - 1, 4)
    summary = {
        "iteration_time_ratio_skippipe_vs_full": round(sp["measured"]["iteration_s"]
                                                       / results["full"]["measured"]["iteration_s"], 4),
        "iteration_time_ratio_skippipe_vs_random": round(sp["measured"]["iteration_s"]
                                                         / results["random"]["measured"]["iteration_s"], 4),
        "predicted_time_error": max(r["predicted_time_error"] for r in results.values()),
        "hop_overhead_ratio": round(hop / link, 4) if link > 0 else None,
        "eval_loss_ratio_skippipe_vs_full": round(sp["final_eval_loss"] / results["full"]["final_eval_loss"], 4),
        "makespan_ratio_skippipe_vs_full": round(sp["measured"]["makespan_s"]
                                                 / results["full"]["measured"]["makespan_s"], 4),
        "perplexity_trained_with_skipping": ppl["with_skipping"],
        "perplexity_trained_without_skipping": ppl["without_skipping"],
    }
    summary["targets_met"] = {k: _meets(summary[k], *TARGETS[k]) for k in TARGETS}
    doc = {"summary": summary, "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
           "setup": {"nodes": len(LAYOUT), "layout": LAYOUT, "regions": REGIONS, "speed": SPEED, "w_s": W_S,
                     "bandwidth_scale": BW_SCALE, "stages": STAGES, "skip_ratio": "1/3 (2 of 3 transformer stages)",
                     "mb_per_origin": MB_PER_ORIGIN, "memory": MEMORY, "model": MODEL, "data": DATA,
                     "stage0_blocks": stage0_share(MODEL["n_layers"], STAGES),
                     "iterations": iterations, "eval_every": eval_every, "quick": args.quick,
                     "links_ms_mbps": links(), "workdir": str(workdir)},
           "methods": results, "hop_split": hop_split,
           "notes": {"iteration_s": "measured step to step at the data nodes (median over the timed iterations); "
                                    "makespan_s: first microbatch leaving a data node to the last backward at one "
                                    "(the paper's simulator's figure, no replica gradient exchange)",
                     "predicted": "a model: pipeline/simulator.py iteration_period (makespan plus the replica "
                                  "gradient exchange and EndOfIteration between iterations) on the cost model "
                                  "the coordinator planned with; makespan_s is simulate()'s figure"},
           "wall_s": round(time.monotonic() - t_start, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out} in {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
