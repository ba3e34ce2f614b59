"""benchmarks/checkfree.py's core on a tiny config: the JSON carries the issue's summary keys with
finite figures, the failure schedule is shared by every setting, and the checkpoint replay redoes
exactly the iterations lost since the last checkpoint. No timing is asserted."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.checkfree import BenchConfig, checkpoint_replay, failure_arrivals, run_benchmark

SUMMARY_KEYS = ("wallclock_ratio_checkfree_vs_best_checkpoint", "wallclock_ratio_checkfree_vs_best_checkpoint_local_disk",
                "loss_jump_ratio_gradavg_vs_random",
                "loss_jump_ratio_gradavg_vs_copy", "loss_jump_ratio_gradavg_vs_uniform")


def _numbers(obj):
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _numbers(v)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    bc = BenchConfig(d_model=16, n_heads=2, transformer_stages=4, layers_per_stage=1, seq_len=16, batch_size=2,
                     iterations=12, eval_every=4, rates=(0.10,), seeds=(0,), checkpoint_every=(4, 8), smooth=2,
                     iteration_s=1800.0,                  # 2 iterations per emulated hour: failures in 12 iterations
                     max_train_bytes=50_000, max_val_bytes=5_000, eval_batches=1)
    return json.loads(json.dumps(run_benchmark(bc, tmp_path_factory.mktemp("cfbench"), log=lambda m: None)))


def test_summary_has_the_issue_keys_with_finite_numbers(doc):
    s = doc["summary"]
    for key in SUMMARY_KEYS:
        assert key in s and isinstance(s[key], float) and math.isfinite(s[key]) and s[key] > 0, (key, s[key])
    assert all(math.isfinite(x) for x in _numbers(doc))
    assert doc["calibration"]["rollback_replay_exact"] is True
    assert "measured" in doc["measured_vs_emulated"] and "emulated" in doc["measured_vs_emulated"]


def test_the_zero_cost_bound_is_the_no_failure_time_over_the_best_checkpointing_time(doc):
    """The ratio a recovery that costs no time and no loss would get."""
    s, run = doc["summary"], doc["runs"]["0"]
    res = run["rates"]["0.1"]
    for where, suffix in (("offnode_", ""), ("", "_local_disk")):  # headline: checkpoints off the node
        best = min(res[f"{where}checkpoint_{k}"]["target_reached"]["clock_s"] for k in (4, 8)
                   if res[f"{where}checkpoint_{k}"]["target_reached"])
        bound = run["no_failure"]["target_reached"]["clock_s"] / best
        assert s[f"wallclock_ratio_bound_zero_cost_recovery{suffix}"] == pytest.approx(bound, abs=1e-3)
        assert s["wallclock_ratio_by_rate"]["0.1"][f"bound_zero_cost_recovery{suffix}"] == pytest.approx(bound, abs=1e-3)


def test_offnode_checkpoints_cross_the_link_and_cost_what_was_measured(doc):
    cal, off = doc["calibration"], doc["summary"]["offnode_checkpoint"]
    costs, scale = cal["emulated_costs_s"], cal["emulated_s_per_measured_s"]
    rtt = 2 * doc["setup"]["store_link_latency_ms"] / 1000
    # a stage checkpoint (weights + AdamW moments) is about 3x its weights, and the paced upload of
    # it takes at least its bytes over the link's bandwidth
    mbps = doc["setup"]["store_link_mbps"]
    assert all(c > 2.5 * w for c, w in zip(cal["checkpoint_bytes_per_stage"][1:], cal["weights_bytes_per_stage"][1:]))
    assert cal["offnode_save_measured_s"] >= max(cal["checkpoint_bytes_per_stage"]) * 8 / (mbps * 1e6)
    assert off["save_emulated_s"] == pytest.approx(
        (cal["checkpoint_save_measured_s"] + cal["offnode_save_measured_s"]) * scale + rtt, rel=1e-3)
    assert off["save_emulated_s"] > off["local_save_emulated_s"] and off["load_emulated_s"] > rtt
    # (no ordering of the two replays' times is asserted: dearer saves move the clock, and with it
    # the iterations the same failure times land on)
    res = doc["runs"]["0"]["rates"]["0.1"]
    for ev in res["checkfree"]["events"]:  # CheckFree's neighbour fetch crosses the same link
        assert ev["recovery_emulated_s"]["fetch_s"] == pytest.approx(costs["link_fetch_s"], abs=1e-3)


def test_every_setting_sees_the_same_failures_and_records_the_split(doc):
    res = doc["runs"]["0"]["rates"]["0.1"]
    assert res["failures_in_first_iterations"] > 0
    arrivals = failure_arrivals(0, 0.1, 4, 1e9)
    for s in ("checkfree", "checkfree_plus", "copy", "uniform", "random"):
        evs = res[s]["events"]
        # the first loss is the schedule's first arrival in every setting; later ones may land an iteration
        # apart (recovery costs differ a little), but always come from the same schedule
        assert evs and (evs[0]["clock_s"], evs[0]["stages"]) == (pytest.approx(arrivals[0][0], abs=1e-3),
                                                                  [arrivals[0][1]])
        taken = sum(len(e["stages"]) for e in evs)
        assert sorted(x for e in evs for x in e["stages"]) == sorted(b for _, b in arrivals[:taken])
    for ev in res["checkfree"]["events"]:
        assert set(ev["recovery_emulated_s"]) == {"detect_s", "fetch_s", "apply_s"}
        assert ev["recovery_emulated_s"]["detect_s"] == 10.0
        assert math.isfinite(ev["jump"]) and ev["loss_after"] == pytest.approx(ev["loss_before"] + ev["jump"], abs=1e-4)
    rules = {r["rule"] for ev in res["random"]["events"] for r in ev["recoveries"]}
    assert rules == {"random"}
    curve = res["checkfree"]["curve"]
    assert [c[0] for c in curve] == sorted(c[0] for c in curve) and curve[-1][0] >= 12


def test_failure_arrivals_depend_on_seed_and_rate_only():
    a = failure_arrivals(3, 0.1, 5, 3600 * 50)
    assert a == failure_arrivals(3, 0.1, 5, 3600 * 50) and a != failure_arrivals(4, 0.1, 5, 3600 * 50)
    assert {s for _, s in a} <= {1, 2, 3, 4, 5} and all(t < 3600 * 50 for t, _ in a)
    # about -ln(0.9) failures per stage-hour
    assert 0.5 * 5 * 50 * 0.105 < len(a) < 1.5 * 5 * 50 * 0.105


def test_checkpoint_replay_redoes_the_iterations_since_the_last_checkpoint():
    bc = BenchConfig(iteration_s=10.0, detect_s=1.0)
    curve = [[i, i * 10.0, 5.0 - i / 10] for i in range(0, 31, 5)]
    costs = {"save_s": 2.0, "load_s": 3.0}
    # 10 s per iteration, a 2 s save after 10: iteration 13 completes at 132, the failure at 135 s hits 14
    r = checkpoint_replay(bc, 10, [(135.0, 2)], costs, curve, target_iteration=30, cap_iterations=30)
    (ev,) = r["events"]
    assert (ev["at_iteration"], ev["rolled_back_to"], ev["lost_iterations"]) == (13, 10, 3)
    # then detect 1 + load 3, iterations 11..30 again (200 s) with one more save at 20
    assert r["target_reached"]["clock_s"] == pytest.approx(135.0 + 1.0 + 3.0 + 200.0 + 2.0)
    assert r["redone_iterations"] == 3
    assert [c[0] for c in r["curve"]] == [0, 5, 10, 15, 20, 25, 30]
    assert r["curve"][2][1] == pytest.approx(100.0) and r["curve"][3][1] == pytest.approx(139.0 + 50.0)
