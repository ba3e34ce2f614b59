"""Which peers' state and round labels a node believes: pure rules, no I/O.

A joiner (or a recovering node) must not take a peer's word alone: one forged card at a
plausible round serving scrambled weights would otherwise poison every joiner, and one card
republished a few rounds ahead would ratchet every worker's round label (issue 33, finding 4).
The role downloads state from several READY peers and reads the node cards; these rules decide.

    choose_donor(candidates, max_distance) -> DonorVerdict
        the medoid of the candidates that agree with a majority (distances relative to the
        smaller norm, as the NoLoCo exchange bound); outliers are rejected by name; one lone
        candidate is accepted and flagged ``lone``; two that disagree give no majority.
    supported_label(others, own=None, max_jump=16, quorum=2) -> LabelSupport
        the highest round label at least ``quorum`` distinct peers have reached (one card can
        never raise it); a lone peer is followed only when it is the only peer there is.

:class:`DonorCheckSettings` holds the knobs; a role's section inherits it (``[noloco]``).
Transport, downloads and logging are the callers' (node/training.py ``download_state``,
optimizers/noloco_role.py). Residual risk: several cards of one actor (sybils) count as several
peers here; admission tokens are the defence there (docs/security.md, 'Admission tokens').
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DonorCheckSettings", "Candidate", "DonorVerdict", "LabelSupport", "choose_donor", "relative_distance",
           "supported_label"]


class DonorCheckSettings(BaseModel):
    """How many donors a joiner compares, how close they must be, and how many peers must
    support a round label (local checks, never part of a ``cfg_hash``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    donors_compared: int = Field(3, ge=1, le=8)
    """A joiner downloads the state of up to this many READY peers (at once) and adopts the one
    that agrees with the majority of them; the others' disagreement rejects a forged donor. Each
    one costs a full state download: lower it (not below 2, which still catches a forger but
    cannot outvote it) on slow links with a large model; 1 turns the check off."""

    donor_max_distance: float = Field(0.5, gt=0)
    """Two donors agree when ``||a - b|| <= k * min(||a||, ||b||)`` over the whole state. Honest
    replicas measured 0.0 apart in tests/integration/test_donor_attack.py (a pair's phi is equal
    after its exchange; replicas never averaged for 40 inner steps: about 0.25, see
    ``noloco.max_distance_ratio``); the honest weights scrambled measured 1.19-1.35. Raise it if
    ``swarmnode_state_donors_rejected_total`` rises in a swarm without attackers (replicas that
    trained apart for very long); lower it to be stricter."""

    round_label_quorum: int = Field(2, ge=1, le=8)
    """A round label is adopted (a joiner's start round, ``catch_up``) only when at least this
    many distinct READY peers have reached it, so a single card cannot ratchet the labels of the
    swarm. With fewer peers than this in the swarm the most advanced ones count (a lone peer is
    followed, and said so in the log). The price: a single worker far faster than all the others
    is followed only once a second one reaches its label. 1 follows the single most advanced card
    (the old behaviour: a lone fast worker is followed at once, and so is a forged card)."""


@dataclass(frozen=True)
class Candidate:
    """One downloaded state: who served it, at which progress, and its tensors (host, checked)."""

    peer_id: str
    progress: int
    tensors: Sequence[torch.Tensor]


@dataclass
class DonorVerdict:
    """What :func:`choose_donor` decided."""

    chosen: Candidate | None
    """The donor to adopt (None: no majority; start without a donor's state)."""
    agreeing: list[Candidate] = field(default_factory=list)
    """The candidates within the distance bound of the chosen one (the chosen one included)."""
    rejected: dict[str, float] = field(default_factory=dict)
    """peer ID -> its distance to the chosen one, for each candidate outside the bound."""
    distances: dict[str, float] = field(default_factory=dict)
    """peer ID -> its distance to the chosen one, for every other candidate."""
    lone: bool = False
    """Only one candidate: adopted unchecked (nobody to compare it with)."""
    reason: str = "majority"
    """``majority``, ``lone`` or ``no_majority``."""


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def relative_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """``||a - b|| / min(||a||, ||b||)`` over all tensors (inf when a side is zero, or shapes differ)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    scale = min(_norm(a), _norm(b))
    if scale <= 0.0:
        return 0.0 if _norm(a) == _norm(b) == 0.0 else math.inf
    return math.sqrt(sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))) / scale


def choose_donor(candidates: Sequence[Candidate], max_distance: float) -> DonorVerdict:
    """The donor to adopt among downloaded states.

    A candidate is supported when, counting itself, a strict majority of the candidates lie
    within ``max_distance`` (:func:`relative_distance`) of it. The chosen one is the supported
    candidate with the most agreeing others, then the smallest summed distance to them (the
    medoid: the median of several), then the highest progress, then the input order. Every
    candidate farther than the bound from the chosen one is rejected. One candidate: adopted,
    ``lone``. None supported (two that disagree, or three all apart): ``no_majority``."""
    n = len(candidates)
    if n == 0:
        return DonorVerdict(None, reason="no_majority")
    if n == 1:
        return DonorVerdict(candidates[0], [candidates[0]], lone=True, reason="lone")
    dist = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            dist[i][j] = dist[j][i] = relative_distance(candidates[i].tensors, candidates[j].tensors)
    best: tuple | None = None
    for i in range(n):
        near = [j for j in range(n) if j != i and dist[i][j] <= max_distance]
        if 2 * (len(near) + 1) <= n:
            continue
        key = (-len(near), sum(dist[i][j] for j in near), -candidates[i].progress, i)
        best = key if best is None or key < best else best
    if best is None:
        return DonorVerdict(None, reason="no_majority",
                            rejected={c.peer_id: min(d for k, d in enumerate(dist[i]) if k != i)
                                      for i, c in enumerate(candidates)})
    k = best[-1]
    agreeing = [c for j, c in enumerate(candidates) if j == k or dist[k][j] <= max_distance]
    distances = {c.peer_id: dist[k][j] for j, c in enumerate(candidates) if j != k}
    rejected = {peer: d for peer, d in distances.items() if d > max_distance}
    return DonorVerdict(candidates[k], agreeing, rejected, distances)


@dataclass(frozen=True)
class LabelSupport:
    """What :func:`supported_label` decided."""

    label: int | None
    """The highest label the peers support (None: no peer has one)."""
    support: int
    """How many distinct peers have reached it (``quorum``, or fewer when the swarm is smaller)."""
    lone: bool
    """True when it rests on fewer than ``quorum`` peers because no more exist."""
    ignored: int = 0
    """Peers whose label was above the result: unsupported (or out of range) claims."""


def supported_label(others: Sequence[int | None], own: int | None = None, max_jump: int | None = None,
                    quorum: int = 2) -> LabelSupport:
    """The round label the READY peers support: the highest value that at least ``quorum`` of
    ``others`` (one label per distinct peer; None: no label) have reached, i.e. their
    ``quorum``-th highest label. With fewer labelled peers than ``quorum`` the lowest of them
    (a lone peer: its label, ``lone``). ``max_jump`` first drops labels more than that far above
    the lower median of ``others`` and ``own`` (an absurd claim never counts, not even towards a
    quorum). ``own`` is never support: the caller keeps ``max(own, label)``. One forged card
    therefore never lifts the label above what an honest peer has reached."""
    values = [v for v in others if v is not None]
    if max_jump is not None and values:
        pool = sorted(values + ([own] if own is not None else []))
        anchor = pool[(len(pool) - 1) // 2]
        values = [v for v in values if v - anchor <= max_jump]
    if not values:
        return LabelSupport(None, 0, False, len([v for v in others if v is not None]))
    values.sort(reverse=True)
    k = min(quorum, len(values))
    label = values[k - 1]
    counted = len([v for v in others if v is not None])
    return LabelSupport(label, len([v for v in values if v >= label]), k < quorum,
                        ignored=counted - len([v for v in values if v <= label]))
