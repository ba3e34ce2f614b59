"""CheckFree in the live role, the pure parts: the executor aborts an iteration whose schedule lost
a node and restarts it cleanly (docs/pipeline.md, 'CheckFree recovery', in-flight iteration); the coordinator's vacancy;
the recovery helpers (renaming a neighbour's blocks, applying a rebuild: fresh optimizer at the
scaled LR, a replica's AdamW state as is)."""

from __future__ import annotations

from dataclasses import replace

import torch

from models.config import ModelConfig
from models.optim import InnerConfig
from models.stages import build_stage
from pipeline.checkfree import average_neighbours
from pipeline.stage_liveness import pick_vacancy, stage_replicas
from pipeline.recovery import Rebuilt, apply_recovery, optimizer_spec, relabel
from pipeline.schedule import Schedule
from pipeline.stage_exec import Aborted, Msg, StageExecutor, weights_sha256
from tests.unit.test_stage_exec import CFG, LR, S, SEED, RecordingSGD, _nodes, _run_iteration, _skip_schedule

REPLACEMENT = "peer08"


def _without_stage2(sched: Schedule) -> Schedule:
    """The same paths with stage 2's two nodes replaced by one new node (epoch 2)."""
    new = len(sched.names)
    parts = tuple((new,) if s == 2 else g for s, g in enumerate(sched.partitions))
    paths = tuple(tuple(new if sched.stage_of(x) == 2 else x for x in p) for p in sched.paths)
    return replace(sched, partitions=parts, paths=paths, epoch=2, names=(*sched.names, REPLACEMENT))


def _replacement(donor: StageExecutor) -> StageExecutor:
    mod = build_stage(CFG, SEED, 2, S)
    mod.load_state_dict(donor.module.state_dict())
    opt = RecordingSGD(mod.parameters(), LR)
    ex = StageExecutor(REPLACEMENT, 2, mod, opt, memory=3, clip=1.0)
    opt.ex = ex
    ex.iteration = donor.iteration
    return ex


def test_a_lost_node_aborts_the_running_iteration_which_restarts_without_residue():
    sched = _skip_schedule()
    sched2 = _without_stage2(sched)
    test, control = _nodes(sched), _nodes(sched)
    for nodes in (test, control):
        _run_iteration(nodes, sched)
    # test: iteration 1 starts on epoch 1 and stage 2's nodes die at once: the microbatches that skip
    # stage 2 go all the way (gradients accumulate elsewhere), the others stop at the dead nodes
    dead = [sched.names[x] for x in sched.partitions[2]]
    queue = []
    for x in sched.origins:
        ex = test[sched.names[x]]
        early = []
        ex.emit = early.extend
        queue += [(ex.me, o) for o in early + ex.start_iteration()]
    for ex in test.values():
        ex.emit = None
    lost_msgs = []
    while queue:
        src, o = queue.pop(0)
        if o.dest in dead:
            lost_msgs.append((src, o))
            continue
        queue += [(o.dest, new) for new in test[o.dest].handle(Msg(o.kind, src, o.meta, o.tensor))]
    assert lost_msgs and any(p.grad is not None for ex in test.values() for p in ex.module.parameters())
    assert all(ex.iteration == 1 for ex in test.values())
    repl_t, repl_c = _replacement(test[dead[0]]), _replacement(control[dead[0]])
    stale = [(src, o) for src, o in lost_msgs]
    for nodes, repl in ((test, repl_t), (control, repl_c)):
        for name in dead:
            del nodes[name]
        nodes[REPLACEMENT] = repl
        repl.add_schedule(sched)
        repl.add_schedule(sched2)
    for x in sched.origins:                                  # the control never started iteration 1:
        for _ in range(len(sched.path_ids(x))):              # skip the same batches the test consumed
            control[sched.names[x]].data()
    for name, ex in test.items():
        if name == REPLACEMENT:
            continue
        ex.add_schedule(sched2)
        aborted = [e for e in ex.events if isinstance(e, Aborted)]
        assert len(aborted) == 1 and aborted[0].iteration == 1 and aborted[0].new_epoch == 2, (name, aborted)
        assert set(aborted[0].lost) == set(dead)
        assert aborted[0].had_state == (ex.stage == 0)
        assert ex.epoch == 2 and ex.floor_epoch == 2 and 1 not in ex._it
        assert all(p.grad is None for p in ex.module.parameters()), "the aborted iteration left gradients"
    for name, ex in control.items():
        if name != REPLACEMENT:
            ex.add_schedule(sched2)
    # the aborted iteration's messages still arrive (re-sent to the replacement): dropped and counted
    for src, o in stale:
        assert repl_t.handle(Msg(o.kind, src, o.meta, o.tensor)) == []
    assert repl_t.dropped["aborted_epoch"] == len(stale)
    # the origins restart iteration 1 on epoch 2; it completes with one step per node
    for nodes in (test, control):
        _run_iteration(nodes, sched2)
    for name in test:
        assert test[name].iteration == 2 == control[name].iteration
        if name != REPLACEMENT:
            assert test[name].opt.steps == 2
        for (n, p), (_, q) in zip(test[name].module.named_parameters(), control[name].module.named_parameters()):
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=f"{name} {n}: the aborted iteration left a trace")


