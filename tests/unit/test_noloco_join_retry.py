"""A joiner that finds trained peers but adopts no state tries again with fresh cards before it
trains from the run's seed (optimizers/noloco_join.py ``join_from_peers``, called by
optimizers/noloco_role.py ``_join``).

Seen in CI (tests/integration/test_donor_attack.py, token mode, loaded): of three donors one was
gone, one honest donor's card lagged its state by 5 rounds (not adopted), so the forged and the
other honest state were a tie; the joiner adopted nothing and trained from the seed. The control
flow is tested here with its I/O replaced (the download and the card read); the downloads
themselves are tested on real processes."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from node.card import CardView, NodeCard
from optimizers import noloco_join as J
from optimizers import noloco_role as R


def _view(rnd: int) -> CardView:
    card = NodeCard(role="noloco", state="ready", version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                    published_at=0.0, details={"round": rnd})
    return CardView("12D3KooWpeer", card, 0.0)


def _role(monkeypatch, answers: list, peer_rounds: list[int], ttl_s: float = 0.0):
    """A NoLoCoRole whose download answers ``answers`` in turn and whose card read shows READY
    peers at ``peer_rounds``."""
    role = R.NoLoCoRole.__new__(R.NoLoCoRole)
    adopted, calls = [], []

    async def ready(*_a, **_k):
        return None

    async def joined(_timeout):
        return True

    async def fetch(min_round):
        calls.append(min_round)
        return answers.pop(0) if answers else None

    async def views(timeout=None):
        return [_view(r) for r in peer_rounds]

    async def run(fn, *args):
        return fn(*args)

    role.ctx = SimpleNamespace(set_role_ready=ready, membership=SimpleNamespace(wait_joined=joined), peer_id="me",
                               config=SimpleNamespace(card=SimpleNamespace(ttl_s=ttl_s)))
    role.compute = SimpleNamespace(run=run)
    role.engine = SimpleNamespace(adopt=lambda rnd, phi: adopted.append((rnd, phi)))
    monkeypatch.setattr(role, "_fetch_from_donor", fetch, raising=False)
    monkeypatch.setattr(role, "_read_views", views, raising=False)
    monkeypatch.setattr(role, "_ready_peers", lambda vs: vs, raising=False)
    monkeypatch.setattr(J, "JOIN_RETRY_S", 0.01)
    return role, adopted, calls


def test_a_tie_is_retried_with_fresh_cards_and_the_second_attempt_is_adopted(monkeypatch):
    role, adopted, calls = _role(monkeypatch, [None, (12, ["phi"], "12D3KooWhonest")], [12, 13])
    asyncio.run(role._join())
    assert calls == [1, 1] and adopted == [(12, ["phi"])]


def test_no_trained_peer_means_the_first_worker_starts_from_the_seed_at_once(monkeypatch):
    role, adopted, calls = _role(monkeypatch, [], [0, 0])
    asyncio.run(role._join())
    assert calls == [1] and adopted == []


def test_after_every_attempt_failed_it_trains_from_the_seed_and_says_so(monkeypatch, caplog):
    role, adopted, calls = _role(monkeypatch, [], [12])
    asyncio.run(role._join())
    assert len(calls) == J.JOIN_TRIES and adopted == []
    assert [r for r in caplog.records if getattr(r, "event", None) == "join_from_seed"] or \
        "join_from_seed" in caplog.text


def test_it_keeps_trying_until_a_crashed_donors_card_could_have_expired(monkeypatch):
    """One download of two donors is never adopted (node/checked_download.py): when the other
    donor crashed, its card lives on for ``card.ttl_s``; the joiner tries that long, so the
    live donor becomes the only peer and is adopted, instead of training from the seed."""
    role, adopted, calls = _role(monkeypatch, [], [12], ttl_s=0.3)
    t0 = time.monotonic()
    asyncio.run(role._join())
    assert time.monotonic() - t0 >= 0.3 and len(calls) > J.JOIN_TRIES and adopted == []
    role, adopted, calls = _role(monkeypatch, [None] * 5 + [(12, ["phi"], "12D3KooWhonest")], [12], ttl_s=30.0)
    monkeypatch.setattr(J, "JOIN_RETRY_S", 0.001)
    asyncio.run(role._join())
    assert len(calls) == 6 and adopted == [(12, ["phi"])]
