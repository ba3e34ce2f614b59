"""One NoLoCo outer exchange of a real-sized model on a device, host copies included (issue 9).

    python benchmarks/device_exchange.py --device cuda --out F [--quick]

Starts a bootstrap and two ``noloco`` workers (``node.localswarm.LocalSwarm``, real processes,
DHTs and gRPC on 127.0.0.1) on ``--device`` with a model of ``--d-model`` x ``--layers`` (default
d 1024, 4 layers: about 51 M parameters, 0.2 GB of fp32 theta per exchange), both at the same
pace, ``overlap_fraction`` 0 so a round blocks for the whole exchange. Each worker logs every
round (``averaging_round_done``); the figures are read from those records:

- ``exchange_s``: the transfer of one exchange once the partner is matched (both directions
  streamed at once, digests checked, the ordered mean computed);
- ``blocked_s`` of a paired round: from the end of the inner phase to the mean, i.e. the
  device-to-host copy of the tensors to send into pinned buffers, the pairing, the exchange;
- ``outer_step_s`` is not separate: the host-to-device copy of the mean and the outer step run
  after ``blocked_s`` and before the next round's first step.

Summary: ``exchange_s_median``, ``blocked_s_median_paired`` (over both workers' paired rounds
after the first), ``exchange_bytes`` and ``params``. ``--quick`` runs 4 rounds of 10 inner steps.
Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.noloco_swarm import records  # noqa: E402  (a node's log records of one event)
from node.localswarm import LocalSwarm  # noqa: E402


def count_params(args: argparse.Namespace) -> int:
    """Parameters of the workers' model (built on the meta device: no memory, no init)."""
    import torch

    from models.config import ModelConfig
    from models.llama import build_model

    with torch.device("meta"):
        model = build_model(ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                                        max_seq_len=128), 0)
    return sum(p.numel() for p in model.parameters())


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds = 4 if args.quick else args.rounds
    steps = rounds * args.inner_steps
    sets = [f"noloco.inner_steps={args.inner_steps}", f"noloco.exit_after_steps={steps}",
            "noloco.overlap_fraction=0", "noloco.round_timeout=60", "noloco.eval_every=0",
            "noloco.checkpoint_every=0", "noloco.torch_threads=2", "noloco.inner.warmup=2",
            f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", f"model.n_heads={args.heads}",
            "model.max_seq_len=128", "data.seq_len=128", "data.batch_size=8",
            "data.max_train_bytes=2000000", "data.max_val_bytes=100000", "card.ttl_s=20", "card.refresh_s=2",
            "drain.budget_s=20", f"device.device={args.device}", f"device.precision={args.precision}"]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="device-exchange-") as tmp, \
            LocalSwarm(run_id="device-exchange", workdir=Path(tmp), common_set=sets) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=120)
        workers = [swarm.start("noloco", name=f"w{i}") for i in range(2)]
        swarm.wait_ready(workers, timeout=300)
        deadline = time.monotonic() + args.timeout_s
        while any(w.alive() for w in workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {args.timeout_s:.0f} s")
            time.sleep(0.5)
        per = {w.name: records(w, "averaging_round_done") for w in workers}
        ready = {w.name: [{k: r.get(k) for k in ("device", "precision", "outer_state_device")}
                          for r in records(w, "device_ready")] for w in workers}
    paired = [r for rs in per.values() for r in rs[1:] if r["outcome"] == "ok"]
    if not paired:
        outcomes = [(r["outcome"], r["reason"]) for rs in per.values() for r in rs]
        raise RuntimeError(f"no paired round after the first: {outcomes}; see the workers' logs")
    params = count_params(args)
    summary = {
        "exchange_s_median": statistics.median(r["exchange_s"] for r in paired),
        "blocked_s_median_paired": statistics.median(r["blocked_s"] for r in paired),
        "paired_rounds": len(paired),
        "rounds": sum(len(rs) for rs in per.values()),
        "params": params,
        "exchange_bytes": 4 * params,  # fp32 theta (tied consensus: theta only)
    }
    return {"benchmark": "device_exchange", "measured": True, "quick": args.quick,
            "setup": {"device": args.device, "precision": args.precision, "d_model": args.d_model,
                      "layers": args.layers, "heads": args.heads, "inner_steps": args.inner_steps, "sets": sets},
            "device_ready": ready, "summary": summary, "rounds": per,
            "elapsed_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="device.device of both workers (cpu, cuda, cuda:N)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=400.0)
    ap.add_argument("--quick", action="store_true", help="4 rounds (a few minutes on a GPU)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
