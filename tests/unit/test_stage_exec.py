"""The SkipPipe executor (pipeline/stage_exec.py) on in-process nodes (docs/pipeline.md, 'Stage execution').

Messages between executors are delivered by a tiny in-process loop (the executors are
transport-free; the real streams are covered by tests/integration/test_pipeline_swarm.py), in
per-link FIFO order like a stream, optionally interleaving links at random. The references are
single-process runs: the whole model (`models.stages.run_order`, one autograd graph) over the
same (microbatch, layer order) pairs, then per stage sum / visits and clip.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from models.config import ModelConfig
from models.llama import build_model, lm_loss
from models.stages import StageSet, build_stage, run_order
from pipeline.cluster import Cluster
from pipeline.paths import PathRules
from pipeline.schedule import Schedule, ScheduleViolation, chain_routes, validate_schedule
from pipeline.search import full_pipeline_schedule, plan
from pipeline.stage_exec import BadInput, EvalResult, Msg, OriginDone, StageExecutor, StepResult, weights_sha256

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=16)
S, SEED, LR, CLIP = 4, 3, 0.1, 1.0
B, T = 2, 8
NAMES = [f"peer{i:02d}" for i in range(8)]
PARTS = ((0, 1), (2, 3), (4, 5), (6, 7))


def _data(origin: int):
    g = torch.Generator().manual_seed(1000 + origin)

    def next_batch():
        x = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    return next_batch


class RecordingSGD(torch.optim.SGD):
    """SGD that records the gradient it steps with and checks P13 at every step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps, self.seen, self.ex = 0, [], None

    def step(self, closure=None):
        ex = self.ex
        st = ex._it[ex.iteration]
        sched = ex.schedules[st.epoch]
        assert not st.inflight and not st.deferred, "stepped with microbatches still in flight"
        assert set(sched.origins) <= st.eoi, "stepped before every origin's EndOfIteration"
        self.steps += 1
        self.seen.append({n: p.grad.clone() for n, p in ex.module.core.named_parameters()})
        return super().step(closure)


def _cluster(n: int) -> Cluster:
    return Cluster(compute=[0.05] * n, comm=[[0.0 if i == j else 0.01 for j in range(n)] for i in range(n)],
                   memory=3, names=NAMES[:n])


def _nodes(sched: Schedule, memory: int = 3, clip: float | None = CLIP, device: str = "cpu", autocast=None):
    nodes = {}
    for s, group in enumerate(sched.partitions):
        for x in group:
            mod = build_stage(CFG, SEED, s, S).to(device)
            opt = RecordingSGD(mod.parameters(), LR)
            ex = StageExecutor(sched.names[x], s, mod, opt, memory=memory, clip=clip, device=device,
                               data=_data(x) if s == 0 else None, eval_data=[_data(99)()] if s == 0 else None,
                               **({"autocast": autocast} if autocast else {}))
            opt.ex = ex
            ex.add_schedule(sched)
            nodes[sched.names[x]] = ex
    return nodes


def _pump(nodes, outs, rng=None, log=None):
    """Deliver until quiet; with `rng`, links interleave at random (each link stays FIFO).
    Messages an executor emits early (`emit`) join their link before what its call returns."""
    links = defaultdict(list)  # (src, dst) -> FIFO
    for src, o in outs:
        links[(src, o.dest)].append(o)
    for name, ex in nodes.items():
        ex.emit = lambda early, name=name: [links[(name, o.dest)].append(o) for o in early]
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
        early = []
        ex.emit = early.extend
        outs += [(ex.me, o) for o in early + ex.start_iteration()]
    _pump(nodes, outs, rng, log)


def _skip_schedule(seed=0):
    rules = PathRules.from_skip_ratio(S, 1 / 3)
    return plan(_cluster(8), list(PARTS), rules, 3, seed=seed, time_budget_s=2.0, max_iters=300)


def _explicit(paths, memory_cap=False, L=3) -> Schedule:
    rules = PathRules(S=S, L=L, max_jump=4, max_swaps=2, max_total_swap_distance=2, cap_visits_by_memory=memory_cap)
    return validate_schedule(Schedule(partitions=PARTS, paths=tuple(paths), rules=rules, epoch=1, names=NAMES),
                             _cluster(8) if memory_cap else None)


