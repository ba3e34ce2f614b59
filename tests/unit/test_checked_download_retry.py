"""A joiner's checked download (node/checked_download.py) retries a donor that refused it for a
reason that passes (issue 33 flake): with a forger among three donors, one honest donor that
refuses the first call (its view of the members has not caught up with the joiner's new card:
PERMISSION_DENIED, or it is busy: RESOURCE_EXHAUSTED) must not leave the joiner with one honest
and one forged state, no majority, and a start from scratch."""

from __future__ import annotations

import logging

from node.checked_download import download_checked
from node.state_sync import StateFetchError
from tests.unit.test_donor_choice import _scrambled, _state, _view


class Donors:
    """A fetch over fixed states; ``refuse[peer]`` = how many first calls that donor refuses and
    whether the refusal passes (``transient``)."""

    def __init__(self, states: dict, refuse: dict[str, tuple[int, bool]]):
        self.states, self.refuse, self.calls = states, dict(refuse), {}

    async def __call__(self, view):
        peer = view.peer_id
        self.calls[peer] = self.calls.get(peer, 0) + 1
        times, transient = self.refuse.get(peer, (0, False))
        if self.calls[peer] <= times:
            raise StateFetchError(f"state download from {view.card.grpc_addr} refused: PERMISSION_DENIED: not a "
                                  "live member", transient=transient)
        rnd, tensors = self.states[peer]
        return {"round": str(rnd)}, {"a": tensors[0], "b": tensors[1]}


async def _download(donors, fetch, **kw):
    return await download_checked(donors, fetch, ["a", "b"], log=logging.getLogger("swarmnode.test_donor"),
                                  progress_key="round", min_progress=1, retry_s=0.01, **kw)


def _swarm():
    donors = [_view("forger", 112), _view("h1", 100), _view("h2", 99)]
    states = {"forger": (112, _scrambled(1)), "h1": (100, _state(1, 0.02)), "h2": (99, _state(2, 0.02))}
    return donors, states


async def test_an_honest_donor_that_refused_once_is_asked_again_and_the_forger_still_loses(caplog):
    caplog.set_level("INFO", logger="swarmnode.test_donor")
    donors, states = _swarm()
    fetch = Donors(states, {"h1": (1, True)})
    got = await _download(donors, fetch)
    assert got is not None, "one transient refusal left the joiner with no majority: it starts from scratch"
    assert got.donor in {"h1", "h2"} and list(got.rejected) == ["forger"] and got.progress == 99
    assert fetch.calls == {"forger": 1, "h1": 2, "h2": 1}
    retried = [r for r in caplog.records if getattr(r, "event", None) == "state_download_retry"]
    assert retried and "h1" in retried[0].getMessage()


async def test_a_refusal_that_does_not_pass_is_not_retried():
    donors, states = _swarm()
    fetch = Donors(states, {"h1": (1, False)})  # e.g. another cfg_hash, a malformed stream
    assert await _download(donors, fetch) is None  # one honest, one forged: no majority, as before
    assert fetch.calls == {"forger": 1, "h1": 1, "h2": 1}


async def test_retries_stay_within_the_budget():
    donors, states = _swarm()
    fetch = Donors(states, {"h1": (99, True)})  # never lets us in
    assert await _download(donors, fetch, tries=3) is None
    assert fetch.calls["h1"] == 3 and sum(fetch.calls.values()) == 5  # compare + tries - 1 downloads in all
    fetch = Donors(states, {"h1": (99, True)})
    assert await _download(donors, fetch, tries=1) is None
    assert fetch.calls == {"forger": 1, "h1": 1, "h2": 1}  # tries=1: one wave, no retry


async def test_a_forger_that_answers_while_every_honest_donor_refuses_is_not_adopted(caplog):
    """CI, under load: both honest donors refused the joiner (its card not read yet) on the first
    call and on the one retry the budget allowed; the forger, which answers anyone, was the only
    download and was adopted unchecked. Now the refusers are asked again in waves, and a single
    download of several donors is never adopted."""
    caplog.set_level("INFO", logger="swarmnode.test_donor")
    donors, states = _swarm()
    fetch = Donors(states, {"h1": (99, True), "h2": (99, True)})
    assert await _download(donors, fetch) is None
    assert fetch.calls == {"forger": 1, "h1": 3, "h2": 3}  # both honest donors asked in each of 2 retry waves
    unconfirmed = [r for r in caplog.records if getattr(r, "event", None) == "state_donor_unconfirmed"]
    assert unconfirmed and "forger" in unconfirmed[0].getMessage()
    # the same refusals, passing on the second retry: the forger is outvoted
    fetch = Donors(states, {"h1": (2, True), "h2": (2, True)})
    got = await _download(donors, fetch)
    assert got is not None and got.donor in {"h1", "h2"} and list(got.rejected) == ["forger"]
