"""A starting NoLoCo worker's join: adopt a trained peer's state, retrying, before training from the seed.

``join_from_peers`` is the control flow of ``NoLoCoRole._join`` (optimizers/noloco_role.py): the
download and its checks (node/checked_download.py), the card reads and the adoption are the
role's, passed in. While trained peers (round >= 1) are READY and no state was adopted (two
donors that disagree, or one download of several: see ``state_donor_unconfirmed``), it reads the
cards and downloads again, for at least ``JOIN_TRIES`` attempts and ``budget_s`` (the role passes
``card.ttl_s``: a crashed donor's card has expired by then and the live donor left is the only
peer); only then does the worker train from the run's seed (``join_from_seed``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from node.logs import emit

log = logging.getLogger("swarmnode.noloco")

JOIN_TRIES = 3
"""Attempts at adopting a peer's state when trained peers exist (fresh cards each time), at
least; a joiner goes on trying until ``budget_s`` has passed since its first attempt."""
JOIN_RETRY_S = 2.0
"""Seconds before the second attempt (times the attempt number after that, at most 4x)."""


async def join_from_peers(fetch: Callable[[], Awaitable[tuple[int, Any, str] | None]],
                          trained: Callable[[], Awaitable[int]],
                          adopt: Callable[[int, Any], Awaitable[None]], budget_s: float) -> None:
    """``fetch()``: (round, phi, donor) of a checked download, or None; ``trained()``: how many
    READY peers have trained (round >= 1); ``adopt(round, phi)``. Returns once a state is adopted,
    at once when nobody has trained (the run's first worker starts from the seed), or after the
    attempts above (``join_from_seed``, error)."""
    t0, attempt = time.monotonic(), 0
    while True:
        attempt += 1
        got = await fetch()
        if got is not None:
            rnd, phi, donor = got
            await adopt(rnd, phi)
            emit(log, "resume", "joined at round {round} with state from {donor}", source="peer", round=rnd,
                 donor=donor)
            return
        n = await trained()
        if not n:
            return                        # the first worker of the run: it starts from the seed
        if attempt >= JOIN_TRIES and time.monotonic() - t0 >= budget_s:
            break
        # two donors that disagree (one forged, one honest whose card lagged its state), one
        # download of several (the others busy, or a crashed donor's card not expired yet):
        # fresh cards and downloads, instead of training from the seed
        delay = JOIN_RETRY_S * min(attempt, 4)
        emit(log, "join_retry", "no state adopted from the {n} trained peer(s) (attempt {attempt}; trying for "
             "{budget_s:.0f} s and {tries} attempts at least): reading the cards and downloading again in "
             "{delay_s:.0f} s", level=logging.WARNING, n=n, attempt=attempt, tries=JOIN_TRIES,
             budget_s=budget_s, delay_s=delay)
        await asyncio.sleep(delay)
    emit(log, "join_from_seed", "no state adopted from the trained peers after {tries} attempts in {elapsed_s:.0f} "
         "s: training from the run's seed (its first outer rounds pull it toward its partners; check the "
         "state_donor_* events)", level=logging.ERROR, tries=attempt, elapsed_s=time.monotonic() - t0)


__all__ = ["JOIN_RETRY_S", "JOIN_TRIES", "join_from_peers"]
