"""A malicious pipeline stage is caught: backdoor attack vs the three checks (docs/pipeline.md, 'Stage-integrity checks'; issue 12).

EMULATED IN ONE PROCESS (not a swarm of processes): a data node (stage 0: embedding, head, loss)
and 3 transformer stages x 2 replicas of a tiny byte-level LLaMA (d 64, 1 block per stage), real
torch forward/backward/AdamW steps, every microbatch on the full in-order path (no skipping), the
microbatches of an iteration split over each stage's replicas. Replicas average their gradients
the way hivemind's all-reduce leaves them (each adds ``mean - own`` to its own part), so honest
replicas drift apart at ulp level, as in a real swarm.

Setup shared by every run (same seeds): the model is pre-trained on the stdlib corpus (the
"public start weights"); the attacker learns its task vector offline from those weights and
from its own guess of where training will take them (a copy it trains on public text with its
own data seed), with the vector's per-element size capped so that it can be injected in
`inject_steps` in-bound pieces (pipeline/backdoor.py: a prompt ending in the trigger must
continue with the target); then
post-training runs from the public weights with:

- ``honest_off`` / ``honest_on``: no attacker, checks off / on, stepped in lockstep, one
  iteration of each in turn, so the iteration-time ratio sees the same machine load;
- ``replica_off`` / ``replica_on``: replica 1 of the middle stage injects the task vector;
- ``solo_off`` / ``solo_on``: the middle stage has a single replica, the attacker.

Checks on (security/stage_integrity.py, on every transformer-stage replica): every iteration,
replica commits + sketches compared across replicas and the AdamW step-bound test; a replay
audit (the step replayed from the committed pre-step state and gradient; residual drift test)
on a keyed, unpredictable 25% of iterations and always for both replicas of a sketch mismatch,
which attributes the mismatch to the replica whose own step does not replay; spot-check
recomputation of 2% of the hops from the committed weights. The checks run on the stage's flat
parameter vector. Response, emulated: the flagged replica is removed and its slot is
re-filled by copying the honest replica (weights + optimizer state), or, when the stage had no
other replica, rebuilt by the CheckFree rule from its neighbours (pipeline.checkfree.
average_neighbours, fresh AdamW at 1.1x LR); that iteration is exempt from the monitor. The live
response (coordinator quarantine, ``swarmnode_security_flags_total{check}``, SkipPipe re-plan,
``swarmnode status``) is the stage role's job and is not exercised here.

Backdoor success is measured through the attacked replica's slot (the weights a request routed
through it would see), on held-out prompts from the validation text; clean validation loss on the
full in-order model (replica 0 of every stage, and the attacked slot for the middle stage).

Summary: backdoor_success_without_defense (target >= 0.8), backdoor_success_with_defense (<= 0.05,
the worse of the two attacker placements), honest_false_flag_rate (<= 0.01: flags on honest
replicas / honest replica-iterations checked, every checks-on run), iterations_to_detection
(injected iterations until the attacker is flagged, per placement), iteration_time_ratio_checks_vs_off
(<= 1.10, median over lockstepped honest iterations).

    python benchmarks/stage_integrity.py --quick --out /tmp/stage_integrity_quick.json   # ~4 min, 2 cores
    python benchmarks/stage_integrity.py --out /tmp/stage_integrity.json                 # 3 seeds, longer
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # allow `python benchmarks/stage_integrity.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models.config import DataConfig, ModelConfig  # noqa: E402
from models.corpus import batches, eval_batches, load_corpus  # noqa: E402
from models.llama import lm_loss  # noqa: E402
from models.optim import InnerConfig  # noqa: E402
from models.stages import StageSet  # noqa: E402
from pipeline.backdoor import (BackdoorAttackConfig, Injector, backdoor_success, clean_val_loss,  # noqa: E402
                               learn_task_vector, simulate_training)
from pipeline.checkfree import average_neighbours, fresh_optimizer  # noqa: E402
from security.stage_integrity import (AdamHparams, SpotSampler, UpdateMonitor, adam_step_bound,  # noqa: E402
                                      commit_weights, compare_sketches, module_forward, replay_adamw,
                                      sketch_seed, spot_check, weight_sketch)

TARGETS = {"backdoor_success_without_defense": (">=", 0.8), "backdoor_success_with_defense": ("<=", 0.05),
           "honest_false_flag_rate": ("<=", 0.01), "iteration_time_ratio_checks_vs_off": ("<=", 1.10)}
MODEL = dict(d_model=64, n_layers=3, n_heads=4, max_seq_len=64)
DATA = dict(seq_len=64, batch_size=12, max_train_bytes=1_000_000, max_val_bytes=60_000)
STAGES = 4                 # stage 0 (data node) + 3 transformer stages of one block
ATTACKED = 2               # the middle transformer stage
MICROBATCHES = 4           # per iteration, each of DATA.batch_size windows
LR = 1e-3                  # post-training AdamW LR (constant), weight decay 0
LR_SCALE = 1.1             # CheckFree: a rebuilt stage trains at 1.1x LR with a fresh optimizer
PER_STEP_LR = 1.0          # the attacker's task vector: |delta| <= inject_steps * 1.0 * LR per element
SPOT_RATE = 0.02
AUDIT_RATE = 0.25
"""Share of iterations (keyed, unpredictable to the stage) at which a replica's step is replayed from
its committed pre-step state and gradient; a replica in a sketch mismatch is always replayed."""
CLIP = 1.0
HP = AdamHparams(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


# ------------------------------------------------------------------------------------- one replica

class Replica:
    """One emulated stage node: its module, AdamW, and (if malicious) its injector."""

    def __init__(self, name: str, stage: int, module: torch.nn.Module, injector: Injector | None = None):
        self.name, self.stage, self.module, self.injector = name, stage, module, injector
        self.opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=HP.betas, eps=HP.eps,
                                     weight_decay=HP.weight_decay)
        self.lr = LR
        self.exempt_next = False
        self.grad_norm_pre = 0.0

    @property
    def malicious(self) -> bool:
        return self.injector is not None

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def opt_state(self) -> dict:
        return {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.opt.state[p].items()}
                for n, p in self.module.named_parameters() if p in self.opt.state}

    # the checks run on the stage's flat parameter vector (one tensor: what the averager and the
    # weight service hold); per-tensor names only matter for the spot check's forward
    def flat_weights(self) -> dict[str, torch.Tensor]:
        flat = torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])
        return {"stage": flat}

    def flat_grads(self) -> dict[str, torch.Tensor]:
        return {"stage": torch.cat([p.grad.detach().reshape(-1) for p in self.module.parameters()])}

    def flat_opt_state(self) -> dict:
        params = list(self.module.parameters())
        if params[0] not in self.opt.state:
            return {}
        first = self.opt.state[params[0]]
        return {"stage": {"step": first["step"].clone(),
                          "exp_avg": torch.cat([self.opt.state[p]["exp_avg"].reshape(-1) for p in params]),
                          "exp_avg_sq": torch.cat([self.opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])}}

    def step_count(self) -> int:
        p = next(self.module.parameters())
        st = self.opt.state.get(p)
        return int(st["step"]) if st else 0


def _rename(weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Neighbour stage weights under this stage's parameter names (one block per stage)."""
    return {re.sub(r"layers\.\d+\.", f"layers.{layer}.", n): t for n, t in weights.items()}


