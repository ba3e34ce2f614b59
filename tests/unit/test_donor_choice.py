"""The donor and round-label rules (node/donor_choice.py): pure, on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from node.donor_choice import Candidate, DonorCheckSettings, choose_donor, relative_distance, supported_label


def _state(seed: int, noise: float = 0.0, base: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(base)
    honest = [torch.randn(16, 8, generator=g), torch.randn(8, generator=g)]
    if not noise:
        return honest
    n = torch.Generator().manual_seed(seed)
    return [t + noise * torch.randn(t.shape, generator=n) for t in honest]


def _scrambled(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [t.flatten()[torch.randperm(t.numel(), generator=g)].view_as(t) for t in _state(0)]


def test_relative_distance_is_symmetric_scaled_and_safe():
    a, b = _state(1, 0.05), _state(2, 0.05)
    assert relative_distance(a, b) == pytest.approx(relative_distance(b, a))
    assert relative_distance(a, a) == 0.0
    assert relative_distance(a, [2 * t for t in a]) == pytest.approx(1.0)  # ||a|| / min(||a||, ||2a||)
    assert 1.2 < relative_distance(_state(0), _scrambled(7)) < 1.7         # same norm, wrong weights
    assert relative_distance(a, a[:1]) == math.inf                         # a different model
    zero = [torch.zeros(16, 8), torch.zeros(8)]
    assert relative_distance(zero, zero) == 0.0 and relative_distance(zero, a) == math.inf


def test_the_majority_wins_and_the_forger_is_rejected_by_name():
    cands = [Candidate("forger", 112, _scrambled(3)), Candidate("h1", 100, _state(1, 0.02)),
             Candidate("h2", 99, _state(2, 0.02))]
    v = choose_donor(cands, 0.5)
    assert v.chosen is not None and v.chosen.peer_id in {"h1", "h2"} and not v.lone and v.reason == "majority"
    assert sorted(c.peer_id for c in v.agreeing) == ["h1", "h2"]
    assert list(v.rejected) == ["forger"] and v.rejected["forger"] > 1.0


def test_the_medoid_is_chosen_among_agreeing_donors():
    # h_mid sits between the two others: the smallest summed distance to the agreeing ones
    lo, hi = _state(1, 0.0), [t + 0.2 for t in _state(1, 0.0)]
    mid = [(a + b) / 2 for a, b in zip(lo, hi)]
    v = choose_donor([Candidate("lo", 5, lo), Candidate("hi", 6, hi), Candidate("mid", 5, mid)], 0.5)
    assert v.chosen.peer_id == "mid" and not v.rejected


def test_one_donor_is_adopted_unchecked_and_flagged():
    v = choose_donor([Candidate("only", 4, _scrambled(1))], 0.5)
    assert v.chosen.peer_id == "only" and v.lone and v.reason == "lone"
    assert choose_donor([], 0.5).chosen is None


def test_two_that_disagree_give_no_majority_and_two_that_agree_both_count():
    v = choose_donor([Candidate("h", 10, _state(1, 0.02)), Candidate("x", 22, _scrambled(2))], 0.5)
    assert v.chosen is None and v.reason == "no_majority" and set(v.rejected) == {"h", "x"}
    v = choose_donor([Candidate("a", 10, _state(1, 0.02)), Candidate("b", 11, _state(2, 0.02))], 0.5)
    assert v.chosen.peer_id == "b"  # tie on distance: the more advanced one
    assert len(v.agreeing) == 2 and not v.rejected and not v.lone


def test_two_forgers_that_agree_still_lose_to_three_honest_donors_and_win_against_one():
    x = _scrambled(5)
    honest = [Candidate(f"h{i}", 10, _state(i, 0.02)) for i in range(3)]
    v = choose_donor([Candidate("x1", 22, x), Candidate("x2", 22, x), *honest], 0.5)
    assert v.chosen.peer_id.startswith("h") and set(v.rejected) == {"x1", "x2"}
    # the documented residual risk: a sybil majority is believed (admission tokens are the defence)
    v = choose_donor([Candidate("x1", 22, x), Candidate("x2", 22, x), honest[0]], 0.5)
    assert v.chosen.peer_id.startswith("x") and set(v.rejected) == {"h0"}


def test_a_single_card_never_lifts_the_supported_label():
    # two honest peers at 100 and 98, one forged card at 112 (inside max_jump 16)
    s = supported_label([100, 112, 98], own=99, max_jump=16, quorum=2)
    assert s.label == 100 and s.support == 2 and not s.lone and s.ignored == 1
    # republished ever higher, it still never counts
    for forged in (113, 120, 200, 10 ** 12):
        assert supported_label([100, forged], own=100, max_jump=16).label == 100


def test_two_peers_that_reached_a_label_support_it():
    s = supported_label([105, 105, 90], own=90, max_jump=16)
    assert s.label == 105 and s.support == 2
    assert supported_label([105, 104, 90], own=90, max_jump=16).label == 104


def test_a_lone_peer_is_followed_and_flagged():
    s = supported_label([40], own=37, max_jump=16)
    assert s.label == 40 and s.lone and s.support == 1
    assert supported_label([None, 40], own=0).label == 40
    assert supported_label([], own=3).label is None and supported_label([None], own=3).label is None


def test_absurd_claims_never_count_towards_a_quorum():
    s = supported_label([10 ** 12, 10 ** 12, 50], own=50, max_jump=16)
    assert s.label == 50  # anchor: the lower median of [50, 50, 1e12, 1e12] is 50


def test_quorum_one_is_the_old_rule():
    assert supported_label([100, 112, 98], own=99, max_jump=16, quorum=1).label == 112


def test_settings_defaults_and_bounds():
    s = DonorCheckSettings()
    assert (s.donors_compared, s.donor_max_distance, s.round_label_quorum) == (3, 0.5, 2)
    with pytest.raises(ValueError):
        DonorCheckSettings(donors_compared=0)
    with pytest.raises(ValueError):
        DonorCheckSettings(unknown=1)
