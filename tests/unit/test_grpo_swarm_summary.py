"""benchmarks/grpo_swarm.py's summary: both topologies against the same solo runs, the default's
figure at the top level (pure arithmetic on made-up final accuracies)."""

from __future__ import annotations

import pytest

from benchmarks.grpo_swarm import ARMS, summarize


def _run(arm: str, seed: int, finals: list[float]) -> dict:
    mode, topology = ARMS[arm]
    peer = {"accuracy_end": None, "accuracy_start": 0.1, "bytes_per_token": 10.0, "filtered_frac_mean": 0.1,
            "weight_mean": 0.8, "peers_seen_mean": 2.0, "rounds": 4, "skipped": 0, "finished": True}
    return {"arm": arm, "mode": mode, "topology": topology, "seed": seed,
            "peers": [{**peer, "accuracy_end": f} for f in finals]}


def test_summary_reports_both_topologies_against_the_shared_solo_runs():
    runs = []
    for seed in (0, 1):
        runs += [_run("solo", seed, [0.2, 0.2, 0.4]), _run("uncorrected", seed, [0.1, 0.2, 0.2]),
                 _run("ftis_horizontal", seed, [0.3, 0.2 + 0.1 * seed, 0.4]),
                 _run("ftis_vertical", seed, [0.2, 0.3, 0.6])]
    s = summarize(runs, [0, 1], default="horizontal")
    h, v = s["by_topology"]["horizontal"], s["by_topology"]["vertical"]
    assert h["gain_per_peer"] == pytest.approx([1.5, 1.25, 1.0])         # peer 1: mean(0.2, 0.3) / 0.2
    assert v["gain_per_peer"] == pytest.approx([1.0, 1.5, 1.5])
    assert h["reward_gain_ftis_vs_solo"] == pytest.approx(3.75 / 3) and v["reward_gain_ftis_vs_solo"] == pytest.approx(4 / 3)
    assert s["reward_gain_ftis_vs_solo"] == h["reward_gain_ftis_vs_solo"] and s["default_topology"] == "horizontal"
    assert s["reward_ratio_ftis_vs_uncorrected"] == pytest.approx((3 + 1.25 + 2) / 3)
    assert summarize(runs, [0, 1], default="vertical")["reward_gain_ftis_vs_solo"] == pytest.approx(4 / 3)
    assert s["targets"]["reward_gain_ftis_vs_solo"]["met"] is True
    # one topology only (--topologies horizontal): the other is absent, nothing breaks
    only = summarize([r for r in runs if r["arm"] != "ftis_vertical"], [0, 1], default="vertical")
    assert set(only["by_topology"]) == {"horizontal"} and only["reward_gain_ftis_vs_solo"] == pytest.approx(3.75 / 3)
    assert only["topology"] == "horizontal" and only["default_topology"] == "vertical"    # says whose figure it is
