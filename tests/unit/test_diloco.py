"""DiLoCo baseline: heavy-ball formula, Nesterov == torch SGD(nesterov=True) (N2), state."""

import io

import pytest
import torch

from optimizers.diloco import DiLoCoOuter

SHAPES = [(3, 5), (7,)]


def _rand(gen, scale=1.0, dtype=torch.float32):
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in SHAPES]


def _theta_bars(rounds, phi_fn, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        yield [p + d for p, d in zip(phi_fn(), _rand(gen, 0.1))]


def test_default_momenta():
    theta0 = _rand(torch.Generator().manual_seed(0))
    assert DiLoCoOuter(theta0).outer_momentum == 0.3
    assert DiLoCoOuter(theta0, momentum="nesterov").outer_momentum == 0.9
    with pytest.raises(ValueError):
        DiLoCoOuter(theta0, momentum="adam")


def test_heavyball_formula():
    theta0 = _rand(torch.Generator().manual_seed(1))
    d = DiLoCoOuter(theta0, 0.7, 0.3, "heavyball")
    phi_ref = [t.clone().double() for t in theta0]
    m_ref = [torch.zeros_like(p) for p in phi_ref]
    for tb in _theta_bars(5, lambda: d.phi):
        for i, t in enumerate(tb):
            delta = phi_ref[i] - t.double()                      # pseudo-gradient
            m_ref[i] = 0.3 * m_ref[i] - 0.7 * delta
            phi_ref[i] = phi_ref[i] + m_ref[i]
        d.outer_step(tb, tb, None, 4)
        for a, b in zip(d.phi, phi_ref):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mu", [0.9, 0.5])
def test_n2_nesterov_matches_torch_sgd_nesterov(mu):
    theta0 = _rand(torch.Generator().manual_seed(2))
    d = DiLoCoOuter(theta0, 0.7, mu, "nesterov")
    params = [torch.nn.Parameter(t.clone()) for t in theta0]
    sgd = torch.optim.SGD(params, lr=0.7, momentum=mu, nesterov=True, foreach=False)
    for tb in _theta_bars(6, lambda: d.phi, seed=3):
        for p, t in zip(params, tb):
            p.grad = p.detach() - t                               # Delta = phi - theta_bar
        sgd.step()
        d.outer_step(tb, tb, None, 4)
        for a, p in zip(d.phi, params):
            assert torch.equal(a, p.detach())                     # op-for-op identical


def test_heavyball_and_nesterov_differ():
    theta0 = _rand(torch.Generator().manual_seed(4))
    hb = DiLoCoOuter(theta0, 0.7, 0.5, "heavyball")
    nv = DiLoCoOuter(theta0, 0.7, 0.5, "nesterov")
    for tb in _theta_bars(3, lambda: hb.phi, seed=5):
        hb.outer_step(tb, tb, None, 2)
        nv.outer_step(tb, tb, None, 2)
    assert max(float((a - b).abs().max()) for a, b in zip(hb.phi, nv.phi)) > 1e-3


@pytest.mark.parametrize("form", ["heavyball", "nesterov"])
def test_solo_step_uses_own_theta(form):
    theta0 = _rand(torch.Generator().manual_seed(6))
    a, b = DiLoCoOuter(theta0, momentum=form), DiLoCoOuter(theta0, momentum=form)
    theta = _rand(torch.Generator().manual_seed(7))
    nan = [torch.full(s, float("nan")) for s in SHAPES]
    a.outer_step(theta, nan, None, 1)
    b.outer_step(theta, theta, None, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.phi, b.phi))
    assert all(bool(torch.isfinite(x).all()) for x in a.phi)


@pytest.mark.parametrize("form", ["heavyball", "nesterov"])
def test_state_dict_round_trip_and_fp32(form):
    theta0 = _rand(torch.Generator().manual_seed(8), dtype=torch.bfloat16)
    straight, first = DiLoCoOuter(theta0, momentum=form), DiLoCoOuter(theta0, momentum=form)
    assert all(t.dtype == torch.float32 for t in straight.phi + straight.m)
    assert all(t.dtype == torch.float32 for t in straight.exchange_tensors(theta0))
    bars = list(_theta_bars(6, lambda: straight.phi, seed=9))
    for tb in bars:
        straight.outer_step(tb, tb, None, 3)
    for tb in bars[:3]:
        first.outer_step(tb, tb, None, 3)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = DiLoCoOuter(theta0, momentum=form)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.rounds == 3
    for tb in bars[3:]:
        resumed.outer_step(tb, tb, None, 3)
    assert all(torch.equal(x, y)
               for x, y in zip(straight.phi + straight.m, resumed.phi + resumed.m))
    with pytest.raises(ValueError, match="original outer settings"):
        DiLoCoOuter(theta0, 0.5, momentum=form).load_state_dict(first.state_dict())


def test_set_phi_adopts_peer_phi():
    theta0 = _rand(torch.Generator().manual_seed(10))
    d = DiLoCoOuter(theta0)
    other = _rand(torch.Generator().manual_seed(11))
    d.set_phi(other)
    assert all(torch.equal(a, b) for a, b in zip(d.phi, other))
