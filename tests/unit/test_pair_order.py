"""Who may propose a NoLoCo pair to whom (optimizers/exchange_common.py, ``proposes_to``): one
direction per pair, a total order per round, a new order every round."""

import itertools

from optimizers.exchange_common import proposes_to
from security.keys import generate_key, peer_id_str

PEERS = sorted(peer_id_str(generate_key()) for _ in range(6))


def test_exactly_one_of_two_peers_may_propose_and_the_order_is_total():
    for r in range(50):
        for a, b in itertools.permutations(PEERS, 2):
            assert proposes_to(a, b, r) != proposes_to(b, a, r)
        assert not any(proposes_to(a, a, r) for a in PEERS)
        for a, b, c in itertools.permutations(PEERS, 3):     # transitive: no cycle of lock waits
            if proposes_to(a, b, r) and proposes_to(b, c, r):
                assert proposes_to(a, c, r)


def test_the_order_is_new_every_round_and_no_peer_is_last_for_long():
    """With peer-ID order the highest ID was last every round (it never proposed, and the one
    before it could propose only to it: fixed pairs); here each peer is last about 1 round in 6."""
    last = [max(PEERS, key=lambda p: sum(proposes_to(q, p, r) for q in PEERS)) for r in range(600)]
    counts = {p: last.count(p) for p in PEERS}
    assert all(60 <= n <= 140 for n in counts.values()), counts
    a, b = PEERS[0], PEERS[-1]
    forward = sum(proposes_to(a, b, r) for r in range(1000))
    assert 430 <= forward <= 570, forward                     # ~ half the rounds each way