def _reference(sched: Schedule, iterations: int, clip: float = CLIP):
    """Whole model in one process: every microbatch along its layer order, then per stage
    grad / visits, clip per stage, one SGD step. Returns (model, per-iteration stage grads)."""
    model = build_model(CFG, SEED)
    split = StageSet.build(CFG, SEED, S)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = {x: _data(x) for x in sched.origins}
    names_of = [{n for n, _ in m.core.named_parameters()} for m in split.stages]
    params = dict(model.named_parameters())
    grads = []
    for _ in range(iterations):
        opt.zero_grad(set_to_none=True)
        visits = [0] * S
        for origin, seq, pid in sched.microbatches():
            x, y = data[origin]()
            lm_loss(run_order(model, x, split.block_order(sched.stages(pid))), y).backward()
            for s in sched.stages(pid):
                visits[s] += 1
        per_stage = []
        for s in range(S):
            group = [params[n] for n in sorted(names_of[s])]
            for p in group:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad /= max(visits[s], 1)
            torch.nn.utils.clip_grad_norm_(group, clip)
            per_stage.append({n: params[n].grad.clone() for n in names_of[s]})
        grads.append(per_stage)
        opt.step()
    return model, grads


def _assert_weights(ex, model, atol=1e-5):
    whole = dict(model.named_parameters())
    for name, p in ex.module.core.named_parameters():
        torch.testing.assert_close(p, whole[name], atol=atol, rtol=0)


# --------------------------------------------------------------------------------- P9 / P10 / P11 / P13

@pytest.mark.parametrize("order_seed", [None, 1, 2])
def test_stage_gradients_and_steps_match_a_single_process_run(order_seed):
    """P10/P11/P13: for two iterations of a skipping, swapping schedule, the gradient each node
    steps with equals the whole model's (sum over visiting microbatches / visits, clipped per
    stage), replicas are bitwise identical, and every node steps exactly once per iteration,
    only after all backwards and every origin's EndOfIteration (checked inside step())."""
    sched = _skip_schedule()
    assert any(len(set(sched.stages(p))) == sched.rules.L for p in range(len(sched.paths)))
    assert any(list(sched.stages(p)[1:]) != sorted(sched.stages(p)[1:]) for p in range(len(sched.paths))), \
        "the schedule should include a swapped path"
    nodes = _nodes(sched)
    rng = random.Random(order_seed) if order_seed is not None else None
    for _ in range(2):
        _run_iteration(nodes, sched, rng)
    model, ref_grads = _reference(sched, 2)
    for ex in nodes.values():
        assert ex.iteration == 2 and not ex.dropped, ex.dropped
        assert ex.opt.steps == 2
        assert [e.iteration for e in ex.events if isinstance(e, StepResult)] == [0, 1]
        for it in range(2):
            for name, g in ex.opt.seen[it].items():
                torch.testing.assert_close(g, ref_grads[it][ex.stage][name], atol=1e-5, rtol=0)
        _assert_weights(ex, model)
    for group in sched.partitions:
        assert len({weights_sha256(nodes[sched.names[x]].module) for x in group}) == 1


def test_distributed_logits_equal_the_single_process_layer_order():
    """P9: the logits the originator computes when microbatch P comes back equal the whole
    model run with the layer order of P's stages (fp32, atol 1e-5)."""
    sched = _skip_schedule(seed=2)
    nodes = _nodes(sched)
    got = defaultdict(list)
    for x in sched.origins:
        ex = nodes[sched.names[x]]
        head = ex.module.head_forward
        ex.module.head_forward = lambda h, head=head, name=ex.me: got[name].append(head(h)) or got[name][-1]
    log = []
    _run_iteration(nodes, sched, random.Random(4), log)
    model, split = build_model(CFG, SEED), StageSet.build(CFG, SEED, S)
    data = {x: _data(x) for x in sched.origins}
    batches = {(o, q): data[o]() for o, q, _ in sched.microbatches()}
    returns = defaultdict(list)          # origin name -> path IDs in the order they came back
    for src, dst, kind, meta in log:
        if kind == "fwd" and meta["h"] == len(sched.paths[meta["p"]]):
            returns[dst].append(meta["p"])
    checked = 0
    for name, pids in returns.items():
        for pid, logits in zip(pids, got[name], strict=True):
            origin = sched.paths[pid][0]
            tokens, _ = batches[(origin, sched.path_ids(origin).index(pid))]
            want = run_order(model, tokens, split.block_order(sched.stages(pid)))
            torch.testing.assert_close(logits.detach(), want.detach(), atol=1e-5, rtol=0)
            checked += 1
    assert checked == len(sched.paths)


