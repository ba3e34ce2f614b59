"""Open-swarm range checks (issue 7): tensor norm/distance bounds, the robust round frontier,
the "recovering" readiness reason, and the rejection metrics' labels. The rollback of a bad outer
step itself is tested with the engine that takes it (tests/unit/test_noloco_engine.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.card import CARD_INT_MAX, CardView, NodeCard, card_int, frontier_card_int
from node.lifecycle import READINESS_REASONS
from node.metrics import REGISTRY, DhtCollector, count_rejection
from node.state_sync import order_donors
from optimizers.config import NoLoCoConfig
from optimizers.exchange_common import TensorBounds, bound_violation
from optimizers.exchange_link import ExchangeLink
from protocol.codec import TensorRejected
from protocol.streams import PeerError

B = TensorBounds()  # defaults: norm ratio 4, distance ratio 1, floor 1e-2


def model(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 32, generator=g) * scale, torch.randn(32, generator=g) * scale, torch.zeros(16)]


def reason(ours, theirs, bounds=B):
    bad = bound_violation(ours, theirs, bounds, ["w", "b", "zero_bias"])
    return None if bad is None else bad[0]


# ---------------------------------------------------------------- tensor bounds

def test_honest_partner_passes_and_zero_biases_never_fail():
    ours = model()
    theirs = [t + 0.1 * torch.randn_like(t) for t in ours]  # a replica trained apart: small distance
    theirs[2] = torch.full((16,), 1e-3)  # a bias still near zero on one side, exactly zero on the other
    assert reason(ours, theirs) is None
    assert reason(ours, [t.clone() for t in ours]) is None


@pytest.mark.parametrize("attack,expected", [
    (lambda t: t * 1e6, "norm"),                         # finite but huge (the attack)
    (lambda t: torch.full_like(t, 3e38), "norm"),        # near fp32 max: no overflow to "nonfinite"
    (lambda t: -t, "distance"),                          # plausible norm, wrong direction
    (lambda t: torch.zeros_like(t), "norm"),             # would pull our weights halfway to zero
    (lambda t: torch.randn_like(t), "distance"),         # random weights of the same scale
    (lambda t: t * 3.0, "distance"),                     # within the norm ratio, too far
    (lambda t: torch.full_like(t, float("nan")), "nonfinite"),
    (lambda t: torch.full_like(t, float("inf")), "nonfinite"),
])
def test_attacks_are_rejected_with_their_reason(attack, expected):
    ours = model()
    theirs = [attack(t) if i < 2 else t.clone() for i, t in enumerate(ours)]
    assert reason(ours, theirs) == expected


def test_one_bad_tensor_is_enough():
    ours = model()
    theirs = [t.clone() for t in ours]
    theirs[1] = theirs[1] * 50  # one small tensor blown up: the global norm hardly notices
    assert reason(ours, theirs) == "norm"


def test_our_own_nonfinite_is_not_the_partners_fault():
    ours = model()
    theirs = [t.clone() for t in ours]
    ours[0][0, 0] = float("nan")
    assert reason(ours, theirs) == "local_nonfinite"


@pytest.mark.parametrize("seed", range(6))
def test_verdict_is_symmetric(seed):
    """Both partners run the test with the roles swapped: they must agree (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ours = model(seed)
    scale = [0.05, 0.5, 1.0, 1.9, 3.0, 5.0][seed]
    theirs = [t * (1 + scale * torch.rand(1, generator=g).item()) + scale * torch.randn(t.shape, generator=g)
              for t in ours]
    a, b = bound_violation(ours, theirs, B), bound_violation(theirs, ours, B)
    assert (a is None) == (b is None)
    if a is not None:
        assert a[0] == b[0]


def test_bounds_are_configurable_and_checked():
    ours = model()
    theirs = [t * 3.0 for t in ours]
    assert reason(ours, theirs, TensorBounds(max_distance_ratio=2.5)) is None
    assert reason(ours, theirs, TensorBounds(max_norm_ratio=2.0, max_distance_ratio=2.5)) == "norm"
    with pytest.raises(ValueError):
        TensorBounds(max_norm_ratio=1.0)
    cfg = NoLoCoConfig(max_norm_ratio=8, max_distance_ratio=0.5, bound_floor_rms=1e-3, max_round_jump=4)
    assert (cfg.max_norm_ratio, cfg.max_distance_ratio, cfg.bound_floor_rms, cfg.max_round_jump) == (8, 0.5, 1e-3, 4)
    assert cfg.cfg_hash() == NoLoCoConfig().cfg_hash()  # local checks: peers need not agree on them
    with pytest.raises(ValueError):
        NoLoCoConfig(max_norm_ratio=1.0)


def link(**kw):
    specs = [("w", torch.float32, (64, 32)), ("b", torch.float32, (32,)), ("zero_bias", torch.float32, (16,))]
    seen = []
    ln = ExchangeLink(run_id="r", peer_id="me", cfg_hash="h", grpc_addr="127.0.0.1:1", specs=specs, netem=None,
                      max_round_skew=2, poll_interval_s=0.1, on_reject=seen.append, **kw)
    return ln, seen


def test_link_check_bounds_raises_counts_and_charges():
    ln, seen = link(bounds=B, distrust_rounds=5)
    ours = model()
    asyncio.run(ln.check_bounds(ours, [t.clone() for t in ours]))  # fine: no raise
    with pytest.raises(TensorRejected) as exc:
        asyncio.run(ln.check_bounds(ours, [t * 1e6 for t in ours]))
    assert exc.value.reason == "norm" and "max_norm_ratio" in str(exc.value)
    bad = [t.clone() for t in ours]
    bad[0][0, 0] = float("nan")
    with pytest.raises(PeerError) as perr:
        asyncio.run(ln.check_bounds(bad, ours))
    assert perr.value.reason == "local_nonfinite"
    ln.count("norm")
    assert seen == ["norm"]
    ln.last_round = 7
    ln.charge("attacker", "norm")
    ln.charge(None, "norm")  # an unverified caller is never charged
    assert ln.is_distrusted("attacker", 12) and not ln.is_distrusted("attacker", 13)
    assert not ln.is_distrusted("honest", 8) and list(ln.distrusted) == ["attacker"]


def test_link_without_bounds_checks_nothing_extra():
    ln, _ = link()
    ours = model()
    asyncio.run(ln.check_bounds(ours, [t * 1e6 for t in ours]))


def test_rejection_metrics_have_the_new_reasons():
    for r in ("norm", "distance"):
        before = REGISTRY.get_sample_value("swarmnode_tensors_rejected_total", {"reason": r}) or 0.0
        count_rejection(r)
        assert REGISTRY.get_sample_value("swarmnode_tensors_rejected_total", {"reason": r}) == before + 1


def test_dht_rejections_carry_a_reason_label():
    fams = list(DhtCollector(lambda timeout: (3, {"schema": 2, "signature": 1})).collect())
    rejected = next(f for f in fams if f.name == "swarmnode_dht_records_rejected")
    got = {(s.labels["validator"], s.labels["reason"]): s.value for s in rejected.samples if s.name.endswith("_total")}
    assert got == {("signed_record", "schema"): 2, ("signed_record", "signature"): 1}


# ---------------------------------------------------------------- round frontier

def view(peer, **details):
    card = NodeCard(role="noloco", state="ready", version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                    published_at=0.0, details={"cfg_hash": "h", **details})
    return CardView(peer_id=peer, card=card, expiration=0.0)


def test_card_int_refuses_values_that_would_poison_our_card():
    assert card_int(view("a", round=CARD_INT_MAX), "round") == CARD_INT_MAX
    assert card_int(view("a", round=CARD_INT_MAX + 1), "round") is None
    assert card_int(view("a", round=2 ** 64 - 1), "round") is None


def test_frontier_ignores_a_forged_absurd_round():
    honest = [view("a", round=40), view("b", round=41), view("c", round=43)]
    forged = view("evil", round=10 ** 12)
    assert frontier_card_int([*honest, forged], "round", 16) == 43
    assert frontier_card_int([honest[0], forged], "round", 16) == 40      # lower median: the honest one
    assert frontier_card_int([forged], "round", 16, own=40) is None       # alone with a stranger: keep ours
    assert frontier_card_int([honest[0], forged], "round", 16, own=39) == 40
    assert frontier_card_int([view("x", round=2 ** 63)], "round", 16, own=3) is None  # junk: not a card int
    assert frontier_card_int([], "round", 16) is None
    # an honest swarm far ahead of a lagging worker is still followed once two peers agree
    assert frontier_card_int([view("a", round=500), view("b", round=501)], "round", 16, own=3) == 501


def test_frontier_window_is_configurable():
    views = [view("a", round=10), view("b", round=10), view("c", round=30)]
    assert frontier_card_int(views, "round", 16) == 10
    assert frontier_card_int(views, "round", 20) == 30


def test_order_donors_never_puts_the_forger_first():
    views = [view("a", round=40), view("b", round=41), view("evil", round=10 ** 12)]
    assert [v.peer_id for v in order_donors(views, role="noloco", cfg_hash="h", max_jump=16)] == ["b", "a"]
    assert order_donors(views, role="noloco", cfg_hash="h")[0].peer_id == "evil"  # what it did before


# ---------------------------------------------------------------- rollback

def test_recovering_is_a_readiness_reason():
    assert "recovering" in READINESS_REASONS
