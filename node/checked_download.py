"""A joiner's state download, checked against other donors before it is adopted.

:func:`download_checked` downloads the state of up to ``compare`` READY peers at once
(``node.state_sync.fetch_state``: run, cfg hash, names, dtypes, shapes, digests, finiteness),
lets ``node.donor_choice.choose_donor`` pick the donor the majority agrees with (the medoid),
rejects the others by name (``swarmnode_state_donors_rejected_total{reason}``, a
``state_donor_rejected`` event; the caller skips them afterwards) and adopts the progress
(round, iteration) that at least ``quorum`` agreeing donors served
(``node.donor_choice.supported_label``), never one donor's claim alone. A donor that is the only
peer there is (the first joiner of a one-worker swarm) is adopted unchecked and said so in a
``state_donor_unchecked`` event. A donor that refused for a reason that passes
(``StateFetchError.transient``: it has not read the joiner's new card yet, it is busy) is asked
again after a short wait while the download budget lasts, before the choice: otherwise one slow
honest donor leaves an honest and a forged state, no majority, and the joiner starts from
scratch. When several donors were listed but only one download worked, that one is not adopted
(``state_donor_unconfirmed``): a forger that answers every caller at once while the honest
donors are slow would otherwise win by default; the caller reads the cards and tries again. Called
by ``TrainingRole.download_state`` (node/training.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import torch

from node import metrics as NM
from node.card import CardView, card_int
from node.donor_choice import Candidate, choose_donor, supported_label
from node.logs import emit
from node.state_sync import StateFetchError, meta_int

__all__ = ["Downloaded", "download_checked", "RETRY_S"]

RETRY_S = 1.0
"""Seconds before a donor that refused transiently is asked again (doubling per retry): about
twice the interval at which a donor re-reads the node cards for an unknown caller
(node/known_peers.py ``wait_known``), so the second call finds the joiner's card."""

Fetch = Callable[[CardView], Awaitable[tuple[dict[str, str], dict[str, torch.Tensor]]]]


@dataclass
class Downloaded:
    """The state to adopt: the chosen donor's metadata and tensors, and the progress to start at."""

    meta: dict[str, str]
    tensors: dict[str, torch.Tensor]
    donor: str
    """The chosen donor's peer ID."""
    progress: int
    """The progress (round, iteration) at least ``quorum`` agreeing donors served (<= the chosen
    donor's own when another agreeing donor is behind it)."""
    agreeing: list[str] = field(default_factory=list)
    rejected: dict[str, float] = field(default_factory=dict)
    """Donors not adopted -> their distance to the chosen state."""
    lone: bool = False