def test_a_replanned_join_without_a_lost_node_does_not_abort():
    sched = _skip_schedule()
    nodes = _nodes(sched)
    _run_iteration(nodes, sched)
    again = replace(sched, epoch=2)
    for ex in nodes.values():
        ex.add_schedule(again)
        assert not [e for e in ex.events if isinstance(e, Aborted)] and ex.floor_epoch == 0


def test_a_plan_with_a_restarted_node_aborts_the_iteration_its_old_process_held():
    """A stage node restarted as itself and rebuilt keeps its peer ID, so the re-plan names the
    same nodes; what its old process held of the running iteration died with it. Each plan records
    the process (`incarnations`: the cards' started_at) and the iteration aborts as if the node were
    lost (on real processes it stalled at iteration 25 for 120 s until the watchdog ended the run;
    in the chaos soak, after a coordinator takeover, for 47 s). A thawed node (same process) aborts
    nothing, nor does a plan without incarnations."""
    base = _skip_schedule()
    sched = replace(base, incarnations=tuple(float(i) for i in range(len(base.names))))
    victim_i = sched.partitions[2][0]
    victim = sched.names[victim_i]
    renewed = replace(sched, epoch=2, incarnations=tuple(t + 100.0 if i == victim_i else t
                                                        for i, t in enumerate(sched.incarnations)))
    assert Schedule.from_json(renewed.to_json()) == renewed and "incarnations" not in base.to_dict()
    assert renewed.renewed_since(sched) == {victim} and not replace(sched, epoch=2).renewed_since(sched)
    assert not renewed.renewed_since(base) and not base.renewed_since(sched)
    for new, expect in ((replace(sched, epoch=2), ()), (renewed, (victim,))):
        nodes = _nodes(sched)
        _run_iteration(nodes, sched)
        for x in sched.origins:                              # iteration 1 starts on epoch 1
            nodes[sched.names[x]].start_iteration()
        for x in sched.origins:
            ex = nodes[sched.names[x]]
            ex.add_schedule(new)
            aborted = [e for e in ex.events if isinstance(e, Aborted)]
            assert [a.lost for a in aborted] == ([expect] if expect else []), aborted


def test_vacancy_prefers_a_lost_stage_then_the_least_replicated():
    members = [("a", 0), ("b", 1), ("c", 3), ("d", 3), ("e", 1)]
    members = [(p, s, "", None, None, None) for p, s in members]
    reps = stage_replicas(members, 4)
    assert reps == {0: 1, 1: 2, 2: 0, 3: 2}
    assert pick_vacancy(reps) == 2
    assert pick_vacancy({0: 1, 1: 2, 2: 1, 3: 1}) == 2
    assert pick_vacancy({0: 0, 1: 1, 2: 1}) == 0
    assert pick_vacancy({0: 1, 1: 1, 2: 0, 3: 0, 4: 1}, claimed={2}) == 3   # two lost: the next replacement
    assert pick_vacancy({0: 1, 1: 1, 2: 1, 3: 1}, peak={1: 1, 2: 2, 3: 1}) == 2  # stage 2 lost one of two


