"""A stage node frozen past its liveness probes, then resumed (issue 29, the chaos soak: SIGSTOP for
20-60 s): the coordinator took it for down and never probed it again, so the pipeline, one node per
stage, stayed suspended for good. Now a down node that answers SERVING again fills its stage again,
but only while no other node holds that stage (pipeline/coordinator.py `readmit_returned`)."""

from __future__ import annotations

from pipeline.coordinator import LivenessProbe, readmit_returned

S0, S1, S2, NEW2 = ("peer-s0", 0, "a0"), ("peer-s1", 1, "a1"), ("peer-s2", 2, "a2"), ("peer-new2", 2, "a3")


def probe_with(down: dict[str, str], back: set[str]) -> LivenessProbe:
    p = LivenessProbe()
    p.down.update(down)
    p.back.update(back)
    return p


def test_a_down_node_that_answers_again_fills_its_empty_stage():
    p = probe_with({"peer-s2": "unreachable (DEADLINE_EXCEEDED)"}, {"peer-s2"})
    live = readmit_returned(p, [S0, S1, S2], set(), now=5.0)
    assert live == [S0, S1, S2]
    assert "peer-s2" not in p.down and not p.back and p.fails["peer-s2"] == 0 and p.last_ok["peer-s2"] == 5.0


def test_a_down_node_that_has_not_answered_stays_out():
    p = probe_with({"peer-s2": "unreachable (UNAVAILABLE)"}, set())
    assert readmit_returned(p, [S0, S1, S2], set(), now=5.0) == [S0, S1]
    assert "peer-s2" in p.down


def test_a_returning_node_does_not_join_a_stage_a_replacement_holds():
    p = probe_with({"peer-s2": "unreachable (DEADLINE_EXCEEDED)"}, {"peer-s2"})
    assert readmit_returned(p, [S0, S1, S2, NEW2], set(), now=5.0) == [S0, S1, NEW2]
    assert "peer-s2" in p.down and not p.back


def test_a_quarantined_node_is_never_readmitted():
    p = probe_with({"peer-s2": "unreachable (DEADLINE_EXCEEDED)"}, {"peer-s2"})
    assert readmit_returned(p, [S0, S1, S2], {"peer-s2"}, now=5.0) == [S0, S1]
    assert "peer-s2" in p.down


def test_the_plan_resumes_and_forgets_its_lost_stages_once_every_planned_node_is_back(tmp_path):
    """Stage 1's node frozen (down, the plan suspended) then back: the published plan runs on as it
    is, so no new epoch clears the suspension; without this, stage 1 stayed 'lost in the same
    incident' and a later replacement for stage 2 found no transformer stage to rebuild from."""
    from types import SimpleNamespace

    from pipeline.config import ScheduleConfig
    from pipeline.coordinator import ScheduleCoordinator

    coord = ScheduleCoordinator(SimpleNamespace(config=SimpleNamespace(state_dir=str(tmp_path), run_id="run")),
                                ScheduleConfig(stages=3), activation_bytes=1)
    coord.scheduled = [S0, S1, S2]
    coord._check_liveness([S0, S2], now=10.0)
    assert coord.reported_down == {1} and coord.suspended_since == 10.0
    coord._check_liveness([S0, S1, S2], now=14.0)
    coord.live = [S0, S1, S2]
    assert coord.reported_down == set() and coord.suspended_since is None
    st = coord.status()
    assert list(st.down_stages) == [] and not st.suspended and not st.hold
