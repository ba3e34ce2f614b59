"""Robust averaging (optimizers/robust.py): the clip's bound, crafted numbers, honest pairs untouched."""

import math

import pytest
import torch

from optimizers.robust import PartnerClip, bound_backward, centered_clip, clip_factor, clip_toward, distance


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
    clip = PartnerClip(multiplier=2.0, window=4, redescend=None)  # the plain clip (ClippedGossip)
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


def test_redescending_clip_crafted_numbers():
    """Past k = 2 radii the kept contribution is k * radius**2 / distance: the same partner as
    above (distance 5, radius 2) moves the mean 0.8, not 1.0; continuous at 2 radii; no
    change within them."""
    ours = [torch.tensor([0.0, 0.0]), torch.tensor([1.0])]
    theirs = [torch.tensor([3.0, 0.0]), torch.tensor([5.0])]
    clip = PartnerClip(multiplier=2.0, window=4)                 # redescend 2 by default
    clip.history.extend([0.5, 1.0, 2.0])
    v = clip.clip(ours, theirs, own_move=0.25, peer="p")
    assert v.factor == pytest.approx(2 * (2.0 / 5.0) ** 2) and v.hard  # 0.32: length 1.6
    assert torch.allclose(v.tensors[0], torch.tensor([0.96, 0.0])) and torch.allclose(v.tensors[1], torch.tensor([2.28]))
    assert distance(ours, _mean(ours, v.tensors)) == pytest.approx(0.8)
    assert clip_factor(4.0, 2.0, 2.0) == clip_factor(4.0, 2.0) == 0.5                  # continuous at k radii
    assert clip_factor(3.0, 2.0, 2.0) == clip_factor(3.0, 2.0) == pytest.approx(2 / 3)  # a plain clip inside
    assert clip_factor(1.5, 2.0, 2.0) == 1.0 and clip_factor(math.inf, 2.0, 2.0) == 0.0
    with pytest.raises(ValueError, match="redescend"):
        PartnerClip(redescend=0.5)


def test_a_far_partner_moves_its_victim_less_the_farther_it_is():
    """The influence (how far one exchange moves us) peaks at the radius / 2 at k radii and falls
    beyond, where a plain clip keeps it at radius / 2 however far the partner sits."""
    ours = [torch.zeros(16)]
    moved = {}
    for d in (1.0, 4.0, 8.0, 16.0, 64.0):
        theirs = [torch.full((16,), d / 4.0)]                       # distance d
        for k in (None, 2.0):
            v = PartnerClip(multiplier=2.0, redescend=k).clip(ours, theirs, own_move=1.0)  # radius 2
            moved[d, k] = distance(ours, _mean(ours, v.tensors))
    assert moved[1.0, 2.0] == pytest.approx(0.5) and moved[4.0, 2.0] == pytest.approx(1.0)
    for d in (8.0, 16.0, 64.0):
        assert moved[d, None] == pytest.approx(1.0)                 # plain: radius / 2
        assert moved[d, 2.0] == pytest.approx(4.0 / d)              # k * radius**2 / d / 2
    assert max(moved.values()) <= 1.0 + 1e-6


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
            va = clips[a].clip(thetas[a], thetas[b], moves[a], peer=str(b), origin=phis[a])
            vb = clips[b].clip(thetas[b], thetas[a], moves[b], peer=str(a), origin=phis[b])
            factors += [va.factor, vb.factor]
            mean = _mean(thetas[a], thetas[b])
            phis[a] = [m.clone() for m in mean]
            phis[b] = [m.clone() for m in mean]
    assert min(factors) == 1.0  # no honest contribution clipped (nor cut for pulling back)
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


def _dot(a, b):
    return sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))


