"""Robust averaging: clip a partner's contribution to a radius that follows this run's honest partners.

Owns the rule of docs/noloco.md, 'Robust averaging', in pure torch: the whole-model distance
between two tensor lists, the clip of a partner's difference (ClippedGossip, He, Karimireddy,
Jaggi 2022), CenteredClip (Karimireddy et al. 2021) for a group, and :class:`PartnerClip`, the
small per-worker state that sets the radius and counts partners clipped hard. Does not own
moving tensors, charging a peer or metrics: the exchange (``optimizers/exchange_link.py``)
calls :meth:`PartnerClip.clip` where the partner's tensors arrive and acts on the verdict.

The rule, for our tensors ``x`` and a partner's ``y`` (whole model, one radius)::

    d   = ||y - x||
    tau = multiplier * max(median(last `window` recorded distances), own_move)
    f   = min(1, tau / d)                         # k * (tau / d)**2 beyond d = k * tau (redescend k)
    y'  = x + f * (y - x)                         # the partner's contribution, clipped
    mean = (x + y') / n                           # n = 2: the step moves by at most tau / 2

Past ``redescend`` (k = 2) radii the contribution shrinks again, to ``k * tau**2 / d``: a partner
that far is the evidence of a hard clip, and each such round moved its victim a whole
``tau / 2`` off the swarm with a plain clip; the victim's next honest partner then found it past
the radius and clipped it in turn (in the attacked runs of ``benchmarks/robust_gossip.py``,
about 10% of honest contributions, against 2% without an attacker). The bound is unchanged (no
partner moves us more than ``tau / 2``, the most at exactly ``k`` radii, which the adaptive
attacker can take anyway), an honest partner is never that far (no honest hard clip in a clean
run), and a straggler that far loses little: it is far behind, its contribution is stale.

Before the norm clip, the pull *backward* along our own move is bounded (when the caller passes
``origin``, our ``phi``): with ``u = theta - phi`` (length ``own_move``), the partner's difference
``delta = y - x`` has a backward component ``b = -(delta . u) / ||u||``; when ``b > backward *
own_move`` the excess is removed (``delta += (b - backward * own_move) u / ||u||``), so after the mean
we keep at least ``1 - backward / 2`` of this round's progress along ``u``. An honest partner's
inner steps go roughly our way (``b`` about ``(1 - c) * own_move`` for a correlation ``c`` of the two
moves, plus the replicas' spread); a partner that pushes against our progress (the first-order
loss-ascent direction, what an attacker that reads our ``theta`` first sends) is cut to what an
uncorrelated honest partner does, and the cut counts as a clip (its factor is the final
difference's length over the sent one's, so a partner sent far backward is clipped hard).

``own_move`` is ``||theta - phi||``, how far our own inner steps went this round: honest pairs
sit at about that scale (two replicas' inner moves plus the replicas' spread), it needs no
history (the warm-up rule of the first rounds) and a partner cannot shrink it, so an attacker
that feeds tiny distances cannot drive the radius to zero and get honest partners clipped.
The recorded distance is ``min(d, tau, record_cap * own_move)``: a partner far away raises
the history at most to twice our own move, so the radius stays within ``multiplier`` x
[1, ``record_cap``] own moves even when one partner fills the whole window (a partner that is
always waiting is every worker's first choice; with the cap at the radius alone, measured on
real processes, the radius grew 4x per window and the recipe attacker was never clipped hard). Both
terms shrink as the swarm converges (the LR decays, the replicas' spread contracts).

Memory (who gets charged): a partner's last ``window`` contributions with us are remembered
as clipped hard (factor < ``hard_factor``) or not; it is charged once ``strikes`` of them were
hard and our history is settled. That catches a partner far away round after round as well as
one that poisons only now and then (an unclipped round in between does not wipe its record).
An honest joiner starts from a downloaded state, one own-move from the swarm: it is not
clipped at all; a straggler or a joiner without a download is far for a round or two and is
then pulled in by each exchange (every mean halves its distance to its partner), so it stays
below ``strikes`` hard clips. Each further charge of the same partner doubles how long it is
skipped (``ClipVerdict.charges``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ClipVerdict", "PartnerClip", "bound_backward", "centered_clip", "clip_toward", "distance"]

_BLOCK = 1 << 20  # elements per float64 pass


@torch.no_grad()
def distance(ours: Sequence[Tensor], theirs: Sequence[Tensor]) -> float:
    """``||theirs - ours||`` over the whole list, accumulated in float64 (inf if not finite)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} tensors of ours vs {len(theirs)} of theirs")
    total = 0.0
    for a, b in zip(ours, theirs):
        fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
        for s in range(0, fa.numel(), _BLOCK):
            d = fb[s:s + _BLOCK].to(torch.float64) - fa[s:s + _BLOCK].to(torch.float64)
            total += float(torch.dot(d, d))
    return math.sqrt(total) if math.isfinite(total) else math.inf


