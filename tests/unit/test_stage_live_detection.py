"""Live detection of a malicious unreplicated stage, the pure parts (docs/pipeline.md, 'What is caught live'):
attribution of non-finite tensors (pipeline/nonfinite_watch.py), the nodes' tallies and evidence
(pipeline/stage_evidence.py), the recomputation of a stage's outputs and gradients
(pipeline/stage_audit.py `replay_outputs`, `step_gradient`) and the attack harness
(pipeline/live_attacks.py)."""

from __future__ import annotations

import math

import torch

from models.config import ModelConfig
from models.stages import build_stage
from pipeline.live_attacks import LiveAttack
from pipeline.nonfinite_watch import NonfiniteWatch, first_producers
from pipeline.replica_audits import EPOCHS_KEPT, ReplicaAudits, match_evidence
from pipeline.stage_audit import FORWARD_RTOL, replay_outputs, step_gradient
from pipeline.stage_evidence import Entry, EvidenceLog, parse_nonfinite
from pipeline.stage_msgs import Out

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
S0, S1, S2 = "data0", "blocks1", "blocks2"


# ------------------------------------------------------------------ attribution
def nan_from_last_stage() -> dict:
    """S2 sends NaN activations: S0's loss is NaN, every gradient back from it too."""
    return {S0: {("fwd", S2)}, S2: {("bwd", S0)}, S1: {("bwd", S2)}}


def test_the_first_forward_producer_is_blamed_not_the_nodes_after_it():
    assert first_producers(nan_from_last_stage()) == {S2}
    # NaN starting in stage 1: stage 2 passes it on (it received NaN itself), stage 1 did not
    assert first_producers({S2: {("fwd", S1)}, S0: {("fwd", S2)}, S1: {("bwd", S2)}}) == {S1}


def test_with_finite_activations_the_first_backward_producer_is_blamed():
    # S2 negates nothing but sends NaN gradients upstream: S1 passes them on to S0
    assert first_producers({S1: {("bwd", S2)}, S0: {("bwd", S1)}}) == {S2}
    assert first_producers({}) == set()


def feed(watch: NonfiniteWatch, it: int, tallies: dict, nodes=(S0, S1, S2)) -> list:
    """Every node has stepped `it`; their cards carry the tallies of `it`."""
    reports = [(n, it + 1, [(it, k, s) for k, s in tallies.get(n, ())]) for n in nodes]
    return watch.note(reports, set(nodes))


def test_a_node_is_suspected_after_three_consecutive_iterations_and_only_once():
    w = NonfiniteWatch()
    assert feed(w, 0, nan_from_last_stage()) == []
    assert feed(w, 1, nan_from_last_stage()) == []
    assert feed(w, 2, nan_from_last_stage()) == [(S2, [0, 1, 2])]
    assert feed(w, 3, nan_from_last_stage()) == []          # already suspected


def test_a_transient_nan_suspects_nobody():
    w = NonfiniteWatch()
    for it in range(20):      # one bad iteration every other iteration: never three in a row
        assert feed(w, it, nan_from_last_stage() if it % 2 == 0 else {}) == []
    assert not w.suspected


def test_an_iteration_is_attributed_only_once_every_scheduled_node_stepped_it():
    w = NonfiniteWatch()
    # S1 still runs iteration 0 (its card says 0 iterations done): nothing attributed yet
    reports = [(S0, 1, [(0, "fwd", S2)]), (S1, 0, []), (S2, 1, [(0, "bwd", S0)])]
    assert w.note(reports, {S0, S1, S2}) == [] and w.done == -1
    for it in range(3):
        out = feed(w, it, nan_from_last_stage())
    assert out == [(S2, [0, 1, 2])]


# ------------------------------------------------------------------ tallies and evidence
def test_the_evidence_log_tallies_nonfinite_inputs_and_keeps_recent_iterations():
    log = EvidenceLog(keep=2)
    good, bad = torch.ones(1, 2, 3), torch.full((1, 2, 3), float("nan"))
    for it in range(4):
        log.note("recv", "fwd", {"it": it, "p": 0, "h": 1}, S1, bad if it >= 2 else good)
        log.note("sent", "fwd", {"it": it, "p": 0, "h": 2}, S2, good)
    log.note("recv", "eoi", {"it": 3}, S1, good)              # not a tensor kind that is kept
    assert sorted(log.entries) == [2, 3] and len(log.about(S1, 3)) == 1 and log.about(S2, 0) == []
    assert parse_nonfinite(log.card_detail()) == [(3, "fwd", S1), (2, "fwd", S1)]
    assert parse_nonfinite("x:fwd:a,3:weird:b,4:bwd:" + "c" * 200 + ",5:bwd:ok") == [(5, "bwd", "ok")]


