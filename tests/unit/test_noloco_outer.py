"""NoLoCo outer step: N2-N11, N13 (pure, single process, exact in-memory group means)."""

import io

import numpy as np
import pytest
import torch

from optimizers.diloco import DiLoCoOuter
from optimizers.grouping import groups_for_roster
from optimizers.config import NoLoCoConfig
from protocol.codec import all_finite
from optimizers.noloco import NoLoCoOuter, copy_into, make_outer, replica_spread

SHAPES = [(4, 3), (5,), (2, 2, 2)]


def _rand(gen: torch.Generator, scale: float = 1.0, dtype=torch.float32) -> list[torch.Tensor]:
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in SHAPES]


def _group_round(outers, thetas, groups):
    """Exact in-memory exchange: compute every group's means first, then step every member."""
    plans = []
    for g in groups:
        sent = [outers[w].exchange_tensors(thetas[w]) for w in g]
        means = [torch.stack(col).mean(0) for col in zip(*sent)]
        for w in g:
            plans.append((w, *outers[w].split_means(means), len(g)))
    return {w: outers[w].outer_step(thetas[w], tb, pb, n) for w, tb, pb, n in plans}


def _inner_progress(r: int, w: int, phi, scale=0.05):
    """Deterministic stand-in for H inner steps: theta = phi + noise(r, w)."""
    gen = torch.Generator().manual_seed(1000 * r + w)
    return [p + d for p, d in zip(phi, _rand(gen, scale))]


def _simulate(outers, rounds, ids, seed=0, H=20, k=2, progress=True):
    for r in rounds:
        thetas = [(_inner_progress(r, w, o.phi) if progress else [p.clone() for p in o.phi])
                  for w, o in enumerate(outers)]
        groups = [[ids.index(p) for p in g] for g in groups_for_roster(ids, r, seed, H, k)]
        _group_round(outers, thetas, groups)


# ---- N2: k = W and identical phi is heavy-ball DiLoCo, not Nesterov --------------------------
def test_n2_global_group_equals_heavyball_diloco_exactly():
    W, alpha, beta = 4, 0.3, 0.7
    theta0 = _rand(torch.Generator().manual_seed(0))
    nolocos = [NoLoCoOuter(theta0, beta, alpha) for _ in range(W)]
    diloco = DiLoCoOuter(theta0, beta, alpha, momentum="heavyball")
    nesterov_params = [torch.nn.Parameter(t.clone()) for t in theta0]
    sgd = torch.optim.SGD(nesterov_params, lr=beta, momentum=alpha, nesterov=True, foreach=False)
    for r in range(6):
        thetas = [_inner_progress(r, w, nolocos[w].phi) for w in range(W)]
        _group_round(nolocos, thetas, [list(range(W))])
        theta_bar = [torch.stack(c).mean(0) for c in zip(*thetas)]
        diloco.outer_step(thetas[0], theta_bar, None, W)
        for p, tb in zip(nesterov_params, theta_bar):
            p.grad = p.detach() - tb
        sgd.step()
        for o in nolocos:
            for a, b, c, d in zip(o.phi, nolocos[0].phi, diloco.phi, o.m):
                assert torch.equal(a, b)                         # replicas stay identical
                assert torch.equal(a, c)                         # == heavy-ball DiLoCo, bitwise
            assert all(torch.equal(a, b) for a, b in zip(o.m, diloco.m))
    gap = max(float((a - p.detach()).abs().max()) for a, p in zip(diloco.phi, nesterov_params))
    assert gap > 1e-3, "NoLoCo must not coincide with torch SGD(nesterov=True)"


# ---- N3: mean-field identity ---------------------------------------------------------------
@pytest.mark.parametrize("consensus", ["tied", 0.3, 0.0])
@pytest.mark.parametrize("k", [2, 4])
def test_n3_worker_mean_is_heavyball_diloco(consensus, k):
    W, alpha, beta = 8, 0.5, 0.7
    gen = torch.Generator().manual_seed(3)
    outers = [NoLoCoOuter(_rand(gen), beta, alpha, consensus) for _ in range(W)]
    for o in outers:                                             # non-zero, different momenta
        o.m = _rand(gen, 0.1)
    rng = np.random.default_rng(5)
    for r in range(4):
        mean_phi = [torch.stack(c).mean(0) for c in zip(*(o.phi for o in outers))]
        mean_m = [torch.stack(c).mean(0) for c in zip(*(o.m for o in outers))]
        thetas = [_inner_progress(r, w, outers[w].phi, 0.2) for w in range(W)]
        mean_theta = [torch.stack(c).mean(0) for c in zip(*thetas)]
        ref = DiLoCoOuter(mean_phi, beta, alpha, "heavyball")
        ref.m = [m.clone() for m in mean_m]
        ref.outer_step(mean_theta, mean_theta, None, W)
        perm = rng.permutation(W)
        _group_round(outers, thetas, [list(perm[i:i + k]) for i in range(0, W, k)])
        new_phi = [torch.stack(c).mean(0) for c in zip(*(o.phi for o in outers))]
        new_m = [torch.stack(c).mean(0) for c in zip(*(o.m for o in outers))]
        for a, b in zip(new_phi + new_m, ref.phi + ref.m):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


