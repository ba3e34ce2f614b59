"""The SkipPipe executor (pipeline/stage_exec.py) on in-process nodes: routing, deferral,
visit-normalised replica averaging, one step per iteration, bad input.

Messages between executors are delivered by a tiny in-process loop (the executors are
transport-free; the real streams are covered by tests/integration/test_pipeline_swarm.py).
The reference is a single process running every microbatch along its path with
models.stages.run_path_stagewise, then per stage: sum / visits, clip, one SGD step.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from models.config import ModelConfig
from models.stages import StageSet, build_stage, run_path_stagewise
from pipeline.cluster import Cluster
from pipeline.paths import PathRules
from pipeline.schedule import Schedule, validate_schedule
from pipeline.search import full_pipeline_schedule, plan
from pipeline.stage_exec import BadInput, EvalResult, Msg, StageExecutor, StepResult, weights_sha256

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=16)
S, SEED, LR, CLIP = 4, 3, 0.1, 1.0
B, T = 2, 8


def _data(origin: int):
    g = torch.Generator().manual_seed(1000 + origin)

    def next_batch():
        x = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    return next_batch


def _cluster(n: int) -> Cluster:
    return Cluster(compute=[0.05] * n, comm=[[0.0 if i == j else 0.01 for j in range(n)] for i in range(n)],
                   memory=3, names=[f"peer{i:02d}" for i in range(n)])


def _nodes(sched: Schedule, memory: int = 3, clip: float = CLIP):
    nodes = {}
    for s, group in enumerate(sched.partitions):
        for x in group:
            mod = build_stage(CFG, SEED, s, S)
            ex = StageExecutor(sched.names[x], s, mod, torch.optim.SGD(mod.parameters(), lr=LR), memory=memory,
                               clip=clip, data=_data(x) if s == 0 else None,
                               eval_data=[_data(99)()] if s == 0 else None)
            ex.add_schedule(sched)
            nodes[sched.names[x]] = ex
    return nodes


def _pump(nodes, outs, rng=None, log=None):
    """Deliver until quiet; with `rng`, in random order (streams keep per-link order only)."""
    links = defaultdict(list)  # (src, dst) -> FIFO
    for src, o in outs:
        links[(src, o.dest)].append(o)
    while any(links.values()):
        keys = [k for k, v in links.items() if v]
        key = rng.choice(keys) if rng else keys[0]
        o = links[key].pop(0)
        if log is not None:
            log.append((key[0], o.dest, o.kind, dict(o.meta)))
        for new in nodes[o.dest].handle(Msg(o.kind, key[0], o.meta, o.tensor)):
            links[(o.dest, new.dest)].append(new)


def _run_iteration(nodes, sched, rng=None, log=None):
    outs = []
    for x in sched.origins:
        ex = nodes[sched.names[x]]
        outs += [(ex.me, o) for o in ex.start_iteration()]
    _pump(nodes, outs, rng, log)


def _reference(sched: Schedule, iterations: int, clip: float = CLIP):
    ref = StageSet.build(CFG, SEED, S)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in ref.stages]
    data = {x: _data(x) for x in sched.origins}
    for _ in range(iterations):
        ref.zero_grad()
        visits = [0] * S
        for origin, seq, pid in sched.microbatches():
            x, y = data[origin]()
            run_path_stagewise(ref, x, y, sched.stages(pid))
            for s in sched.stages(pid):
                visits[s] += 1
        for s, m in enumerate(ref.stages):
            for p in m.parameters():
                if p.grad is not None:
                    p.grad /= visits[s]
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
            opts[s].step()
    return ref


def _skip_schedule(seed=0):
    rules = PathRules.from_skip_ratio(S, 1 / 3)
    return plan(_cluster(8), [(0, 1), (2, 3), (4, 5), (6, 7)], rules, 3, seed=seed, time_budget_s=2.0,
                max_iters=300)




@pytest.mark.parametrize("order_seed", [None, 1, 2])
def test_skip_schedule_matches_single_process_reference(order_seed):
    sched = _skip_schedule()
    assert sched.rules.L == 3 and any(len(set(sched.stages(p))) == 3 for p in range(len(sched.paths)))
    nodes = _nodes(sched)
    rng = random.Random(order_seed) if order_seed is not None else None
    for _ in range(2):
        _run_iteration(nodes, sched, rng)
    ref = _reference(sched, 2)
    for ex in nodes.values():
        assert ex.iteration == 2 and not ex.dropped, ex.dropped
        steps = [e for e in ex.events if isinstance(e, StepResult)]
        assert [e.iteration for e in steps] == [0, 1]          # exactly one step per iteration
        want = dict(ref.stages[ex.stage].named_parameters())
        for name, p in ex.module.named_parameters():
            torch.testing.assert_close(p, want[name], atol=1e-5, rtol=0)
    for s, group in enumerate(sched.partitions):                # replicas bitwise identical
        assert len({weights_sha256(nodes[sched.names[x]].module) for x in group}) == 1


def test_unequal_replica_visits_are_normalised_by_visits():
    """Stage 1's replica A sees 3 microbatches, B sees 1: the stage gradient is the mean over all
    4 (not the mean of the two replica means)."""
    names = [f"peer{i:02d}" for i in range(8)]
    rules = PathRules(S=S, L=3, max_jump=4, max_swaps=0, max_total_swap_distance=0, cap_visits_by_memory=False)
    parts = ((0, 1), (2, 3), (4, 5), (6, 7))
    paths = [(0, 2, 4), (1, 2, 6), (0, 2, 7), (1, 3, 5), (0, 4, 6), (1, 5, 7)]
    sched = validate_schedule(Schedule(partitions=parts, paths=tuple(paths), rules=rules, epoch=1, names=names))
    nodes = _nodes(sched)
    _run_iteration(nodes, sched)
    ref = _reference(sched, 1)
    a, b = nodes["peer02"], nodes["peer03"]
    assert [e.visits for e in a.events] == [3] and [e.visits for e in b.events] == [1]
    assert a.events[0].total_visits == 4
    for ex in (a, b):
        want = dict(ref.stages[1].named_parameters())
        for name, p in ex.module.named_parameters():
            torch.testing.assert_close(p, want[name], atol=1e-5, rtol=0)


def test_memory_window_defers_and_still_matches():
    """Full in-order pipeline with one replica per stage and memory 1: forwards queue up
    (deferred) and run as slots free; the result is unchanged."""
    sched = full_pipeline_schedule(_cluster(5), ((0, 4), (1,), (2,), (3,)), 2)
    nodes = _nodes(sched, memory=1)
    _run_iteration(nodes, sched, random.Random(5))
    assert sum(ex.deferred_total for ex in nodes.values()) > 0
    assert all(ex.in_flight == 0 and ex.iteration == 1 for ex in nodes.values())
    ref = _reference(sched, 1)
    for ex in nodes.values():
        want = dict(ref.stages[ex.stage].named_parameters())
        for name, p in ex.module.named_parameters():
            torch.testing.assert_close(p, want[name], atol=1e-5, rtol=0)


def test_gradients_go_back_to_the_exact_predecessor():
    sched = _skip_schedule(seed=1)
    nodes = _nodes(sched)
    log = []
    _run_iteration(nodes, sched, random.Random(3), log)
    fwd = {(m["p"], m["h"]): (src, dst) for src, dst, k, m in log if k == "fwd"}
    for src, dst, kind, m in log:
        if kind == "bwd":
            # the gradient for hop h+1's input goes from the node at hop h+1 to the node at hop h
            assert fwd[(m["p"], m["h"] + 1)] == (dst, src)
    assert sum(k == "bwd" for _, _, k, _ in log) == len(sched.paths) * sched.rules.L


def test_bad_input_is_refused_or_dropped_and_counted():
    sched = _skip_schedule()
    nodes = _nodes(sched)
    pid = 0
    path = sched.paths[pid]
    hop1 = nodes[sched.names[path[1]]]
    origin = sched.names[path[0]]
    meta = {"it": 0, "ep": sched.epoch, "p": pid, "h": 1, "o": path[0]}
    with pytest.raises(BadInput) as exc:
        hop1.handle(Msg("fwd", origin, meta, torch.zeros(B, T, CFG.d_model + 1)))
    assert exc.value.reason == "shape"
    with pytest.raises(BadInput):
        hop1.handle(Msg("fwd", origin, meta, torch.zeros(B, CFG.d_model)))
    assert hop1.handle(Msg("fwd", origin, dict(meta, p=len(sched.paths) + 5), torch.zeros(B, T, CFG.d_model))) == []
    assert hop1.dropped["unknown_path"] == 1
    wrong_sender = next(n for n in sched.names if n not in (origin, hop1.me))
    assert hop1.handle(Msg("fwd", wrong_sender, meta, torch.zeros(B, T, CFG.d_model))) == []
    assert hop1.dropped["unknown_path"] == 2
    assert hop1.handle(Msg("fwd", origin, dict(meta, ep=99), torch.zeros(B, T, CFG.d_model))) == []
    assert hop1.dropped["unknown_epoch"] == 1
    # a good forward goes through; its duplicate is dropped
    outs = hop1.handle(Msg("fwd", origin, meta, torch.zeros(B, T, CFG.d_model)))
    assert len(outs) == 1 and outs[0].kind == "fwd" and outs[0].meta["h"] == 2
    assert hop1.handle(Msg("fwd", origin, meta, torch.zeros(B, T, CFG.d_model))) == []
    assert hop1.dropped["duplicate"] == 1
    # after a whole iteration, a message of iteration 0 is stale
    fresh = _nodes(sched)
    _run_iteration(fresh, sched)
    ex = fresh[hop1.me]
    assert ex.handle(Msg("fwd", origin, meta, torch.zeros(B, T, CFG.d_model))) == []
    assert ex.dropped["stale_iteration"] == 1
    assert ex.iteration == 1


def test_in_order_validation_and_fin():
    sched = _skip_schedule()
    nodes = _nodes(sched)
    ev_origin = nodes[sched.names[sched.origins[0]]]
    _pump(nodes, [(ev_origin.me, o) for o in ev_origin.start_eval()])
    res = [e for e in ev_origin.events if isinstance(e, EvalResult)]
    assert len(res) == 1 and res[0].iteration == 0
    ref = StageSet.build(CFG, SEED, S)
    x, y = ev_origin.eval_data[0]
    from models.llama import lm_loss
    assert res[0].loss == pytest.approx(float(lm_loss(ref.logits(x, (0, 1, 2, 3)), y)), abs=1e-5)
    _pump(nodes, [(ev_origin.me, o) for o in ev_origin.fin_messages()])
    assert all(ex.finished for ex in nodes.values() if ex is not ev_origin)