def test_relabel_averages_neighbours_by_position_and_apply_resets_the_optimizer():
    cfg = ModelConfig(d_model=16, n_layers=3, n_heads=2, max_seq_len=16)
    left, mid, right = (build_stage(cfg, seed, s, 4) for seed, s in ((1, 1), (2, 2), (3, 3)))
    names = [n for n, _ in mid.named_parameters()]
    lw = relabel(dict(left.named_parameters()), [n for n, _ in left.named_parameters()], names)
    rw = relabel(dict(right.named_parameters()), [n for n, _ in right.named_parameters()], names)
    avg = average_neighbours({k: v.detach() for k, v in lw.items()}, {k: v.detach() for k, v in rw.items()},
                             left_norm=1.0, right_norm=1.0, left_iteration=5, right_iteration=5)
    optim = InnerConfig(lr=0.01, warmup=0, total_steps=100, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05)
    r = Rebuilt(2, "average", 5, avg, None, {1: "x", 3: "y"})
    opt, sched = apply_recovery(mid, r, optim, 1.2)
    for n, p in mid.named_parameters():
        torch.testing.assert_close(p.detach(), (lw[n].detach() + rw[n].detach()) / 2, atol=1e-7, rtol=0)
    assert opt.param_groups[0]["initial_lr"] == 1.2 * 0.01 and not opt.state
    assert sched.last_epoch == 5        # the fresh AdamW carries the run's betas, eps and weight decay
    assert (opt.param_groups[0]["betas"], opt.param_groups[0]["eps"], opt.param_groups[0]["weight_decay"]) == \
        ((0.85, 0.98), 1e-7, 0.05)
    # a second recovery does not compound the scale
    opt2, _ = apply_recovery(mid, r, optim, 1.2)
    assert opt2.param_groups[0]["initial_lr"] == 1.2 * 0.01


def test_a_replica_copy_keeps_the_donor_optimizer_state():
    cfg = ModelConfig(d_model=16, n_layers=3, n_heads=2, max_seq_len=16)
    donor, joiner = build_stage(cfg, 1, 2, 4), build_stage(cfg, 9, 2, 4)
    dopt = torch.optim.AdamW(donor.parameters(), lr=0.01)
    donor(torch.randn(2, 8, 16)).square().mean().backward()
    dopt.step()
    flat = {}
    for n, p in donor.named_parameters():
        for k, v in dopt.state[p].items():
            flat[f"{n}.{k}"] = v.detach().float().reshape(v.shape)
    assert set(flat) == set(optimizer_spec(donor))
    r = Rebuilt(2, "replica", 1, {n: p.detach().clone() for n, p in donor.named_parameters()}, flat, {2: "x"})
    opt, _ = apply_recovery(joiner, r, InnerConfig(lr=0.01, warmup=0, total_steps=100), 1.2)
    assert weights_sha256(joiner) == weights_sha256(donor)
    assert opt.param_groups[0]["initial_lr"] == 0.01
    for (n, p), q in zip(joiner.named_parameters(), donor.parameters()):
        torch.testing.assert_close(opt.state[p]["exp_avg"], dopt.state[q]["exp_avg"], atol=0, rtol=0)
        assert float(opt.state[p]["step"]) == 1.0


def test_checkfree_plus_paths_swap_exactly_the_odd_microbatches():
    """P24 in the live schedule: with k = 0 odd microbatches of each origin visit (2,1,...,T,T-1),
    even ones run in order; the nodes per stage (visits, memory) are unchanged."""
    from pipeline.checkfree import checkfree_plus_order
    from pipeline.cluster import Cluster
    from pipeline.paths import PathRules
    from pipeline.schedule import checkfree_plus_paths, validate_schedule
    from pipeline.search import plan

    for stages in (5, 7):
        n = stages + 1                                    # two data nodes
        parts = [(0, 1)] + [(s + 1,) for s in range(1, stages)]
        cluster = Cluster(compute=[0.05] * n, comm=[[0.0 if i == j else 0.01 for j in range(n)] for i in range(n)],
                          memory=4, names=[f"n{i}" for i in range(n)])
        rules = PathRules.from_skip_ratio(stages, 0.0)
        base = plan(cluster, parts, rules, 4, method="full", seed=0, time_budget_s=1.0)
        plus = validate_schedule(checkfree_plus_paths(base), cluster)
        assert plus.stage_visits() == base.stage_visits() and plus.node_visits() == base.node_visits()
        for origin in plus.origins:
            for seq, pid in enumerate(plus.path_ids(origin)):
                assert list(plus.stages(pid)[1:]) == checkfree_plus_order(seq, stages - 1), (stages, seq)


