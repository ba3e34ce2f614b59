"""Poisoned rollouts in collaborative GRPO: attack success with and without the defenses (docs/grpo.md, 'Benchmarks').

For every attack mode (``inject``, ``edit``, ``inject+fake_logp``, ``verbose``, ``collude``: two
injecting attackers; ``inject_start``: the HTTT paper's text attack, the marker at the start of the
reasoning; ``vertical``: the paper's vertical attacker in the vertical topology (``grpo.topology``:
every peer answers prompts of its own in whole groups), the right answers of its own groups poisoned at
the start and its wrong ones clean), every swarm (``homogeneous``: four peers with the same initial weights, so
the same ``model_id``, hence the logit / support check; ``heterogeneous``: three honest peers of
different sizes and an attacker of yet another model, hence the probability floor + the ``arith``
rule judge), defenses off and on, and each seed: 3 honest learners and the attacker(s) run in one
process for N rounds. Real ``rl/`` and ``security/`` code: every batch is encoded, signed with the
sender's Ed25519 key and opened by each receiver through the full codec and validation
(``rl.grpo_exchange.open_signed``); the honest learners then run ``Learner.train`` with
(``[grpo.defense]`` defaults: admission with rate bans and token budgets, logit check, judge) or
without (``Learner.defense = None``: plain F-TIS sharing) the defenses. Attackers do not train.

Figures per run: attack success = share of each honest peer's held-out completions (fixed prompts,
fixed sampling seed) containing the attack's marker (``" !!"`` for inject, ``"2+2=5"`` for edit)
after N rounds; held-out accuracy before and after; per-sender checked / rejected counts and
ban rounds as seen by each honest receiver; tokens trained per round from each attacker (DoS);
seconds per round of the honest learners' training step (with vs without defenses, same run).

The top-level ``summary``:
  attack_success_without_defense   max over non-DoS modes and swarms of the mean over honest peers
                                   (and seeds), defenses off                 target >= 0.9 (harness is real)
  attack_success_with_defense      the same, defenses on                     target <= 0.05
  honest_false_reject_rate         honest senders' completions rejected / checked, defended runs   <= 0.05
  reject_rule                      the default ``grpo.defense.reject_rule`` (the figures above use it)
  by_rule                          per rule (``drop``, ``zero_reward``): attack_success_with_defense,
                                   honest_false_reject_rate, accuracy_end over the same defended runs
  by_mode, attacker_ban_round, dos (tokens trained from the verbose attacker per round: no defense,
  token budget only (``defense.kind = "off"``: no content check, no ban), full defenses; its budget;
  honest held-out length ratio end / start), cost_s_per_round (off/on) and the judge used.

Commands (2 CPU cores; repository root, venv active)::

    python benchmarks/grpo_attacks.py --quick --out docs/results/grpo_attacks_quick.json   # 1 seed, 2 modes, < 5 min
    python benchmarks/grpo_attacks.py --out docs/results/grpo_attacks.json                 # 3 seeds, all runs, ~40 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # allow `python benchmarks/grpo_attacks.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("inject", "edit", "inject+fake_logp", "verbose", "collude", "inject_start", "vertical")
ATTACKS: dict[str, dict[str, Any]] = {"inject_start": {"mode": "inject", "placement": "start"},
                                      "vertical": {"mode": "inject", "placement": "start", "vertical": True},
                                      "collude": {"mode": "inject"}}
"""Benchmark modes that are not a plain ``[grpo.adversary] mode``: the HTTT paper's text attack
(marker at the start of the reasoning), its vertical attacker (the right answers of its own groups
poisoned at the start, its wrong ones clean), two colluding injectors."""
RULES = ("drop", "zero_reward")
SWARMS = ("homogeneous", "heterogeneous")
TARGETS = {"attack_success_without_defense": (">=", 0.9), "attack_success_with_defense": ("<=", 0.05),
           "honest_false_reject_rate": ("<=", 0.05)}

HOMO_SIZE = (32, 2, 4)
HETERO_SIZES = ((32, 1, 4), (32, 2, 4), (48, 2, 4))
ATTACKER_SIZE = (32, 2, 4)

GRPO: dict[str, Any] = {"max_operand": 5, "max_completion_tokens": 24, "lr": 1e-3,
                        "steps_per_round": 4, "heldout_size": 50, "eval_samples": 4, "prompts_per_round": 16}
"""[grpo] settings shared by every peer of every run (recorded in the JSON). lr 1e-3 with 4 steps per
round lets an undefended injection take hold within tens of rounds on these tiny models. Sampling
and the support check use the role's defaults (top-k 50, top-p 1: the HTTT paper's support)."""

QUICK = {"rounds": 32, "seeds": 1, "runs": [("edit", "homogeneous"), ("inject", "heterogeneous"),
                                           ("inject_start", "homogeneous"), ("vertical", "heterogeneous")]}
"""The headline comparison in about three minutes on an idle 2-core machine (12 runs, 2 at a time): the
strongest undefended attack (in-context edit: same model, the logit / support check), the injection
into a heterogeneous swarm (the rule judge), the paper's start-of-reasoning injection (same model)
and its vertical attacker (other model), each with defenses off and on under both reject rules.
Every mode, the DoS figures and 3 seeds are the full run's."""
FULL = {"rounds": 100, "seeds": 3, "runs": [(m, s) for s in SWARMS for m in MODES]}
"""Every mode in both swarms, defenses off and on (on: under both reject rules; verbose also with the
token budget alone), 3 seeds: 126 runs of 100 rounds, about 80 min on an idle 2-core machine (2 runs at
a time)."""