def test_unequal_replica_visits_are_normalised_by_visits():
    """P11: stage 1's replica A sees 3 microbatches, B sees 1: the stage gradient is the mean
    over all 4 (not the mean of the two replica means)."""
    sched = _explicit([(0, 2, 4), (1, 2, 6), (0, 2, 7), (1, 3, 5), (0, 4, 6), (1, 5, 7)])
    nodes = _nodes(sched)
    _run_iteration(nodes, sched)
    model, ref_grads = _reference(sched, 1)
    a, b = nodes["peer02"], nodes["peer03"]
    assert [e.visits for e in a.events if isinstance(e, StepResult)] == [3]
    assert [e.visits for e in b.events if isinstance(e, StepResult)] == [1]
    for ex in (a, b):
        assert [e.total_visits for e in ex.events if isinstance(e, StepResult)] == [4]
        for name, g in ex.opt.seen[0].items():
            torch.testing.assert_close(g, ref_grads[0][1][name], atol=1e-5, rtol=0)
        _assert_weights(ex, model)


def test_zero_visit_replica_still_aggregates_and_matches():
    """P12: node peer03 (stage 1) is on no path; it still takes the one step of its stage,
    with weight 0 in the average, and nobody waits for it."""
    sched = _explicit([(0, 2, 4), (1, 2, 6), (0, 2, 7), (1, 2, 5), (0, 4, 6), (1, 5, 7)])
    assert sched.node_visits()[3] == 0
    nodes = _nodes(sched)
    for _ in range(2):
        _run_iteration(nodes, sched, random.Random(7))
    model, _ = _reference(sched, 2)
    idle = nodes["peer03"]
    assert idle.iteration == 2 and [e.visits for e in idle.events if isinstance(e, StepResult)] == [0, 0]
    assert idle.microbatches["forward"] == 0
    assert weights_sha256(idle.module) == weights_sha256(nodes["peer02"].module)
    _assert_weights(idle, model)


def test_skipped_stage_gets_nothing_from_that_microbatch():
    """P12: with a single microbatch that skips stage 2, stage 2's nodes compute nothing and
    step with a zero gradient (no NaN from 0/0), stages 1 and 3 step with that microbatch's."""
    rules = PathRules(S=S, L=3, max_jump=4, max_swaps=0, max_total_swap_distance=0, cap_visits_by_memory=False)
    parts = ((0,), (1,), (2,), (3,))
    sched = Schedule(partitions=parts, paths=((0, 1, 3),), rules=rules, epoch=1, names=tuple(NAMES[:4]))
    with pytest.raises(ScheduleViolation) as exc:   # not balanced: refused by the validator, naming R5
        validate_schedule(sched)
    assert exc.value.rule == "R5"
    nodes = _nodes(sched)                           # the executor itself does not need balance
    before = weights_sha256(nodes["peer02"].module)
    _run_iteration(nodes, sched)
    skipped = nodes["peer02"]
    assert skipped.iteration == 1 and skipped.microbatches["forward"] == 0
    assert weights_sha256(skipped.module) == before
    assert skipped.dropped["no_visits"] == 1
    assert all(nodes[n].iteration == 1 for n in NAMES[:4])


# --------------------------------------------------------------------------------- P14 / P15

def test_memory_window_defers_and_still_matches():
    """P14: full in-order pipeline with one replica per stage and memory 1: forwards queue up
    (deferred) and run as slots free; the result is unchanged."""
    sched = full_pipeline_schedule(_cluster(5), ((0, 4), (1,), (2,), (3,)), 2)
    nodes = _nodes(sched, memory=1)
    _run_iteration(nodes, sched, random.Random(5))
    assert sum(ex.deferred_total for ex in nodes.values()) > 0
    assert all(ex.in_flight == 0 and ex.iteration == 1 for ex in nodes.values())
    model, _ = _reference(sched, 1)
    for ex in nodes.values():
        _assert_weights(ex, model)


