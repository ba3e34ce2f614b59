"""Robust averaging (optimizers/robust.py): the clip's bound, crafted numbers, honest pairs untouched."""

import math

import pytest
import torch

from optimizers.robust import PartnerClip, centered_clip, clip_factor, clip_toward, distance


def _mean(a, b):
    return [(x + y) / 2 for x, y in zip(a, b)]


def _model(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=g) * scale, torch.randn(32, generator=g) * scale]


def _attack(theta, seed=0):
    """The issue's attacker: 0.55 * theta + 0.835 * perm(theta), per tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in theta:
        flat = t.reshape(-1)
        out.append((0.55 * flat + 0.835 * flat[torch.randperm(flat.numel(), generator=g)]).reshape(t.shape))
    return out


def test_crafted_numbers():
    ours = [torch.tensor([0.0, 0.0]), torch.tensor([1.0])]
    theirs = [torch.tensor([3.0, 0.0]), torch.tensor([5.0])]  # difference (3, 0, 4): distance 5
    assert distance(ours, theirs) == 5.0
    clip = PartnerClip(multiplier=2.0, window=4)
    clip.history.extend([0.5, 1.0, 2.0])  # median 1.0 -> radius 2 * max(1.0, 0.25) = 2.0
    assert clip.radius(0.25) == 2.0
    v = clip.clip(ours, theirs, own_move=0.25, peer="p")
    assert v.factor == pytest.approx(0.4) and v.radius == 2.0 and v.distance == 5.0 and v.hard
    assert torch.allclose(v.tensors[0], torch.tensor([1.2, 0.0])) and torch.allclose(v.tensors[1], torch.tensor([2.6]))
    # the step: mean moves 1.0 from ours (radius / 2), not 2.5
    assert distance(ours, _mean(ours, v.tensors)) == pytest.approx(1.0)
    assert list(clip.history) == [0.5, 1.0, 2.0, 0.5]  # recorded min(d, radius, 2 x own move)
    # own move dominates an empty or small history (the warm-up rule)
    assert PartnerClip(multiplier=3.0).radius(0.5) == 1.5
    assert clip_factor(0.0, 0.0) == 1.0 and clip_factor(math.inf, 1.0) == 0.0


def test_a_partner_met_every_round_cannot_walk_the_radius_up():
    """Found on real processes: an attacker that is always waiting is every worker's partner;
    recorded at the radius, its distances made the median (and the radius) grow 4x per window
    until it was no longer clipped. Recorded at most at 2 own moves, the radius stays within
    multiplier x [1, 2] own moves and the attacker stays clipped hard."""
    clip = PartnerClip(multiplier=4.0, window=16, min_history=0)
    ours, far = [torch.zeros(4)], [torch.full((4,), 50.0)]  # distance 100
    verdicts = [clip.clip(ours, far, own_move=1.0, peer=f"a{i % 3}") for i in range(60)]
    assert max(v.radius for v in verdicts) <= 8.0 + 1e-9
    assert all(v.hard for v in verdicts)


def test_factor_one_returns_partner_tensors_untouched():
    ours, theirs = _model(0), _model(1)
    assert all(a is b for a, b in zip(clip_toward(ours, theirs, 1.0), theirs))
    v = PartnerClip(multiplier=1e6).clip(ours, theirs, own_move=1.0)
    assert v.factor == 1.0 and all(a is b for a, b in zip(v.tensors, theirs))


@pytest.mark.parametrize("seed", range(12))
def test_bound_holds_for_any_partner_tensor(seed):
    """Property: whatever the partner sends, the pair step deviates from our own tensors (the
    honest-only step of a pair whose partner is dropped) by at most radius / 2."""
    g = torch.Generator().manual_seed(100 + seed)
    ours = _model(seed)
    kinds = [
        [torch.randn(t.shape, generator=g) * 10 ** float(torch.randint(-3, 30, (1,), generator=g)) for t in ours],
        [t * float(torch.randn(1, generator=g) * 1e3) for t in ours],          # scaled copies
        _attack(ours, seed),                                                     # permutations
        [-t for t in ours],
        [torch.full_like(t, 3.0e38) for t in ours],                              # huge, finite
    ]
    clip = PartnerClip(multiplier=float(torch.rand(1, generator=g)) * 5 + 0.5, window=8)
    clip.history.extend(float(x) for x in torch.rand(5, generator=g))
    for theirs in kinds:
        move = float(torch.rand(1, generator=g))
        tau = clip.radius(move)
        v = clip.clip(ours, theirs, own_move=move, peer="x")
        assert v.radius == tau
        dev = distance(ours, _mean(ours, v.tensors))
        assert dev <= tau / 2 * (1 + 1e-5) + 1e-6, (dev, tau)


def test_centered_clip_bound_and_reference():
    center = [torch.zeros(3)]
    parts = [[torch.tensor([1.0, 0.0, 0.0])], [torch.tensor([0.0, 1.0, 0.0])], [torch.tensor([0.0, 0.0, 100.0])]]
    v, factors = centered_clip(parts, center, radius=2.0)
    assert factors == [1.0, 1.0, 0.02]
    assert torch.allclose(v[0], torch.tensor([1 / 3, 1 / 3, 2 / 3]))
    # one member alone moves the result by at most radius / n, whatever it sends
    honest = [parts[0], parts[1]]
    ref, _ = centered_clip(honest + [center], center, radius=2.0)
    for bad in ([torch.tensor([1e30, -1e30, 0.0])], [torch.tensor([-5.0, 2.0, 7.0])]):
        got, _ = centered_clip(honest + [bad], center, radius=2.0)
        assert distance(ref, got) <= 2.0 / 3 + 1e-5


def test_attacker_is_clipped_and_charged_honest_pairs_untouched():
    """A converging honest swarm (synthetic): replicas share phi, each round's inner moves shrink;
    every honest pair has clip factor 1; the issue's attacker is clipped hard and charged."""
    g = torch.Generator().manual_seed(7)
    target = _model(42)
    phis = [[t.clone() for t in _model(3)] for _ in range(4)]
    clips = [PartnerClip(multiplier=4.0, window=16, strikes=3) for _ in phis]
    factors = []
    for r in range(30):
        lr = 0.3 * (0.9 ** r)
        thetas = [[p + lr * (t - p) + 0.02 * lr * torch.randn(p.shape, generator=g) for p, t in zip(phi, target)]
                  for phi in phis]
        moves = [distance(th, phi) for th, phi in zip(thetas, phis)]
        perm = torch.randperm(4, generator=g).tolist()
        for a, b in ((perm[0], perm[1]), (perm[2], perm[3])):
            va = clips[a].clip(thetas[a], thetas[b], moves[a], peer=str(b))
            vb = clips[b].clip(thetas[b], thetas[a], moves[b], peer=str(a))
            factors += [va.factor, vb.factor]
            mean = _mean(thetas[a], thetas[b])
            phis[a] = [m.clone() for m in mean]
            phis[b] = [m.clone() for m in mean]
    assert min(factors) == 1.0  # no honest contribution clipped
    # the attacker, against worker 0 in its settled state
    clip, theta, phi = clips[0], thetas[0], phis[0]
    move = moves[0]
    charged = []
    for r in range(3):
        v = clip.clip(theta, _attack(theta, r), move, peer="attacker")
        charged.append(v.charge)
        assert v.factor < 0.05 and v.hard
        assert distance(theta, _mean(theta, v.tensors)) <= v.radius / 2 + 1e-5  # fp32 rounding
    assert charged == [False, False, True]