def test_adjacent_failure_restores_the_newest_checkpoint_of_any_replica(tmp_path):
    """P23 fallback: with stage 2 and a neighbour lost, the stage comes back from the newest
    checkpoint any of its replicas wrote under checkpoint_dir (weights and AdamW state), joining
    at the survivors' iteration; its age is reported. Never an average with missing weights."""
    from models.optim import build_optimizer, inner_lr_scheduler
    from node.checkpoint import Checkpointer
    from pipeline.checkfree import choose_recovery
    from pipeline.recovery import newest_checkpoint, rebuilt_from_checkpoint, stage_checkpoint_dir

    cfg = ModelConfig(d_model=16, n_layers=4, n_heads=2, max_seq_len=16)
    optim = InnerConfig(lr=0.01, warmup=0, total_steps=100)
    written = {}
    for peer, it, seed in (("peerA", 10, 1), ("peerB", 15, 2)):
        mod = build_stage(cfg, seed, 2, 5)
        opt = build_optimizer(mod.parameters(), optim)
        mod(torch.randn(2, 8, 16)).square().mean().backward()
        opt.step()
        Checkpointer(stage_checkpoint_dir(tmp_path, 2) / peer, "fmt", "h2").save(
            {"stage": mod, "optimizer": opt, "lr_schedule": inner_lr_scheduler(opt, optim)},
            {"iteration": it, "stage": 2, "cfg_hash": "h2"})
        written[it] = (weights_sha256(mod), opt.state_dict()["state"][0]["exp_avg"].clone())
    rule = choose_recovery(2, 4, alive={0, 1, 4}, has_checkpoint=True)
    assert rule.rule == "checkpoint"
    assert choose_recovery(2, 4, alive={0, 1, 4}).rule == "nearest"        # no checkpoint: never "average"
    assert newest_checkpoint(tmp_path, 3, "fmt", "h3") is None
    state = newest_checkpoint(tmp_path, 2, "fmt", "h2")
    assert state["meta"]["iteration"] == 15
    r = rebuilt_from_checkpoint(state, 2, 21)
    assert r.iteration == 21 and r.norms[-1] == 6 and "6 iterations old" in r.warn
    target = build_stage(cfg, 9, 2, 5)
    opt, sched = apply_recovery(target, r, optim, 1.2)
    assert weights_sha256(target) == written[15][0]
    torch.testing.assert_close(opt.state_dict()["state"][0]["exp_avg"], written[15][1], atol=0, rtol=0)
    assert sched.last_epoch == 21 and opt.param_groups[0]["initial_lr"] == 0.01


def test_a_replica_lost_after_the_backwards_leaves_its_twin_a_degraded_step_not_a_lag():
    """Stage 2's replica peer05 dies after every backward of iteration 1 but before its gradient
    reached peer04: every other stage steps on iteration 1; peer04 must not abort it (it would lag
    one iteration behind forever) but step with its own gradient when the schedule drops peer05."""
    sched = _skip_schedule()
    nodes = _nodes(sched)
    _run_iteration(nodes, sched)
    dead = "peer05"
    queue = []
    for x in sched.origins:
        ex = nodes[sched.names[x]]
        early = []
        ex.emit = early.extend
        queue += [(ex.me, o) for o in early + ex.start_iteration()]
    for ex in nodes.values():
        ex.emit = None
    while queue:
        src, o = queue.pop(0)
        if o.kind == "grad" and dead in (src, o.dest):
            continue
        queue += [(o.dest, new) for new in nodes[o.dest].handle(Msg(o.kind, src, o.meta, o.tensor))]
    twin = nodes["peer04"]
    assert twin.iteration == 1 and all(ex.iteration == 2 for n, ex in nodes.items() if n not in ("peer04", dead))
    own = twin._it[1].grads["peer04"]
    parts = tuple(tuple(x for x in g if sched.names[x] != dead) for g in sched.partitions)
    paths = tuple(tuple(4 if sched.names[x] == dead else x for x in p) for p in sched.paths)
    sched2 = replace(sched, partitions=parts, paths=paths, epoch=sched.epoch + 1)
    del nodes[dead]
    for ex in nodes.values():
        ex.add_schedule(sched2)
    assert twin.iteration == 2 and twin.dropped["degraded_step"] == 1 and twin.opt.steps == 2
    expected = own[1] / own[0]
    got = torch.cat([g.reshape(-1) for g in twin.opt.seen[1].values()])
    norm = float(expected.norm())
    torch.testing.assert_close(got, expected * min(1.0, 1.0 / norm), atol=1e-6, rtol=1e-5)
    _run_iteration(nodes, sched2)
    assert all(ex.iteration == 3 for ex in nodes.values()), {n: ex.iteration for n, ex in nodes.items()}