def _marker_of(mode: str) -> tuple[str, ...]:
    from rl.grpo_config import AdversaryConfig
    a = AdversaryConfig()
    out = []
    attack = ATTACKS.get(mode, {"mode": mode})["mode"]
    if "inject" in attack:
        out.append(a.marker)
    if "edit" in attack:
        out.append(a.false_step)
    return tuple(out)


def run_one(args: tuple[str, str, bool, int, int, str]) -> dict[str, Any]:
    """One (mode, swarm, defense, seed) run; returns its figures. Runs in a worker process."""
    mode, swarm, defended, seed, rounds, cache, *grpo = args   # grpo: the [grpo] settings (default GRPO)
    import torch

    from models import ModelConfig
    from rl.adversary import Adversary
    from rl.defense import Defense
    from rl.grpo_config import AdversaryConfig, GRPOConfig
    from rl.grpo_exchange import open_signed, sign_batch
    from rl.learner import Learner
    from rl.rollout import Expect
    from security.keys import generate_key, peer_id_str

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    adv_cfg = AdversaryConfig(**ATTACKS.get(mode, {"mode": mode}))
    # the vertical attacker in the vertical topology: its groups stay its own (advantages within them)
    topology = "vertical" if adv_cfg.vertical else "horizontal"
    cfg = GRPOConfig(**{**(grpo[0] if grpo else GRPO), "topology": topology})
    run_id = f"attacks-{seed}"
    n_att = 2 if mode == "collude" else 1
    keys = [generate_key() for _ in range(3 + n_att)]
    ids = [peer_id_str(k) for k in keys]

    def mc(size):
        d, n, h = size
        return ModelConfig(d_model=d, n_layers=n, n_heads=h, max_seq_len=64)

    honest: list[Learner] = []
    for i in range(3):
        size = HOMO_SIZE if swarm == "homogeneous" else HETERO_SIZES[i]
        wseed = 100 * seed + 7 if swarm == "homogeneous" else 100 * seed + i
        L = Learner(cfg, mc(size), wseed, run_id, ids[i])
        L.warmup(cache)
        L.gen.manual_seed(10_000 * seed + i)          # same weights, own sampling stream
        L.rng.seed(10_000 * seed + i)
        honest.append(L)
    attackers = []
    for j in range(n_att):
        wseed = 100 * seed + 7 if swarm == "homogeneous" else 100 * seed + 50 + j
        A = Learner(cfg, mc(ATTACKER_SIZE), wseed, run_id, ids[3 + j])
        A.warmup(cache)
        A.gen.manual_seed(10_000 * seed + 3 + j)
        attackers.append(Adversary(A, adv_cfg, seed=seed + j))
    markers = _marker_of(mode)
    start = [L.evaluate(None, markers) for L in honest]
    budget_cfg = cfg.model_copy(update={"defense": cfg.defense.model_copy(update={"kind": "off"})})
    for L in honest:
        # defended == "budget": no content check and no ban, only the per-sender token budget (DoS)
        L.defense = (Defense(budget_cfg if defended == "budget" else cfg, L.model_id, L.policy.decode)
                     if defended else None)
    ex_base = dict(run=run_id, tokenizer_hash=honest[0].tokenizer_hash, temperature=cfg.temperature,
                   vocab_size=honest[0].policy.vocab_size, max_tokens=cfg.max_completion_tokens,
                   max_completions_per_group=64, config_hash=honest[0].config_hash)
    att_ids = set(ids[3:])
    train_s: list[float] = []
    att_tokens: list[int] = []
    schema_rejects = 0
    for r in range(rounds):
        gens = [L.generate(r) for L in honest]
        signed = [sign_batch(keys[i], L.batch(g)) for i, (L, g) in enumerate(zip(honest, gens))]
        for j, A in enumerate(attackers):
            signed.append(sign_batch(keys[3 + j], A.batch(A.learner.generate(r))))
        # what each sender's batch must answer: the round's prompts, or (vertical) its own, whole groups
        ex = [Expect(round=r, prompt_ids=frozenset(honest[0].round_prompts(r, ids[k])), **ex_base,
                     group_size=cfg.completions_per_prompt if topology == "vertical" else None)
              for k in range(len(signed))]
        t0 = time.perf_counter()
        for i, L in enumerate(honest):
            foreign = []
            for k, s in enumerate(signed):
                if k == i:
                    continue
                b, err = open_signed(s.body, s.signature, ex[k], ids[k])
                if err is not None:
                    schema_rejects += 1
                    continue
                foreign.append(b)
            st = L.train(gens[i], foreign)
            att_tokens.append(sum(v for s_, v in st.foreign_tokens.items() if s_ in att_ids))
        train_s.append(time.perf_counter() - t0)
    end = [L.evaluate(None, markers) for L in honest]
    peers = []
    for i, L in enumerate(honest):
        rep = L.defense.sender_report() if L.defense is not None else {}
        peers.append({
            "accuracy_start": start[i][0], "accuracy_end": end[i][0],
            "marker_rate_start": start[i][1], "marker_rate_end": end[i][1],
            "attack_success": max(end[i][1].values(), default=0.0),
            "heldout_len_start": start[i][2], "heldout_len_end": end[i][2],
            "senders": {("attacker" if s in att_ids else f"honest{ids.index(s)}") + f"-{s[-6:]}": v
                        for s, v in rep.items()},
            "rejected_by_reason": dict(L.defense.rejected) if L.defense is not None else {},
            "judge": L.defense.judge_name if L.defense is not None and L.defense._judge is not None else None,
        })
    honest_checked = sum(v.get("checked", 0) for p in peers for k, v in p["senders"].items() if k.startswith("honest"))
    honest_rejected = sum(v.get("rejected", 0) for p in peers for k, v in p["senders"].items()
                          if k.startswith("honest"))
    ban_rounds = [v.get("ban_round") for p in peers for k, v in p["senders"].items() if k.startswith("attacker")]
    return {"mode": mode, "swarm": swarm, "defense": defended, "seed": seed, "rounds": rounds, "topology": topology,
            "reject_rule": cfg.defense.reject_rule,
            "attack_success": statistics.fmean(p["attack_success"] for p in peers),
            "accuracy_start": statistics.fmean(p["accuracy_start"] for p in peers),
            "accuracy_end": statistics.fmean(p["accuracy_end"] for p in peers),
            "honest_checked": honest_checked, "honest_rejected": honest_rejected,
            "attacker_ban_rounds": ban_rounds,
            "attacker_tokens_per_round": statistics.fmean(att_tokens) / 1 if att_tokens else 0.0,
            "attacker_tokens_per_round_max": max(att_tokens, default=0),
            "token_budget": Defense(cfg, "", str).budget.per_sender,
            "train_s_per_round": statistics.fmean(train_s), "schema_rejects": schema_rejects,
            "peers": peers, "wall_s": round(time.perf_counter() - t_start, 1)}


