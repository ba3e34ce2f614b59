"""benchmarks/robust_gossip.py's figures from worker logs: a diverged worker (its eval loss logged
as "nan") makes the run's mean inf and is counted, the JSON stays strict, and ``--from-keep``
rebuilds a run from the logs it kept."""

import json
import math

from benchmarks.robust_gossip import _json_safe, kept_run, mode_summary

HONEST = ["12D3KooWhonestA", "12D3KooWhonestB"]
ATTACKER = "12D3KooWattacker"


def _log(peer: str, partners_per_round: list[list[str]], clipped: list[tuple[str, bool]], eval_end) -> str:
    lines = [json.dumps({"event": "node_listening", "peer_id": peer})]
    for r, partners in enumerate(partners_per_round):
        lines.append(json.dumps({"event": "averaging_round_done", "peer_id": peer, "round": r, "outcome": "ok",
                                 "partners": partners, "pulled_back": [0.5] * len(partners)}))
    for who, hard in clipped:
        lines.append(json.dumps({"event": "partner_clipped", "peer_id": peer, "peer": who, "hard": hard}))
    lines.append(json.dumps({"event": "training_finished", "peer_id": peer, "eval_loss_end": eval_end, "step": 10}))
    return "\n".join(lines) + "\n"


def _keep(tmp_path, name, eval_ends, attacker: bool):
    d = tmp_path / f"noloco-{name}"
    d.mkdir()
    a, b = HONEST
    (d / "w0.log").write_text(_log(a, [[b], [b], [ATTACKER] if attacker else [b]],
                                   [(b, False)] + ([(ATTACKER, True)] if attacker else []), eval_ends[0]))
    (d / "w1.log").write_text(_log(b, [[a], [a], [a]], [], eval_ends[1]))
    if attacker:
        (d / "attacker.json").write_text(json.dumps({"peer_id": ATTACKER}))
    return d


def test_kept_runs_rebuild_the_figures_and_a_diverged_run_is_inf_and_counted(tmp_path):
    clean = kept_run("noloco", "clean_on", _keep(tmp_path, "clean_on", [2.0, 2.2], attacker=False))
    assert clean["eval_loss_end_mean"] == 2.1 and clean["workers_diverged"] == 0
    assert clean["honest_judged"] == 6 and clean["honest_clipped"] == 1 and clean["wall_s"] is None
    attacked = kept_run("noloco", "recipe_on", _keep(tmp_path, "recipe_on", [2.1, 2.1], attacker=True))
    assert attacked["honest_judged"] == 5 and attacked["honest_clipped"] == 1
    assert attacked["attacker_judged_ok"] == 1 and attacked["attacker_clipped_hard"] == 1
    off = kept_run("noloco", "clean_off", _keep(tmp_path, "clean_off", [2.0, 2.0], attacker=False))
    diverged = kept_run("noloco", "recipe_off", _keep(tmp_path, "recipe_off", ["nan", 5.5], attacker=True))
    assert diverged["eval_loss_end_mean"] == math.inf and diverged["workers_diverged"] == 1
    assert math.isnan(diverged["workers"][0]["eval_loss_end"])

    summary = mode_summary({"clean_on": clean, "clean_off": off, "recipe_on": attacked, "recipe_off": diverged})
    assert summary["honest_partner_clip_rate"] == 2 / 11
    assert summary["eval_loss_ratio_under_attack_vs_clean"] == 2.1 / 2.1
    assert summary["eval_loss_ratio_no_defense_under_attack_vs_clean"] == math.inf
    text = json.dumps(_json_safe(summary), allow_nan=False)  # strict JSON: raises on a bare inf / nan
    assert json.loads(text)["eval_loss_ratio_no_defense_under_attack_vs_clean"] == "inf"