def test_joiner_is_not_charged_while_it_closes_in():
    """A partner clipped hard once or twice and then within the radius is never charged."""
    clip = PartnerClip(multiplier=2.0, strikes=3, min_history=0)
    ours = [torch.zeros(4)]
    far = [torch.full((4,), 10.0)]
    near = [torch.full((4,), 0.1)]
    seq = [clip.clip(ours, t, own_move=0.5, peer="j") for t in (far, far, *[near] * 20)]
    assert [v.hard for v in seq[:3]] == [True, True, False]
    assert not any(v.charge for v in seq)
    assert clip.hard_count("j") == 0  # the two early hard clips left its record


def test_rare_poisoner_is_charged_and_charged_again_counts_up():
    """A partner that poisons one round in 5 and looks honest in between (so it is never clipped
    hard twice in a row) is charged at its third hard clip within ``window`` rounds; a second
    offence after the charge counts as a second charge (the caller skips it twice as long)."""
    clip = PartnerClip(multiplier=2.0, window=16, strikes=3, min_history=0)
    ours, far, near = [torch.zeros(4)], [torch.full((4,), 10.0)], [torch.full((4,), 0.1)]
    verdicts = [clip.clip(ours, far if (i + 1) % 5 == 0 else near, own_move=0.5, peer="rare") for i in range(30)]
    charged = [i + 1 for i, v in enumerate(verdicts) if v.charge]
    assert charged == [15, 30]  # its 3rd and 6th poisoned rounds
    assert [verdicts[i - 1].charges for i in charged] == [1, 2]
    # a poisoner rarer than the window allows (1 in 8: 2 hard clips per 16 rounds) is clipped, never charged
    slow = PartnerClip(multiplier=2.0, window=16, strikes=3, min_history=0)
    vs = [slow.clip(ours, far if (i + 1) % 8 == 0 else near, own_move=0.5, peer="r8") for i in range(40)]
    assert sum(v.hard for v in vs) == 5 and not any(v.charge for v in vs)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="robust clip settings"):
        PartnerClip(multiplier=0)
