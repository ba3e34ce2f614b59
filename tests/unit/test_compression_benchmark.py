"""Pure summary arithmetic of benchmarks/compression.py (no processes, no training)."""

from __future__ import annotations

import pytest

from benchmarks import compression as bench

P = 1000  # parameters


def _round(label: int, sent: int, outcome: str = "ok", g: int = 2) -> dict:
    return {"round": label, "sent_bytes": sent, "outcome": outcome, "group_size": g if outcome == "ok" else 1}


def _worker(end: float, curve: list[tuple[float, float]]) -> dict:
    return {"eval_loss_end": end, "eval_curve": curve}


def _arm(bpp: float, workers: list[dict]) -> dict:
    return {"bytes_per_param": bpp, "eval_loss_end_mean": sum(w["eval_loss_end"] for w in workers) / len(workers),
            "workers": workers}


def test_pairs_fp32_is_four_bytes_per_param_and_failed_rounds_do_not_count():
    rounds = [_round(1, 4 * P), _round(2, 4 * P), _round(3, 0, "solo"), _round(3, 123, "failed")]
    assert bench.bytes_per_param_pairs(rounds, P) == pytest.approx(4.0)
    assert bench.bytes_per_param("noloco", rounds, P) == pytest.approx(4.0)
    assert bench.bytes_per_param_pairs([_round(1, 0, "solo")], P) is None