@pytest.mark.parametrize("seed", range(4))
def test_crossed_swapped_paths_do_not_deadlock_and_grads_return_to_the_predecessor(seed):
    """P14/P15: paths cross nodes peer02 (stage 1) and peer04 (stage 2) in both orders
    (1 -> 2 and 2 -> 1, a swap); within the memory cap nothing deadlocks, every gradient goes
    back to the node that sent that forward, and the result matches the reference."""
    paths = [(0, 2, 4), (1, 4, 2), (0, 5, 7), (1, 7, 5), (0, 3, 6), (1, 3, 7)]
    sched = _explicit(paths, memory_cap=True)          # at most `memory` visits per node (R5)
    nodes = _nodes(sched)
    log = []
    _run_iteration(nodes, sched, random.Random(seed), log)
    assert all(ex.iteration == 1 for ex in nodes.values())
    fwd = {(m["p"], m["h"]): (src, dst) for src, dst, k, m in log if k == "fwd"}
    bwd = [(src, dst, m) for src, dst, k, m in log if k == "bwd"]
    assert len(bwd) == len(paths) * sched.rules.L
    for src, dst, m in bwd:  # the gradient for hop h+1's input goes from hop h+1's node to hop h's
        assert fwd[(m["p"], m["h"] + 1)] == (dst, src)
    model, _ = _reference(sched, 1)
    for ex in nodes.values():
        _assert_weights(ex, model)


def test_paths_carrying_two_microbatches_run_back_to_back_without_deferrals():
    """The paper's cap (mb_per_path = 2): 6 visits on peer07 with memory 3 is legal because each
    path's second microbatch leaves only once its first is home, so no node ever holds more than
    its 3 paths' worth and nothing is deferred; the result matches the reference."""
    routes = [(0, 2, 4), (1, 4, 2), (0, 5, 7), (1, 7, 5), (0, 3, 6), (1, 3, 7)]
    paths, after = chain_routes(routes, 2)
    rules = PathRules(S=S, L=3, max_jump=4, max_swaps=2, max_total_swap_distance=2, mb_per_path=2)
    sched = validate_schedule(Schedule(partitions=PARTS, paths=tuple(paths), rules=rules, epoch=1,
                                       names=NAMES), _cluster(8))
    assert sched.node_visits()[7] == 6 and sched.after() == after
    for seed in range(3):
        nodes = _nodes(sched)
        log = []
        _run_iteration(nodes, sched, random.Random(seed), log)
        assert all(ex.iteration == 1 for ex in nodes.values())
        assert sum(ex.deferred_total for ex in nodes.values()) == 0
        sent = {m["p"]: i for i, (_, _, k, m) in enumerate(log) if k == "fwd" and m["h"] == 1}
        home = {m["p"]: i for i, (_, _, k, m) in enumerate(log) if k == "bwd" and m["h"] == 0}
        assert len(sent) == len(home) == 12
        assert all(sent[pid] > home[prev] for pid, prev in enumerate(after) if prev is not None)
    model, _ = _reference(sched, 1)
    for ex in nodes.values():
        _assert_weights(ex, model)


def test_memory_cap_refuses_more_visits_than_slots():
    paths = [(0, 2, 4), (1, 4, 2), (0, 5, 7), (1, 7, 5), (0, 3, 7), (1, 3, 7)]   # peer07: 4 visits
    with pytest.raises(ScheduleViolation) as exc:
        _explicit(paths, memory_cap=True)
    assert exc.value.rule == "R5" and "memory" in str(exc.value)


# --------------------------------------------------------------------------------- P16 / bad input

def _first_hop(sched):
    pid = 0
    path = sched.paths[pid]
    return pid, path, sched.names[path[0]]


