"""Poisoned rollouts on real processes: three honest ``grpo`` peers and one attacker
(``[grpo.adversary] mode = "inject"``: correct answers with a marker appended) on 127.0.0.1, a
homogeneous swarm (same model and initial weights: the logit / support check), defenses at their
defaults. Signed batches travel through the DHT index + gRPC Fetch. Run in both ``grpo.topology``
settings: ``horizontal`` (the attacker's completions join the honest peers' groups) and
``vertical`` (it publishes whole groups for prompts of its own, which the honest peers rebuild
from its peer ID and check as groups of their own).

- Every honest peer bans the attacker on its rejection rate (``grpo_sender_banned``, the
  ``swarmnode_grpo_sender_bans_total`` metric, the card's ``grpo_banned_ids``, which
  ``swarmnode status`` turns into ``banned_by`` on the attacker's row) and never an honest peer.
- No honest peer's held-out completions carry the marker, rejections are by the logit check.
- Honest training goes on: every honest peer trains all its rounds with foreign rows, and the
  honest peers' held-out accuracy rises (their mean, over 3 x 320 completions, by at least
  ACCURACY_GAIN after 48 rounds at the benchmark's lr, 1e-3; vertical: falls by at most
  VERTICAL_MAX_DROP).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from node.localswarm import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROUNDS = 48
ROUND_S = 1.5
ACCURACY_GAIN = 0.03
"""The mean held-out accuracy gain the honest peers must show after ROUNDS rounds. The evaluation
noise on the mean of 3 x 320 sampled completions is about 0.015, so an untrained swarm passes
with ~2% chance. At 32 rounds learning itself was too slow to tell apart from that reliably: gains
0.001-0.17 in ten runs, two under 0.03 (one a CI failure, 0.021; the peers' training rewards
rose in those runs too, just little). At 48 rounds five runs measured 0.075-0.284 (mean 0.17).
Asserted for the horizontal topology only: see VERTICAL_MAX_DROP."""
VERTICAL_MAX_DROP = 0.03
"""Vertical topology: the honest peers' mean held-out accuracy may not fall by more than this.
Vertical learns more slowly at G = 2 (a group of two has an advantage only when exactly one answer
is right; benchmarks/grpo_swarm.py: 1.32x over solo against 1.62x horizontal), and in 32 rounds at
this lr its rise is not reliably above the evaluation noise: two runs measured 0.219 -> 0.209
(peers 0.156, 0.253, 0.219) and 0.219 -> 0.280 (both at 32 rounds). What this case checks is that the defenses hold (ban, no marker, the logit check)
while the peers still trade and train every round; a poisoned swarm's accuracy would fall."""


def _events(node, name: str) -> list[dict]:
    return [json.loads(line) for line in node.log_text().splitlines()
            if line.startswith("{") and f'"event": "{name}"' in line]


def _status(swarm: LocalSwarm) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "node.cli", "status", "--initial-peers", swarm.bootstrap_maddr,
                          "--run-id", swarm.run_id, "--json"], capture_output=True, text=True, timeout=40)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("topology", ["horizontal", "vertical"])
def test_attacker_is_banned_and_honest_peers_keep_learning(tmp_path, topology):
    common = [f"grpo.topology={topology}", "grpo.torch_threads=1", f"grpo.round_s={ROUND_S}", "grpo.max_operand=5",
              "grpo.prompts_per_round=16",
              "grpo.lr=1e-3", "grpo.steps_per_round=4", "grpo.eval_every=0", "grpo.eval_samples=8",
              "grpo.heldout_size=40", "grpo.max_completion_tokens=16", "grpo.top_p=0.95", "grpo.model_seed=3",
              f"grpo.warmup_cache_dir={tmp_path / 'warm'}", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
              "model.max_seq_len=40", "card.ttl_s=10", "card.refresh_s=1"]
    t0 = time.monotonic()
    with LocalSwarm(run_id=f"grpo-poison-{topology}", workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        honest = [swarm.start("grpo", name=f"honest-{i}", extra_set=[f"grpo.exit_after_rounds={ROUNDS}"])
                  for i in range(3)]
        attacker = swarm.start("grpo", name="attacker",
                               extra_set=[f"grpo.exit_after_rounds={ROUNDS + 6}", "grpo.adversary.mode=inject"])
        swarm.wait_ready([boot], timeout=60)
        # every honest peer bans the attacker
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_events(p, "grpo_ban_announced") for p in honest):
            time.sleep(0.3)
        bans = {p.name: _events(p, "grpo_ban_announced") for p in honest}
        assert all(bans.values()), {p.name: p.log_text()[-3000:] for p in honest}
        rows = {r["peer_id"]: r for r in _status(swarm)}
        # then they finish their rounds (own deadline: a ban may come late in the first one's budget)
        deadline = time.monotonic() + ROUNDS * ROUND_S * 2 + 30
        while time.monotonic() < deadline and any(p.alive() for p in honest):
            time.sleep(0.3)
        codes = [p.proc.poll() for p in honest]
        swarm.kill(attacker)
    assert codes == [0, 0, 0], [p.log_text()[-3000:] for p in honest]
    for p in honest:
        assert [b["sender"] for b in bans[p.name]] == [attacker.peer_id]
        banned = _events(p, "grpo_sender_banned")
        # banned within a few rounds of the first both could trade in (32 checked completions): the
        # attacker may come up rounds after this peer on a loaded machine, so count from the later start
        both_up = max(_events(p, "grpo_round_done")[0]["round"], _events(attacker, "grpo_adversary_round")[0]["round"])
        assert [b["sender"] for b in banned] == [attacker.peer_id] and banned[0]["round"] <= both_up + 5, \
            (banned[0]["round"], both_up)
        fin = _events(p, "training_finished")[0]
        assert fin["marker_rates"][" !!"] == 0.0, fin
        senders = fin["senders"]
        assert senders[attacker.peer_id]["banned"] and senders[attacker.peer_id]["rate"] > 0.5
        for pid, rep in senders.items():
            if pid != attacker.peer_id:
                assert not rep["banned"] and rep["rate"] <= 0.1, (pid, rep)
        rounds = _events(p, "grpo_round_done")
        assert sum(r["rejected_by"].get("logit_check", 0) for r in rounds) >= 32
        assert sum(r["n_foreign"] for r in rounds) > 0
        # every honest peer trained all its rounds on its own and its peers' rows (the attacker's dropped)
        assert len(rounds) == ROUNDS, [r["round"] for r in rounds]
    # the honest peers learn although the attacker floods them
    fins = [_events(p, "training_finished")[0] for p in honest]
    start = sum(f["accuracy_start"] for f in fins) / 3
    end = sum(f["accuracy_end"] for f in fins) / 3
    print(f"honest held-out accuracy {start:.3f} -> {end:.3f} "
          f"({[(round(f['accuracy_start'], 3), round(f['accuracy_end'], 3)) for f in fins]})")
    if topology == "horizontal":
        assert end - start >= ACCURACY_GAIN, [(f["accuracy_start"], f["accuracy_end"]) for f in fins]
    else:
        assert end - start >= -VERTICAL_MAX_DROP, [(f["accuracy_start"], f["accuracy_end"]) for f in fins]
    # swarmnode status: the honest peers' cards list the attacker as banned
    assert rows[attacker.peer_id].get("banned_by", 0) >= 1, rows
    assert rows[attacker.peer_id].get("adversary") is True
    assert all(rows[p.peer_id].get("grpo_banned") == 1 for p in honest if p.peer_id in rows and
               rows[p.peer_id].get("grpo_banned") is not None)
    print(f"poison test took {time.monotonic() - t0:.1f} s")