def test_a_neighbour_found_lost_during_the_rebuild_sends_the_stage_to_its_checkpoint():
    """Two adjacent stages die together, but the coordinator's probes report them a poll apart: the
    replacement of stage 2 first sees only stage 2 down and decides to average stages 1 and 3. When
    stage 3 is reported lost while it waits for stage 3's state, it stops fetching and decides again:
    adjacent -> checkpoint (P23), never an average with a dead neighbour, never a 20 s fetch timeout."""
    import asyncio
    from types import SimpleNamespace

    from pipeline.config import CheckFreeConfig
    from pipeline.recovery import StageRecovery

    first = SimpleNamespace(live_stages=[0, 1, 3, 4], down_stages=[2], replicas={0: 1, 1: 1, 2: 0, 3: 1, 4: 1})
    later = SimpleNamespace(live_stages=[0, 1, 4], down_stages=[2, 3], replicas={0: 1, 1: 1, 2: 0, 3: 0, 4: 1})
    calls = []

    async def status():
        calls.append(1)
        return first if len(calls) < 3 else later

    fetching = []

    async def rebuild(stage, r):        # stage 3's dead card never serves: the fetch would wait
        fetching.append(r.rule)
        await asyncio.sleep(60)

    rec = StageRecovery(ctx=SimpleNamespace(config=SimpleNamespace(run_id="r")), me="peerZ", n_stages=5,
                        cfg=CheckFreeConfig(), build=lambda i: None, cfg_hash_of=str, status=status,
                        has_checkpoint=lambda s: True)
    rec.rebuild = rebuild

    async def go():
        return await asyncio.wait_for(rec.decide_and_rebuild(2, first), 10)
    rule, rebuilt = asyncio.run(go())
    assert fetching == ["average"] and rule.rule == "checkpoint" and rebuilt is None
    assert len(calls) == 3                         # stopped as soon as stage 3 was reported lost


def test_a_replacement_never_copies_a_quarantined_replica(monkeypatch):
    """After a quarantine the attacker is still live and still publishes a READY card for its stage,
    possibly the most advanced one: the donors a replacement asks are the coordinator's non-quarantined
    nodes only (ScheduleStatus.quarantined)."""
    import asyncio
    import time as _time
    from types import SimpleNamespace

    import pipeline.recovery as recovery
    from node.card import CardView, NodeCard
    from pipeline.config import CheckFreeConfig
    from pipeline.recovery import StageRecovery

    def view(peer, it):
        card = NodeCard(role="stage", state="ready", version="0", grpc_addr="127.0.0.1:1", started_at=0.0,
                        published_at=_time.time(), details={"stage": 1, "iteration": it, "cfg_hash": "h1"})
        return CardView(peer, card, _time.time() + 30)

    views = [view("attacker", 40), view("honest", 30)]

    async def fake_read_cards(dht, run_id):
        return views
    monkeypatch.setattr(recovery, "read_cards", fake_read_cards)

    async def status():
        return SimpleNamespace(quarantined=["attacker"])

    rec = StageRecovery(ctx=SimpleNamespace(config=SimpleNamespace(run_id="r"), membership=SimpleNamespace(dht=None)),
                        me="peerZ", n_stages=3, cfg=CheckFreeConfig(), build=lambda i: None,
                        cfg_hash_of=lambda i: f"h{i}", status=status)
    got = asyncio.run(rec._donor_views(1))
    assert [v.peer_id for v in got] == ["honest"]
    rec.status = None                    # no coordinator to ask: the card order alone would pick the attacker
    rec.quarantined = set()
    assert [v.peer_id for v in asyncio.run(rec._donor_views(1))][0] == "attacker"


