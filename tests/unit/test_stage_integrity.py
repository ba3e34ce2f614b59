"""The three pipeline-backdoor checks (security/stage_integrity.py; docs/pipeline.md, 'Stage-integrity checks').

Each check must flag its crafted deviation and stay silent on honest replicas, including two
honest replicas that drift apart at ulp level because they average their gradients in different
orders (what hivemind's all-reduce does): no flag in 200 honest iterations.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.stages import TransformerStage
from security.stage_integrity import (AdamHparams, SpotSampler, UpdateMonitor, adam_step_bound, commit_weights,
                                      compare_commits, compare_sketches, module_forward, replay_adamw,
                                      sketch_seed, spot_check, verify_commit, weight_sketch)

LR = 1e-3
CFG = ModelConfig(d_model=32, n_layers=3, n_heads=2, max_seq_len=16)


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _opt_state(opt: torch.optim.Optimizer, module: nn.Module) -> dict:
    return {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
            for n, p in module.named_parameters() if p in opt.state}


class Replica:
    """One replica of a one-block stage with its AdamW; `order` is how it sums the microbatch grads."""

    def __init__(self, order: list[int]):
        self.module = TransformerStage(CFG, seed=0, layers=(1, 2))
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.01)
        self.order = order
        self.step = 0

    def step_with(self, parts: list[dict[str, torch.Tensor]]) -> tuple[dict, dict, dict]:
        """Average `parts` in this replica's order, step; return (before, state before, mean grad)."""
        before, state = _weights(self.module), _opt_state(self.opt, self.module)
        mean = {}
        for n, p in self.module.named_parameters():
            acc = torch.zeros_like(p)
            for i in self.order:
                acc = acc + parts[i][n]
            mean[n] = acc / len(parts)
            p.grad = mean[n].clone()
        self.opt.step()
        self.step += 1
        return before, state, mean


def _grad_parts(module: nn.Module, gen: torch.Generator, n: int = 4) -> list[dict[str, torch.Tensor]]:
    """Per-microbatch gradients of a toy loss on the stage's output (computed on replica A's weights)."""
    parts = []
    for _ in range(n):
        x = torch.randn(2, 8, CFG.d_model, generator=gen)
        target = torch.randn(2, 8, CFG.d_model, generator=gen)
        module.zero_grad()
        ((module(x) - target) ** 2).mean().backward()
        parts.append({k: p.grad.detach().clone() for k, p in module.named_parameters()})
    module.zero_grad()
    return parts


