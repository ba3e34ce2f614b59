"""A malicious stage replica is caught and quarantined on a real swarm (issue 12; docs/pipeline.md, 'Quarantine and audits').

A bootstrap (schedule coordinator) and 3 stages x 2 replicas as processes on 127.0.0.1 (stage 0 =
the two data nodes, stages 1 and 2 = transformer blocks). One replica of the middle stage (1) runs
the test-only harness `stage.attack_weight_edit`: after every optimizer step it edits its own
weights outside the gradient path. Asserted: its published weight commit disagrees with its
replica's, the coordinator's audit replays each replica's last AdamW step from its served states
and attributes the deviation to the attacker alone (`replica_audit`), counts
`swarmnode_security_flags_total{check="replica_commit"}`, quarantines it
(`swarmnode_pipeline_quarantined_replicas` 1, `replica_quarantined`) and re-plans without it;
a hot spare started with the swarm (`stage.checkfree.standby`) then refills the slot: it copies
the honest replica (never the quarantined one, still live) and steps in lockstep with it; the stage reaches the end, every honest node exits 0, and the final
validation loss is finite and within `LOSS_BOUND` of an all-honest run of the same seeds measured
in the same test.
"""

from __future__ import annotations

import json
import math
import time

from pathlib import Path

import pytest

from node.localswarm import LocalSwarm, NodeProc
from security.admission import encode_b64, issue_token
from security.keys import generate_key, peer_id_str, write_key_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ITERATIONS = 100
LAYOUT = [0, 0, 1, 1, 2, 2]
ATTACKER = 3                  # index into LAYOUT: the second replica of the middle stage
EDIT = 0.5                    # per-element edit, in units of the LR: in-bound for AdamW, far above replay noise
LOSS_BOUND = 0.02             # the issue's bound: within 2% of an all-honest run
DEADLINE_S = 100
REFILL_S = 2.0                # a hot spare refills a stage that stayed a replica short this long


def events(node: NodeProc, event: str) -> list[dict]:
    text = node.log_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if f'"event": "{event}"' in line]


def settings(stages: int = 3, iterations: int = ITERATIONS) -> list[str]:
    return [f"schedule.stages={stages}", "schedule.skip_ratio=0", "schedule.mb_per_origin=2", "schedule.memory=4",
            "schedule.max_swaps=0", "schedule.settle_s=1.0", "schedule.time_budget_s=1.0",
            "model.d_model=32", f"model.n_layers={stages - 1}", "model.n_heads=2", "model.max_seq_len=32",
            "data.seq_len=32", "data.batch_size=4", "data.max_train_bytes=200000", "data.max_val_bytes=20000",
            "stage.torch_threads=1", "stage.eval_every=0", "stage.optim.lr=0.003", "stage.optim.warmup=0",
            f"stage.iterations={iterations}", "stage.iteration_timeout_s=40", "card.refresh_s=1", "drain.budget_s=10"]


class Tokens:
    """Token mode (`security.admission = "token"`): the bootstrap holds the coordinator key (it
    signs the tokens and needs none itself); every stage node gets a key and a `stage` token."""

    def __init__(self, workdir: Path, run_id: str):
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.run_id, self.coord = workdir, run_id, generate_key()
        write_key_file(workdir / "bootstrap.key", self.coord)   # LocalSwarm starts a node with <name>.key
        self.common = ["security.admission=token", f"security.coordinator_peer_id={peer_id_str(self.coord)}"]

    def for_node(self, name: str) -> list[str]:
        key = generate_key()
        write_key_file(self.workdir / f"{name}.key", key)
        token = issue_token(self.coord, run_id=self.run_id, peer_id=peer_id_str(key), expires_at=time.time() + 3600,
                            roles=["stage"])
        return [f"security.admission_token={encode_b64(token)}"]


