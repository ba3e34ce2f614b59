"""A stage node frozen past its liveness probes, then resumed (issue 29, the chaos soak: SIGSTOP for
20-60 s): the coordinator took it for down and never probed it again, so the pipeline, one node per
stage, stayed suspended for good. Now a down node that answers SERVING again fills its stage again,
but only while no other node holds that stage (pipeline/stage_liveness.py `readmit_returned`)."""

from __future__ import annotations

from pipeline.stage_liveness import LivenessProbe, readmit_returned

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


def test_a_node_that_came_back_far_behind_is_not_planned_and_said_so_once(caplog):
    """A stage node restarted as itself without its state answers again at iteration 0 while the
    live nodes are at 40: planning it stalled the pipeline on its initial weights (issue 29's known
    gap). A frozen node comes back at the iteration it had (within STALE_SLACK) and is readmitted."""
    from pipeline.stage_liveness import STALE_SLACK
    caplog.set_level("WARNING", logger="swarmnode.pipeline.coordinator")
    p = probe_with({"peer-s2": "unreachable (UNAVAILABLE)"}, {"peer-s2"})
    p.started["peer-s2"] = 100.0                            # the process it ran as before it died
    cards = {"peer-s0": (40, 1.0), "peer-s1": (40, 1.0), "peer-s2": (0, 200.0)}
    assert readmit_returned(p, [S0, S1, S2], set(), now=5.0, cards=cards) == [S0, S1]
    assert "peer-s2" in p.down and not p.back
    p.back.add("peer-s2")                                   # it answers SERVING again at the next poll
    assert readmit_returned(p, [S0, S1, S2], set(), now=6.0, cards=cards) == [S0, S1]
    stale = [r for r in caplog.records if getattr(r, "event", None) == "stage_node_stale"]
    assert len(stale) == 1 and "iteration 0" in stale[0].getMessage()
    # rebuilt at the live nodes' iteration (it rejoined by CheckFree): readmitted, as a new process
    # (the iteration in flight died with the old one: the caller re-plans instead of resuming)
    p.back.add("peer-s2")
    cards["peer-s2"] = (40 - STALE_SLACK, 200.0)
    assert readmit_returned(p, [S0, S1, S2], set(), now=7.0, cards=cards) == [S0, S1, S2]
    assert "peer-s2" not in p.down and not p.stale and p.restarted == {"peer-s2"}


def test_a_new_node_at_its_initial_weights_beside_a_running_pipeline_is_not_planned(caplog):
    """Seen under load: three of six replicas were admitted 2.3 s after the others, planned one
    epoch later at iteration 0 beside neighbours at 27, and the pipeline stalled on them. A node no
    plan has named that still holds its initial weights is held back once the run is past
    STALE_SLACK; the first plan (everyone at 0), nodes already planned and a replacement that copied
    a live replica (it reports that iteration, and re-syncs) are not."""
    from pipeline.stage_liveness import STALE_SLACK, hold_back_late
    caplog.set_level("WARNING", logger="swarmnode.pipeline.coordinator")
    held: set[str] = set()
    everyone = [S0, S1, S2, NEW2]
    assert hold_back_late(everyone, set(), {p[0]: 0 for p in everyone}, held) == everyone   # the first plan
    planned = {"peer-s0", "peer-s1", "peer-s2"}
    its = {"peer-s0": 27, "peer-s1": 27, "peer-s2": 27, "peer-new2": 0}
    for _ in range(3):
        assert hold_back_late(everyone, planned, its, held) == [S0, S1, S2]
    late = [r for r in caplog.records if getattr(r, "event", None) == "stage_node_late"]
    assert len(late) == 1 and "iteration 0" in late[0].getMessage() and "standby=true" in late[0].getMessage()
    assert hold_back_late(everyone, planned, {**its, "peer-new2": None}, held) == [S0, S1, S2]   # no iteration yet
    # within the slack (the run has just begun): planned
    assert hold_back_late(everyone, planned, {p: min(v, STALE_SLACK) for p, v in its.items()}, set()) == everyone
    # a replacement that copied a live replica at 24: planned, it re-syncs at the iteration it is asked to run
    assert hold_back_late(everyone, planned, {**its, "peer-new2": 24}, set()) == everyone
    # a node that was planned before (a restarted one is readmit_returned's business): not held here
    assert hold_back_late(everyone, planned | {"peer-new2"}, its, set()) == everyone
    # after a takeover (this coordinator planned nobody yet) the membership is the reference
    assert hold_back_late(everyone, set(), its, set()) == [S0, S1, S2]


def test_a_frozen_node_is_readmitted_as_the_same_process_and_the_plan_resumes():
    p = LivenessProbe()
    cards = {"peer-s0": (12, 1.0), "peer-s1": (12, 1.0), "peer-s2": (12, 5.0)}
    assert readmit_returned(p, [S0, S1, S2], set(), now=1.0, cards=cards) == [S0, S1, S2]
    p.down["peer-s2"] = "unreachable (DEADLINE_EXCEEDED)"  # SIGSTOP past its probes
    p.back.add("peer-s2")                                   # SIGCONT: the same process answers again
    cards["peer-s2"] = (11, 5.0)
    assert readmit_returned(p, [S0, S1, S2], set(), now=9.0, cards=cards) == [S0, S1, S2]
    assert not p.restarted and "peer-s2" not in p.down


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


def test_the_first_plan_without_a_quarantined_node_tells_the_stages_to_clear_their_moments(tmp_path):
    """`Schedule.reset_moments`: set on the first published plan that leaves every quarantined node
    out (a plan still naming it would clear the moments while it still feeds them), then off; not
    for a replica quarantined for its weight commit (its twin carried the stage)."""
    import asyncio
    from types import SimpleNamespace

    from node.netem import NetemConfig
    from pipeline.config import ScheduleConfig
    from pipeline.coordinator import ScheduleCoordinator
    from pipeline.schedule import Schedule

    ctx = SimpleNamespace(config=SimpleNamespace(state_dir=str(tmp_path), run_id="run", netem=NetemConfig()),
                          card=SimpleNamespace(update=lambda **kw: None))
    coord = ScheduleCoordinator(ctx, ScheduleConfig(stages=3, mb_per_origin=2), activation_bytes=1)
    node = lambda peer, s: (peer, s, f"127.0.0.1:{1000 + s}", None, None, None)  # noqa: E731
    both = [node("d0", 0), node("a1", 1), node("b1", 1), node("s2", 2)]

    def published() -> Schedule:
        return Schedule.from_json(coord.replies[coord.epoch].schedule_json)

    async def go():
        await coord._plan(both)
        assert not published().reset_moments
        coord._quarantine("a1", 1, "solo_audit@3: outputs differ")
        await coord._plan(both)                       # planned before the quarantine was seen: still names it
        assert not published().reset_moments and coord.reset_moments
        await coord._plan([m for m in both if m[0] != "a1"])
        assert published().reset_moments and not coord.reset_moments
        await coord._plan([m for m in both if m[0] != "a1"])
        assert not published().reset_moments     # once
        # a replica whose weights left its twin's: the twin carried the stage, the moments stay
        coord._quarantine("b1", 1, "replica_commit@9: weights differ from its replica's")
        assert not coord.reset_moments
        await coord._plan([m for m in both if m[0] not in ("a1", "b1")])
        assert not published().reset_moments
    asyncio.run(go())
