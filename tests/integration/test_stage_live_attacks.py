"""A malicious unreplicated stage is caught live (issue 32; docs/pipeline.md, 'What is caught live').

A bootstrap (schedule coordinator) and a 3-stage pipeline as processes on 127.0.0.1: stage 0 (the
data node: embedding, head, loss) and transformer stages 1 and 2, one node each, plus a hot spare
(`stage.checkfree.standby`) that rebuilds a quarantined stage by CheckFree. One node runs a
test-only attack harness (pipeline/live_attacks.py):

- the last stage sends NaN activations every iteration: the receivers' non-finite tallies name it
  as the first producer within 5 iterations (`stage_suspected`,
  `swarmnode_security_flags_total{check="nonfinite_output"}`); it is quarantined and rebuilt;
- the last stage adds Gaussian noise to its activations, or stage 1 negates its parameter
  gradients before its optimizer step: the solo audit recomputes its outputs and gradients from
  the tensors its honest neighbours kept and fails it (`stage_replay`); it is quarantined and
  rebuilt within 100 iterations.

The pipeline's validation loss after 100 iterations is within 10% of an all-honest run of the same
seeds (measured once in this module) in each case, and no honest node is ever flagged. The honest
stages clear their AdamW moments on the first plan without the quarantined node
(`optimizer_moments_reset`): the noisy stage's gradients otherwise stay in them.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from node.localswarm import LocalSwarm, NodeProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ITERATIONS = 100
STAGES = 3
LOSS_BOUND = 0.10             # the bound: within 10% of the honest run
DEADLINE_S = 400
SOLO_AUDIT_S = 2.0
"""Mean seconds between random audits of each unreplicated stage (a few iterations: `compute_delay_s`
makes an iteration take a few tenths of a second, as on a slow device, so audits, whose downloads
take seconds on a loaded box, see the run while it lasts)."""


def events(node: NodeProc, event: str) -> list[dict]:
    text = node.log_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if f'"event": "{event}"' in line]


def settings(solo_audit_s: float = SOLO_AUDIT_S) -> list[str]:
    return ["schedule.stages=3", "schedule.skip_ratio=0", "schedule.mb_per_origin=2", "schedule.memory=4",
            "schedule.max_swaps=0", "schedule.settle_s=1.0", "schedule.time_budget_s=1.0",
            f"schedule.solo_audit_every_s={solo_audit_s}",
            "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
            "data.seq_len=32", "data.batch_size=4", "data.max_train_bytes=200000", "data.max_val_bytes=20000",
            "stage.torch_threads=1", "stage.compute_delay_s=0.03", "stage.evidence_iterations=16", "stage.eval_every=0", "stage.optim.lr=0.003", "stage.optim.warmup=0",
            f"stage.iterations={ITERATIONS}", "stage.iteration_timeout_s=40", "card.refresh_s=1", "drain.budget_s=10"]


def run_pipeline(workdir, attacker: int | None = None, attack: tuple[str, ...] = (),
                 solo_audit_s: float = SOLO_AUDIT_S) -> dict:
    """Bootstrap + stages 0..2 (node `attacker` with the `attack` settings) + a hot spare; waits for
    the honest nodes to finish and returns the bootstrap, nodes, spare, metrics and final eval."""
    t0 = time.monotonic()
    with LocalSwarm(run_id="live", common_set=settings(solo_audit_s), workdir=workdir) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap", extra_set=[f"schedule.expect_nodes={STAGES}"])
        swarm.wait_ready([boot], timeout=60)
        nodes = [swarm.start("stage", name=f"s{s}", extra_set=[
            f"stage.index={s}", *(attack if s == attacker else ())])
            for s in range(STAGES)]
        spare = swarm.start("stage", name="spare", extra_set=["stage.checkfree.recover=true", "stage.checkfree.allow_edge_copy=true",
                                                              "stage.checkfree.standby=true"])
        deadline = time.monotonic() + DEADLINE_S
        for n in [n for s, n in enumerate(nodes) if s != attacker]:
            rc = swarm.wait_exit(n, timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"{n.name} exited with {rc}: {n.log_text()[-3000:]}\n{boot.log_text()[-3000:]}"
        if events(spare, "stage_recovered"):        # it rebuilt a stage: it finishes with the run
            rc = swarm.wait_exit(spare, timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"spare exited with {rc}: {spare.log_text()[-3000:]}"
        metrics = boot.metrics() or {}
    evals = events(nodes[0], "pipeline_eval")
    final = max(evals, key=lambda e: e["iteration"]) if evals else {"iteration": -1, "eval_loss": math.nan}
    return {"boot": boot, "nodes": nodes, "spare": spare, "metrics": metrics, "eval_loss": final["eval_loss"],
            "final_iteration": final["iteration"], "wall": time.monotonic() - t0,
            "attacker": None if attacker is None else nodes[attacker]}


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> dict:
    """The all-honest run every attacked run is compared with (same seeds, same nodes)."""
    return run_pipeline(tmp_path_factory.mktemp("honest"))


def flagged(boot: NodeProc) -> set[str]:
    """Every node the coordinator suspected, failed in an audit or quarantined."""
    out = {e["peer"] for e in events(boot, "stage_suspected") + events(boot, "replica_quarantined")}
    for a in events(boot, "replica_audit"):
        out |= set(a["failed"])
    return out


def check_recovered(r: dict, honest: dict, stage: int, loss_bound: bool = True) -> None:
    """The attacker alone was flagged and quarantined, the spare rebuilt its stage from honest
    nodes, and the run reached 100 iterations (`loss_bound`: within LOSS_BOUND of the honest run)."""
    boot, bad, spare = r["boot"], r["attacker"], r["spare"]
    assert events(bad, "stage_attack"), "the harness did not turn on"
    assert flagged(boot) == {bad.peer_id}, (flagged(boot), bad.peer_id)
    q = events(boot, "replica_quarantined")
    assert [(e["peer"], e["stage"]) for e in q] == [(bad.peer_id, stage)], q
    rec = events(spare, "stage_recovered")
    assert rec and rec[0]["stage"] == stage and bad.peer_id not in rec[0]["donors"].values(), spare.log_text()[-3000:]
    assert r["final_iteration"] == honest["final_iteration"] == ITERATIONS
    loss, ref = r["eval_loss"], honest["eval_loss"]
    assert math.isfinite(loss)
    if loss_bound:
        assert abs(loss - ref) <= LOSS_BOUND * ref, (loss, ref)


def test_the_honest_run_flags_nobody(honest):
    boot = honest["boot"]
    assert flagged(boot) == set(), flagged(boot)
    assert honest["final_iteration"] == ITERATIONS and honest["eval_loss"] < 0.7 * events(
        honest["nodes"][0], "pipeline_eval")[0]["eval_loss"]           # it trained
    audits = events(boot, "replica_audit")
    assert any(a["n_passed"] for a in audits), audits                 # the audits ran, and passed
    assert not events(honest["spare"], "stage_recovered")
    m = honest["metrics"]
    assert m.get('swarmnode_security_flags_total{check="nonfinite_output"}') == 0, m
    assert m.get('swarmnode_security_flags_total{check="stage_replay"}') == 0, m
    print(f"\nhonest: eval loss {honest['eval_loss']:.4f} after {ITERATIONS} iterations; audits "
          f"{[(a['stage'], a['n_passed'], a['n_inconclusive']) for a in audits]}; wall {honest['wall']:.0f} s")


def test_a_last_stage_sending_nan_is_suspected_within_5_iterations(tmp_path, honest):
    r = run_pipeline(tmp_path, attacker=2, attack=("stage.attack_nonfinite=true",))
    boot, bad = r["boot"], r["attacker"]
    sus = events(boot, "stage_suspected")
    assert sus and sus[0]["peer"] == bad.peer_id and sus[0]["check"] == "nonfinite_output", sus
    assert sus[0]["iteration"] <= 4, sus                  # named by its outputs of iterations 0..4 at the latest
    assert r["metrics"].get('swarmnode_security_flags_total{check="nonfinite_output"}') == 1, r["metrics"]
    check_recovered(r, honest, 2)
    print(f"\nNaN last stage: suspected on iterations {sus[0]['iterations']}; eval loss {r['eval_loss']:.4f} vs "
          f"honest {honest['eval_loss']:.4f}; wall {r['wall']:.0f} s")


@pytest.fixture(scope="module")
def noisy(tmp_path_factory) -> dict:
    """The last stage adds Gaussian noise of 1 x RMS to every activation it sends on."""
    return run_pipeline(tmp_path_factory.mktemp("noisy"), attacker=2, attack=("stage.attack_activation_noise=1.0",))


def test_a_stage_adding_noise_to_its_activations_is_quarantined_and_rebuilt(noisy, honest):
    r = noisy
    q = events(r["boot"], "replica_quarantined")
    assert q and "outputs differ" in q[0]["why"], q
    audited = int(q[0]["why"].split("@")[1].split(":")[0])
    assert audited <= 10, q                    # caught on one of its first steps (audited as soon as it has one)
    assert r["metrics"].get('swarmnode_security_flags_total{check="stage_replay"}') == 1, r["metrics"]
    check_recovered(r, honest, 2, loss_bound=False)
    print(f"\nnoisy last stage: quarantined {q[0]['why'][:160]}; eval loss {r['eval_loss']:.4f} vs honest "
          f"{honest['eval_loss']:.4f}; wall {r['wall']:.0f} s")


def test_after_a_noisy_stage_is_rebuilt_the_eval_loss_is_near_the_honest_run(noisy, honest):
    """Within the issue's 10%: the honest stages cleared their AdamW moments on the first plan
    without the noisy node (`optimizer_moments_reset`; before, the noisy iterations' gradients
    stayed in the second moments and left eval 13-14% above the honest run)."""
    resets = {n.name: events(n, "optimizer_moments_reset") for n in noisy["nodes"][:2]}
    assert all(len(r) == 1 for r in resets.values()), resets
    assert not events(honest["nodes"][0], "optimizer_moments_reset")
    loss, ref = noisy["eval_loss"], honest["eval_loss"]
    assert math.isfinite(loss) and abs(loss - ref) <= LOSS_BOUND * ref, (loss, ref)


def test_a_stage_flipping_its_gradients_is_quarantined_and_rebuilt(tmp_path, honest):
    r = run_pipeline(tmp_path, attacker=1, attack=("stage.attack_grad_flip=params",))
    q = events(r["boot"], "replica_quarantined")
    assert q and "gradient it stepped on has cosine" in q[0]["why"], q
    assert r["metrics"].get('swarmnode_security_flags_total{check="stage_replay"}') == 1, r["metrics"]
    check_recovered(r, honest, 1)
    print(f"\ngradient-flipping stage 1: quarantined {q[0]['why'][:120]}; eval loss {r['eval_loss']:.4f} vs "
          f"honest {honest['eval_loss']:.4f}; wall {r['wall']:.0f} s")
