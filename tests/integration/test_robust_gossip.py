"""Robust averaging (issue 32) on real processes: a joiner that downloads the state from its peers
is about one own-move from them: it pairs within a few rounds, is never charged and charges
nobody, and is clipped hard fewer times than a charge takes (the clip must not turn on honest
newcomers).

The attackers themselves are replayed elsewhere: the recipe attacker on a live swarm is clipped
and charged in tests/integration/test_attacks.py (in-bound poison); the loss under the recipe
and adaptive attackers against a clean run is what benchmarks/robust_gossip.py measures (three
swarms of several minutes each, too long for the suite; docs/noloco.md, 'Robust averaging', has its figures and
the target it does not yet meet).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from benchmarks.robust_gossip import COMMON
from node.localswarm import LocalSwarm
from tests.integration.hostile import metric, wait_for

pytestmark = [pytest.mark.slow]


def _digest(node) -> str:
    """A worker's event counts, round outcomes and last warnings (for a failure message)."""
    text = node.log_text()
    events = Counter(re.findall(r'"event": "([a-z_]+)"', text))
    warnings = [line[:300] for line in text.splitlines() if '"level": "warning"' in line][-6:]
    outcomes = {o: metric(node, "swarmnode_outer_rounds_total", outcome=o) for o in ("ok", "solo", "failed")}
    return f"--- {node.name} alive={node.alive()} rounds={outcomes} events={dict(events)}\n" + "\n".join(warnings)


@pytest.mark.timeout(600)
def test_joiner_with_downloaded_state_is_not_clipped(tmp_path):
    settings = [*COMMON, "noloco.inner_steps=10", "noloco.compute_delay_s=0.1"]
    with LocalSwarm(run_id="robust-joiner", workdir=tmp_path, common_set=settings) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=180)
        first = [swarm.start("noloco", name=f"w{i}") for i in range(2)]
        swarm.wait_ready(first, timeout=240)
        wait_for(lambda: all(metric(w, "swarmnode_outer_rounds_total", outcome="ok") >= 4 for w in first), 240,
                 "the first two workers to average 4 rounds")
        joiner = swarm.start("noloco", name="joiner")
        swarm.wait_ready([joiner], timeout=240)
        assert '"event": "resume"' in joiner.log_text() and '"source": "peer"' in joiner.log_text(), \
            "the joiner did not start from a downloaded state"
        try:
            wait_for(lambda: metric(joiner, "swarmnode_outer_rounds_total", outcome="ok") >= 4, 240,
                     "the joiner to average 4 rounds")
        except AssertionError as exc:     # once seen in CI only: say what the workers did meanwhile
            raise AssertionError(f"{exc}\n" + "\n".join(_digest(w) for w in [*first, joiner])) from None
        nodes = [*first, joiner]
        judged = {w.name: metric(w, "swarmnode_outer_partner_clip_factor_count") for w in nodes}
        below_one = {w.name: metric(w, "swarmnode_outer_partner_clip_factor_bucket", le="0.99") for w in nodes}
        hard = {w.name: metric(w, "swarmnode_outer_partners_clipped_total", severity="hard") for w in nodes}
        assert judged[joiner.name] >= 4 and sum(judged.values()) >= 12, judged
        # never charged. A joiner that pairs at once is not clipped; one that missed its first pairs
        # trained alone meanwhile (7 solo rounds once on a loaded CI box: distance 9.8 against a
        # radius of 3.5-3.9) and is clipped hard once or twice, on both sides, while each exchange
        # halves the distance: fewer than the 3 strikes that charge a partner (robust_strikes)
        assert max(hard.values()) < 3, (hard, below_one, judged)
        assert sum(below_one.values()) <= 0.25 * sum(judged.values()), (below_one, judged)
        for w in nodes:
            assert '"reason": "clipped"' not in w.log_text(), w.name
