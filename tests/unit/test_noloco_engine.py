"""optimizers/noloco_engine.py: one NoLoCo/DiLoCo worker's compute without a network. Inner steps
train, the outer step with a known group mean gives exactly the outer optimizer's phi, a refused
(nonfinite or oversized) step is rolled back bitwise to the last good state, and adopt / resync /
rewind / resume put the state where the role expects it. Pure CPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from models.config import DataConfig, ModelConfig
from models.optim import InnerConfig
from optimizers.config import NoLoCoConfig
from optimizers.diloco import DiLoCoOuter
from optimizers.noloco import NoLoCoOuter
from optimizers.noloco_engine import NoLoCoEngine, Placement

CPU = torch.device("cpu")
TINY = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
DATA = DataConfig(seq_len=32, batch_size=8, max_train_bytes=200_000, max_val_bytes=20_000)


def engine(outer_state: str = "device", data: bool = False, **cfg) -> NoLoCoEngine:
    cfg.setdefault("inner", InnerConfig(lr=3e-3, warmup=2, total_steps=200))
    eng = NoLoCoEngine(NoLoCoConfig(outer_state_device=outer_state, eval_batches=4, **cfg), TINY)
    eng.place(Placement(CPU, CPU))
    if data:
        eng.load_data(DATA, shard=0, num_shards=2)
        eng.start_data()
    eng.mark_good()
    return eng


def moved(eng: NoLoCoEngine, delta: float = 0.01) -> None:
    """theta off phi, as H inner steps would leave it."""
    with torch.no_grad():
        for p in eng.params:
            p.add_(delta)


def snapshot(eng: NoLoCoEngine) -> dict[str, list[torch.Tensor]]:
    return {"params": [p.detach().clone() for p in eng.params], "phi": [t.clone() for t in eng.outer.phi],
            "m": [t.clone() for t in eng.outer.m]}


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- inner steps ---------------------------------------------------------------------------------
def test_losses_go_down_over_inner_steps():
    seen = []
    eng = engine(data=True)
    eng.on_step = lambda loss, tokens, seconds: seen.append((loss, tokens))
    before = eng.evaluate()
    first = eng.inner_steps(5)
    for _ in range(7):
        last = eng.inner_steps(5)
    assert eng.step == 40 and len(seen) == 40 and all(t == DATA.batch_size * DATA.seq_len for _, t in seen)
    assert eng.first_loss == seen[0][0] and eng.last_loss == last == seen[-1][0]
    assert last < first - 0.3, (first, last)
    assert eng.evaluate() < before - 0.3


def test_should_stop_abandons_the_rest_of_the_steps():
    eng = engine(data=True)
    eng.should_stop = lambda: eng.step >= 2
    eng.inner_steps(10)
    assert eng.step == 2
    assert math.isnan(eng.inner_steps(3)) and eng.step == 2  # nothing left to compute: no loss


def test_start_data_needs_the_corpus():
    with pytest.raises(RuntimeError, match="load_data"):
        engine().start_data()


# ---- the outer step --------------------------------------------------------------------------------
@pytest.mark.parametrize("outer_state", ["device", "host"])
def test_outer_step_with_a_known_mean_gives_the_exact_phi(outer_state):
    eng = engine(outer_state)
    ref = NoLoCoOuter([p.detach() for p in eng.params])
    moved(eng)
    sent = eng.outgoing()
    assert eng.placement.to_host is None  # CPU: no staging buffers, the outer optimizer's own copies
    assert all(s.data_ptr() != p.data_ptr() and torch.equal(s, p) for s, p in zip(sent, eng.params))
    mean = [s + 0.001 for s in sent]  # a partner's theta, averaged
    theta = [p.detach().clone() for p in eng.params]
    res = eng.outer_step(mean, 2, sent, rnd=6)
    want = ref.outer_step(theta, mean, n=2)
    for p, w in zip(eng.params, want):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)
    assert res.refused is None and res.norm > 0 and res.spread == pytest.approx(0.001, rel=1e-3)
    assert all(t.device == CPU and t.dtype == torch.float32 for t in eng.outer.phi + eng.outer.m)
    # kept: the round moved on and the good state is a host copy of the new phi and m
    assert eng.round == 7 and eng.good.round == 7 and eng.round_start_step == eng.step
    for name, phi, m, good_m in zip(eng.names, eng.outer.phi, eng.outer.m, eng.good.m):
        good = eng.good.phi[name]
        assert good.data_ptr() != phi.data_ptr() and torch.equal(good, phi) and torch.equal(good_m, m)


def test_untied_consensus_exchanges_phi_and_steps_like_the_outer_optimizer():
    eng = engine(consensus=0.3)
    ref = NoLoCoOuter([p.detach() for p in eng.params], consensus=0.3)
    moved(eng)
    sent = eng.outgoing()
    k = len(eng.params)
    assert len(sent) == 2 * k and all(torch.equal(s, phi) for s, phi in zip(sent[k:], eng.outer.phi))
    mean = [s + 0.002 for s in sent]
    want = ref.outer_step([p.detach().clone() for p in eng.params], mean[:k], mean[k:], n=2)
    assert eng.outer_step(mean, 2, sent, rnd=0).refused is None
    assert_bitwise(eng.outer.phi, want)


def test_solo_step_and_diloco():
    eng = engine()
    ref = NoLoCoOuter([p.detach() for p in eng.params])
    moved(eng)
    theta = [p.detach().clone() for p in eng.params]
    res = eng.outer_step([t * 100 for t in theta], 1, eng.outgoing(), rnd=0)  # n = 1: the mean is ignored
    assert res.refused is None and res.spread is None
    assert_bitwise(eng.outer.phi, ref.outer_step(theta, None, n=1))
    dil = engine(outer="diloco", diloco_momentum="nesterov")
    dref = DiLoCoOuter([p.detach() for p in dil.params], 0.7, 0.9, "nesterov")
    moved(dil)
    sent = dil.outgoing()
    mean = [s - 0.004 for s in sent]
    want = dref.outer_step([p.detach().clone() for p in dil.params], mean, n=3)
    assert dil.outer_step(mean, 3, sent, rnd=2).refused is None and dil.round == 3
    assert_bitwise(dil.outer.phi, want)


@pytest.mark.parametrize("outer_state", ["device", "host"])
def test_steps_taken_while_the_exchange_ran_are_kept_on_top_of_the_outer_step(outer_state):
    """overlap_fraction: the outer step uses the theta that was sent; the inner progress made
    while the exchange ran is added to the new phi, and phi itself never sees it."""
    eng = engine(outer_state)
    ref = NoLoCoOuter([p.detach() for p in eng.params])
    moved(eng)
    sent = eng.outgoing()
    theta_sent = [s.clone() for s in sent]
    mean = [s + 0.001 for s in sent]
    progress = [torch.full_like(p, 0.003) * (i + 1) for i, p in enumerate(eng.params)]
    trained_on(eng, progress, steps=2)  # two inner steps' worth of change after the tensors went out
    eng.outer_step(mean, 2, sent, rnd=0)
    assert_phi_then_progress(eng, ref.outer_step(theta_sent, mean, n=2), progress, phi_atol=0)
    assert eng.round_start_step == eng.step - 2  # theta == phi where the tensors were sent
    # a solo step reads our own theta: the one sent, not the one trained on since
    sent = eng.outgoing()
    theta_sent = [s.clone() for s in sent]
    trained_on(eng, progress, steps=1)
    eng.outer_step(None, 1, sent, rnd=1)
    assert_phi_then_progress(eng, ref.outer_step(theta_sent, None, n=1), progress, phi_atol=1e-6)


def trained_on(eng: NoLoCoEngine, progress: list[torch.Tensor], steps: int) -> None:
    """``steps`` inner steps' change to theta, made while the exchange ran."""
    with torch.no_grad():
        for p, d in zip(eng.params, progress):
            p.add_(d)
    eng.step += steps