# ---- N4: consensus sign and conservation ---------------------------------------------------
def _wrong_sign_step(phi, phi_bar, gamma):
    return phi + gamma * (phi - phi_bar)                          # pushes away from the centre


@pytest.mark.parametrize("consensus,gamma", [("tied", 0.7), (0.7, 0.7), (0.3, 0.3)])
def test_n4_pair_gap_shrinks_by_one_minus_gamma_and_sum_conserved(consensus, gamma):
    gen = torch.Generator().manual_seed(4)
    a = NoLoCoOuter(_rand(gen), 0.7, 0.0, consensus)
    b = NoLoCoOuter(_rand(gen), 0.7, 0.0, consensus)
    gap0 = [x - y for x, y in zip(a.phi, b.phi)]
    sum0 = [x + y for x, y in zip(a.phi, b.phi)]
    thetas = [[p.clone() for p in a.phi], [p.clone() for p in b.phi]]   # theta = phi
    _group_round([a, b], thetas, [[0, 1]])
    for g0, s0, x, y in zip(gap0, sum0, a.phi, b.phi):
        torch.testing.assert_close(x - y, (1 - gamma) * g0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x + y, s0, rtol=1e-6, atol=1e-6)
    # the divergent sign grows the gap by (1 + gamma): the same check must reject it
    gen = torch.Generator().manual_seed(4)
    pa, pb = _rand(gen), _rand(gen)
    centre = [(x + y) / 2 for x, y in zip(pa, pb)]
    wa = [_wrong_sign_step(x, c, gamma) for x, c in zip(pa, centre)]
    wb = [_wrong_sign_step(y, c, gamma) for y, c in zip(pb, centre)]
    for x, y, g0, nx, ny in zip(pa, pb, gap0, wa, wb):
        torch.testing.assert_close(nx - ny, (1 + gamma) * g0, rtol=1e-5, atol=1e-6)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(nx - ny, (1 - gamma) * g0, rtol=1e-5, atol=1e-6)


# ---- N5: tied shortcut ---------------------------------------------------------------------
def test_n5_tied_equals_two_tensor_exchange_when_gamma_equals_beta():
    W = 6
    theta0 = _rand(torch.Generator().manual_seed(5))
    tied = [NoLoCoOuter(theta0, 0.7, 0.5, "tied") for _ in range(W)]
    full = [NoLoCoOuter(theta0, 0.7, 0.5, 0.7) for _ in range(W)]
    assert len(tied[0].exchange_tensors(theta0)) == len(SHAPES)
    assert len(full[0].exchange_tensors(theta0)) == 2 * len(SHAPES)
    ids = [f"p{i}" for i in range(W)]
    for r in range(8):
        _simulate(tied, [r], ids)
        _simulate(full, [r], ids)
        for t, f in zip(tied, full):
            for x, y in zip(t.phi + t.m, f.phi + f.m):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert replica_spread([o.phi for o in tied]) > 0               # replicas genuinely differ


# ---- N6: solo step --------------------------------------------------------------------------
@pytest.mark.parametrize("consensus", ["tied", 0.3])
def test_n6_solo_step_formula_ignores_means_and_stays_finite(consensus):
    gen = torch.Generator().manual_seed(6)
    o = NoLoCoOuter(_rand(gen), 0.7, 0.5, consensus)
    o.m = _rand(gen, 0.1)
    theta = _rand(gen)
    phi0, m0 = [p.clone() for p in o.phi], [m.clone() for m in o.m]
    nan = [torch.full(s, float("nan")) for s in SHAPES]
    new = o.outer_step(theta, nan, nan, 1)
    for p0, mm0, th, m, p in zip(phi0, m0, theta, o.m, new):
        expect_m = 0.5 * mm0 + 0.7 * (th - p0)
        torch.testing.assert_close(m, expect_m)
        torch.testing.assert_close(p, p0 + expect_m)
    assert all(map(all_finite, new)) and all(map(all_finite, o.m))
    assert not all(map(all_finite, nan))
    o.outer_step(theta, None, None, n=1)                           # no means at all is fine too