@torch.no_grad()
def bound_backward(ours: Sequence[Tensor], theirs: Sequence[Tensor], origin: Sequence[Tensor],
                   backward: float) -> tuple[list[Tensor], float]:
    """``theirs`` with its pull against our own move bounded: (tensors, backward component before,
    in units of our move ``||ours - origin||``). ``origin`` (our phi) covers the first
    ``len(origin)`` tensors (a list that carries phi after theta is bounded on theta alone); the
    others pass as sent. Unchanged (the same tensors) when the component is within ``backward``
    or we did not move."""
    k = len(origin)
    if k > len(ours) or len(ours) != len(theirs):
        raise ValueError(f"{len(origin)} origin tensors for {len(ours)} of ours and {len(theirs)} of theirs")
    uu = ud = 0.0
    for a, b, o in zip(ours[:k], theirs[:k], origin):
        fa, fb, fo = a.detach().reshape(-1), b.detach().reshape(-1), o.detach().reshape(-1)
        for s in range(0, fa.numel(), _BLOCK):
            a64 = fa[s:s + _BLOCK].to(torch.float64)
            u = a64 - fo[s:s + _BLOCK].to(torch.float64)
            uu += float(torch.dot(u, u))
            ud += float(torch.dot(u, fb[s:s + _BLOCK].to(torch.float64) - a64))
    m = math.sqrt(uu)
    if not (m > 0 and math.isfinite(m) and math.isfinite(ud)):
        return list(theirs), 0.0
    pulled = -ud / m / m                         # backward component, in own moves
    if pulled <= backward:
        return list(theirs), pulled
    step = pulled - backward                     # add step * u: the backward component becomes `backward` moves
    out = [(b.detach().to(torch.float32) + step * (a.detach().to(torch.float32) - o.detach().to(torch.float32))
            ).to(b.dtype) for a, b, o in zip(ours[:k], theirs[:k], origin)]
    return out + list(theirs[k:]), pulled


def clip_factor(dist: float, radius: float, redescend: float | None = None) -> float:
    """min(1, radius / dist); 1.0 for a zero distance, 0.0 for an infinite one. With ``redescend``
    (``k``), a partner farther than ``k`` radii keeps a contribution of length ``k * radius**2 /
    dist`` instead of the radius: the factor is ``k * (radius / dist)**2`` (continuous at ``k``
    radii; a redescending influence, Hampel's rule, so the most any partner moves us stays the
    radius and one far beyond it moves us little)."""
    if not dist > radius:
        return 1.0
    if math.isinf(dist):
        return 0.0
    if redescend is not None and dist > redescend * radius:
        return redescend * (radius / dist) ** 2
    return radius / dist


@torch.no_grad()
def clip_toward(ours: Sequence[Tensor], theirs: Sequence[Tensor], factor: float) -> list[Tensor]:
    """``ours + factor * (theirs - ours)`` per tensor, in the partner tensors' dtype; with
    ``factor`` 1 the partner's own tensors come back untouched (the mean stays bitwise the
    plain mean both partners compute)."""
    if factor >= 1.0:
        return list(theirs)
    out = []
    for a, b in zip(ours, theirs):
        a32 = a.detach().to(torch.float32)
        out.append((a32 + factor * (b.detach().to(torch.float32) - a32)).to(b.dtype))
    return out