def test_match_evidence_pairs_inputs_outputs_and_gradients_by_path():
    t = torch.zeros(1, 2, 3)
    es = [Entry(5, "sent", "fwd", 0, 1, S1, t), Entry(5, "recv", "fwd", 0, 2, S0, t + 1),
          Entry(5, "sent", "bwd", 0, 1, S0, t + 2), Entry(5, "recv", "bwd", 0, 0, S1, t + 3)]
    samples, missing, ep, paths = match_evidence(es)
    assert missing == "" and ep == 0 and paths == (0,) and len(samples) == 1 and float(samples[0][3].sum()) == 0 + 3 * 6
    assert match_evidence(es[:2])[1].startswith("its neighbours kept no output")
    assert match_evidence([])[1] == "no evidence of its microbatches"


# ------------------------------------------------------------------ recomputation
def stage_step(attack: LiveAttack | None = None, microbatches: int = 2, reset: bool = False):
    """One honest-or-attacked step of a transformer stage: what its neighbours saw and the
    AdamW states before and after (as a node serves them). `reset`: the moments are cleared before
    the step, as on the first step of a plan made after a quarantine (`Schedule.reset_moments`)."""
    torch.manual_seed(0)
    mod = build_stage(CFG, 0, 1, 3)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    # one honest step first, so the moments before the audited step are not zero
    mod(torch.randn(2, 8, CFG.d_model)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    state = lambda: {f"{n}.{k}": v.detach().clone() for n, p in mod.named_parameters()  # noqa: E731
                     for k, v in opt.state[p].items()}
    weights = {n: p.detach().clone() for n, p in mod.named_parameters()}
    before = state()
    if reset:
        opt.state.clear()
    samples = []
    for _ in range(microbatches):
        x = torch.randn(2, 8, CFG.d_model, requires_grad=True)
        y = mod(x)
        gy = torch.randn_like(y)
        y.backward(gy)
        out = Out("next", "fwd", {}, y.detach())
        back = Out("prev", "bwd", {}, x.grad.detach())
        if attack is not None:
            out, back = attack.outgoing([out, back])
        samples.append((x.detach(), out.tensor, gy, back.tensor))
    torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.5)       # clipping keeps the direction
    if attack is not None:
        attack.before_step(mod)
    opt.step()
    return weights, samples, step_gradient(before, state(), list(weights), 0.9)


def test_an_honest_stage_recomputes():
    weights, samples, stepped = stage_step()
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is True and "gradient cosine 1.0000" in why, why


def test_noise_on_the_activations_is_caught():
    weights, samples, stepped = stage_step(LiveAttack(noise=0.3))
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is False and "outputs differ" in why, why
    # below the tolerance it passes: the knob's scale is relative to the activations' RMS
    weights, samples, stepped = stage_step(LiveAttack(noise=FORWARD_RTOL / 4))
    assert replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)[0] is True


def test_the_step_after_the_moments_were_cleared_is_audited_like_any_other():
    weights, samples, stepped = stage_step(reset=True)
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is True and "gradient cosine 1.0000" in why, why
    weights, samples, stepped = stage_step(LiveAttack(grad_flip="params"), reset=True)
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is False and "gradient it stepped on has cosine -1" in why, why


def test_a_flipped_parameter_gradient_is_caught_though_its_step_replays():
    weights, samples, stepped = stage_step(LiveAttack(grad_flip="params"))
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is False and "gradient it stepped on has cosine -1" in why, why


def test_a_flipped_upstream_gradient_and_nan_outputs_are_caught():
    weights, samples, stepped = stage_step(LiveAttack(grad_flip="upstream"))
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is False and "sent upstream" in why, why
    weights, samples, stepped = stage_step(LiveAttack(nonfinite=True))
    ok, why = replay_outputs(build_stage(CFG, 1, 1, 3), weights, samples, stepped)
    assert ok is False and "inf" in why, why


def test_step_gradient_needs_exactly_one_step_between_the_states():
    weights, _, stepped = stage_step()
    assert stepped is not None and all(math.isfinite(float(g.norm())) for g in stepped.values())
    n = next(iter(weights))
    same = {f"{n}.step": torch.tensor(3.0), f"{n}.exp_avg": torch.ones(2)}
    assert step_gradient(same, same, [n], 0.9) is None          # a skipped (non-finite) step
    assert replay_outputs(build_stage(CFG, 1, 1, 3), weights, [], None) == (None, "no evidence of its microbatches")


