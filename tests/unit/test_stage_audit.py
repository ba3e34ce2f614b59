"""Attributing a replica disagreement by replaying its last AdamW step (pipeline/stage_audit.py)
and the coordinator's commit bookkeeping (pipeline/coordinator.py), pure parts."""

import torch

from node.status import card_rows, format_table
from pipeline.coordinator import commit_disagreements, parse_commit, parse_commits
from pipeline.stage_audit import RESIDUAL_LR, commit_of, replay_residual


def _stepped(lr: float, wd: float, steps: int, edit: float = 0.0):
    torch.manual_seed(0)
    mod = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(mod.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    before = None
    for _ in range(steps):
        before = {n: p.detach().clone() for n, p in mod.named_parameters()}
        mod(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(torch.full_like(p, edit * lr))      # outside the gradient path
    after = {n: p.detach().clone() for n, p in mod.named_parameters()}
    state = {}
    for n, p in mod.named_parameters():
        for k, v in opt.state[p].items():
            state[f"{n}.{k}"] = v.detach().float().clone()
    return before, after, state


def test_an_honest_step_replays_and_an_edited_one_does_not():
    for wd in (0.0, 0.1):
        before, after, state = _stepped(1e-3, wd, 3)
        res, _ = replay_residual(before, after, state, 1e-3, (0.9, 0.999), 1e-8, wd)
        assert res < 1e-3, res
        before, after, state = _stepped(1e-3, wd, 3, edit=0.2)
        res, where = replay_residual(before, after, state, 1e-3, (0.9, 0.999), 1e-8, wd)
        assert res > RESIDUAL_LR and where


def test_commit_of_matches_the_stage_hash():
    from pipeline.stage_msgs import weights_sha256
    mod = torch.nn.Linear(3, 2)
    assert commit_of({n: p for n, p in mod.named_parameters()}) == weights_sha256(mod)


def test_commits_parse_strictly_and_disagreements_are_found_per_stage():
    assert parse_commit("12:ab09") == (12, "ab09")
    for bad in (None, 3, "x:ab", "12:", "12:XYZ", "1:" + "a" * 65):
        assert parse_commit(bad) is None
    assert parse_commits("5:aa,4:bb,x,3:") == [(5, "aa"), (4, "bb")] and parse_commits(7) == []
    sched = [("a", 1), ("b", 1), ("c", 2), ("d", 2)]
    commits = {"a": {3: "aa", 4: "bb"}, "b": {3: "aa", 4: "cc"}, "c": {4: "dd"}, "d": {5: "ee"}}
    assert commit_disagreements(sched, commits) == {1: 4}
    commits["b"][4] = "bb"
    assert commit_disagreements(sched, commits) == {}


def test_status_names_quarantined_nodes_and_why():
    from types import SimpleNamespace as NS
    card = lambda role, **d: NS(role=role, state="ready", version="1", grpc_addr="x", published_at=0.0,  # noqa: E731
                                started_at=0.0, details=d)
    views = [NS(peer_id="BOOT0000", card=card("bootstrap", quarantined="12345678=replica_commit@7: step 7 does not "
                                                                      "replay")),
             NS(peer_id="AAAA12345678", card=card("stage", stage=2)), NS(peer_id="BBBB87654321", card=card("stage", stage=2))]
    rows = card_rows(views, now=1.0)
    assert rows[1]["quarantined_why"].startswith("replica_commit@7") and "quarantined_why" not in rows[2]
    text = format_table(rows)
    assert "AAAA12345678…: QUARANTINED by the schedule coordinator: replica_commit@7" in text
    assert "BBBB87654321…: QUARANTINED" not in text


async def test_an_audit_that_cannot_run_raises_the_alert_and_a_later_run_clears_it(monkeypatch, caplog):
    """Issue 33, finding 2: a refused download is an alert at once (metric, `audit_blocked` event,
    the coordinator's /readyz detail), a replica inconclusive INCONCLUSIVE_ALERT_AFTER times in a
    row too; an audit that runs again clears it."""
    import logging
    from types import SimpleNamespace

    from node import ready_details
    from node.state_sync import StateFetchError
    from pipeline import stage_metrics as M
    from pipeline.replica_audits import INCONCLUSIVE_ALERT_AFTER, ReplicaAudits, StageAuditSpec

    ctx = SimpleNamespace(config=SimpleNamespace(run_id="r"), peer_id="coord")
    audits = ReplicaAudits(ctx, StageAuditSpec(lambda i: ((), (), ""), (0.9, 0.999), 1e-8, 0.0), 0.0, 3,
                           lambda peer, stage, why: None)
    answers: dict[str, Exception | tuple] = {}

    async def audit_one(stage, m):
        a = answers[m[0]]
        if isinstance(a, Exception):
            raise a
        return a
    monkeypatch.setattr(audits, "audit_one", audit_one)
    peers = [("A", 1, "a:1"), ("B", 1, "b:1")]
    answers["A"] = StateFetchError("state download from a:1 refused: PERMISSION_DENIED: admission refused: no token")
    answers["B"] = ValueError("its state of iteration 4 is no longer kept")
    with caplog.at_level(logging.INFO, logger="swarmnode.pipeline.coordinator"):
        await audits.audit_stage(1, 5, peers)
        blocked = [r._fields for r in caplog.records if getattr(r, "event", None) == "audit_blocked"]
        assert [(b["peer"], b["refused"]) for b in blocked] == [("A", True)]
        assert "security.coordinator_peer_id" in blocked[0]["hint"]
        assert M.AUDITS_BLOCKED._value.get() == 1
        assert set(ready_details.snapshot()["stage_audits"]["blocked"]) == {"A"}
        for _ in range(INCONCLUSIVE_ALERT_AFTER - 1):          # B raced on: alert only when it keeps happening
            await audits.audit_stage(1, 5, peers)
    assert set(audits.blocked) == {"A", "B"} and M.AUDITS_BLOCKED._value.get() == 2
    answers["A"] = (True, "step 5 replays", 5)
    await audits.audit_stage(1, 6, peers)
    assert set(ready_details.snapshot()["stage_audits"]["blocked"]) == {"B"} and M.AUDITS_BLOCKED._value.get() == 1
    audits.forget("B")
    assert ready_details.snapshot()["stage_audits"]["blocked"] == {} and M.AUDITS_BLOCKED._value.get() == 0