def _task_vector(module: nn.Module, per_step: float) -> dict[str, torch.Tensor]:
    """A random direction whose per-step share (delta / steps) is at most `per_step` per element."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for n, p in module.named_parameters():
        d = torch.randn(p.shape, generator=gen)
        out[n] = d / d.abs().max() * per_step
    return out


def _run(iterations: int, inject_from: int | None = None, per_step: float = 0.1 * LR):
    """Two replicas, B possibly adding an in-bound edit (<= `per_step` per element) after each step
    from `inject_from` (the delta/1000 of P27 for a task vector of 0.1 in max norm); all checks on.
    Returns the flags seen, by check name -> list of iterations."""
    torch.manual_seed(0)
    a, b = Replica([0, 1, 2, 3]), Replica([3, 1, 0, 2])
    delta = _task_vector(b.module, per_step)
    monitors = {"a": UpdateMonitor("a", AdamHparams(weight_decay=0.01)),
                "b": UpdateMonitor("b", AdamHparams(weight_decay=0.01))}
    gen = torch.Generator().manual_seed(1)
    flags: dict[str, list[int]] = {}
    fwd = module_forward(a.module)
    for t in range(iterations):
        parts = _grad_parts(a.module, gen)
        for name, rep in (("a", a), ("b", b)):
            before, state, mean = rep.step_with(parts)
            if name == "b" and inject_from is not None and t >= inject_from:
                with torch.no_grad():
                    for n, p in rep.module.named_parameters():
                        p.add_(delta[n])
            replayed, _ = replay_adamw(before, mean, state, LR, AdamHparams(weight_decay=0.01))
            res = monitors[name].observe(t, before, _weights(rep.module), LR, step=rep.step, replayed=replayed)
            for f in res.flags:
                flags.setdefault(f.check, []).append(t)
        wa, wb = _weights(a.module), _weights(b.module)
        seed = sketch_seed("run", t, [commit_weights(wa), commit_weights(wb)])
        res = compare_sketches("b", t, weight_sketch(wa, seed), weight_sketch(wb, seed))
        for f in res.flags:
            flags.setdefault(f.check, []).append(t)
        x = torch.randn(2, 8, CFG.d_model, generator=gen)
        with torch.no_grad():
            y = b.module(x)
        res = spot_check("b", t, fwd, wb, x, y)
        for f in res.flags:
            flags.setdefault(f.check, []).append(t)
    return flags, a, b


def test_honest_replicas_with_ulp_drift_raise_no_flag_in_200_iterations():
    flags, a, b = _run(200)
    assert flags == {}
    wa, wb = _weights(a.module), _weights(b.module)
    # the replicas really did drift apart (different summation orders), so the tolerance is exercised
    assert commit_weights(wa) != commit_weights(wb)
    assert max(float((wa[n] - wb[n]).abs().max()) for n in wa) > 0


def test_injecting_replica_is_flagged_by_sketch_at_once_and_by_drift_within_patience():
    # from iteration 60 (AdamW's bound has grown past its step-1 value of lr, so a 0.1 lr edit fits beside the honest step)
    flags, _, _ = _run(68, inject_from=60)
    assert flags["replica_sketch"][0] == 60
    assert flags["update_drift"][0] <= 60 + 2          # patience 3: the third off-path iteration
    assert "update_bound" not in flags          # in-bound steps: the size test alone would miss it
    assert "spot_check" not in flags            # it computes honestly with its (edited) weights


def test_bit_exact_replicas_compare_commits_exactly():
    w = _weights(TransformerStage(CFG, seed=0, layers=(1, 2)))
    assert compare_commits("b", 0, commit_weights(w), commit_weights({k: v.clone() for k, v in w.items()})).ok
    w2 = {k: v.clone() for k, v in w.items()}
    name = next(iter(w2))
    w2[name].view(-1)[0] = torch.nextafter(w2[name].view(-1)[0], torch.tensor(1e9))   # one ulp
    assert not compare_commits("b", 0, commit_weights(w), commit_weights(w2)).ok
    seed = sketch_seed("run", 0, [commit_weights(w), commit_weights(w2)])
    assert compare_sketches("b", 0, weight_sketch(w, seed), weight_sketch(w2, seed)).ok   # but sketches agree


def test_sketch_seed_depends_on_every_commit_and_a_foreign_seed_is_flagged():
    assert sketch_seed("r", 3, ["a", "b"]) == sketch_seed("r", 3, ["b", "a"])
    assert sketch_seed("r", 3, ["a", "b"]) != sketch_seed("r", 3, ["a", "c"])
    assert sketch_seed("r", 3, ["a", "b"]) != sketch_seed("r", 4, ["a", "b"])
    w = _weights(TransformerStage(CFG, seed=0, layers=(1, 2)))
    res = compare_sketches("b", 0, weight_sketch(w, 1), weight_sketch(w, 2))
    assert not res.ok and "seed" in res.flags[0].reason


def test_sketch_catches_an_edit_hidden_in_one_coordinate():
    w = _weights(TransformerStage(CFG, seed=0, layers=(1, 2)))
    w2 = {k: v.clone() for k, v in w.items()}
    w2["core.layers.1.ffn.w2.weight"][3, 5] += 0.01
    res = compare_sketches("b", 0, weight_sketch(w, 11), weight_sketch(w2, 11))
    assert not res.ok and res.flags[0].tensor == "core.layers.1.ffn.w2.weight"


def test_adam_step_bound_is_never_exceeded_and_is_tight_at_step_one():
    assert abs(adam_step_bound(1) - 1.0) < 1e-12
    assert 7.2 < adam_step_bound(10_000) < 7.3
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        p = nn.Parameter(torch.zeros(256))
        opt = torch.optim.Adam([p], lr=1.0)
        worst = 0.0
        for t in range(1, 60):
            # adversarial-ish sequences: bursts of large gradients, then tiny ones of the same sign
            scale = 10.0 ** float(torch.randint(-4, 2, (1,), generator=gen))
            p.grad = torch.rand(256, generator=gen) * scale
            w0 = p.detach().clone()
            opt.step()
            worst = max(worst, float((p.detach() - w0).abs().max()) / adam_step_bound(t))
        assert worst <= 1.0 + 1e-6


def test_update_monitor_flags_over_bound_steps_not_honest_adam():
    rep = Replica([0, 1, 2, 3])
    mon = UpdateMonitor("a", AdamHparams(weight_decay=0.01))
    gen = torch.Generator().manual_seed(3)
    for t in range(30):
        before, _, _ = rep.step_with(_grad_parts(rep.module, gen))
        assert mon.observe(t, before, _weights(rep.module), LR, step=rep.step).ok
    # a double step (the official code's pitfall: Adam stepping twice per iteration) at 10x the LR
    before, _, _ = rep.step_with(_grad_parts(rep.module, gen))
    for g in rep.opt.param_groups:
        g["lr"] = 10 * LR
    rep.opt.step()
    res = mon.observe(30, before, _weights(rep.module), LR, step=rep.step)
    assert not res.ok and {f.check for f in res.flags} == {"update_bound"}
    assert res.flags[0].value > 1.0


def test_drift_needs_a_persistent_direction_and_recovery_is_exempt():
    w = {"w": torch.randn(500)}
    mon = UpdateMonitor("s", patience=3)
    gen = torch.Generator().manual_seed(5)
    # off-path residuals in random directions: no flag however many
    for t in range(50):
        noise = {"w": w["w"] + 1e-4 * torch.randn(500, generator=gen)}
        assert mon.observe(t, w, noise, lr=1.0, step=100, replayed=w).ok
    # a steady direction: flagged on the 3rd iteration
    d = 1e-4 * torch.randn(500, generator=gen)
    got = [mon.observe(50 + i, w, {"w": w["w"] + d}, lr=1.0, step=100, replayed=w).ok for i in range(3)]
    assert got == [True, True, False]
    # a recovery iteration (weights replaced, fresh optimizer) is exempt and restarts the history
    mon.reset()
    jump = {"w": w["w"] + 10.0}
    assert mon.observe(60, w, jump, lr=1e-3, step=1, exempt=True).ok
    assert mon.observe(61, w, {"w": w["w"] + d}, lr=1.0, step=100, replayed=w).ok


def test_replay_of_an_honest_step_is_bit_exact():
    rep = Replica([0, 1, 2, 3])
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        before, state, mean = rep.step_with(_grad_parts(rep.module, gen))
    replayed, new_state = replay_adamw(before, mean, state, LR, AdamHparams(weight_decay=0.01))
    after = _weights(rep.module)
    assert all(torch.equal(replayed[n], after[n]) for n in after)
    assert int(new_state["core.layers.1.attn.wq.weight"]["step"]) == 3


def test_spot_check_flags_outputs_from_other_weights_and_passes_honest_ones():
    stage = TransformerStage(CFG, seed=0, layers=(1, 2))
    committed = _weights(stage)
    x = torch.randn(2, 8, CFG.d_model)
    fwd = module_forward(stage)
    with torch.no_grad():
        honest = stage(x)
    assert spot_check("s", 0, fwd, committed, x, honest).ok
    # the stage claims `committed` but computes with edited weights
    edited = {k: v + 0.01 * torch.randn_like(v) for k, v in committed.items()}
    with torch.no_grad():
        lying = fwd(edited, x)
    res = spot_check("s", 0, fwd, committed, x, lying)
    assert not res.ok and res.flags[0].check == "spot_check"
    assert not spot_check("s", 0, fwd, committed, x, honest[:1]).ok                   # wrong shape
    assert not spot_check("s", 0, fwd, committed, x, honest * float("nan")).ok        # non-finite
    # the module's own weights were not touched by functional_call
    assert all(torch.equal(p, committed[n]) for n, p in stage.named_parameters())


def test_verify_commit_and_spot_sampler():
    w = _weights(TransformerStage(CFG, seed=0, layers=(1, 2)))
    c = commit_weights(w)
    assert verify_commit("s", 0, w, c).ok
    assert not verify_commit("s", 0, {k: v * 1.0001 for k, v in w.items()}, c).ok
    sampler = SpotSampler(0.1, b"secret")
    picked = sum(sampler.chosen(t, m) for t in range(100) for m in range(20))
    assert 140 <= picked <= 260
    assert [SpotSampler(0.1, b"other").chosen(t, 0) for t in range(50)] != [sampler.chosen(t, 0) for t in range(50)]


def test_flags_are_counted_by_check_on_the_node_registry():
    from node.metrics import REGISTRY
    from node.integrity_metrics import SECURITY_FLAGS, count_flags

    def value(check: str) -> float:
        return REGISTRY.get_sample_value("swarmnode_security_flags_total", {"check": check}) or 0.0

    w = _weights(TransformerStage(CFG, seed=0, layers=(1, 2)))
    bad = verify_commit("s", 0, w, "0" * 64)
    before = value("commit_mismatch")
    assert count_flags([bad, verify_commit("s", 0, w, commit_weights(w))]) == 1
    assert value("commit_mismatch") == before + 1
    assert SECURITY_FLAGS is not None    # declared on the node registry (the stage coordinator counts into it)
