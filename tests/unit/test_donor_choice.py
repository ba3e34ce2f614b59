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


# ---- download_checked (node/checked_download.py) with a fake fetch: which state is adopted, what is counted

def _view(peer: str, rnd: int):
    from node.card import CardView, NodeCard
    card = NodeCard(role="noloco", state="ready", version="0", grpc_addr=f"127.0.0.1:{abs(hash(peer)) % 60000 + 1}",
                    started_at=0.0, published_at=0.0, details={"cfg_hash": "h", "round": rnd})
    return CardView(peer_id=peer, card=card, expiration=0.0)


def _fetcher(states: dict):
    from node.state_sync import StateFetchError

    async def fetch(view):
        served = states[view.peer_id]
        if served is None:
            raise StateFetchError(f"{view.card.grpc_addr} is busy")
        rnd, tensors = served
        return {"round": str(rnd)}, {"a": tensors[0], "b": tensors[1]}
    return fetch


async def _download(donors, states, **kw):
    import logging

    from node.checked_download import download_checked
    return await download_checked(donors, _fetcher(states), ["a", "b"], log=logging.getLogger("swarmnode.test_donor"),
                                  progress_key="round", min_progress=1, **kw)


def _counted(reason: str) -> float:
    from node import metrics as NM
    return NM.STATE_DONORS_REJECTED.labels(reason=reason)._value.get()


async def test_download_rejects_the_forger_and_starts_at_a_round_two_donors_served(caplog):
    caplog.set_level("INFO", logger="swarmnode.test_donor")
    donors = [_view("forger", 112), _view("h1", 100), _view("h2", 99)]
    before = _counted("outlier")
    got = await _download(donors, {"forger": (112, _scrambled(1)), "h1": (100, _state(1, 0.02)),
                                   "h2": (99, _state(2, 0.02))})
    assert got.donor in {"h1", "h2"} and got.progress == 99 and list(got.rejected) == ["forger"]
    assert _counted("outlier") == before + 1
    named = [r for r in caplog.records if getattr(r, "event", None) == "state_donor_rejected"]
    assert named and "forger" in named[0].getMessage()


async def test_a_forger_serving_honest_weights_cannot_lift_the_start_round():
    honest = _state(1, 0.0)
    got = await _download([_view("forger", 112), _view("h1", 100)], {"forger": (112, honest), "h1": (100, honest)})
    assert got.progress == 100 and not got.rejected  # the weights agree, the round needs two donors


async def test_a_lone_donor_is_adopted_and_said_so_and_disagreeing_pairs_are_not(caplog):
    caplog.set_level("INFO", logger="swarmnode.test_donor")
    got = await _download([_view("only", 7)], {"only": (7, _state(1))})
    assert got.donor == "only" and got.lone and got.progress == 7
    unchecked = [r for r in caplog.records if getattr(r, "event", None) == "state_donor_unchecked"]
    assert unchecked and "only peer" in unchecked[0].getMessage()
    # another donor was listed but failed: the one download that worked is not adopted unconfirmed
    assert await _download([_view("h1", 9), _view("busy", 9)], {"h1": (9, _state(1)), "busy": None}) is None
    unconfirmed = [r for r in caplog.records if getattr(r, "event", None) == "state_donor_unconfirmed"]
    assert unconfirmed and "h1" in unconfirmed[0].getMessage()
    # donors_compared = 1 turns the comparison off: the first download that works is adopted
    got = await _download([_view("h1", 9), _view("busy", 9)], {"h1": (9, _state(1)), "busy": None}, compare=1)
    assert got is not None and got.donor == "h1" and got.lone
    before = _counted("no_majority")
    assert await _download([_view("h", 9), _view("x", 9)], {"h": (9, _state(1)), "x": (9, _scrambled(2))}) is None
    assert _counted("no_majority") == before + 2


async def test_a_failed_donor_is_replaced_by_the_next_one():
    donors = [_view("busy", 12), _view("h1", 11), _view("h2", 11), _view("h3", 10)]
    got = await _download(donors, {"busy": None, "h1": (11, _state(1, 0.01)), "h2": (11, _state(2, 0.01)),
                                   "h3": (10, _state(3, 0.01))}, compare=3)
    assert not got.lone and len(got.agreeing) == 3 and got.progress == 11  # two donors served 11
