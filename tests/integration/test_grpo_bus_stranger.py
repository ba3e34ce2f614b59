"""A stranger publishing GRPO rollouts on the event bus of a token-mode swarm (issue 33, finding 1).

Real processes on 127.0.0.1, ``security.admission = "token"``, the event bus on: the bootstrap is
the coordinator (its key signs the tokens), two honest ``grpo`` peers hold tokens for ``grpo``.
The stranger is a full ``grpo`` daemon with its own key and no token (it runs in open mode, so it
starts): the same model, seed and task, so its rollouts pass every content check an honest
peer's pass. It reads the honest cards, dials their gossip addresses and publishes its signed
rollout shards and reachability notices on the bus every round, as the issue's probe did (there:
each honest peer checked 141 of its completions and trained on 120, and counted it as a
reporter of its reachability, ``reached_by`` 3/4).

Checked: no honest peer trains on a single completion of the stranger (its ID never appears in
a round's ``foreign_tokens``, nor in the defense's per-sender report, nor in a rollout refusal:
nothing of it reaches the inbox); each honest sidecar drops its messages as ``not_member`` and
bans it (``peer_banned``); it is not among the reporters of an honest node's reachability;
the honest peers still train on each other's rollouts, delivered over the bus.
"""

from __future__ import annotations

import json
import time

import pytest

from node.localswarm import LocalSwarm
from security.admission import encode_b64, issue_token
from security.keys import generate_key, peer_id_str, write_key_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RUN = "grpo-stranger"
ROUNDS = 10
ROUND_S = 3.0


def _events(node, name: str) -> list[dict]:
    return [json.loads(line) for line in node.log_text().splitlines()
            if line.startswith("{") and f'"event": "{name}"' in line]


def _metric(node, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in node.metrics().items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def test_a_stranger_on_the_bus_is_never_trained_on(tmp_path):
    coord = generate_key()
    coord_id = peer_id_str(coord)
    write_key_file(tmp_path / "bootstrap.key", coord)
    common = ["grpo.torch_threads=1", f"grpo.round_s={ROUND_S}", "grpo.max_operand=5", "grpo.prompts_per_round=8",
              "grpo.eval_every=0", "grpo.heldout_size=20", "grpo.max_completion_tokens=12", "grpo.model_seed=3",
              f"grpo.warmup_cache_dir={tmp_path / 'warm'}", "grpo.warmup_target_acc=0.1", "model.max_seq_len=40",
              "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "card.ttl_s=10", "card.refresh_s=2",
              "eventbus.enabled=true", "eventbus.port=0", "eventbus.probe_interval_s=2", "eventbus.probe_timeout_s=2",
              "limits.ban_threshold=6", "security.known_peers_refresh_s=2",
              "security.admission=token", f"security.coordinator_peer_id={coord_id}"]

    def token_for(name: str) -> str:
        key = generate_key()
        write_key_file(tmp_path / f"{name}.key", key)   # LocalSwarm starts the node with this key
        return encode_b64(issue_token(coord, run_id=RUN, peer_id=peer_id_str(key), expires_at=time.time() + 3600,
                                      roles=["grpo"]))

    with LocalSwarm(run_id=RUN, workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=90)
        stranger = swarm.start("grpo", name="stranger", extra_set=["security.admission=open",
                                                                   "grpo.exit_after_rounds=1000"])
        swarm.wait_ready([stranger], timeout=150)   # it computes the warm-up the honest peers then load
        honest = [swarm.start("grpo", name=f"honest-{i}", extra_set=[
            f"security.admission_token={token_for(f'honest-{i}')}", f"grpo.exit_after_rounds={ROUNDS}"])
            for i in range(2)]
        dropped = {h.name: 0.0 for h in honest}
        reporters: dict[str, list] = {h.name: [] for h in honest}
        deadline = time.monotonic() + 120 + ROUNDS * ROUND_S * 4
        while time.monotonic() < deadline and any(h.alive() for h in honest):
            for h in honest:
                if not h.alive():
                    continue
                dropped[h.name] = max(dropped[h.name], _metric(h, "swarmnode_eventbus_messages_dropped_total",
                                                               reason="not_member"))
                bus = ((h.readyz() or {}).get("details") or {}).get("eventbus") or {}
                if bus.get("reporters"):
                    reporters[h.name].append((bus.get("reached_by"), bus["reporters"]))
            time.sleep(1.0)
        codes = [h.proc.poll() for h in honest]
        stranger_alive = stranger.alive()
        swarm.stop(stranger)
    assert codes == [0, 0], [h.log_text()[-3000:] for h in honest]
    assert stranger_alive, stranger.log_text()[-3000:]
    # the stranger really played: it published rounds of rollouts on the bus the whole time
    assert len(_events(stranger, "grpo_round_done")) >= 3, stranger.log_text()[-3000:]

    sid = stranger.peer_id
    for h in honest:
        rounds = _events(h, "grpo_round_done")
        assert len(rounds) == ROUNDS, h.log_text()[-3000:]
        from_stranger = sum(int(r.get("foreign_tokens", {}).get(sid, 0)) for r in rounds)
        assert from_stranger == 0, (h.name, "trained on the stranger's completions", from_stranger)
        refused = [e for e in _events(h, "grpo_rollout_rejected") if e.get("sender") == sid]
        assert refused == [], refused[:3]     # nothing of it reached the inbox: dropped before any work
        senders = (_events(h, "training_finished") or [{}])[-1].get("senders") or {}
        assert sid not in senders, senders
        # honest peers still trade rollouts, over the bus
        other = next(o.peer_id for o in honest if o is not h)
        from_other = sum(int(r.get("foreign_tokens", {}).get(other, 0)) for r in rounds)
        assert from_other > 0, (h.name, rounds[-3:])
        assert all(r["bus"] for r in rounds), rounds
        # dropped as not_member, counted, and the stranger banned on repeat
        assert dropped[h.name] >= 1, (h.name, dropped)
        bans = [e for e in _events(h, "peer_banned") if e.get("key") == sid]
        assert bans, (h.name, "stranger never banned")
        # its reachability reports never count (it reached every honest node: before the fix it
        # was one of the reporters)
        assert reporters[h.name], (h.name, "no reachability reports seen")
        assert all(sid[-8:] not in ids for _, ids in reporters[h.name]), reporters[h.name]