# ------------------------------------------------------------------------------------- the emulated swarm

class Swarm:
    """Stage 0 + transformer stages with `replicas[s]` replicas each, trained in one process."""

    def __init__(self, label: str, public: StageSet, replicas: dict[int, int], train_tokens, *, seed: int,
                 checks: bool, attacker: tuple[int, int] | None = None, delta=None,
                 attack: BackdoorAttackConfig | None = None):
        self.label, self.cfg, self.checks, self.seed = label, public.cfg, checks, seed
        self.stage0 = copy.deepcopy(public.stages[0])
        self.opt0 = torch.optim.AdamW(self.stage0.parameters(), lr=LR, betas=HP.betas, eps=HP.eps,
                                      weight_decay=HP.weight_decay)
        self.ranges = public.ranges
        self.nodes: dict[int, list[Replica]] = {}
        for s in range(1, STAGES):
            self.nodes[s] = []
            for r in range(replicas[s]):
                inj = Injector(delta, attack) if attacker == (s, r) else None
                self.nodes[s].append(Replica(f"s{s}r{r}", s, copy.deepcopy(public.stages[s]), inj))
        self.attack = attack
        self.data = batches(train_tokens, DATA["batch_size"], DATA["seq_len"], seed=seed)
        self.monitors = {n.name: UpdateMonitor(n.name, HP) for ns in self.nodes.values() for n in ns}
        self.sampler = SpotSampler(SPOT_RATE, f"verifier-{seed}".encode())
        self.auditor = SpotSampler(AUDIT_RATE, f"auditor-{seed}".encode())
        self.audits = 0
        self.iteration = 0
        self.times: list[float] = []
        self.flags: list[dict] = []
        self.detections: list[dict] = []
        self.honest_checked = 0
        self.honest_flagged = 0
        self.spot_checks = 0
        self.attacked_slot = attacker

    # -------------------------------------------------------------- one iteration
    def step(self) -> None:
        t0 = time.perf_counter()
        t = self.iteration
        spot_jobs = []
        for mb in range(MICROBATCHES):
            x, y = next(self.data)
            path = [self.nodes[s][mb % len(self.nodes[s])] for s in range(1, STAGES)]
            h_out = self.stage0.embed_forward(x)
            msg, hops = h_out.detach(), []
            for node in path:
                inp = msg.requires_grad_()
                out = node.module(inp)
                hops.append((inp, out))
                msg = out.detach()
                if self.checks and self.sampler.chosen(t, f"{mb}:{node.stage}"):
                    spot_jobs.append((node, inp.detach().clone(), msg.clone()))
            h_in = msg.requires_grad_()
            loss = lm_loss(self.stage0.head_forward(h_in), y)
            (loss / MICROBATCHES).backward()
            grad = h_in.grad
            for inp, out in reversed(hops):
                out.backward(grad)
                grad = inp.grad
            h_out.backward(grad)
        # stage 0: one node, plain clipped step
        torch.nn.utils.clip_grad_norm_(self.stage0.parameters(), CLIP)
        self.opt0.step()
        self.opt0.zero_grad(set_to_none=True)
        for s, nodes in self.nodes.items():
            self._stage_step(t, s, nodes, spot_jobs)
        self.times.append(time.perf_counter() - t0)
        self.iteration += 1

    def _stage_step(self, t: int, s: int, nodes: list[Replica], spot_jobs: list) -> None:
        # replica gradient exchange as hivemind leaves it: mean computed once, each replica adds
        # (mean - own) to its own part, so replicas differ at ulp level
        parts = [{n: p.grad for n, p in node.module.named_parameters()} for node in nodes]
        if len(nodes) > 1:       # each part is already (sum over its microbatches) / MICROBATCHES
            total = {n: sum(part[n] for part in parts) for n in parts[0]}
            for part in parts:
                for n in part:
                    part[n].add_(total[n] - part[n])
        pre, spotted = {}, {j[0].name for j in spot_jobs if j[0].stage == s}
        for node in nodes:
            node.grad_norm_pre = float(torch.nn.utils.clip_grad_norm_(node.module.parameters(), CLIP))
            if self.checks:      # the committed pre-step state a verifier may fetch (flat, like the averager's buffers)
                pre[node.name] = (node.flat_weights(), node.flat_opt_state(),
                                  node.weights() if node.name in spotted else None)
            before = node.weights() if node.malicious else None
            node.opt.step()
            if not self.checks:
                node.opt.zero_grad(set_to_none=True)
            if node.malicious:
                node.injector.after_step(t, node.module, before, node.lr, adam_step_bound(node.step_count(), HP.betas))
        if not self.checks:
            return
        try:
            self._check_stage(t, s, nodes, spot_jobs, pre)
        finally:                 # the step's gradients stay on the parameters until an audit has read them
            for node in nodes:
                node.opt.zero_grad(set_to_none=True)

    def _check_stage(self, t: int, s: int, nodes: list[Replica], spot_jobs: list, pre: dict) -> None:
        # ---- checks: spot checks of this stage's hops, update monitor, replica sketches
        flagged: dict[str, list[dict]] = {}
        for node, x, y in (j for j in spot_jobs if j[0].stage == s):
            self.spot_checks += 1
            res = spot_check(node.name, t, module_forward(node.module), pre[node.name][2], x, y)
            for f in res.flags:
                flagged.setdefault(node.name, []).append(f.as_dict())
        # replica sketches first: a mismatching pair is audited (replayed) at once
        mismatches = []
        after = {node.name: node.flat_weights() for node in nodes}
        if len(nodes) > 1:
            ws = [after[node.name] for node in nodes]
            seed = sketch_seed(self.label, t, [commit_weights(w) for w in ws])
            sketches = [weight_sketch(w, seed) for w in ws]
            for i in range(len(nodes)):
                for j in range(i + 1, len(nodes)):
                    res = compare_sketches(nodes[j].name, t, sketches[i], sketches[j])
                    if not res.ok:
                        mismatches.append((nodes[i], nodes[j], res))
        must_audit = {n.name for a, b, _ in mismatches for n in (a, b)}
        for node in nodes:
            before, state, _ = pre[node.name]
            exempt = node.exempt_next
            node.exempt_next = False
            audit = not exempt and (node.name in must_audit or self.auditor.chosen(t, node.name))
            self.audits += audit
            replayed = replay_adamw(before, node.flat_grads(), state, node.lr, HP)[0] if audit else None
            res = self.monitors[node.name].observe(t, before, after[node.name], node.lr,
                                                   step=node.step_count(),
                                                   replayed=replayed, exempt=exempt)
            for f in res.flags:
                flagged.setdefault(node.name, []).append(f.as_dict())
        for a, b, res in mismatches:
            culprits = [n for n in (a, b) if self.monitors[n.name].off_path]
            if len(culprits) == 1:
                flagged.setdefault(culprits[0].name, []).append(
                    dict(res.flags[0].as_dict(), suspect=culprits[0].name,
                         reason=res.flags[0].reason + "; attributed: its own step does not replay"))
            else:
                self.flags.append({"iteration": t, "stage": s, "check": "replica_sketch",
                                   "unattributed": [a.name, b.name]})
        for node in nodes:
            if node.malicious:
                continue
            self.honest_checked += 1
            self.honest_flagged += int(node.name in flagged)
        for name, fl in flagged.items():
            node = next(n for n in nodes if n.name == name)
            self.flags.extend(dict(f, stage=s, malicious=node.malicious) for f in fl)
            self._respond(t, s, node, sorted({f["check"] for f in fl}))

    # -------------------------------------------------------------- response (emulated)
    def _respond(self, t: int, s: int, node: Replica, checks: list[str]) -> None:
        nodes = self.nodes[s]
        honest = [n for n in nodes if n is not node]
        was_malicious = node.malicious
        if honest:
            donor = honest[0]
            node.module.load_state_dict(donor.module.state_dict())
            node.opt.load_state_dict(donor.opt.state_dict())
            node.lr, rule = donor.lr, "copy_replica"
        else:
            left, right = self.nodes[s - 1][0] if s > 1 else None, self.nodes.get(s + 1, [None])[0]
            if left is None or right is None:
                raise RuntimeError(f"stage {s} is an edge stage: the benchmark only attacks interior stages")
            layer = self.ranges[s][0]
            rebuilt = average_neighbours(_rename(left.weights(), layer), _rename(right.weights(), layer),
                                         left_norm=left.grad_norm_pre, right_norm=right.grad_norm_pre,
                                         left_iteration=t, right_iteration=t)
            node.module.load_state_dict(rebuilt)
            node.opt = fresh_optimizer(node.module.parameters(), InnerConfig(lr=LR, betas=HP.betas, eps=HP.eps,
                                                                             weight_decay=HP.weight_decay), LR_SCALE)
            node.lr, rule = LR * LR_SCALE, "checkfree_average"
        node.injector = None                      # the attacker is out; a replacement node serves the slot
        node.exempt_next = True
        self.monitors[node.name].reset()          # the slot's history restarts; the donor's is unaffected
        self.detections.append({"iteration": t, "stage": s, "node": node.name, "checks": checks,
                                "malicious": was_malicious, "rule": rule})

    # -------------------------------------------------------------- evaluation
    def pipeline(self, slot: tuple[int, int] | None = None) -> StageSet:
        """The full in-order model: replica 0 of each stage, or the replica in `slot` for its stage."""
        mods = [self.stage0]
        for s in range(1, STAGES):
            r = slot[1] if slot is not None and slot[0] == s else 0
            mods.append(self.nodes[s][r].module)
        return StageSet(self.cfg, mods, self.ranges)


