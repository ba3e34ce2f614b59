"""pipeline/coordinator_state.py: the schedule epoch a restarted coordinator goes on from."""

from __future__ import annotations

import os

import pytest

from pipeline.coordinator_state import load_epoch, save_epoch, state_path


def test_a_saved_epoch_is_loaded_back_for_the_same_run_only(tmp_path):
    assert load_epoch(tmp_path, "run") == (0, "")                  # no file: a run's start
    save_epoch(tmp_path / "sub", "run", 7)                            # the directory is made
    assert load_epoch(tmp_path / "sub", "run") == (7, "")
    save_epoch(tmp_path / "sub", "run", 8)                            # replaced whole
    assert load_epoch(tmp_path / "sub", "run") == (8, "")
    epoch, why = load_epoch(tmp_path / "sub", "other-run")
    assert epoch == 0 and "not 'other-run'" in why
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["schedule_coordinator.json"]   # no temp file left


@pytest.mark.parametrize("body", ["", "{", "[]", '{"run_id": "run"}', '{"run_id": "run", "epoch": -1}',
                                  '{"run_id": "run", "epoch": "3"}', '{"run_id": "run", "epoch": true}'])
def test_a_damaged_file_starts_at_epoch_one_and_says_why(tmp_path, body):
    state_path(tmp_path).write_text(body)
    epoch, why = load_epoch(tmp_path, "run")
    assert epoch == 0 and why and str(state_path(tmp_path)) in why


def test_an_unwritable_state_dir_raises_and_leaves_no_temp_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError):
            save_epoch(tmp_path, "run", 3)
    finally:
        tmp_path.chmod(0o700)
    assert list(tmp_path.iterdir()) == []


def test_a_restarted_coordinator_reports_the_epoch_the_run_reached_before_it_plans(tmp_path):
    """A replacement stage node takes a vacancy only once a run is underway (status epoch > 0): a
    restarted (or newly active) coordinator has published nothing yet, but must say so (issue 29:
    replacements started during the outage waited out `wait_s` and failed)."""
    from types import SimpleNamespace

    from pipeline.config import ScheduleConfig
    from pipeline.coordinator import ScheduleCoordinator

    save_epoch(tmp_path, "run", 5)
    ctx = SimpleNamespace(config=SimpleNamespace(state_dir=str(tmp_path), run_id="run"))
    coord = ScheduleCoordinator(ctx, ScheduleConfig(stages=3), activation_bytes=1)
    coord.live = [("peer-s2", 2)]                     # only stage 2 has a node: stages 0 and 1 are vacant
    st = coord.status()
    assert st.epoch == 5 and list(st.missing_stages) == [0, 1] and st.vacancy == 0
    fresh = ScheduleCoordinator(SimpleNamespace(config=SimpleNamespace(state_dir=str(tmp_path / "new"),
                                                                       run_id="run")),
                                ScheduleConfig(stages=3), activation_bytes=1)
    assert fresh.status().epoch == 0                  # a run's start: nothing to rebuild from yet