def test_messages_name_their_hop_and_bad_ones_are_dropped_and_counted():
    """P16: a forward carries (iteration, epoch, originator, mb_seq, path ID, hop); unknown
    paths, wrong senders, wrong mb_seq, unknown or mismatched epochs, duplicates, stale and far
    future iterations are dropped and counted; a wrong-shape tensor raises BadInput."""
    sched = _skip_schedule()
    nodes = _nodes(sched)
    pid, path, origin = _first_hop(sched)
    hop1 = nodes[sched.names[path[1]]]
    launched = nodes[origin].start_iteration()
    first = next(o for o in launched if o.meta["p"] == pid)
    assert {k: first.meta[k] for k in ("it", "ep", "p", "h", "o", "q")} == \
        {"it": 0, "ep": sched.epoch, "p": pid, "h": 1, "o": path[0], "q": 0}
    meta, good = first.meta, first.tensor
    with pytest.raises(BadInput) as exc:
        hop1.handle(Msg("fwd", origin, meta, torch.zeros(B, T, CFG.d_model + 1)))
    assert exc.value.reason == "shape"
    with pytest.raises(BadInput):
        hop1.handle(Msg("fwd", origin, meta, torch.zeros(B, CFG.d_model)))
    cases = [("unknown_path", origin, dict(meta, p=len(sched.paths) + 5)),
             ("unknown_path", next(n for n in sched.names if n not in (origin, hop1.me)), meta),
             ("unknown_path", origin, dict(meta, q=7)),
             ("unknown_epoch", origin, dict(meta, ep=99)),
             ("future_iteration", origin, dict(meta, it=5)),
             ("malformed", origin, {k: v for k, v in meta.items() if k != "it"})]
    for reason, sender, m in cases:
        before = hop1.dropped[reason]
        assert hop1.handle(Msg("fwd", sender, m, good)) == []
        assert hop1.dropped[reason] == before + 1, reason
    outs = hop1.handle(Msg("fwd", origin, meta, good))   # the good one goes through ...
    assert len(outs) == 1 and outs[0].kind == "fwd" and outs[0].meta["h"] == 2
    assert hop1.handle(Msg("fwd", origin, meta, good)) == []   # ... once
    assert hop1.dropped["duplicate"] == 1
    other = Schedule(partitions=sched.partitions, paths=sched.paths, rules=sched.rules, epoch=sched.epoch + 1,
                     names=sched.names)
    hop1.add_schedule(other)                             # a known epoch, but not this iteration's
    assert hop1.handle(Msg("fwd", origin, dict(meta, p=1, ep=other.epoch), good)) == []
    assert hop1.dropped["epoch_mismatch"] == 1


def test_stale_iterations_duplicates_of_eoi_and_grads_and_fin_from_strangers():
    sched = _skip_schedule()
    nodes = _nodes(sched)
    _run_iteration(nodes, sched)
    pid, path, origin = _first_hop(sched)
    ex = nodes[sched.names[path[1]]]
    meta = {"it": 0, "ep": sched.epoch, "p": pid, "h": 1, "o": path[0], "q": 0}
    assert ex.handle(Msg("fwd", origin, meta, torch.zeros(B, T, CFG.d_model))) == []
    assert ex.dropped["stale_iteration"] == 1 and ex.iteration == 1
    eoi = {"it": 1, "ep": sched.epoch, "o": path[0]}
    assert ex.handle(Msg("eoi", origin, eoi, torch.zeros(1))) == []
    assert ex.handle(Msg("eoi", origin, eoi, torch.zeros(1))) == []
    assert ex.dropped["duplicate"] == 1
    assert ex.handle(Msg("eoi", sched.names[path[1]], dict(eoi, o=path[1]), torch.zeros(1))) == []
    assert ex.dropped["unknown_origin"] == 1
    n = sum(p.numel() for p in ex.module.parameters())
    stranger = next(sched.names[x] for x in sched.partitions[0])
    assert ex.handle(Msg("grad", stranger, {"it": 1, "ep": sched.epoch, "v": 1}, torch.zeros(n))) == []
    assert ex.dropped["not_a_replica"] == 1
    replica = next(sched.names[x] for x in sched.partitions[ex.stage] if sched.names[x] != ex.me)
    with pytest.raises(BadInput):
        ex.handle(Msg("grad", replica, {"it": 1, "ep": sched.epoch, "v": 1}, torch.zeros(n + 1)))
    assert ex.handle(Msg("fin", replica, {"it": 1, "ep": sched.epoch}, torch.zeros(1))) == []
    assert not ex.finished and ex.dropped["unknown_origin"] == 2