@torch.no_grad()
def centered_clip(parts: Sequence[Sequence[Tensor]], center: Sequence[Tensor], radius: float,
                  iters: int = 1) -> tuple[list[Tensor], list[float]]:
    """CenteredClip: ``v <- v + mean_j clip(x_j - v, radius)``, ``iters`` times from ``center``.
    Returns (v, the clip factors of the last iteration, one per part). Each part moves the
    result by at most ``radius / len(parts)`` per iteration, whatever it holds."""
    if not parts:
        raise ValueError("centered_clip needs at least one part")
    v = [c.detach().to(torch.float32).clone() for c in center]
    factors: list[float] = []
    for _ in range(max(1, iters)):
        factors = [clip_factor(distance(v, p), radius) for p in parts]
        acc = [torch.zeros_like(t) for t in v]
        for p, f in zip(parts, factors):
            if f > 0:
                for s, t, c in zip(acc, p, v):
                    s.add_(t.detach().to(torch.float32) - c, alpha=f)
        for c, s in zip(v, acc):
            c.add_(s, alpha=1.0 / len(parts))
    return v, factors


@dataclass(frozen=True)
class ClipVerdict:
    factor: float
    """The share of the sent difference used (1.0: the contribution as sent): the norm clip's
    factor (``clip_factor`` of ``cut_distance``) times ``cut_distance / distance``."""
    distance: float
    radius: float
    tensors: list[Tensor]
    """The contribution to average: the partner's own tensors when ``factor`` is 1."""
    hard: bool
    """factor < ``hard_factor``: counted as a hard clip."""
    charge: bool
    """The partner was clipped hard in ``strikes`` of its last ``window`` rounds with us, with a
    settled history: the caller should charge it (skip it as a partner)."""
    charges: int = 0
    """How many times this partner was charged for clipping, this one included (0: no charge)."""
    pulled_back: float = 0.0
    """The sent difference's component against our own move, in own moves (bounded to
    ``backward`` before the norm clip; 0 without an origin)."""
    cut_distance: float | None = None
    """The distance after the backward cut, when it cut (``pulled_back`` > ``backward``): the
    norm clip judged this one; None when nothing was cut (it judged ``distance``)."""