def assert_phi_then_progress(eng: NoLoCoEngine, want_phi, progress, phi_atol: float) -> None:
    """phi is the outer optimizer's; theta is phi plus the progress made since the send."""
    for phi, w in zip(eng.outer.phi, want_phi):
        torch.testing.assert_close(phi, w, rtol=0, atol=phi_atol)
    for p, w, d in zip(eng.params, want_phi, progress):
        torch.testing.assert_close(p.detach(), w + d, rtol=0, atol=1e-6)


def test_off_the_cpu_the_tensors_to_send_are_staged_in_alternating_host_buffers():
    """The GPU path's bookkeeping, with a recording stand-in for the pinned pool."""
    eng = engine()
    calls = []

    def to_host(named):
        calls.append(list(named))
        return {k: v.clone() for k, v in named.items()}

    eng.placement = Placement(torch.device("meta"), CPU, to_host=to_host)  # "not the CPU": staging on
    eng.outgoing()
    eng.outgoing()
    assert [c[0] for c in calls] == [f"0.theta.{eng.names[0]}", f"1.theta.{eng.names[0]}"]
    assert all(len(c) == len(eng.names) for c in calls)


# ---- checks and rollback ---------------------------------------------------------------------------
@pytest.mark.parametrize("poison,expected", [(float("nan"), "nonfinite"), (float("inf"), "nonfinite"),
                                             (1e6, "out_of_bound")])