def test_a_full_window_refuses_a_bad_tensor_at_once():
    """A wrong-width activation is refused when it arrives, not later when a slot frees (where
    the error would hit whoever freed the slot)."""
    sched = full_pipeline_schedule(_cluster(5), ((0, 4), (1,), (2,), (3,)), 2)
    nodes = _nodes(sched, memory=1)
    first = nodes["peer00"].start_iteration()[0]
    stage1 = nodes[first.dest]
    assert stage1.handle(Msg("fwd", "peer00", first.meta, first.tensor))       # slot now taken
    second = nodes["peer04"].start_iteration()[0]
    with pytest.raises(BadInput):
        stage1.handle(Msg("fwd", "peer04", second.meta, torch.zeros(B, T, CFG.d_model + 3)))
    assert stage1.deferred_total == 0


def test_ready_messages_leave_before_the_next_compute():
    """emit: the origin's first microbatch is handed over before the second is embedded, and a
    stage's gradient before the deferred forward it makes room for (the simulator's order)."""
    sched = full_pipeline_schedule(_cluster(5), ((0, 4), (1,), (2,), (3,)), 2)
    nodes = _nodes(sched, memory=1)
    origin = nodes["peer00"]
    origin.memory = 2
    timeline = []
    origin.delay = lambda kind: timeline.append(("compute", kind))
    origin.emit = lambda outs: timeline.extend(("emit", o.kind) for o in outs)
    returned = origin.start_iteration()
    assert timeline == [("compute", "forward"), ("emit", "fwd"), ("compute", "forward")]
    assert [o.kind for o in returned] == ["fwd"]
    a, b = returned[0], nodes["peer04"].start_iteration()[0]
    stage1 = nodes[a.dest]                                   # memory 1: b waits for a's slot
    timeline.clear()
    stage1.delay = lambda kind: timeline.append(("compute", kind))
    stage1.emit = lambda outs: timeline.extend(("emit", o.kind) for o in outs)
    assert [o.kind for o in stage1.handle(Msg("fwd", "peer00", a.meta, a.tensor))] == ["fwd"]
    assert stage1.handle(Msg("fwd", "peer04", b.meta, b.tensor)) == [] and stage1.deferred_total == 1
    grad = {**a.meta, "h": 1}
    returned = stage1.handle(Msg("bwd", sched.names[sched.paths[a.meta["p"]][2]], grad, torch.ones_like(a.tensor)))
    assert timeline == [("compute", "forward"), ("compute", "backward"), ("emit", "bwd"), ("compute", "forward")]
    assert [o.kind for o in returned] == ["fwd"]


# --------------------------------------------------------------------------------- records, state, eval

def test_step_records_norms_before_and_after_clipping_and_the_snapshot():
    sched = _skip_schedule()
    nodes = _nodes(sched, clip=1e-3)
    _run_iteration(nodes, sched)
    for ex in nodes.values():
        rec = ex.records[-1]
        assert rec.grad_norm > 1e-3 and rec.grad_norm_clipped == pytest.approx(1e-3)
        meta, weights, opt = ex.snapshot()
        assert meta["stage"] == ex.stage and meta["iteration"] == 1
        assert meta["weights_sha256"] == weights_sha256(ex.module) == rec.weights_sha256
        assert meta["grad_norm"] == rec.grad_norm
        for name, p in ex.module.named_parameters():
            assert torch.equal(weights[name], p.detach()) and weights[name].data_ptr() != p.data_ptr()
        assert opt == {}                           # plain SGD keeps no state
    origin = nodes[sched.names[sched.origins[0]]]
    assert [type(e) for e in origin.events if isinstance(e, (OriginDone, StepResult))] == [OriginDone, StepResult]


def test_adamw_state_is_in_the_snapshot():
    mod = build_stage(CFG, SEED, 1, S)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    mod(torch.randn(B, T, CFG.d_model)).sum().backward()
    opt.step()
    ex = StageExecutor("peer02", 1, mod, opt, memory=2)
    _, weights, state = ex.snapshot()
    for name, p in mod.named_parameters():
        torch.testing.assert_close(state[f"{name}.exp_avg"], opt.state[p]["exp_avg"])
        assert state[f"{name}.exp_avg_sq"].shape == p.shape
    assert set(weights) == {n for n, _ in mod.named_parameters()}


