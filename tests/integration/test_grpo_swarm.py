"""Collaborative GRPO on real processes: a bootstrap and ``grpo`` peers of different sizes on
127.0.0.1 exchange signed rollout batches (DHT index + RolloutService.Fetch) for 20 rounds.

- The three heterogeneous learners raise their held-out accuracy (mean gain >= 0.03; none ends
  more than 0.05 below its start: a CI run under load once saw one peer at 0.171 -> 0.152 while a
  strict per-peer rise was asserted), and each trained on its peers' rollouts (peers seen,
  foreign rows used).
- A fourth peer is SIGKILLed (no drain: a vanished spot VM) mid-run: the others keep their round
  clock (no round after the kill takes longer than a round) and finish all their rounds.

The task is the built-in ``arith`` with operands 0-5 (36 problems): small enough that 20 rounds
at B = 16 revisit every problem. Learning rate 5e-4 with 4 steps per round (defaults 2e-4 and 2:
made for 60+ rounds) and 8 samples per held-out prompt keep the rise above the evaluation noise:
with the defaults the largest peer once ended at 0.113 from 0.158, with 5e-4 and 2 steps the
smallest at 0.165 from 0.171."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from node.localswarm import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROUNDS = 20
ROUND_S = 2.0
"""A round's own work takes up to ~1.7 s on two busy cores; the clock leaves room for it, so a round
past ROUND_S after the kill means the dead peer stalled someone, not that the work got slower."""
SIZES = ((32, 2, 4), (48, 2, 4), (64, 3, 4), (32, 1, 4))     # the last one is killed mid-run


def _events(node, name: str) -> list[dict]:
    out = []
    for line in node.log_text().splitlines():
        if line.startswith("{") and f'"event": "{name}"' in line:
            out.append(json.loads(line))
    return out


def _when(event: dict) -> float:
    return datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def test_three_heterogeneous_peers_learn_and_a_killed_peer_stalls_nobody(tmp_path):
    common = ["grpo.torch_threads=1", f"grpo.round_s={ROUND_S}", f"grpo.exit_after_rounds={ROUNDS}",
              "grpo.max_operand=5", "grpo.prompts_per_round=16", "grpo.lr=5e-4", "grpo.steps_per_round=4",
              "grpo.eval_every=0", "grpo.eval_samples=8",
              "grpo.heldout_size=60", "grpo.max_completion_tokens=12", f"grpo.warmup_cache_dir={tmp_path / 'warm'}",
              "model.max_seq_len=40", "card.ttl_s=10", "card.refresh_s=2",
              # the rollout defenses have their own test (test_grpo_poison): here the rule judge would
              # drop the weak peers' honest-but-unsound completions and slow what this test measures
              "grpo.defense.kind=off"]
    with LocalSwarm(run_id="grpo-it", workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        peers = [swarm.start("grpo", name=f"grpo-{i}",
                             extra_set=[f"model.d_model={d}", f"model.n_layers={n}", f"model.n_heads={h}",
                                        f"grpo.model_seed={i}"])
                 for i, (d, n, h) in enumerate(SIZES)]
        learners, victim = peers[:3], peers[3]
        swarm.wait_ready(peers, timeout=120)
        # kill the fourth peer once it has traded rollouts for a few rounds
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_events(victim, "grpo_round_done")) < 5:
            time.sleep(0.3)
        assert len(_events(victim, "grpo_round_done")) >= 5, victim.log_text()[-2000:]
        swarm.kill(victim)
        killed_at = time.time()
        deadline = time.monotonic() + ROUNDS * ROUND_S * 4 + 30
        while time.monotonic() < deadline and any(p.alive() for p in learners):
            time.sleep(0.5)
        codes = [p.proc.poll() for p in learners]
    assert codes == [0, 0, 0], [p.log_text()[-3000:] for p in learners]
    gains: list[float] = []
    for p in learners:
        done = _events(p, "training_finished")
        assert len(done) == 1, p.log_text()[-3000:]
        fin = done[0]
        rounds = _events(p, "grpo_round_done")
        assert fin["rounds"] == ROUNDS == len(rounds)
        # it learned from its peers: their batches arrived and entered its groups
        assert max(r["peers_seen"] for r in rounds) >= 2 and sum(r["n_foreign"] for r in rounds) > 0
        # 8 bytes per token on the wire: what is not 8 B/token is a per-batch header of constant size
        # (same groups and completion counts every round) while the token counts vary
        assert len({r["sent_bytes"] - 8 * r["sent_tokens"] for r in rounds}) == 1
        assert len({r["sent_tokens"] for r in rounds}) > 1
        # held-out accuracy: no peer ends clearly worse (0.05 = ~2.5 standard errors of the difference
        # at 60 prompts x 8 samples); that the swarm learns is asserted on the mean gain below
        assert fin["accuracy_end"] > fin["accuracy_start"] - 0.05, (p.name, fin)
        gains.append(fin["accuracy_end"] - fin["accuracy_start"])
        # the kill stalled nothing: rounds after it kept the clock and saw at most the 2 others
        after = [r for r in rounds if _when(r) > killed_at + 2 * ROUND_S]
        assert after, "no rounds after the kill"
        # a round over the clock now and then is a load spike on this shared machine (2.07 s in CI,
        # 3.16 s beside a pipeline test run); a peer stalled by the dead one would wait on it in
        # every round after the kill: the typical round keeps the clock, none takes two
        durs = sorted(r["duration_s"] for r in after)
        assert durs[len(durs) // 2] < ROUND_S and durs[-1] < 2 * ROUND_S, [r["duration_s"] for r in after]
        assert all(r["peers_seen"] <= 2 for r in after)
    # the swarm learned: mean held-out gain (measured +0.08 to +0.12 over the three; with no training
    # it is 0 give or take ~0.015)
    assert sum(gains) / len(gains) >= 0.03, gains


def test_rollouts_travel_on_the_event_bus_when_it_is_on(tmp_path):
    """With ``eventbus.enabled`` the batches arrive as signed shards on the ``rollouts`` topic:
    peers train on each other's rollouts without a single gRPC Fetch."""
    common = ["grpo.torch_threads=1", "grpo.round_s=2", "grpo.exit_after_rounds=4", "grpo.max_operand=5",
              "grpo.eval_every=0", "grpo.heldout_size=20", "grpo.max_completion_tokens=12",
              f"grpo.warmup_cache_dir={tmp_path / 'warm'}", "grpo.warmup_target_acc=0.1", "model.max_seq_len=40",
              "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "card.ttl_s=10", "card.refresh_s=2",
              "eventbus.enabled=true", "eventbus.port=0"]
    with LocalSwarm(run_id="grpo-bus", workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        peers = [swarm.start("grpo", name=f"grpo-{i}", extra_set=[f"grpo.model_seed={i}"]) for i in range(2)]
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and any(p.alive() for p in peers):
            time.sleep(0.5)
        codes = [p.proc.poll() for p in peers]
    assert codes == [0, 0], [p.log_text()[-3000:] for p in peers]
    for p in peers:
        rounds = _events(p, "grpo_round_done")
        assert len(rounds) == 4
        assert all(r["bus"] for r in rounds)
        via_bus = [r for r in rounds if r["n_foreign"] > 0 and r["fetched"] == 0]
        assert len(via_bus) >= 3, rounds
        assert sum(r["fetched"] for r in rounds) <= 1      # the index + Fetch is only the fallback