def test_outer_step_argument_errors():
    o = NoLoCoOuter(_rand(torch.Generator().manual_seed(0)), consensus=0.3)
    th = [p.clone() for p in o.phi]
    with pytest.raises(TypeError, match="needs n"):
        o.outer_step(th, th)
    with pytest.raises(ValueError, match="phi_bar is required"):
        o.outer_step(th, th, None, 2)
    with pytest.raises(ValueError, match="shape"):
        o.outer_step(th, [torch.zeros(1)] * 3, th, 2)
    with pytest.raises(ValueError, match="tensors"):
        o.outer_step(th[:2], th, th, 2)


# ---- N7: fixed point -------------------------------------------------------------------------
@pytest.mark.parametrize("consensus", ["tied", 0.3])
def test_n7_equal_state_stays_equal_under_any_grouping(consensus):
    W = 8
    gen = torch.Generator().manual_seed(7)
    theta0, m0 = _rand(gen), _rand(gen, 0.1)
    outers = [NoLoCoOuter(theta0, 0.7, 0.5, consensus) for _ in range(W)]
    for o in outers:
        o.m = [m.clone() for m in m0]
    rng = np.random.default_rng(7)
    for r in range(5):
        theta = _inner_progress(r, 0, outers[0].phi)               # same theta on every worker
        perm = list(rng.permutation(W))
        groups = [perm[:2], perm[2:4], perm[4:6], perm[6:]]
        _group_round(outers, [theta] * W, groups)
        for o in outers:
            assert all(torch.equal(a, b) for a, b in zip(o.phi + o.m, outers[0].phi + outers[0].m))
    # theta = phi and m = 0 is a true fixed point: nothing moves
    o = NoLoCoOuter(theta0)
    o.outer_step([p.clone() for p in o.phi], [p.clone() for p in o.phi], None, 2)
    assert all(torch.equal(a, b) for a, b in zip(o.phi, theta0))


# ---- N8: consensus over rounds; frozen pairs do not converge ---------------------------------
def _n8_setup():
    phi0 = np.random.default_rng(1).standard_normal((8, 32))
    return [NoLoCoOuter([torch.tensor(row, dtype=torch.float32)], 0.7, 0.5, "tied")
            for row in phi0]