async def download_checked(donors: Sequence[CardView], fetch: Fetch, names: Sequence[str], *, log: logging.Logger,
                           progress_key: str, min_progress: int, ahead: int = 0, compare: int = 3,
                           tries: int = 3, max_distance: float = 0.5, quorum: int = 2,
                           offload: Callable[..., Awaitable[Any]] | None = None,
                           retry_s: float = RETRY_S) -> Downloaded | None:
    """Download from ``donors`` (best first) until ``compare`` succeeded or ``compare + tries - 1``
    first asks were made, then choose. ``fetch(view)`` downloads one donor's (meta, tensors);
    ``names`` are the tensors compared (the weights); a served progress outside ``[min_progress,
    card + ahead]`` is a failed download. When every donor was asked and fewer than ``compare``
    answered, the ones that refused transiently are asked again after ``retry_s`` (doubling each
    time), at most ``tries - 1`` times. None when nothing could be downloaded, no majority
    agreed, or one download worked of several donors (each case logged and counted)."""
    run = offload or asyncio.to_thread
    got: list[tuple[CardView, dict[str, str], dict[str, torch.Tensor], int]] = []
    queue, budget = list(donors), max(1, compare) + max(0, tries - 1)
    again: list[CardView] = []  # refused transiently: worth asking again
    retries = max(0, tries - 1)  # waves of asking the transient refusers again

    async def one(view: CardView):
        addr = view.card.grpc_addr
        try:
            meta, tensors = await fetch(view)
            served, claimed = meta_int(meta, progress_key, addr), card_int(view, progress_key) or 0
            if not min_progress <= served <= claimed + ahead:
                raise StateFetchError(f"{addr} served {progress_key} {served}, but its card says {claimed} "
                                      f"(and we need >= {min_progress}); not adopting it")
        except StateFetchError as exc:
            NM.STATE_DOWNLOADS.labels(outcome="failed").inc()
            emit(log, "state_download_failed", "state download failed: {error}", level=logging.WARNING,
                 error=str(exc), donor=view.peer_id, transient=exc.transient)
            if exc.transient:
                again.append(view)
            return None
        NM.STATE_DOWNLOADS.labels(outcome="ok").inc()
        return view, meta, tensors, served

    delay = retry_s
    while len(got) < compare:
        if queue and budget > 0:  # first asks
            wave = queue[:min(compare - len(got), budget)]
            queue, budget = queue[len(wave):], budget - len(wave)
        elif again and retries > 0:  # every donor was asked: the transient refusers again
            retries -= 1
            wave = again[:compare - len(got)]
            del again[:len(wave)]
            emit(log, "state_download_retry", "asking {donors} again in {delay_s:.1f} s: refused for a reason that "
                 "passes ({have} of {want} donors downloaded)", donors=[v.peer_id for v in wave],
                 delay_s=delay, have=len(got), want=compare)
            await asyncio.sleep(delay)
            delay *= 2
        else:
            break
        got += [r for r in await asyncio.gather(*(one(v) for v in wave)) if r is not None]
    if not got:
        return None
    if len(got) == 1 and len(donors) > 1 and compare > 1:  # donors_compared = 1: the check is off
        emit(log, "state_donor_unconfirmed", "only {donor}'s download worked of {n} donors: not adopting a state no "
             "other donor confirms (the others failed or refused; see state_download_failed)",
             level=logging.WARNING, donor=got[0][0].peer_id, n=len(donors),
             failed=[v.peer_id for v in donors if v.peer_id != got[0][0].peer_id])
        return None
    cands = [Candidate(v.peer_id, served, [t[n] for n in names]) for v, _, t, served in got]
    verdict = await run(choose_donor, cands, max_distance)
    for peer, dist in verdict.rejected.items():
        NM.STATE_DONORS_REJECTED.labels(reason=verdict.reason if verdict.chosen is None else "outlier").inc()
        emit(log, "state_donor_rejected", "donor {donor} not adopted: its state is {distance:.3g} x its norm away "
             "from {against}", level=logging.WARNING, donor=peer, distance=round(dist, 4),
             against="the other donors'" if verdict.chosen is None else "the majority's",
             reason="no_majority" if verdict.chosen is None else "outlier", donors=[c.peer_id for c in cands])
    if verdict.chosen is None:
        emit(log, "state_donors_disagree", "no two of the {n} donors agree on the state: adopting none (compare "
             "them by hand, or raise donor_max_distance if they are honest)", level=logging.ERROR, n=len(cands),
             donors=[c.peer_id for c in cands])
        return None
    chosen = next(g for g in got if g[0].peer_id == verdict.chosen.peer_id)
    label = supported_label([c.progress for c in verdict.agreeing], quorum=quorum)
    progress = min(chosen[3], label.label if label.label is not None else chosen[3])
    emit(log, "state_donor_chosen", "adopting {donor}'s state at {progress_key} {progress}: {n_agree} of {n} donors "
         "agree", donor=verdict.chosen.peer_id, progress_key=progress_key, progress=progress,
         n_agree=len(verdict.agreeing), n=len(cands), served=chosen[3],
         distances={p: round(d, 4) for p, d in verdict.distances.items()})
    if verdict.lone or label.lone:
        why = "it is the only peer to ask" if verdict.lone else "no second agreeing donor served its round"
        emit(log, "state_donor_unchecked", "adopting {donor}'s state without a second donor to compare it with "
             "({why}); {progress_key} {progress}", level=logging.WARNING, donor=verdict.chosen.peer_id, why=why,
             progress_key=progress_key, progress=progress, agreeing=len(verdict.agreeing))
    return Downloaded(chosen[1], chosen[2], verdict.chosen.peer_id, progress,
                      [c.peer_id for c in verdict.agreeing], dict(verdict.rejected), verdict.lone)