def run(tmp_path, attack: bool, token: bool = False) -> dict:
    t0 = time.monotonic()
    workdir = tmp_path / (("token-" if token else "") + ("attack" if attack else "honest"))
    tokens = Tokens(workdir, "q") if token else None
    admit = tokens.for_node if tokens else (lambda name: [])
    with LocalSwarm(run_id="q", common_set=[*settings(), *(tokens.common if tokens else [])],
                    workdir=workdir) as swarm:
        # the coordinator's first plan waits for all six (on a loaded machine the last replicas were
        # admitted 2.3 s after the first: planned a plan later, at iteration 0 beside 27, they stalled)
        boot = swarm.start("bootstrap", name="bootstrap", extra_set=[f"schedule.expect_nodes={len(LAYOUT)}"])
        swarm.wait_ready([boot], timeout=60)
        nodes = [swarm.start("stage", name=f"s{s}-{i}", extra_set=[
            f"stage.index={s}", *admit(f"s{s}-{i}"),
            *([f"stage.attack_weight_edit={EDIT}"] if attack and i == ATTACKER else [])])
            for i, s in enumerate(LAYOUT)]
        deadline = time.monotonic() + DEADLINE_S
        honest = [n for i, n in enumerate(nodes) if not (attack and i == ATTACKER)]
        replacement = None
        if attack:           # a hot spare refills the quarantined slot by copying the honest replica
            replacement = swarm.start("stage", name="replacement", extra_set=[
                "stage.checkfree.recover=true", "stage.checkfree.standby=true", *admit("replacement"),
                f"stage.checkfree.standby_refill_s={REFILL_S}"])
            honest.append(replacement)
        boot_metrics: dict = {}
        for n in honest:
            rc = swarm.wait_exit(n, timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"{n.name} exited with {rc}: {n.log_text()[-3000:]}\n{boot.log_text()[-3000:]}"
        boot_metrics = boot.metrics() or {}
        boot_ready = boot.readyz() or {}
        wall = time.monotonic() - t0
    final = max((e for n in nodes[:2] for e in events(n, "pipeline_eval")), key=lambda e: e["iteration"])
    return {"boot": boot, "nodes": nodes, "metrics": boot_metrics, "wall": wall, "eval_loss": final["eval_loss"],
            "final_iteration": final["iteration"], "replacement": replacement,
            "ready": boot_ready}


def test_malicious_middle_replica_is_quarantined_and_training_matches_an_honest_run(tmp_path):
    honest = run(tmp_path, attack=False)
    attacked = run(tmp_path, attack=True)
    boot, nodes = attacked["boot"], attacked["nodes"]
    bad, good = nodes[ATTACKER], nodes[ATTACKER - 1]

    assert events(bad, "stage_attack"), "the harness did not turn on"
    assert not events(honest["boot"], "replica_commit_mismatch"), "false alarm on an all-honest run"
    assert events(boot, "replica_commit_mismatch"), boot.log_text()[-3000:]
    audits = events(boot, "replica_audit")       # an audit racing the nodes' progress may be inconclusive for one
    assert all(set(a["failed"]) <= {bad.peer_id} for a in audits), audits       # the honest replica never fails
    decisive = [a for a in audits if a["failed"] and a["passed"]]
    assert decisive and decisive[0]["passed"] == [good.peer_id], audits
    q = events(boot, "replica_quarantined")
    assert [e["peer"] for e in q] == [bad.peer_id] and q[0]["stage"] == 1, q
    m = attacked["metrics"]
    assert m.get('swarmnode_security_flags_total{check="replica_commit"}') == 1, m
    assert m.get("swarmnode_pipeline_quarantined_replicas") == 1, m
    assert not honest["metrics"].get("swarmnode_pipeline_quarantined_replicas"), honest["metrics"]

    # the honest replica carried the stage to the end; training finished
    assert [e["iteration"] for e in events(good, "stage_step")][-1] == ITERATIONS - 1
    # the slot was refilled from the honest replica, never from the quarantined one (still live, still
    # publishing its card), and the copy steps in lockstep with its donor
    repl = attacked["replacement"]
    rec = events(repl, "stage_recovered")
    assert rec and rec[0]["stage"] == 1 and rec[0]["rule"] == "replica", repl.log_text()[-3000:]
    assert set(rec[0]["donors"].values()) == {good.peer_id}, rec
    mine = {e["iteration"]: e["weights_sha256"] for e in events(repl, "stage_step")}
    theirs = {e["iteration"]: e["weights_sha256"] for e in events(good, "stage_step")}
    assert len(mine) >= 5 and all(mine[k] == theirs[k] for k in mine if k in theirs), (len(mine), rec)
    assert attacked["final_iteration"] == honest["final_iteration"] == ITERATIONS
    loss, ref = attacked["eval_loss"], honest["eval_loss"]
    print(f"\nfinal validation loss: attacked+quarantined {loss:.4f}, all-honest {ref:.4f} "
          f"({(loss - ref) / ref:+.2%}); quarantined at iteration {q[0]['why']}; "
          f"wall {honest['wall']:.0f} s honest, {attacked['wall']:.0f} s attacked; replacement joined at "
          f"iteration {rec[0]['iteration']} and stepped {len(mine)} in lockstep with its donor")
    assert math.isfinite(loss) and abs(loss - ref) <= LOSS_BOUND * ref, (loss, ref)


def test_token_mode_audits_run_and_quarantine_the_malicious_replica(tmp_path):
    """Issue 33, finding 2: in token mode the coordinator's own audit downloads used to be refused
    ("admission refused: no admission token"), so every audit ended inconclusive and the attacker
    was never flagged. The coordinator's key is its credential: its audits run, attribute the
    deviation to the attacker alone and quarantine it, as in open mode; no audit is refused."""
    attacked = run(tmp_path, attack=True, token=True)
    boot, nodes = attacked["boot"], attacked["nodes"]
    bad, good = nodes[ATTACKER], nodes[ATTACKER - 1]
    assert events(bad, "stage_attack"), "the harness did not turn on"
    blocked = events(boot, "audit_blocked")
    assert not blocked, blocked[:2]
    audits = events(boot, "replica_audit")
    assert all(set(a["failed"]) <= {bad.peer_id} for a in audits), audits
    decisive = [a for a in audits if a["failed"] and a["passed"]]
    assert decisive and decisive[0]["passed"] == [good.peer_id], audits
    q = events(boot, "replica_quarantined")
    assert [e["peer"] for e in q] == [bad.peer_id] and q[0]["stage"] == 1, q
    m = attacked["metrics"]
    assert m.get('swarmnode_security_flags_total{check="replica_commit"}') == 1, m
    assert m.get("swarmnode_pipeline_quarantined_replicas") == 1, m
    assert m.get('swarmnode_pipeline_audits_total{outcome="refused"}') == 0, m
    assert m.get("swarmnode_pipeline_audits_blocked") == 0, m
    assert attacked["ready"]["details"]["stage_audits"] == {"blocked": {}}, attacked["ready"]
    assert attacked["final_iteration"] == ITERATIONS and math.isfinite(attacked["eval_loss"])
    outcomes = {o: m.get(f'swarmnode_pipeline_audits_total{{outcome="{o}"}}') for o in ("replays", "fails", "inconclusive")}
    print(f"\ntoken mode: quarantined at {q[0]['why'][:40]}; audit outcomes {outcomes}; wall {attacked['wall']:.0f} s")


def test_an_unreplicated_malicious_stage_is_audited_quarantined_and_rebuilt_from_its_neighbours(tmp_path):
    """A stage with a single node has no replica to disagree with: the coordinator audits it at
    random times (`schedule.solo_audit_every_s`), replaying one of its steps from its served states.
    Pipeline 0-1-2-3 (one node each), stage 2 runs the harness: its audit fails, it is quarantined
    (`swarmnode_security_flags_total{check="update_drift"}`), the schedule is suspended, a hot spare
    rebuilds stage 2 by CheckFree from stages 1 and 3 (never from the quarantined node) and the run
    finishes. The honest single-node stages are audited too and never fail."""
    with LocalSwarm(run_id="qs", common_set=[*settings(4, 120), "schedule.solo_audit_every_s=1.5"],
                    workdir=tmp_path) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        nodes = [swarm.start("stage", name=f"s{s}", extra_set=[
            f"stage.index={s}", *(["stage.attack_weight_edit=0.5"] if s == 2 else [])])
            for s in range(4)]
        spare = swarm.start("stage", name="spare", extra_set=["stage.checkfree.recover=true",
                                                              "stage.checkfree.standby=true"])
        bad = nodes[2]
        deadline = time.monotonic() + DEADLINE_S
        for n in [*nodes[:2], nodes[3], spare]:
            rc = swarm.wait_exit(n, timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"{n.name} exited with {rc}: {n.log_text()[-3000:]}\n{boot.log_text()[-3000:]}"
        m = boot.metrics() or {}
    audits = events(boot, "replica_audit")
    assert events(boot, "solo_audit") and audits, boot.log_text()[-3000:]
    assert all(set(a["failed"]) <= {bad.peer_id} for a in audits), audits      # honest stages never fail
    assert any(a["passed"] and a["passed"][0] != bad.peer_id for a in audits), "no honest stage was audited"
    q = events(boot, "replica_quarantined")
    assert [(e["peer"], e["stage"]) for e in q] == [(bad.peer_id, 2)] and q[0]["why"].startswith("solo_audit@"), q
    assert m.get('swarmnode_security_flags_total{check="update_drift"}') == 1, m
    rec = events(spare, "stage_recovered")
    assert rec and rec[0]["stage"] == 2 and rec[0]["rule"] == "average", spare.log_text()[-3000:]
    assert bad.peer_id not in rec[0]["donors"].values() and set(rec[0]["donors"]) == {"1", "3"}, rec
    final = max(events(nodes[0], "pipeline_eval"), key=lambda e: e["iteration"])
    assert final["iteration"] == 120 and math.isfinite(final["eval_loss"]), final
    print(f"\nunreplicated attacker: quarantined {q[0]['why'][:60]}...; spare rebuilt stage 2 by average at "
          f"iteration {rec[0]['iteration']}; final validation loss {final['eval_loss']:.4f}")