class PartnerClip:
    """One worker's clipping state: a window of recent partner distances and per-partner strikes.

    Deterministic and small (``window`` floats and a bounded strike table). It is not saved in
    checkpoints: after a restart the radius starts again from ``own_move`` alone, which is the
    same rule as a fresh worker's warm-up.
    """

    def __init__(self, multiplier: float = 4.0, window: int = 16, hard_factor: float = 0.5,
                 strikes: int = 3, min_history: int = 4, record_cap: float = 2.0, backward: float | None = 1.5,
                 redescend: float | None = 2.0):
        if (not multiplier > 0 or window < 1 or not 0 < hard_factor <= 1 or strikes < 1 or min_history < 0
                or (backward is not None and not backward >= 0) or (redescend is not None and not redescend >= 1)):
            raise ValueError(f"bad robust clip settings: multiplier={multiplier}, window={window}, "
                             f"hard_factor={hard_factor}, strikes={strikes}, min_history={min_history}, "
                             f"backward={backward}, redescend={redescend} (at least 1, or None)")
        self.multiplier, self.hard_factor = float(multiplier), float(hard_factor)
        self.backward = None if backward is None else float(backward)
        self.redescend = None if redescend is None else float(redescend)
        self.strikes, self.min_history = int(strikes), int(min_history)
        self.record_cap = float(record_cap)
        self.window = int(window)
        self.history: deque[float] = deque(maxlen=self.window)
        self.record: dict[str, deque[bool]] = {}  # partner -> its last `window` rounds with us: hard clip?
        self.charged: dict[str, int] = {}         # partner -> charges for clipping so far
        self.means: dict[str, deque[bool]] = {}   # DiLoCo root -> its last `window` means: refused?
        self.mean_strikes = 2

    def radius(self, own_move: float) -> float:
        """``multiplier * max(median(history), own_move)``."""
        med = statistics.median(self.history) if self.history else 0.0
        return self.multiplier * max(med, float(own_move))

    def clip(self, ours: Sequence[Tensor], theirs: Sequence[Tensor], own_move: float,
             peer: str | None = None, origin: Sequence[Tensor] | None = None) -> ClipVerdict:
        """Clip ``theirs`` toward ``ours`` and record the round (see the module doc); with
        ``origin`` (our phi, for the first tensors) the pull against our own move is bounded first."""
        d = distance(ours, theirs)
        tau = self.radius(own_move)
        pulled, cut = 0.0, False
        if origin is not None and self.backward is not None and math.isfinite(d):
            theirs, pulled = bound_backward(ours, theirs, origin, self.backward)
            cut = pulled > self.backward
        d_cut = distance(ours, theirs) if cut else d
        norm = clip_factor(d_cut, tau, self.redescend)
        # the share of the sent difference used: the norm clip times the backward cut (which
        # only shortens it: the parallel part shrinks, the rest is kept)
        factor = norm if not cut else (min(1.0, norm * d_cut / d) if d > 0 else 1.0)
        settled = len(self.history) >= self.min_history
        # a far partner raises the history at most to `record_cap` own moves: a partner we meet
        # every round (an attacker that always waits is everyone's first choice) cannot walk
        # the median, and with it the radius, up round after round
        cap = self.record_cap * float(own_move) if own_move > 0 else math.inf
        self.history.append(min(d, tau, cap))
        hard = factor < self.hard_factor
        charge, charges = False, 0
        if peer is not None:
            rec = self.record.get(peer)
            if rec is None:
                rec = self.record[peer] = deque(maxlen=self.window)
            rec.append(hard)
            if hard and settled and sum(rec) >= self.strikes:
                charge = True
                charges = self.charged[peer] = self.charged.get(peer, 0) + 1
                rec.clear()  # a fresh record once it is back
            if len(self.record) > 4096:  # bounded: forget the partners with the fewest hard clips
                for p, _ in sorted(self.record.items(), key=lambda kv: sum(kv[1]))[:1024]:
                    del self.record[p]
            if len(self.charged) > 4096:
                for p, _ in sorted(self.charged.items(), key=lambda kv: kv[1])[:1024]:
                    del self.charged[p]
        return ClipVerdict(factor, d, tau, clip_toward(ours, theirs, norm), hard, charge, charges, pulled,
                           d_cut if cut else None)

    def outside(self, ours: Sequence[Tensor], theirs: Sequence[Tensor], own_move: float,
                origin: Sequence[Tensor] | None = None) -> str | None:
        """Why ``theirs`` (a DiLoCo root's mean) falls outside the rule, or None: farther than the
        radius, or pulling us back along our own move by more than ``backward`` moves. Records
        nothing. An honest mean sits about one own move from each member (its own move against
        the group's average move) and pulls back at most about that far, well inside both."""
        d = distance(ours, theirs)
        tau = self.radius(own_move)
        if not tau > 0:  # no scale yet (no own move passed, no history): nothing to judge by
            return None if math.isfinite(d) else "the mean is not finite"
        if not d <= tau:
            return f"the mean is {d:.4g} from our tensors, past the radius {tau:.4g}"
        if origin is not None and self.backward is not None:
            _, pulled = bound_backward(ours, theirs, origin, self.backward)
            if pulled > self.backward:
                return f"the mean pulls us back {pulled:.3g} own moves along our own move (at most {self.backward:g})"
        return None

    def judge_mean(self, root: str, refused: bool) -> tuple[bool, int]:
        """Record a DiLoCo root's mean, refused or taken; -> (charge it now?, its charges so far).
        Charged at ``mean_strikes`` (2) refused means among its last ``window``: one refusal can
        be the member's own fault (its phi drifted: it took a poisoned mean the others refused, or
        missed a resync), the next mean, after the member re-fetched phi, is judged afresh."""
        rec = self.means.get(root)
        if rec is None:
            rec = self.means[root] = deque(maxlen=self.window)
        rec.append(refused)
        if not refused or sum(rec) < self.mean_strikes:
            return False, 0
        rec.clear()
        charges = self.charged[root] = self.charged.get(root, 0) + 1
        if len(self.means) > 4096:  # bounded: forget the roots with the fewest refusals
            for p, _ in sorted(self.means.items(), key=lambda kv: sum(kv[1]))[:1024]:
                del self.means[p]
        return True, charges

    def hard_count(self, peer: str) -> int:
        """Hard clips in ``peer``'s current record (its last ``window`` rounds with us)."""
        return sum(self.record.get(peer, ()))