def test_a_hot_spare_refills_a_stage_only_after_it_stayed_a_replica_short():
    """standby_refill_s: a spare copies a replica into a stage that stayed short that long (a lost
    or quarantined replica), never at the first sight of it (the stage's other replica may be dying
    too); with 0 it waits for a lost stage only."""
    import asyncio
    from types import SimpleNamespace

    import pipeline.recovery as recovery
    from pipeline.config import CheckFreeConfig
    from pipeline.recovery import StageRecovery

    short = SimpleNamespace(epoch=2, suspended=False, vacancy=1, short_stages=[1])

    async def status():
        return short

    def spare(refill):
        return StageRecovery(ctx=SimpleNamespace(config=SimpleNamespace(run_id="r")), me="peerZ", n_stages=3,
                             cfg=CheckFreeConfig(recover=True, standby=True, standby_refill_s=refill),
                             build=lambda i: None, cfg_hash_of=str, status=status)

    async def timed(rec, limit):
        t0 = asyncio.get_running_loop().time()
        stage, _ = await asyncio.wait_for(rec.vacancy(), limit)
        return stage, asyncio.get_running_loop().time() - t0

    old = recovery.RETRY_S
    recovery.RETRY_S = 0.05
    try:
        stage, waited = asyncio.run(timed(spare(0.4), 5))
        assert stage == 1 and 0.4 <= waited < 1.5
        try:
            asyncio.run(timed(spare(0.0), 1.0))
            raise AssertionError("a spare with standby_refill_s=0 took a live stage")
        except (asyncio.TimeoutError, TimeoutError):
            pass
    finally:
        recovery.RETRY_S = old


def test_a_stage_skeleton_is_built_once_when_the_warm_up_and_the_rebuild_ask_together():
    """A spare warms every stage's meta skeleton while it waits; the rebuild that starts meanwhile
    awaits the build in progress instead of starting a second one (each costs seconds on 2 cores)."""
    import asyncio
    import threading
    import time as _time
    from types import SimpleNamespace

    from pipeline.config import CheckFreeConfig
    from pipeline.recovery import StageRecovery

    builds: list[int] = []
    lock = threading.Lock()

    def build(i):
        with lock:
            builds.append(i)
        _time.sleep(0.2)                     # a slow build: both callers arrive while it runs
        return build_stage(CFG, SEED, i, S)

    rec = StageRecovery(ctx=SimpleNamespace(config=SimpleNamespace(run_id="r")), me="peerZ", n_stages=S,
                        cfg=CheckFreeConfig(), build=build, cfg_hash_of=str, status=None)

    async def go():
        warm = asyncio.ensure_future(rec.skeleton(1))
        await asyncio.sleep(0.05)
        names = await rec.names(1)
        return (await warm), names
    mod, names = asyncio.run(go())
    assert builds == [1], builds
    assert names == [n for n, _ in mod.named_parameters()] and names
    assert all(p.device.type == "meta" for p in mod.parameters())


def _outage_recovery(monkeypatch, answers, outage_s):
    """A StageRecovery whose `status()` plays `answers` (an exception = the coordinator does not
    answer) on a fake clock that moves 10 s per call."""
    import asyncio
    from types import SimpleNamespace

    import pipeline.recovery as recovery
    from pipeline.config import CheckFreeConfig
    from pipeline.recovery import StageRecovery

    clock = {"t": 0.0}
    monkeypatch.setattr(recovery, "time", SimpleNamespace(monotonic=lambda: clock["t"], time=lambda: clock["t"]))
    monkeypatch.setattr(recovery, "RETRY_S", 0.0)
    it = iter(answers)

    async def status():
        clock["t"] += 10.0
        a = next(it)
        if isinstance(a, Exception):
            raise a
        return a
    rec = StageRecovery(ctx=SimpleNamespace(config=SimpleNamespace(run_id="r")), me="peerZ", n_stages=3,
                        cfg=CheckFreeConfig(), build=lambda i: None, cfg_hash_of=str, status=status,
                        coordinator_outage_s=outage_s)
    return rec, (lambda coro: asyncio.run(asyncio.wait_for(coro, 10)))