def _prewarm(args: tuple[int, tuple[int, int, int], str]) -> None:
    import torch

    from models import ModelConfig
    from rl.grpo_config import GRPOConfig
    from rl.learner import Learner
    torch.set_num_threads(1)
    wseed, (d, n, h), cache = args
    Learner(GRPOConfig(**GRPO), ModelConfig(d_model=d, n_layers=n, n_heads=h, max_seq_len=64), wseed, "w",
            "w").warmup(cache)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if xs else None

    from rl.grpo_config import DefenseConfig
    default_rule = DefenseConfig().reject_rule
    by_mode: dict[str, Any] = {}
    alt: dict[str, dict[str, list]] = {}           # other reject rules' defended runs, by rule and mode
    for r in runs:
        key = f"{r['mode']}/{r['swarm']}"
        d = by_mode.setdefault(key, {"off": [], "on": [], "budget": []})
        if r["defense"] is True and r["reject_rule"] != default_rule:
            alt.setdefault(r["reject_rule"], {}).setdefault(key, []).append(r)
            continue
        d["budget" if r["defense"] == "budget" else "on" if r["defense"] else "off"].append(r)
    table = {}
    for key, d in by_mode.items():
        table[key] = {
            "attack_success_off": mean([r["attack_success"] for r in d["off"]]),
            "attack_success_on": mean([r["attack_success"] for r in d["on"]]),
            "accuracy_start": mean([r["accuracy_start"] for r in d["off"] + d["on"]]),
            "accuracy_end_off": mean([r["accuracy_end"] for r in d["off"]]),
            "accuracy_end_on": mean([r["accuracy_end"] for r in d["on"]]),
            "honest_false_reject_rate_on": (sum(r["honest_rejected"] for r in d["on"])
                                            / max(1, sum(r["honest_checked"] for r in d["on"]))),
            "attacker_ban_round_on": [b for r in d["on"] for b in r["attacker_ban_rounds"]],
            "attacker_tokens_per_round_off": mean([r["attacker_tokens_per_round"] for r in d["off"]]),
            "attacker_tokens_per_round_on": mean([r["attacker_tokens_per_round"] for r in d["on"]]),
            "attacker_tokens_per_round_budget_only": mean([r["attacker_tokens_per_round"] for r in d["budget"]]),
            "attacker_tokens_per_round_budget_only_max": max([r["attacker_tokens_per_round_max"] for r in d["budget"]],
                                                             default=None),
            "accuracy_end_budget_only": mean([r["accuracy_end"] for r in d["budget"]]),
            "train_s_per_round_off": mean([r["train_s_per_round"] for r in d["off"]]),
            "train_s_per_round_on": mean([r["train_s_per_round"] for r in d["on"]]),
        }
    non_dos = {k: v for k, v in table.items() if not k.startswith("verbose/")}
    off = [v["attack_success_off"] for v in non_dos.values() if v["attack_success_off"] is not None]
    on = [v["attack_success_on"] for v in non_dos.values() if v["attack_success_on"] is not None]
    inject_off = [v["attack_success_off"] for k, v in table.items() if k.startswith("inject/")
                  and v["attack_success_off"] is not None]
    defended = [r for r in runs if r["defense"] is True and r["reject_rule"] == default_rule]

    def rule_figures(rs_by_mode: dict[str, list]) -> dict[str, Any]:
        rs = [r for v in rs_by_mode.values() for r in v]
        asr = {k: mean([r["attack_success"] for r in v]) for k, v in rs_by_mode.items()}
        return {"attack_success_with_defense": max((v for k, v in asr.items() if not k.startswith("verbose/")),
                                                   default=None),
                "honest_false_reject_rate": sum(r["honest_rejected"] for r in rs) / max(1, sum(r["honest_checked"]
                                                                                             for r in rs)),
                "accuracy_end": mean([r["accuracy_end"] for r in rs]), "attack_success_by_mode": asr}
    by_rule = {default_rule: rule_figures({k: v["on"] for k, v in by_mode.items() if v["on"]}),
               **{rule: rule_figures(v) for rule, v in alt.items()}}
    verbose = {k: v for k, v in table.items() if k.startswith("verbose/")}
    judges = sorted({p["judge"] for r in defended for p in r["peers"] if p["judge"]})
    summary = {
        "attack_success_without_defense": max(off) if off else None,
        "attack_success_without_defense_inject": max(inject_off) if inject_off else None,
        "attack_success_with_defense": max(on) if on else None,
        "honest_false_reject_rate": (sum(r["honest_rejected"] for r in defended)
                                     / max(1, sum(r["honest_checked"] for r in defended))),
        "honest_checked": sum(r["honest_checked"] for r in defended),
        "honest_rejected": sum(r["honest_rejected"] for r in defended),
        "reject_rule": default_rule,
        "by_rule": by_rule,
        "by_mode": table,
        "attacker_ban_round": {k: v["attacker_ban_round_on"] for k, v in table.items()},
        "dos": {k: {"attacker_tokens_trained_per_round_off": v["attacker_tokens_per_round_off"],
                    "attacker_tokens_trained_per_round_on": v["attacker_tokens_per_round_on"],
                    "attacker_tokens_trained_per_round_budget_only": v["attacker_tokens_per_round_budget_only"],
                    "attacker_tokens_trained_max_round_budget_only": v["attacker_tokens_per_round_budget_only_max"],
                    "accuracy_end": {"off": v["accuracy_end_off"], "budget_only": v["accuracy_end_budget_only"],
                                     "on": v["accuracy_end_on"]},
                    "sender_token_budget": next((r["token_budget"] for r in runs), None),
                    "dos_length_ratio_off": mean([p["heldout_len_end"] / p["heldout_len_start"]
                                                  for r in runs if f"{r['mode']}/{r['swarm']}" == k
                                                  and not r["defense"] for p in r["peers"]]),
                    "dos_length_ratio_budget_only": mean([p["heldout_len_end"] / p["heldout_len_start"]
                                                          for r in runs if f"{r['mode']}/{r['swarm']}" == k
                                                          and r["defense"] == "budget" for p in r["peers"]]),
                    "dos_length_ratio_on": mean([p["heldout_len_end"] / p["heldout_len_start"]
                                                 for r in runs if f"{r['mode']}/{r['swarm']}" == k
                                                 and r["defense"] is True for p in r["peers"]])}
                for k, v in verbose.items()},
        "cost_s_per_round": {"without_defense": mean([r["train_s_per_round"] for r in runs if r["defense"] is False]),
                             "with_defense": mean([r["train_s_per_round"] for r in defended])},
        "judge": {"heterogeneous": judges or None, "homogeneous": "logit/support check (no judge call)",
                  "note": "arith = deterministic rule judge (grammar + every step true), security/judge.py"},
    }
    c = summary["cost_s_per_round"]
    c["ratio_with_vs_without"] = (c["with_defense"] / c["without_defense"]) if c["without_defense"] else None
    summary["targets"] = {k: {op: t, "met": summary[k] is not None and (summary[k] >= t if op == ">=" else summary[k] <= t)}
                          for k, (op, t) in TARGETS.items()}
    return summary


