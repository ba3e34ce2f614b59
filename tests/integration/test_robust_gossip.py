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

import json
import math
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


@pytest.mark.timeout(600)
def test_a_partner_sending_our_progress_reversed_is_cut_hard_and_charged(tmp_path):
    """The attacker of the norm clip alone (``adaptive`` with ``--backward inf``: it reads the
    victim's theta first and sends it 0.95 x the radius straight back against the victim's own
    move, which the radius alone let through every time: 1.8x the clean loss in the benchmark)
    pairs with the workers on real processes; the backward cut leaves 1.5 of its ~3.8 own moves,
    a hard clip, and a worker charges it. Also the harness's own check: its exchanges succeed
    (``ok``), they did not when its stream hooks fell out of step with the link."""
    from benchmarks.robust_gossip import run_swarm
    cfg = dict(W=2, H=10, steps=250, delay_s=0.1, attacker_backward=math.inf)
    r = run_swarm("noloco", "adaptive_on", cfg, 0, tmp_path, 300.0)
    tally = r["attacker"]
    assert tally.get("ok", 0) >= 3 and tally.get("poisoned", 0) >= 3, tally
    clips = [json.loads(line) for w in ("w0", "w1") for line in (tmp_path / f"{w}.log").read_text().splitlines()
             if '"event": "partner_clipped"' in line and json.loads(line).get("peer") == tally["peer_id"]]
    assert len(clips) >= 3, (len(clips), tally)
    # sent from the victim's theta minus 3.8 own moves, cut to 1.5: factor 1.5 / 3.8 = 0.39 when
    # the attacker's phi is the victim's (most exchanges); with a phi of another round part of
    # what it sends lies across the victim's move, or less of it along it, and is cut less
    # (factors 0.5-0.9 seen, once a CI run's contribution pulled back under 2 moves)
    seen = sorted((c["factor"], c["pulled_back"], c["distance"], c["radius"]) for c in clips)
    back = sorted(c["pulled_back"] for c in clips)
    assert seen[len(seen) // 2][0] < 0.5 and back[len(back) // 2] > 2.5, seen      # typically cut hard
    assert sum(c["hard"] for c in clips) >= 3, seen
    assert r["workers_that_charged_attacker"] >= 1, {w["name"]: w["attacker_charges"] for w in r["workers"]}
    for w in r["workers"]:
        assert math.isfinite(w["eval_loss_end"]) and w["rounds_ok"] >= 3, w


@pytest.mark.timeout(600)
def test_a_diloco_root_sending_poisoned_means_is_refused_and_the_group_forms_without_it(tmp_path):
    """DiLoCo: the ``root`` attacker (the lowest peer ID, so every round's root) contributes honestly
    and sends each member the recipe of the true mean, which passes the fixed bounds. Every honest
    worker refuses such a mean by the robust rule (``robust_mean``), charges the root, then groups
    with the others around the next lowest ID while the charge lasts (a second offence after it
    expires is charged twice as long); the honest workers keep averaging and their eval loss falls."""
    from benchmarks.robust_gossip import run_swarm
    cfg = dict(W=3, H=10, steps=250, delay_s=0.1)
    r = run_swarm("diloco", "root_on", cfg, 0, tmp_path, 300.0)
    tally = r["attacker"]
    assert tally.get("poisoned", 0) >= 1, tally
    honest = {w["name"] for w in r["workers"]}
    for w in r["workers"]:
        lines = [json.loads(ln) for ln in (tmp_path / f"{w['name']}.log").read_text().splitlines()
                 if ln.startswith("{")]
        fin = next(ln for ln in lines if ln.get("event") == "training_finished")
        charged = [ln for ln in lines if ln.get("event") == "partner_charged"]
        assert w["means_refused"] >= 1 and w["attacker_charges"] >= 1, w
        assert {c["reason"] for c in charged} == {"robust_mean"} and {c["peer"] for c in charged} == \
            {tally["peer_id"]}, charged                    # the root only, never an honest worker
        # once it has refused one of its means it never applies another: the charge keeps it out of
        # the root choice, and when the charge expires its next mean is refused again. (In the first
        # rounds the recipe of a mean can sit within 4 own moves: Adam's first steps move every
        # weight about as far as its initial scale; seen accepted up to round 3.)
        rounds = [ln for ln in lines if ln.get("event") == "averaging_round_done"]
        first = next(i for i, ln in enumerate(rounds) if ln.get("reason") == "robust_mean")
        assert not [ln["round"] for ln in rounds[first:] if ln.get("outcome") == "ok"
                    and tally["peer_id"] in (ln.get("partners") or [])], rounds[first:]
        assert first <= 8, [(ln["round"], ln["outcome"], ln.get("reason")) for ln in rounds[:first + 1]]
        assert w["rounds_ok"] >= 10, w                       # the honest workers grouped without it
        assert w["rollbacks"] == 0 and fin["eval_loss_end"] < fin["eval_loss_start"] - 0.5, (fin, w)
    assert len(honest) == 3