def _unavailable():
    import grpc
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="failed to connect to all addresses")


def test_a_replacement_waits_out_a_coordinator_outage_for_its_vacancy(monkeypatch):
    """Issue 29: a replacement started while the bootstrap is down (restarting, or a standby about
    to take over) waits for a coordinator instead of giving up after `wait_s`: 12 calls without an
    answer are 120 s on the fake clock, past the 60 s floor of the vacancy wait."""
    from types import SimpleNamespace

    vacant = SimpleNamespace(short_stages=[1], vacancy=1, epoch=3, suspended=True)
    rec, run = _outage_recovery(monkeypatch, [_unavailable()] * 12 + [vacant], outage_s=900.0)
    stage, st = run(rec.vacancy())
    assert stage == 1 and st is vacant


def test_a_replacement_gives_up_after_coordinator_outage_s_and_says_so(monkeypatch):
    import pytest

    from pipeline.checkfree import RecoveryError

    rec, run = _outage_recovery(monkeypatch, [_unavailable()] * 40, outage_s=100.0)
    with pytest.raises(RecoveryError, match="did not answer for"):
        run(rec.vacancy())


# ---- a stage node restarted as itself into a run underway (issue 29's known gap)
def _statuses(answers):
    import asyncio

    it = iter(answers)

    async def status():
        a = next(it)
        if isinstance(a, Exception):
            raise a
        await asyncio.sleep(0)
        return a
    return status


def test_a_node_started_for_a_lost_stage_is_told_to_rebuild_it_and_a_fresh_run_is_not():
    """pipeline/replacement.py `lost_stage_on_start`: a node started with `stage.index` into a run
    whose stage is lost rebuilds it (it used to start at its initial weights at iteration 0 beside
    neighbours at N, and the pipeline stalled on it); a fresh run (no schedule yet) or a stage with
    live nodes builds at the initial weights as before."""
    import asyncio
    from types import SimpleNamespace

    from pipeline.replacement import lost_stage_on_start

    def run(answers, index=1, watch_s=0.3, outage_s=5.0):
        return asyncio.run(asyncio.wait_for(lost_stage_on_start(_statuses(answers), index, outage_s, watch_s), 10))

    fresh = SimpleNamespace(epoch=0, missing_stages=[])
    lost = SimpleNamespace(epoch=4, missing_stages=[1])
    live = SimpleNamespace(epoch=4, missing_stages=[])
    assert run([fresh]) is None
    assert run([lost]) is lost
    assert run([live, live, lost], watch_s=3.0) is lost   # its old incarnation is noticed gone a poll later
    assert run([live] * 100, watch_s=0.2) is None   # an extra replica of a live stage: as before
    assert run([SimpleNamespace(epoch=4, missing_stages=[2])] * 100, watch_s=0.2) is None  # another stage's loss
    assert run([_unavailable(), lost]) is lost      # the coordinator answers after a moment


def test_a_restarted_node_takes_its_own_lost_stage_before_the_coordinators_pick(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    import pipeline.recovery as recovery
    from pipeline.config import CheckFreeConfig
    from pipeline.recovery import StageRecovery

    monkeypatch.setattr(recovery, "RETRY_S", 0.0)
    two_lost = SimpleNamespace(epoch=5, suspended=True, vacancy=0, missing_stages=[0, 2], claimed_stages=[],
                               short_stages=[])

    def rec(answers):
        return StageRecovery(ctx=SimpleNamespace(config=SimpleNamespace(run_id="r")), me="peerZ", n_stages=3,
                             cfg=CheckFreeConfig(), build=lambda i: None, cfg_hash_of=str, status=_statuses(answers))
    assert asyncio.run(rec([two_lost]).vacancy(prefer=2))[0] == 2
    assert asyncio.run(rec([two_lost]).vacancy())[0] == 0
    claimed = SimpleNamespace(**{**vars(two_lost), "claimed_stages": [2]})   # another replacement took it
    assert asyncio.run(rec([claimed]).vacancy(prefer=2))[0] == 0