def test_a_bad_outer_step_is_refused_and_rolled_back_bitwise(poison, expected):
    eng = engine(data=True)
    eng.inner_steps(3)
    assert eng.outer_step(None, 1, eng.outgoing(), rnd=4).refused is None  # the last good step
    good, opt = snapshot(eng), eng.opt
    assert any(m.any() for m in good["m"])
    eng.inner_steps(3)
    sent = eng.outgoing()
    res = eng.outer_step([s + poison for s in sent], 2, sent, rnd=5)
    assert res.refused is not None and res.refused.startswith(expected), res
    after = snapshot(eng)
    assert_bitwise(after["phi"], good["phi"])
    assert_bitwise(after["params"], good["phi"])
    assert_bitwise(after["m"], good["m"])
    assert eng.round == 5 and eng.good.round == 5  # the round did not move on
    assert eng.opt is not opt and not eng.opt.state  # fresh Adam: its moments may hold the poison
    assert eng.round_start_step == eng.step == 6 and eng.sched.last_epoch == 6
    if expected == "out_of_bound":
        assert f"> {eng.cfg.max_update_ratio:g} x ||phi||" in res.refused


def test_update_bound_is_relative_to_the_good_phi():
    eng = engine(max_update_ratio=0.5)
    scale = math.sqrt(sum(float((t.double() ** 2).sum()) for t in eng.good.phi.values()))
    delta = 0.4 * scale / math.sqrt(sum(p.numel() for p in eng.params)) / 0.7  # beta x delta: 0.4 x ||phi||
    moved(eng, delta)
    res = eng.outer_step(None, 1, eng.outgoing(), rnd=0)
    assert res.refused is None and res.norm == pytest.approx(0.4 * scale, rel=1e-3)
    moved(eng, 3 * delta)  # alpha x m + beta x 3 delta: about 1.4 x ||phi||
    assert eng.outer_step(None, 1, eng.outgoing(), rnd=1).refused.startswith("out_of_bound")


def test_rollback_before_any_good_step_zeroes_m():
    eng = engine()
    start = snapshot(eng)
    with torch.no_grad():
        for m in eng.outer.m:
            m.fill_(float("inf"))
        for p in eng.params:
            p.fill_(float("nan"))
    eng.rollback()
    assert all(not m.any() for m in eng.outer.m)
    assert_bitwise([p.detach() for p in eng.params], start["phi"])


# ---- adopt, resync, rewind, checkpoints, serving ---------------------------------------------------
def test_adopt_takes_phi_and_round_with_fresh_inner_and_outer_state():
    eng = engine(data=True, inner_steps=8)
    eng.inner_steps(2)
    assert eng.outer_step(None, 1, eng.outgoing(), rnd=0).refused is None
    phi = [torch.full_like(p, 0.25) for p in eng.params]
    eng.adopt(7, phi)
    assert eng.round == 7 and eng.step == eng.round_start_step == 56 and eng.sched.last_epoch == 56
    assert_bitwise([p.detach() for p in eng.params], phi)
    assert_bitwise(eng.outer.phi, phi)
    assert all(not m.any() for m in eng.outer.m)
    assert eng.good.round == 7 and eng.good.m is None and torch.equal(eng.good.phi[eng.names[0]], phi[0])