def test_pairs_mean_over_rounds_includes_the_phi_rounds():
    # topk payload of 0.25 B/param, one round in 4 also carries phi int8 (about 1 B/param)
    rounds = [_round(k, int(1.25 * P) if k % 4 == 0 else P // 4) for k in range(1, 9)]
    assert bench.bytes_per_param_pairs(rounds, P) == pytest.approx(0.25 + 2 / 8)


def test_groups_fp32_is_four_bytes_per_param_for_any_group_size():
    for g in (2, 3, 4):
        # each member sends 4P to the root; the root sends 4P back to each of the g - 1 members
        rounds = []
        for label in (1, 2):
            rounds += [_round(label, 4 * P, g=g) for _ in range(g - 1)] + [_round(label, 4 * P * (g - 1), g=g)]
        assert bench.bytes_per_param_groups(rounds, P) == pytest.approx(4.0)
        assert bench.bytes_per_param("diloco", rounds, P) == pytest.approx(4.0)


def test_groups_per_label_then_mean_and_solo_rounds_ignored():
    rounds = [_round(1, P // 10), _round(1, P // 10),            # 2 workers at 0.1 B/param
              _round(2, P // 5), _round(2, P // 5),              # 0.2 B/param
              _round(3, 0, "solo"), _round(3, 7, "failed")]
    assert bench.bytes_per_param_groups(rounds, P) == pytest.approx(0.15)
    assert bench.bytes_per_param_groups([_round(1, 0, "solo")], P) is None


def test_seconds_to_the_higher_final_loss_and_compare():
    fp32 = _arm(4.0, [_worker(2.0, [(0, 5.0), (10, 3.0), (20, 2.0)]), _worker(2.0, [(0, 5.0), (10, 3.0), (20, 2.0)])])
    comp = _arm(0.4, [_worker(2.1, [(0, 5.0), (4, 3.0), (8, 2.1)]), _worker(2.1, [(0, 5.0), (4, 3.0), (8, 2.1)])])
    t = bench.seconds_to_common_loss(comp["workers"], fp32["workers"])
    assert t == {"target_eval_loss": pytest.approx(2.1), "compressed": 8, "fp32": 20}
    c = bench.compare(comp, fp32)
    assert c["bytes_per_param"] == 0.4
    assert c["eval_loss_ratio"] == pytest.approx(1.05)
    assert c["wallclock_ratio"] == pytest.approx(0.4)


def _runs(walls: dict[str, float], ratio: dict[str, float], seeds: int = 1) -> dict:
    runs: dict = {}
    for outer in ("noloco", "diloco"):
        fp = {k: _arm(4.0, [_worker(2.0, [(0, 5.0), (10, 2.0)])]) for k in range(seeds)}
        end = 2.0 * ratio[outer]
        comp = {k: _arm(0.1, [_worker(end, [(0, 5.0), (10 * walls[outer], end)])]) for k in range(seeds)}
        runs[outer] = {"fp32": fp, bench.BEST[outer]: comp}
    return runs


def test_summary_keys_targets_and_worst_wallclock():
    s = bench.summarize(_runs({"noloco": 0.3, "diloco": 0.6}, {"noloco": 0.99, "diloco": 1.0}, seeds=3))
    for key in ("bytes_per_param_noloco", "bytes_per_param_diloco", "eval_loss_ratio_compressed_vs_fp32_noloco",
                "eval_loss_ratio_compressed_vs_fp32_diloco", "wallclock_ratio_compressed_vs_fp32"):
        assert key in s and key in s["targets"] and key in s["targets_met"]
    assert s["bytes_per_param_noloco"] == pytest.approx(0.1)
    assert s["eval_loss_ratio_compressed_vs_fp32_noloco"] == pytest.approx(0.99)
    # the worse outer mode decides the headline wall-clock figure
    assert s["wallclock_ratio_compressed_vs_fp32_noloco"] == pytest.approx(0.3)
    assert s["wallclock_ratio_compressed_vs_fp32"] == pytest.approx(0.6)
    assert s["targets_met"]["wallclock_ratio_compressed_vs_fp32"] is False
    assert s["targets_met"]["bytes_per_param_diloco"] is True
    assert s["fp32_bytes_per_param"] == {"noloco": 4.0, "diloco": 4.0} and s["fp32_bytes_per_param_ok"]
    assert s["settings"]["noloco"]["compression_phi_every"] == bench.PHI_EVERY
    assert len(s["per_seed"]["diloco"]) == 3


def test_a_failed_arm_makes_its_figures_none_and_the_target_unmet():
    runs = _runs({"noloco": 0.3, "diloco": 0.4}, {"noloco": 1.0, "diloco": 1.0}, seeds=2)
    runs["diloco"][bench.BEST["diloco"]][1] = {"error": "RuntimeError: w1 exited 1"}
    s = bench.summarize(runs)
    assert s["bytes_per_param_noloco"] == pytest.approx(0.1)
    assert s["bytes_per_param_diloco"] is None
    assert s["wallclock_ratio_compressed_vs_fp32"] is None
    assert s["targets_met"]["bytes_per_param_diloco"] is False
    assert s["per_seed"]["diloco"][1] == {"error": True}


def test_fp32_that_is_not_four_bytes_is_flagged():
    runs = _runs({"noloco": 0.3, "diloco": 0.4}, {"noloco": 1.0, "diloco": 1.0})
    runs["diloco"]["fp32"][0]["bytes_per_param"] = 4.5
    assert bench.summarize(runs)["fp32_bytes_per_param_ok"] is False


def test_sweep_rows_and_table():
    runs = _runs({"noloco": 0.5, "diloco": 0.5}, {"noloco": 1.01, "diloco": 1.0})
    runs["noloco"]["int4_b64"] = {0: {"error": "TimeoutError: slow"}}
    rows = bench.sweep_rows(runs)
    assert [(r["outer"], r["setting"]) for r in rows] == [
        ("noloco", "int4_b64"), ("noloco", bench.BEST["noloco"]), ("diloco", bench.BEST["diloco"])]
    assert rows[0]["error"] and rows[0]["bytes_per_param"] is None
    assert rows[1]["eval_loss_ratio"] == pytest.approx(1.01)
    table = bench.sweep_markdown(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert "int4 block 64, phi int8 every 8" in table[2] and table[2].endswith("failed |")
    assert "| diloco | sign block 1024, hold 0.05 | 0.100 | 1.0000 | 0.50 |" == table[4]


def test_arm_settings_and_plan():
    assert bench.arm_settings("diloco", "fp32") == ["noloco.outer=diloco", "noloco.compression=none"]
    nl = bench.arm_settings("noloco", "int4_b64")
    assert "noloco.compression=int4" in nl and "noloco.compression_block=64" in nl
    assert f"noloco.compression_phi_every={bench.PHI_EVERY}" in nl
    quick = bench.plan(bench.QUICK, 1)
    assert quick == [("noloco", "fp32", 0), ("noloco", bench.BEST["noloco"], 0),
                     ("diloco", "fp32", 0), ("diloco", bench.BEST["diloco"], 0)]
    full = bench.plan(bench.FULL, 3)
    assert len(full) == 3 * 2 * 2 + 2 * (len(bench.SWEEP) - 1)  # fp32 + best per seed, the sweep at seed 0
    assert [s for o, s, k in full if (o, k) == ("noloco", 2)] == ["fp32", bench.BEST["noloco"]]
    assert {s for o, s, k in full if o == "diloco" and k == 0} == set(bench.SETTINGS)
    only = bench.plan(bench.QUICK, 1, {"noloco-int8_b128"})
    assert only == [("noloco", "fp32", 0), ("noloco", "int8_b128", 0)]


def test_curves_go_on_one_clock_from_the_first_worker_to_start():
    # w1 started 2.5 s after w0 from a downloaded state (loss 3.1 at its own 0 s)
    per = [_worker(2.9, [(0.0, 5.2), (1.0, 3.3), (4.0, 2.9)]), _worker(2.9, [(0.0, 3.1), (1.5, 2.9)])]
    shifted = bench.on_common_clock(per, ["2026-12-06T10:00:00.000Z", "2026-12-06T10:00:02.500Z"])
    assert shifted[0]["eval_curve"] == per[0]["eval_curve"]
    assert shifted[1]["eval_curve"] == [(pytest.approx(2.5), 3.1), (pytest.approx(4.0), 2.9)]
    assert [p["start_offset_s"] for p in shifted] == [0.0, pytest.approx(2.5)]
    # on one clock the swarm starts at w0's 5.2 and reaches a mean of 3.2 at 2.5 s; on the workers'
    # own clocks it would have had 4.15 at 0 s, before anyone had trained
    from benchmarks.noloco_swarm import mean_curve
    assert dict(mean_curve(shifted))[0.0] == pytest.approx(5.2)
    assert dict(mean_curve(shifted))[2.5] == pytest.approx((3.3 + 3.1) / 2)
    assert dict(mean_curve(per))[0.0] == pytest.approx((5.2 + 3.1) / 2)