# ------------------------------------------------------------------------------------- setup and runs

def pretrain(cfg: ModelConfig, train_tokens, steps: int, seed: int) -> StageSet:
    """The public start weights: the whole stage-split model trained in one process."""
    stages = StageSet.build(cfg, seed, STAGES)
    params = [p for m in stages.stages for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    data = batches(train_tokens, 16, DATA["seq_len"], seed=10_000 + seed)
    for _ in range(steps):
        x, y = next(data)
        h = stages.stages[0].embed_forward(x)
        for s in range(1, STAGES):
            h = stages.stages[s](h)
        loss = lm_loss(stages.stages[0].head_forward(h), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return stages


def evaluate(swarm: Swarm, val_tokens, val_batches, attack: BackdoorAttackConfig, prompts: int) -> dict:
    slot = swarm.attacked_slot
    out = {"clean_val_loss": round(clean_val_loss(swarm.pipeline(slot), val_batches), 4),
           "backdoor_success": backdoor_success(swarm.pipeline(slot), val_tokens, attack, prompts=prompts)}
    if slot is not None and len(swarm.nodes[slot[0]]) > 1:
        other = (slot[0], 1 - slot[1])
        out["backdoor_success_via_honest_replica"] = backdoor_success(swarm.pipeline(other), val_tokens, attack,
                                                                      prompts=prompts)
    return out


def run_seed(seed: int, args, corpus, cfg: ModelConfig) -> dict[str, Any]:
    t0 = time.monotonic()
    public = pretrain(cfg, corpus.train, args.pretrain_steps, seed)
    val_batches = eval_batches(corpus.val, 16, DATA["seq_len"], 4)
    attack = BackdoorAttackConfig(enabled=True, stage=ATTACKED, start_iteration=args.inject_from,
                                  steps=args.inject_steps, offline_steps=args.offline_steps, per_step_lr=PER_STEP_LR,
                                  protect=True)
    public_eval = {"clean_val_loss": round(clean_val_loss(public, val_batches), 4),
                   "backdoor_success": backdoor_success(public, corpus.val, attack, prompts=args.prompts)}
    t_pre = time.monotonic() - t0
    guess = simulate_training(public, corpus.train, iterations=args.iterations, batch=MICROBATCHES * DATA["batch_size"],
                              seq_len=DATA["seq_len"], lr=LR, seed=50_000 + seed)
    delta = learn_task_vector(public, attack, corpus.train, seq_len=DATA["seq_len"], train_lr=LR, seed=seed,
                              anchors=[guess])
    offline = copy.deepcopy(public)
    with torch.no_grad():
        for n, p in offline.stages[ATTACKED].named_parameters():
            p.add_(delta[n])
    offline_eval = {"clean_val_loss": round(clean_val_loss(offline, val_batches), 4),
                    "backdoor_success": backdoor_success(offline, corpus.val, attack, prompts=args.prompts),
                    "delta_max_abs": max(float(d.abs().max()) for d in delta.values()),
                    "delta_rel_norm": float(torch.cat([d.flatten() for d in delta.values()]).norm()
                                            / torch.cat([p.detach().flatten() for p in
                                                         public.stages[ATTACKED].parameters()]).norm())}
    t_learn = time.monotonic() - t0 - t_pre
    full, solo = {1: 2, 2: 2, 3: 2}, {1: 2, 2: 1, 3: 2}
    runs = {
        "honest_off": Swarm("honest_off", public, full, corpus.train, seed=seed, checks=False),
        "honest_on": Swarm("honest_on", public, full, corpus.train, seed=seed, checks=True),
        "replica_off": Swarm("replica_off", public, full, corpus.train, seed=seed, checks=False,
                             attacker=(ATTACKED, 1), delta=delta, attack=attack),
        "replica_on": Swarm("replica_on", public, full, corpus.train, seed=seed, checks=True,
                            attacker=(ATTACKED, 1), delta=delta, attack=attack),
        "solo_off": Swarm("solo_off", public, solo, corpus.train, seed=seed, checks=False,
                          attacker=(ATTACKED, 0), delta=delta, attack=attack),
        "solo_on": Swarm("solo_on", public, solo, corpus.train, seed=seed, checks=True,
                         attacker=(ATTACKED, 0), delta=delta, attack=attack),
    }
    for _ in range(args.iterations):            # lockstep: one iteration of each run in turn
        for swarm in runs.values():
            swarm.step()
    results = {}
    for label, swarm in runs.items():
        node = None if swarm.attacked_slot is None else swarm.nodes[swarm.attacked_slot[0]][swarm.attacked_slot[1]]
        first = next((d for d in swarm.detections if d["malicious"]), None)
        results[label] = {
            **evaluate(swarm, corpus.val, val_batches, attack, args.prompts),
            "iteration_s_median": round(statistics.median(swarm.times[1:]), 5),
            "detections": swarm.detections, "flags": swarm.flags[:20], "flags_total": len(swarm.flags),
            "honest_replica_iterations_checked": swarm.honest_checked,
            "honest_replica_iterations_flagged": swarm.honest_flagged, "spot_checks": swarm.spot_checks,
            "replay_audits": swarm.audits,
            "detected_at_iteration": first["iteration"] if first else None,
            "iterations_to_detection": (first["iteration"] - args.inject_from + 1) if first else None,
            "injected_iterations": (node.injector.injected_iterations if node is not None and node.injector
                                    else None),
            "injected_fraction": (round(node.injector.done_fraction, 4) if node is not None and node.injector
                                  else None),
        }
    on, off = runs["honest_on"].times[1:], runs["honest_off"].times[1:]
    results["time_ratio_checks_vs_off"] = round(statistics.median(a / b for a, b in zip(on, off)), 4)
    return {"seed": seed, "public": public_eval, "offline_task_vector": offline_eval, "runs": results,
            "seconds": {"pretrain": round(t_pre, 1), "offline_attack": round(t_learn, 1),
                        "total": round(time.monotonic() - t0, 1)}}


def _meets(value, op: str, target: float) -> bool | None:
    if value is None:
        return None
    return {"<=": value <= target, ">=": value >= target, "<": value < target}[op]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="1 seed, short runs (~4 min on 2 cores)")
    ap.add_argument("--seeds", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.pretrain_steps = 300 if args.quick else 800
    args.offline_steps = 200 if args.quick else 400
    args.inject_from, args.inject_steps = (10, 40) if args.quick else (40, 60)
    args.iterations = 60 if args.quick else 140     # the attacker times its injection to end near the run's end
    args.prompts = 48 if args.quick else 128
    t_start = time.monotonic()
    cfg = ModelConfig(**MODEL)
    corpus = load_corpus(DataConfig(**DATA))
    seeds = [run_seed(seed, args, corpus, cfg) for seed in range(args.seeds)]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.mean(xs), 4) if xs else None

    r = [s["runs"] for s in seeds]
    checked = sum(x[k]["honest_replica_iterations_checked"] for x in r for k in ("honest_on", "replica_on", "solo_on"))
    flagged = sum(x[k]["honest_replica_iterations_flagged"] for x in r for k in ("honest_on", "replica_on", "solo_on"))
    summary = {
        "backdoor_success_without_defense": mean([min(x["replica_off"]["backdoor_success"],
                                                      x["solo_off"]["backdoor_success"]) for x in r]),
        "backdoor_success_with_defense": mean([max(x["replica_on"]["backdoor_success"],
                                                   x["solo_on"]["backdoor_success"]) for x in r]),
        "honest_false_flag_rate": round(flagged / max(1, checked), 5),
        "iterations_to_detection": {"with_replica": mean([x["replica_on"]["iterations_to_detection"] for x in r]),
                                    "without_replica": mean([x["solo_on"]["iterations_to_detection"] for x in r])},
        "iteration_time_ratio_checks_vs_off": mean([x["time_ratio_checks_vs_off"] for x in r]),
        "backdoor_success_by_run": {k: mean([x[k]["backdoor_success"] for x in r]) for k in r[0]
                                    if isinstance(r[0][k], dict)},
        "clean_val_loss_by_run": {k: mean([x[k]["clean_val_loss"] for x in r]) for k in r[0]
                                  if isinstance(r[0][k], dict)},
        "honest_replica_iterations_checked": checked,
        "attacker_detected_runs": sum(x[k]["detected_at_iteration"] is not None for x in r
                                      for k in ("replica_on", "solo_on")),
        "attacker_runs": 2 * len(r),
    }
    summary["targets_met"] = {k: _meets(summary[k], *TARGETS[k]) for k in TARGETS}
    doc = {"summary": summary, "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
           "setup": {"emulation": "one process: stage 0 + 3 transformer stages x 2 replicas emulated in-process "
                                  "(not separate nodes); full in-order paths; hivemind-style mean-minus-own "
                                  "averaging (ulp drift between honest replicas)",
                     "model": MODEL, "data": DATA, "microbatches": MICROBATCHES, "lr": LR, "clip": CLIP,
                     "spot_rate": SPOT_RATE, "attacked_stage": ATTACKED, "quick": args.quick,
                     "seeds": args.seeds, "pretrain_steps": args.pretrain_steps,
                     "offline_steps": args.offline_steps, "inject_from": args.inject_from,
                     "inject_steps": args.inject_steps, "iterations": args.iterations, "prompts": args.prompts,
                     "attack": BackdoorAttackConfig(enabled=True, stage=ATTACKED, start_iteration=args.inject_from,
                                                    steps=args.inject_steps, offline_steps=args.offline_steps,
                                                    per_step_lr=PER_STEP_LR, protect=True).model_dump(),
                     "torch_threads": 1},
           "seeds": seeds,
           "notes": {"backdoor_success": "greedy continuation of held-out triggered prompts through the attacked "
                                        "replica's slot equals the target exactly",
                     "without_defense": "the lower of the two attacker placements (with / without a replica)",
                     "with_defense": "the higher of the two placements",
                     "iterations_to_detection": "injected iterations until the attacker is flagged (1 = the first "
                                                "injected iteration)",
                     "iteration_time_ratio": "median over iterations of honest_on / honest_off, the two runs "
                                             "stepped in lockstep in one process; every replica every iteration: "
                                             "commit, sketch, step-bound check; replay audit on a keyed 25% of "
                                             "iterations and on every sketch mismatch; 2% spot checks",
                     "left_for_the_live_role": "coordinator quarantine via ReportAnomaly, swarmnode_security_flags"
                                               "_total{check} increments, SkipPipe re-plan, `swarmnode status`"},
           "wall_s": round(time.monotonic() - t_start, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} in {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
