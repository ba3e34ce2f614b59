"""The pure parts of benchmarks/chaos.py: stall computation, growth slopes, digest matching and
non-finite loss detection (no processes)."""

from __future__ import annotations

import math

import pytest

from benchmarks.chaos import (checkpoint_resumes, corrupt_resumes, max_stall, merge_windows, nonfinite_losses,
                              slope_per_hour, worst_growth)


def test_merge_windows_joins_overlaps_and_drops_empty_ones():
    assert merge_windows([(5, 7), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 7)]


def test_max_stall_is_the_longest_gap_including_the_edges():
    assert max_stall([10, 12, 30], 0, 35) == pytest.approx(18)
    assert max_stall([], 0, 50) == pytest.approx(50)
    assert max_stall([1, 2, 3], 0, 40) == pytest.approx(37)    # nothing after t=3: a stall to the end


def test_max_stall_subtracts_freeze_down_and_outage_windows():
    # gap 12 -> 30 (18 s), 10 s of it frozen: 8 s; the edge gap 0 -> 10 is then the longest
    assert max_stall([10, 12, 30], 0, 32, [(15, 25)]) == pytest.approx(10)
    # overlapping windows are not subtracted twice
    assert max_stall([0.5, 40], 0, 41, [(10, 30), (20, 35)]) == pytest.approx(39.5 - 25)
    # a window partly outside the gap counts only inside it
    assert max_stall([0.1, 20, 21], 0, 22, [(15, 100)]) == pytest.approx(14.9)


def test_slope_per_hour_is_the_least_squares_fit():
    pts = [(0, 100.0), (60, 101.0), (120, 102.0), (180, 103.0)]   # 1 MB a minute
    assert slope_per_hour(pts) == pytest.approx(60.0)
    noisy = [(0, 10.0), (1, 12.0), (2, 11.0), (3, 13.0)]
    assert slope_per_hour(noisy) == pytest.approx(0.8 * 3600)
    assert slope_per_hour([(5, 1.0)]) is None and slope_per_hour([(5, 1.0), (5, 2.0)]) is None


def test_worst_growth_skips_the_warmup_and_short_segments():
    start_up = [(t, 100.0 + (50.0 if t < 30 else 0) * t / 30 + (0.0 if t < 30 else 50.0)) for t in range(0, 31, 3)]
    flat = [(t, 150.0) for t in range(30, 121, 3)]
    seg = start_up + flat
    assert worst_growth([seg], warmup_s=30) == pytest.approx(0.0, abs=1e-6)
    leaking = [(t, 200.0 + t / 36.0) for t in range(0, 200, 5)]      # 100 MB/h
    assert worst_growth([seg, leaking], warmup_s=30) == pytest.approx(100.0)
    assert worst_growth([[(0, 1.0), (40, 2.0)]], warmup_s=30) is None       # too few points


def test_corrupt_resumes_are_digests_never_written():
    assert corrupt_resumes(["a", "b"], ["b", "a"]) == []
    assert corrupt_resumes(["a"], ["a", "x", None]) == ["x", None]


def test_only_resumes_from_a_checkpoint_are_checked_against_written_digests():
    recs = [{"event": "resume", "source": "peer", "digest": None},          # a joiner's download
            {"event": "checkpoint_written", "digest": "a"},
            {"event": "resume", "source": "checkpoint", "digest": "a"},
            {"event": "resume", "source": "checkpoint", "digest": "z"}]
    resumed = [r["digest"] for r in checkpoint_resumes(recs)]
    assert resumed == ["a", "z"]
    assert corrupt_resumes([r["digest"] for r in recs if r["event"] == "checkpoint_written"], resumed) == ["z"]


def test_nonfinite_losses_finds_nan_and_inf_in_loss_fields_only():
    recs = [{"event": "averaging_round_done", "train_loss": 1.5},
            {"event": "averaging_round_done", "train_loss": math.nan},
            {"event": "eval_done", "eval_loss": math.inf},
            {"event": "x", "loss_end": "NaN"},
            {"event": "y", "grad_norm": math.nan}]
    assert [r["event"] for r in nonfinite_losses(recs)] == ["averaging_round_done", "eval_done", "x"]