def test_backward_bound_crafted_numbers():
    """Our move u = (2, 0, 0) from phi; a partner 3 moves back and 1 sideways is cut to 1 move
    back (the uncorrelated honest partner's pull), sideways kept; then the norm clip."""
    phi, ours = [torch.tensor([0.0, 0.0]), torch.tensor([0.0])], [torch.tensor([2.0, 0.0]), torch.tensor([0.0])]
    theirs = [torch.tensor([-4.0, 1.0]), torch.tensor([0.0])]          # delta = (-6, 1, 0)
    cut, pulled = bound_backward(ours, theirs, phi, 1.0)
    assert pulled == pytest.approx(3.0)
    assert torch.equal(cut[0], torch.tensor([0.0, 1.0])) and torch.equal(cut[1], torch.tensor([0.0]))
    same, p2 = bound_backward(ours, [torch.tensor([1.5, 3.0]), torch.tensor([9.0])], phi, 1.0)   # 0.25 back: kept
    assert p2 == pytest.approx(0.25) and torch.equal(same[0], torch.tensor([1.5, 3.0]))
    clip = PartnerClip(multiplier=4.0, min_history=0, backward=1.0)
    v = clip.clip(ours, theirs, own_move=2.0, peer="p", origin=phi)   # radius 8 > ||(-2, 1, 0)||: no norm clip
    assert v.pulled_back == pytest.approx(3.0) and v.radius == 8.0
    assert v.cut_distance == pytest.approx(math.sqrt(5)) and v.distance == pytest.approx(math.sqrt(37))
    assert torch.equal(v.tensors[0], torch.tensor([0.0, 1.0]))
    assert v.factor == pytest.approx(math.sqrt(5) / math.sqrt(37)) and v.hard   # 0.37 of the sent difference
    # without the origin (or backward=None) only the norm clip acts: 6.08 < 8, used as sent
    uncut = PartnerClip(multiplier=4.0).clip(ours, theirs, own_move=2.0)
    assert uncut.factor == 1.0 and uncut.cut_distance is None
    assert PartnerClip(multiplier=4.0, backward=None).clip(ours, theirs, 2.0, origin=phi).factor == 1.0
    # a list carrying phi after theta: only the first len(origin) tensors are bounded
    cut3, _ = bound_backward(ours + [torch.tensor([5.0])], theirs + [torch.tensor([-7.0])], phi, 1.0)
    assert torch.equal(cut3[2], torch.tensor([-7.0]))


@pytest.mark.parametrize("seed", range(8))
def test_backward_bound_holds_for_any_partner_tensor(seed):
    """Property: whatever the partner sends, after the clip the pair step keeps at least
    1 - backward / 2 of our own move along its direction, and the norm bound still holds."""
    g = torch.Generator().manual_seed(500 + seed)
    phi = _model(seed)
    ours = [p + 0.1 * torch.randn(p.shape, generator=g) for p in phi]
    u = [a - b for a, b in zip(ours, phi)]
    m = math.sqrt(_dot(u, u))
    beta = float(torch.rand(1, generator=g)) * 2
    clip = PartnerClip(multiplier=float(torch.rand(1, generator=g)) * 5 + 0.5, backward=beta, min_history=0)
    kinds = [[a - 3.8 * d for a, d in zip(ours, u)],                      # the adaptive attacker: against our move
             [a - 20 * d + torch.randn(d.shape, generator=g) for a, d in zip(ours, u)],
             _attack(ours, seed), [-t for t in ours],
             [torch.randn(t.shape, generator=g) * 1e3 for t in ours]]
    for theirs in kinds:
        v = clip.clip(ours, theirs, own_move=m, peer="x", origin=phi)
        step = [(b - a) / 2 for a, b in zip(ours, v.tensors)]            # the mean minus ours
        back = -_dot(step, u) / m
        assert back <= beta * m / 2 * (1 + 1e-4) + 1e-5, (back, beta * m / 2)
        assert math.sqrt(_dot(step, step)) <= v.radius / 2 * (1 + 1e-5) + 1e-6


def test_a_partner_pulling_against_our_move_is_clipped_hard_and_charged():
    """The benchmark's adaptive attacker sits inside the norm radius (0.95 x 4 own moves) but
    straight against our progress: the backward cut leaves 1 of its 3.8 moves, a hard clip,
    charged at the third; an honest partner whose moves go our way is untouched."""
    g = torch.Generator().manual_seed(3)
    phi = _model(1)
    clip = PartnerClip(multiplier=4.0, window=16, strikes=3, min_history=0, backward=1.0)
    verdicts = []
    for r in range(3):
        ours = [p + 0.05 * torch.randn(p.shape, generator=g) for p in phi]
        u = [a - b for a, b in zip(ours, phi)]
        move = math.sqrt(_dot(u, u))
        honest = [p + 0.7 * d + 0.03 * torch.randn(p.shape, generator=g) for p, d in zip(phi, u)]
        assert clip.clip(ours, honest, move, peer="h", origin=phi).factor == 1.0
        v = clip.clip(ours, [a - 3.8 * d for a, d in zip(ours, u)], move, peer="adaptive", origin=phi)
        assert v.distance < v.radius and v.pulled_back == pytest.approx(3.8, rel=1e-4)
        assert v.factor == pytest.approx(1 / 3.8, rel=1e-4) and v.hard
        verdicts.append(v.charge)
    assert verdicts == [False, False, True]


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
    with pytest.raises(ValueError, match="backward=-1"):
        PartnerClip(backward=-1)