def test_in_order_validation_and_fin():
    sched = _skip_schedule()
    nodes = _nodes(sched)
    ev_origin = nodes[sched.names[sched.origins[0]]]
    _pump(nodes, [(ev_origin.me, o) for o in ev_origin.start_eval()])
    res = [e for e in ev_origin.events if isinstance(e, EvalResult)]
    assert len(res) == 1 and res[0].iteration == 0
    ref = StageSet.build(CFG, SEED, S)
    x, y = ev_origin.evaluator.data[0]
    assert res[0].loss == pytest.approx(float(lm_loss(ref.logits(x, (0, 1, 2, 3)), y)), abs=1e-5)
    _pump(nodes, [(ev_origin.me, o) for o in ev_origin.fin_messages()])
    assert all(ex.finished for ex in nodes.values() if ex is not ev_origin)


# --------------------------------------------------------------------------------- device and precision

def test_bf16_autocast_trains_with_fp32_weights_and_wire():
    """node.device.autocast(cpu, "bf16") around every forward: the iteration completes, the
    messages carry fp32, weights stay fp32 and close to the fp32 run."""
    from node.device import autocast
    sched = _skip_schedule()
    nodes = _nodes(sched, autocast=lambda: autocast(torch.device("cpu"), "bf16"))
    outs = [(sched.names[x], o) for x in sched.origins for o in nodes[sched.names[x]].start_iteration()]
    assert outs and all(o.tensor.dtype == torch.float32 for _, o in outs)
    _pump(nodes, outs)
    model, _ = _reference(sched, 1)
    for ex in nodes.values():
        assert ex.iteration == 1 and all(p.dtype == torch.float32 for p in ex.module.parameters())
        _assert_weights(ex, model, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_on_cuda_match_the_cpu_reference():
    """Stages held on the GPU (as the role places them from [device]) compute the same step."""
    sched = _skip_schedule()
    nodes = _nodes(sched, device="cuda")
    _run_iteration(nodes, sched, random.Random(1))
    model, ref_grads = _reference(sched, 1)
    for ex in nodes.values():
        assert all(p.is_cuda for p in ex.module.parameters())
        for name, g in ex.opt.seen[0].items():
            torch.testing.assert_close(g.cpu(), ref_grads[0][ex.stage][name], atol=1e-4, rtol=1e-4)


def test_messages_carry_the_previous_iterations_epoch_and_a_rebuilt_stage_tells_early_from_missed():
    """`pe` on every message of iteration t names the epoch the sender's iteration t-1 ran on. A
    stage rebuilt at t-1 that gets a message of t: only early when that epoch names it (its part in
    t-1 is still due: the origins' eoi can arrive after a successor's first forward of t); missed
    when it does not (the pipeline stepped t-1 through another node) or when t is two ahead."""
    sched = _skip_schedule()
    nodes = _nodes(sched)
    first = []
    _run_iteration(nodes, sched, log=first)
    assert first and all(meta["pe"] == -1 for _, _, k, meta in first if k != "ev")     # nothing stepped yet
    assert all(ex.prev_epoch == sched.epoch and ex.iteration == 1 for ex in nodes.values())
    log = []
    _run_iteration(nodes, sched, log=log)
    kinds = {k for _, _, k, _ in log}
    assert {"fwd", "bwd", "eoi"} <= kinds
    assert all(meta["pe"] == sched.epoch for _, _, k, meta in log if k in ("fwd", "bwd", "eoi", "grad")), log[:3]

    member = nodes[sched.names[sched.partitions[1][0]]]
    stage1 = member.stage
    rebuilt = StageExecutor(member.me, stage1, build_stage(CFG, SEED, stage1, S), RecordingSGD([torch.zeros(1)], LR),
                            memory=3, clip=CLIP)
    rebuilt.add_schedule(sched)
    rebuilt.iteration = 2
    outsider = StageExecutor("not-in-the-schedule", stage1, build_stage(CFG, SEED, stage1, S),
                             RecordingSGD([torch.zeros(1)], LR), memory=3, clip=CLIP)
    outsider.add_schedule(sched)
    outsider.iteration = 2
    msg = lambda it, pe: Msg("fwd", sched.names[0], {"it": it, "ep": sched.epoch, "pe": pe}, None)  # noqa: E731
    assert not rebuilt.missed(msg(3, sched.epoch))      # early: its part in iteration 2 is still due
    assert outsider.missed(msg(3, sched.epoch))         # iteration 2 ran on a schedule without it
    assert rebuilt.missed(msg(3, sched.epoch + 7))      # a schedule it does not have: fetch it first
    assert rebuilt.missed(msg(3, -1))                   # the sender is rebuilt too and says nothing
    assert rebuilt.missed(msg(4, sched.epoch))          # two ahead: stepped without it
    assert not rebuilt.missed(msg(2, -1)) and not outsider.missed(msg(1, -1))   # its own iteration or older


def test_a_validation_pass_in_flight_follows_a_newer_schedule_that_drops_a_node_of_its_path():
    """The in-order pass runs through each stage's first node; when a newer epoch drops one of
    them (a fake or lost stage node), the origin sends the batch again along the new path instead
    of waiting for ever on the dropped node (a live pipeline stalled on it)."""
    import dataclasses
    old = full_pipeline_schedule(_cluster(8), PARTS, 2)
    nodes = _nodes(old)
    origin = nodes[old.names[old.origins[0]]]
    lost = old.names[old.partitions[1][0]]
    first = origin.start_eval()
    assert [o.dest for o in first] == [lost]             # the pass waits on the node about to go
    new = dataclasses.replace(full_pipeline_schedule(_cluster(8), ((0, 1), (3,), (4, 5), (6, 7)), 2), epoch=1)
    resent: list = []
    for name, ex in nodes.items():
        if name != lost:
            ex.emit = resent.extend if ex is origin else (lambda outs: None)
            ex.add_schedule(new)
    assert [o.dest for o in resent] == [new.names[3]] and resent[0].meta["ep"] == 1
    del nodes[lost]
    _pump(nodes, [(origin.me, o) for o in resent])
    res = [e for e in origin.events if isinstance(e, EvalResult)]
    ref = StageSet.build(CFG, SEED, S)
    x, y = origin.evaluator.data[0]
    assert len(res) == 1 and res[0].loss == pytest.approx(float(lm_loss(ref.logits(x, (0, 1, 2, 3)), y)), abs=1e-5)


def test_the_first_step_on_a_plan_made_after_a_quarantine_clears_adamw_moments_on_every_replica_alike():
    """`Schedule.reset_moments`: every node clears its AdamW moments before its first step on that
    epoch, once; replicas stay bit-identical; a later step on the same epoch keeps its moments."""
    import dataclasses

    sched = _skip_schedule()
    nodes = {}
    for s, group in enumerate(sched.partitions):
        for x in group:
            mod = build_stage(CFG, SEED, s, S)
            ex = StageExecutor(sched.names[x], s, mod, torch.optim.AdamW(mod.parameters(), lr=1e-2), memory=3,
                               clip=CLIP, data=_data(x) if s == 0 else None)
            ex.add_schedule(sched)
            nodes[sched.names[x]] = ex

    def steps() -> set[float]:
        return {float(st["step"]) for ex in nodes.values() for st in ex.opt.state.values()}

    def results() -> list[StepResult]:
        out = [e for ex in nodes.values() for e in ex.events if isinstance(e, StepResult)]
        for ex in nodes.values():
            ex.events.clear()
        return out

    for _ in range(3):
        _run_iteration(nodes, sched)
    assert steps() == {3.0} and not any(r.moments_reset for r in results())
    flagged = dataclasses.replace(sched, epoch=sched.epoch + 1, reset_moments=True)
    assert Schedule.from_json(flagged.to_json()).reset_moments and not Schedule.from_json(sched.to_json()).reset_moments
    for ex in nodes.values():
        ex.add_schedule(flagged)
    _run_iteration(nodes, sched)          # runs on the old epoch; its step tells every node the new one
    assert steps() == {4.0} and not any(r.moments_reset for r in results())
    _run_iteration(nodes, flagged)        # the first step on the flagged epoch: cleared, then one step
    first = results()
    assert steps() == {1.0} and len(first) == len(nodes) and all(r.moments_reset for r in first)
    for group in sched.partitions:        # replicas cleared at the same iteration: still bit-identical
        assert len({weights_sha256(nodes[sched.names[x]].module) for x in group}) == 1
    _run_iteration(nodes, flagged)        # a later step on the same epoch keeps its moments
    assert steps() == {2.0} and not any(r.moments_reset for r in results())