def run(quick: bool, out: Path, seeds: int | None = None, rounds: int | None = None, workers: int = 2
        ) -> dict[str, Any]:
    p = dict(QUICK if quick else FULL)
    if seeds:
        p["seeds"] = seeds
    if rounds:
        p["rounds"] = rounds
    out.parent.mkdir(parents=True, exist_ok=True)
    from rl.grpo_config import GRPOConfig
    cache = str(Path(GRPOConfig().warmup_cache_dir).expanduser())
    t0 = time.monotonic()
    warm = set()
    for seed in range(p["seeds"]):
        warm |= {(100 * seed + 7, HOMO_SIZE), (100 * seed + 7, ATTACKER_SIZE)}
        warm |= {(100 * seed + i, s) for i, s in enumerate(HETERO_SIZES)}
        warm |= {(100 * seed + 50 + j, ATTACKER_SIZE) for j in range(2)}
    from rl.grpo_config import DefenseConfig
    default_rule = DefenseConfig().reject_rule

    def settings(rule: str) -> dict[str, Any]:
        return {**GRPO, "defense": {**GRPO.get("defense", {}), "reject_rule": rule}}
    jobs = [(m, s, d, seed, p["rounds"], cache, settings(default_rule)) for seed in range(p["seeds"])
            for (m, s) in p["runs"] for d in ((False, True, "budget") if m == "verbose" else (False, True))]
    jobs += [(m, s, True, seed, p["rounds"], cache, settings(rule)) for seed in range(p["seeds"])
             for (m, s) in p["runs"] if m != "verbose" for rule in RULES if rule != default_rule]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_prewarm, [(w, s, cache) for w, s in sorted(warm)]))
        print(f"warm-up done in {time.monotonic() - t0:.0f} s", flush=True)
        runs = []
        for res in pool.map(run_one, jobs):
            dname = 'budget' if res['defense'] == 'budget' else f"on/{res['reject_rule']}" if res['defense'] else 'off'
            print(f"{res['mode']:>16} {res['swarm']:>13} defense={dname} seed {res['seed']}: "
                  f"attack success {res['attack_success']:.3f}, accuracy {res['accuracy_start']:.3f} -> "
                  f"{res['accuracy_end']:.3f}, honest rejected {res['honest_rejected']}/{res['honest_checked']}, "
                  f"ban rounds {res['attacker_ban_rounds']} ({res['wall_s']:.0f} s)", flush=True)
            runs.append(res)
    summary = summarize(runs)
    result = {"summary": summary, "runs": runs,
              "config": {"quick": quick, **{k: v for k, v in p.items() if k != "runs"},
                         "runs": [list(x) for x in p["runs"]], "grpo": GRPOConfig(**GRPO).model_dump(),
                         "homogeneous_size": HOMO_SIZE, "heterogeneous_sizes": HETERO_SIZES,
                         "attacker_size": ATTACKER_SIZE,
                         "exchange": "in-process: real codec, Ed25519 signatures and validation (open_signed)"},
              "wall_s": round(time.monotonic() - t0, 1)}
    out.write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 32 rounds, edit and inject_start (homogeneous), "
                                                         "inject and vertical (heterogeneous), defenses off/on "
                                                         "(on: both reject rules; < 5 min on 2 cores)")
    ap.add_argument("--out", type=Path, required=True, help="JSON result file")
    ap.add_argument("--seeds", type=int, default=None, help="seeds (full: 3)")
    ap.add_argument("--rounds", type=int, default=None, help="override the rounds per run")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each)")
    ap.add_argument("--min-token-weight", type=float, default=None,
                    help="[grpo.defense] min_token_weight for every peer (the drift rule; default: the config's)")
    args = ap.parse_args(argv)
    if args.min_token_weight is not None:
        GRPO["defense"] = {"min_token_weight": args.min_token_weight}
    res = run(args.quick, args.out, args.seeds, args.rounds, args.workers)
    s = res["summary"]
    print(json.dumps({k: s[k] for k in ("attack_success_without_defense", "attack_success_with_defense",
                                        "honest_false_reject_rate", "cost_s_per_round", "targets")}, default=str))
    print(json.dumps({rule: {k: v for k, v in f.items() if k != "attack_success_by_mode"}
                      for rule, f in s["by_rule"].items()}, default=str))
    print(f"wrote {args.out} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