def test_diloco_resync_keeps_m_and_the_step():
    eng = engine(data=True, outer="diloco")
    eng.inner_steps(3)
    eng.outer_step(None, 1, eng.outgoing(), rnd=0)
    m, good_m = [t.clone() for t in eng.outer.m], eng.good.m
    phi = [torch.full_like(p, -0.5) for p in eng.params]
    eng.resync(9, phi)
    assert eng.round == 9 and eng.step == 3 and eng.good.round == 9 and eng.good.m is good_m
    assert_bitwise(eng.outer.phi, phi)
    assert_bitwise(eng.outer.m, m)
    assert_bitwise([p.detach() for p in eng.params], phi)


def test_rewind_goes_back_to_the_last_outer_step():
    eng = engine(data=True)
    eng.inner_steps(2)
    eng.outer_step(None, 1, eng.outgoing(), rnd=0)
    at = (eng.step, [t.clone() for t in eng.outer.phi])
    eng.inner_steps(3)
    eng.rewind()
    assert eng.step == at[0] == eng.round_start_step
    assert_bitwise([p.detach() for p in eng.params], at[1])


def test_restore_from_parts_continues_where_the_checkpoint_was():
    eng = engine(data=True)
    eng.inner_steps(3)
    eng.outer_step(None, 1, eng.outgoing(), rnd=2)
    assert tuple(eng.parts()) == ("model", "outer", "inner_optimizer", "scheduler")  # the checkpoint format
    saved = {k: copy.deepcopy(v.state_dict()) for k, v in eng.parts().items()}
    other = engine(data=True)
    for k, part in other.parts().items():
        part.load_state_dict(saved[k])
    other.restore(eng.step, eng.round)
    assert (other.step, other.round, other.round_start_step) == (3, 3, 3)
    assert_bitwise([p.detach() for p in other.params], [p.detach() for p in eng.params])
    assert_bitwise(other.outer.phi, eng.outer.phi)
    assert_bitwise(other.outer.m, eng.outer.m)
    assert other.sched.last_epoch == 3 and other.opt.param_groups[0]["lr"] == eng.opt.param_groups[0]["lr"]
    other.start_data()  # the stream continues at the restored step
    assert torch.equal(next(other.train_iter)[0], next(eng.train_iter)[0])


def test_good_state_is_a_host_copy_not_the_live_phi():
    eng = engine()
    assert eng.good.round == 0 and eng.good.m is None
    for n, phi in zip(eng.names, eng.outer.phi):
        t = eng.good.phi[n]
        assert t.device == CPU and t.dtype == torch.float32 and t.data_ptr() != phi.data_ptr() and torch.equal(t, phi)
    assert eng.specs()[eng.names[0]] == (torch.float32, tuple(eng.params[0].shape))


# ---- the role's round accounting (optimizers/noloco_metrics.py) ------------------------------------
def test_tally_paces_counts_and_partner_repeats():
    from node.metrics import REGISTRY
    from optimizers.noloco_metrics import Tally

    t = Tally()
    t.pace(2.0, 4)
    t.pace(1.0, 4)
    assert t.step_s == pytest.approx(0.375)  # moving average of 0.5 and 0.25
    ok0 = REGISTRY.get_sample_value("swarmnode_outer_rounds_total", {"outcome": "ok"})
    for rnd, partners in enumerate((["a"], ["a"], [], ["b"]), start=1):
        n = 1 + len(partners)
        t.record(rnd=rnd, n=n, outcome="ok", reason=None, partners=partners, blocked_s=0.5, sent_bytes=10,
                 received_bytes=10, norm=0.1, spread=0.01 if n > 1 else None)
    assert (t.rounds_ok, t.outer_steps, t.blocked_s) == (3, 4, 2.0)
    assert REGISTRY.get_sample_value("swarmnode_outer_rounds_total", {"outcome": "ok"}) == ok0 + 3
    assert REGISTRY.get_sample_value("swarmnode_outer_partner_repeat_ratio") == pytest.approx(1 / 3)
    assert REGISTRY.get_sample_value("swarmnode_outer_round") == 4