@pytest.mark.parametrize("backward", [1.0, 0.5, None])
def test_the_benchmarks_adaptive_attacker_sits_just_inside_the_rule_in_force(backward):
    """The harness's ``adaptive`` partner (tests/integration/attacker.py) is never clipped: 0.95 of
    the radius away, ``0.95 x backward`` own moves back (all of it back when the cut is off)."""
    from tests.integration.attacker import inside, recipe
    g = torch.Generator().manual_seed(11)
    phi = _model(4)
    theta = [p + 0.05 * torch.randn(p.shape, generator=g) for p in phi]
    u = [t - p for t, p in zip(theta, phi)]
    m = math.sqrt(_dot(u, u))
    across = [r - t for r, t in zip(recipe(theta, g), theta)]
    y = inside(theta, u, across, multiplier=4.0, fraction=0.95, backward=math.inf if backward is None else backward)
    v = PartnerClip(4.0, backward=backward, min_history=0).clip(theta, y, m, origin=phi)
    assert v.factor == 1.0 and v.distance / v.radius == pytest.approx(0.95, rel=1e-5)
    back = -_dot([a - b for a, b in zip(y, theta)], u) / m / m
    assert back == pytest.approx(0.95 * (backward if backward is not None else 4.0), rel=1e-5)


def test_the_attackers_stream_hooks_take_the_links_arguments():
    """The harness's read-first hooks replace ``ExchangeLink.send`` / ``recv_tensors``; when the link
    grew a ``names`` argument they did not, every exchange of the attacker failed (partner_error)
    and the benchmark's attacked runs measured no attack at all."""
    import inspect

    from optimizers.exchange_link import ExchangeLink
    src = inspect.getsource(__import__("tests.integration.attacker", fromlist=["x"]).ByzantinePartner.read_first)
    for name in ("send", "recv_tensors"):
        params = [p for p in inspect.signature(getattr(ExchangeLink, name)).parameters if p != "self"]
        hook = "send_after" if name == "send" else "recv_tensors"
        line = next(ln for ln in src.splitlines() if f"async def {hook}(" in ln)
        assert all(p in line for p in params), (name, params, line.strip())


def test_a_diloco_members_check_of_the_roots_mean():
    """``PartnerClip.outside``: an honest group mean (phi plus the members' average move) is inside
    the rule for every member; the recipe of it (the ``root`` attacker), a mean past the radius and
    one that takes back more than ``backward`` of a member's own move are named; nothing is
    recorded; with no scale at all (no own move, no history) only a non-finite mean is refused."""
    g = torch.Generator().manual_seed(5)
    phi = _model(6)
    moves = [[0.02 * torch.randn(p.shape, generator=g) + 0.02 * p for p in phi] for _ in range(4)]  # correlated
    thetas = [[p + u for p, u in zip(phi, us)] for us in moves]
    mean = [sum(ts) / 4 for ts in zip(*thetas)]
    clip = PartnerClip(4.0, backward=1.5)
    for theta in thetas:
        m = distance(theta, phi)
        assert clip.outside(theta, mean, m, origin=phi) is None
    theta, m = thetas[0], distance(thetas[0], phi)
    assert "radius" in clip.outside(theta, _attack(mean), m, origin=phi)
    far = [t + 5 * m / math.sqrt(sum(x.numel() for x in theta)) for t in theta]  # 5 own moves away
    assert "radius" in clip.outside(theta, far, m, origin=phi)
    back = [t - 2.0 * (t - p) for t, p in zip(theta, phi)]  # 2 own moves straight back (inside the radius)
    assert "pulls us back 2" in clip.outside(theta, back, m, origin=phi)
    assert clip.outside(theta, back, m) is None  # no origin: the radius alone
    assert not clip.history and not clip.record
    assert PartnerClip(4.0).outside(theta, far, 0.0) is None
    assert "not finite" in PartnerClip(4.0).outside(theta, [t * math.inf for t in theta], 0.0)


def test_a_root_is_charged_at_its_second_refused_mean_among_its_last_window():
    """``PartnerClip.judge_mean``: one refused mean may be the member's own drift; a second within
    ``window`` means charges the root (and each further charge counts up); refusals far apart
    do not add up."""
    clip = PartnerClip(window=16)
    assert clip.judge_mean("r", True) == (False, 0)
    assert clip.judge_mean("r", False) == (False, 0)
    assert clip.judge_mean("r", True) == (True, 1)
    assert clip.judge_mean("r", True) == (False, 0) and clip.judge_mean("r", True) == (True, 2)
    slow = PartnerClip(window=4)
    verdicts = [slow.judge_mean("s", i % 5 == 0) for i in range(30)]  # one refusal in 5 means
    assert not any(c for c, _ in verdicts)