# ------------------------------------------------------------------ the loss trend
def test_a_rising_loss_fires_once_per_rise_and_a_falling_one_never():
    from pipeline.loss_trend import LossTrend
    falling = LossTrend(5)
    assert all(falling.note(i, 6.0 - 0.03 * i + (0.05 if i % 2 else -0.05)) is None for i in range(100))
    rising = LossTrend(5)
    fired = [i for i in range(60) if rising.note(i, (5.0 - 0.02 * i) if i < 30 else (4.4 + 0.02 * (i - 30))) is not None]
    assert fired and 30 < fired[0] <= 40, fired
    assert len(fired) < 10                  # not every iteration: once per 2% rise
    assert LossTrend(0).note(1, 9.0) is None and LossTrend(5).note(1, math.nan) is None
    again = LossTrend(2)
    assert again.note(1, 5.0) is None and again.note(1, 50.0) is None      # a repeated iteration is ignored


def test_a_loss_wobbling_on_a_plateau_fires_once_and_training_on_rearms_it():
    """Seen in the chaos soak: a tiny model's loss on a plateau wobbled 2-4% and the coordinator
    logged ``loss_rising`` (and audited every unreplicated stage) every 1-2 s."""
    from pipeline.loss_trend import LossTrend
    trend = LossTrend(5)
    plateau = [3.0 if (i // 10) % 2 == 0 else 3.1 for i in range(200)]       # 3.3% up and down, 10 times
    fired = [i for i, x in enumerate(plateau) if trend.note(i, x) is not None]
    assert len(fired) == 1, fired
    # a further rise over the level it fired at (3.08) fires, once
    assert len([i for i in range(200, 210) if trend.note(i, 3.2) is not None]) == 1
    # training goes on: a new low well under the old one re-arms it, and the next rise fires again
    trend = LossTrend(5)
    xs = [3.0] * 10 + [3.1] * 10 + [2.8] * 10 + [2.9] * 10
    fired = [i for i, x in enumerate(xs) if trend.note(i, x) is not None]
    assert len(fired) == 2 and 10 < fired[0] < 20 and 30 < fired[1] < 40, fired


def test_match_evidence_uses_the_newest_epoch_of_an_aborted_and_restarted_iteration():
    t = torch.zeros(1, 2, 3)
    old = [Entry(5, "sent", "fwd", 0, 1, S1, t + 9, 1)]                  # the aborted attempt: no output came back
    new = [Entry(5, "sent", "fwd", 0, 1, S1, t, 2), Entry(5, "recv", "fwd", 0, 2, S0, t + 1, 2),
           Entry(5, "sent", "bwd", 0, 1, S0, t + 2, 2)]
    samples, missing, ep, _ = match_evidence(old + new)
    assert missing == "" and ep == 2 and float(samples[0][0].sum()) == 0 and samples[0][3] is None


def test_a_solo_audit_compares_the_step_only_for_an_epoch_the_node_ran_alone():
    """Found on real processes: right after its replica was quarantined, the survivor is audited
    as an unreplicated stage, but the audited iteration ran with two replicas, whose averaged
    gradient it stepped on (cosine 0.886 with its own two microbatches): no step comparison then."""
    audits = ReplicaAudits.__new__(ReplicaAudits)
    audits._served = {}
    audits.published(3, {"a": (1, frozenset({0, 1})), "r": (1, frozenset({2, 3})), "z": (2, frozenset({0}))})
    audits.published(4, {"a": (1, frozenset({0, 1, 2, 3})), "z": (2, frozenset({0})), "y": (2, frozenset({1}))})
    assert "had replicas" in audits.step_checkable(1, "a", 3, {0, 1})
    assert audits.step_checkable(1, "a", 4, {0, 1, 2, 3}) == ""
    assert "had replicas" in audits.step_checkable(2, "z", 4, {0})
    assert "no longer remembered" in audits.step_checkable(1, "a", None, {0})
    assert "no longer remembered" in audits.step_checkable(1, "a", 99, {0})
    # found too: a replica of the next stage was killed, and with it the evidence of the one path
    # through it; a gradient recomputed from the other microbatch had cosine 0.895
    assert "evidence of paths [0, 1, 3] of its [0, 1, 2, 3]" in audits.step_checkable(1, "a", 4, {0, 1, 3})
    assert audits.step_checkable(1, "b", 4, {0}) != ""
    audits.published(4 + EPOCHS_KEPT, {"a": (1, frozenset({0}))})
    assert 4 not in audits._served and audits.step_checkable(1, "a", 4 + EPOCHS_KEPT, {0}) == ""
    assert "no longer remembered" in audits.step_checkable(1, "a", 4, {0, 1, 2, 3})
