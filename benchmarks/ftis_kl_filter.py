"""Which F-TIS KL filter at our completion lengths: per-token mean (ours) vs per-sequence sum (the paper's).

Three heterogeneous learners (the demo's three sizes, one byte tokenizer, ``grpo_swarm``'s task
settings) share rollouts in one process for N rounds (batches handed over directly: no transport,
no defenses; the exchange is not what is measured). Each setting runs from the same warmed-up
weights and the same sampling seeds; only the filter differs:

  token_mean delta = 0.5 (our default), sequence g in 5, 10, 50, 100 (the paper's ablation, 50 its
  choice), and no filter (``delta = inf``, the F-TIS weights alone).

Figures per setting: final held-out accuracy per peer (mean of the three; the higher the better),
the share of samples the filter dropped, the mean per-token and per-sequence KL of foreign
samples and the mean completion length. ``summary.best`` is the setting with the highest final
accuracy (mean over seeds); with one seed, differences under ~0.03 are noise.

Commands (2 CPU cores; repository root, venv active)::

    python benchmarks/ftis_kl_filter.py --quick --out /tmp/ftis_kl_quick.json    # 1 seed, 32 rounds, < 5 min
    python benchmarks/ftis_kl_filter.py --seeds 3 --rounds 60 --out /tmp/ftis_kl.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # allow `python benchmarks/ftis_kl_filter.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {"token_mean_0.5": {"kl_stat": "token_mean", "delta": 0.5},
            "sequence_5": {"kl_stat": "sequence", "g": 5.0},
            "sequence_10": {"kl_stat": "sequence", "g": 10.0},
            "sequence_50": {"kl_stat": "sequence", "g": 50.0},
            "sequence_100": {"kl_stat": "sequence", "g": 100.0},
            "no_filter": {"kl_stat": "token_mean", "delta": math.inf}}
GRPO: dict[str, Any] = {"max_operand": 5, "eval_samples": 8}
"""The task settings of benchmarks/grpo_swarm.py (on top of the role's defaults)."""
SIZES = ((32, 2, 4), (48, 2, 4), (64, 3, 4))


def run_one(args: tuple[str, int, int, str]) -> dict[str, Any]:
    name, seed, rounds, cache = args
    import torch

    from models import ModelConfig
    from rl.grpo_config import GRPOConfig
    from rl.learner import Learner

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    cfg = GRPOConfig(**GRPO, **SETTINGS[name])
    peers = []
    for i, (d, n, h) in enumerate(SIZES):
        L = Learner(cfg, ModelConfig(d_model=d, n_layers=n, n_heads=h, max_seq_len=64), 1000 * seed + i,
                    f"kl-{seed}", f"peer{i}")
        L.warmup(cache)
        L.gen.manual_seed(10_000 * seed + i)
        L.rng.seed(10_000 * seed + i)
        peers.append(L)
    start = [L.accuracy() for L in peers]
    filtered, kl_tok, kl_seq, lengths = [], [], [], []
    for r in range(rounds):
        gens = [L.generate(r) for L in peers]
        batches = [L.batch(g) for L, g in zip(peers, gens)]
        for i, L in enumerate(peers):
            st = L.train(gens[i], [b for k, b in enumerate(batches) if k != i])
            filtered.append(st.filtered_frac)
            kl_tok.append(st.kl_foreign)
            kl_seq.append(st.kl_seq_foreign)
            lengths.append(float(gens[i].samples.lengths.float().mean()))
    end = [L.accuracy() for L in peers] if rounds else start

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else 0.0
    return {"setting": name, "seed": seed, "accuracy_start": start, "accuracy_end": end,
            "accuracy_end_mean": statistics.fmean(end), "filtered_frac": mean(filtered),
            "kl_token_mean": mean(kl_tok), "kl_sequence_mean": mean(kl_seq),
            "completion_tokens_mean": mean(lengths), "wall_s": round(time.perf_counter() - t0, 1)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    table = {}
    for name in SETTINGS:
        rs = [r for r in runs if r["setting"] == name]
        if rs:
            table[name] = {k: statistics.fmean(r[k] for r in rs) for k in
                           ("accuracy_end_mean", "filtered_frac", "kl_token_mean", "kl_sequence_mean",
                            "completion_tokens_mean")}
    best = max(table, key=lambda k: table[k]["accuracy_end_mean"]) if table else None
    return {"by_setting": table, "best": best,
            "accuracy_start_mean": statistics.fmean(statistics.fmean(r["accuracy_start"]) for r in runs)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 32 rounds (< 5 min on 2 cores)")
    ap.add_argument("--out", type=Path, required=True, help="JSON result file")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    rounds = args.rounds or 32
    seeds = 1 if args.quick else args.seeds
    from rl.grpo_config import GRPOConfig
    cache = str(Path(GRPOConfig().warmup_cache_dir).expanduser())
    t0 = time.monotonic()
    jobs = [(name, seed, rounds, cache) for seed in range(seeds) for name in SETTINGS]
    # warm the three peers of each seed once (the first job of each seed would race otherwise)
    with ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(run_one, [("token_mean_0.5", s, 0, cache) for s in range(seeds)]))
        runs = []
        for res in pool.map(run_one, jobs):
            print(f"{res['setting']:>15} seed {res['seed']}: accuracy {statistics.fmean(res['accuracy_start']):.3f} -> "
                  f"{res['accuracy_end_mean']:.3f}, filtered {res['filtered_frac']:.3f}, KL/token "
                  f"{res['kl_token_mean']:.3f}, KL/seq {res['kl_sequence_mean']:.2f}, "
                  f"{res['completion_tokens_mean']:.1f} tokens ({res['wall_s']:.0f} s)", flush=True)
            runs.append(res)
    result = {"summary": summarize(runs), "runs": runs,
              "config": {"rounds": rounds, "seeds": seeds, "grpo": GRPO, "settings": SETTINGS, "sizes": SIZES},
              "wall_s": round(time.monotonic() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