def _numpy_reference(rounds=40, W=8, H=20):
    phi = np.random.default_rng(1).standard_normal((W, 32))
    m = np.zeros_like(phi)
    for r in range(rounds):
        perm = np.random.default_rng(r * H + 1).permutation(W)
        for g in range(W // 2):
            members = [perm[i] for i in range(W) if i % (W // 2) == g]
            centre = phi[members].mean(0)
            for i in members:
                m[i] = 0.5 * m[i] + 0.7 * (centre - phi[i])
        phi = phi + m
    return float(np.sqrt(((phi - phi.mean(0)) ** 2).sum() / phi.size))


def test_n8_random_pairs_contract_spread_fixed_pairs_do_not():
    ids = [f"w{i}" for i in range(8)]
    outers = _n8_setup()
    s0 = replica_spread([o.phi for o in outers])
    assert s0 == pytest.approx(0.875, abs=0.01)                    # the reference's 0.88
    _simulate(outers, range(40), ids, seed=0, H=20, k=2, progress=False)
    s40 = replica_spread([o.phi for o in outers])
    ref = _numpy_reference()
    assert ref == pytest.approx(1.7e-4, rel=0.05)
    assert s40 == pytest.approx(ref, rel=0.05)                     # fp32 vs fp64 reference
    assert s40 < 1e-3 * s0                                         # orders of magnitude

    frozen = _n8_setup()
    for _ in range(40):                                            # the same pairs every round
        _simulate(frozen, [0], ids, seed=0, H=20, k=2, progress=False)
    s_frozen = replica_spread([o.phi for o in frozen])
    assert s_frozen > 0.3 * s0                                     # clusters never meet
    pairs = groups_for_roster(ids, 0, 0, 20, 2)                    # ...but each pair agrees
    for g in pairs:
        a, b = (frozen[ids.index(p)] for p in g)
        assert float((a.phi[0] - b.phi[0]).abs().max()) < 1e-3


# ---- N9: what stays local -------------------------------------------------------------------
def test_n9_momentum_never_exchanged_and_theta_equals_phi_after_copy():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params = list(model.parameters())
    adam = torch.optim.Adam(params, lr=1e-2)
    for consensus in ["tied", 0.3]:
        outer = NoLoCoOuter(params, 0.7, 0.5, consensus)
        gen = torch.Generator().manual_seed(9)
        for _ in range(3):                                         # a few inner steps
            x = torch.randn(16, 4, generator=gen)
            loss = (model(x) ** 2).mean()
            adam.zero_grad()
            loss.backward()
            adam.step()
        outer.m = [torch.full_like(m, 12345.0) for m in outer.m]   # sentinel momentum
        sent = outer.exchange_tensors(params)
        for t in sent:
            assert t.dtype == torch.float32
            assert not (t == 12345.0).any()
            assert all(t.data_ptr() != m.data_ptr() for m in outer.m + outer.phi)
        adam_before = {k: {n: v.clone() for n, v in s.items()} for k, s in adam.state.items()}
        means, phi_bar = outer.split_means(sent)
        new_phi = outer.outer_step(params, means, phi_bar, 2)
        copy_into(params, new_phi)
        assert all(torch.equal(p, q) for p, q in zip(params, outer.phi))   # theta == phi
        for k, s in adam.state.items():                             # Adam state untouched
            assert all(torch.equal(v, adam_before[k][n]) for n, v in s.items())
        sd = outer.state_dict()
        assert set(sd) == {"phi", "m", "config"}
        assert "exp_avg" not in repr(sd["config"]) and "adam" not in repr(sd).lower()


# ---- N10: determinism -----------------------------------------------------------------------
@pytest.mark.parametrize("consensus", ["tied", 0.4])
def test_n10_two_runs_bitwise_identical(consensus):
    ids = [f"peer{i}" for i in range(7)]                           # odd W: exercises a triple
    theta0 = _rand(torch.Generator().manual_seed(10))
    runs = []
    for _ in range(2):
        outers = [NoLoCoOuter(theta0, 0.7, 0.5, consensus) for _ in ids]
        _simulate(outers, range(6), ids, seed=3, H=20, k=2)
        runs.append(outers)
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a.phi + a.m, b.phi + b.m))


# ---- N11: checkpoint / restore --------------------------------------------------------------
@pytest.mark.parametrize("consensus", ["tied", 0.4])
def test_n11_state_dict_round_trip_continues_identically(consensus):
    ids = [f"peer{i}" for i in range(6)]
    theta0 = _rand(torch.Generator().manual_seed(11))
    straight = [NoLoCoOuter(theta0, 0.7, 0.5, consensus) for _ in ids]
    _simulate(straight, range(8), ids)

    first = [NoLoCoOuter(theta0, 0.7, 0.5, consensus) for _ in ids]
    _simulate(first, range(4), ids)
    resumed = []
    for o in first:
        buf = io.BytesIO()
        torch.save(o.state_dict(), buf)
        buf.seek(0)
        fresh = NoLoCoOuter(theta0, 0.7, 0.5, consensus)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        resumed.append(fresh)
    _simulate(resumed, range(4, 8), ids)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a.phi + a.m, b.phi + b.m))

    with pytest.raises(ValueError, match="original outer settings"):
        NoLoCoOuter(theta0, 0.6, 0.5, consensus).load_state_dict(first[0].state_dict())


# ---- N13: dtype -----------------------------------------------------------------------------
@pytest.mark.parametrize("consensus", ["tied", 0.3])
def test_n13_fp32_state_and_buffers_with_bf16_model(consensus):
    gen = torch.Generator().manual_seed(13)
    params = [torch.nn.Parameter(t) for t in _rand(gen, dtype=torch.bfloat16)]
    outer = NoLoCoOuter(params, 0.7, 0.5, consensus)
    assert all(t.dtype == torch.float32 for t in outer.phi + outer.m)
    sent = outer.exchange_tensors(params)
    assert all(t.dtype == torch.float32 for t in sent)
    partner = [t.float() + 0.01 for t in sent]
    means = [(a + b) / 2 for a, b in zip(sent, partner)]
    tb, pb = outer.split_means(means)
    new = outer.outer_step(params, tb, pb, 2)
    assert all(t.dtype == torch.float32 for t in new + outer.m)
    copy_into(params, new)
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(params, new))
    assert all(t.dtype == torch.float32 for t in outer.state_dict()["phi"])


def test_make_outer_from_config():
    theta0 = _rand(torch.Generator().manual_seed(14))
    o = make_outer(theta0, NoLoCoConfig(consensus=0.3))
    assert isinstance(o, NoLoCoOuter) and o.gamma == 0.3 and o.outer_momentum == 0.5
    d = make_outer(theta0, NoLoCoConfig(outer="diloco", diloco_momentum="nesterov",
                                        outer_momentum=0.9))
    assert isinstance(d, DiLoCoOuter) and d.momentum == "nesterov" and d.outer_momentum == 0.9
