"""NoLoCo on a real swarm: a bootstrap and 4 workers as OS processes on 127.0.0.1 (N15, N12,
N16, N11 at process level).

At least 5 outer rounds with pairs; validation loss falls; node cards carry the round;
SIGKILL of a worker mid-run leaves the others training (no round blocked past its timeout);
a new worker joins mid-run from a peer's state and catches up; SIGTERM exits 0 within the
budget and writes a checkpoint that ``--resume`` continues from.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from node.localswarm import LocalSwarm, NodeProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROUND_TIMEOUT = 6.0
COMMON = [
    "noloco.inner_steps=8", f"noloco.round_timeout={ROUND_TIMEOUT}", "noloco.matchmaking_time=1",
    "noloco.eval_every=1", "noloco.eval_batches=4", "noloco.torch_threads=1", "noloco.checkpoint_every=2",
    "noloco.inner.lr=0.003", "noloco.inner.warmup=10",
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=64",
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=15",
]


def metric(node: NodeProc, name: str) -> float:
    return sum(v for k, v in node.metrics().items() if k == name or k.startswith(name + "{"))


def wait_for(pred, timeout: float, what, poll: float = 1.0):
    """pred()'s first truthy value; `what` (a string, or a callable giving one at the timeout) names it."""
    t0 = time.monotonic()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(poll)


def rounds_of(node: NodeProc) -> float:
    return metric(node, "swarmnode_outer_round")


def events(node: NodeProc, event: str) -> list[dict]:
    """The node's ``event`` log records; a line naming the event that is not JSON fails the test
    (only a last line still being written, with no newline yet, is left for the next read)."""
    text = node.log_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    out = []
    for line in lines:
        if f'"event": "{event}"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise AssertionError(f"{node.name}: unparsable {event} log line ({exc}): {line[:500]!r}") from None
    return out


def test_noloco_swarm_trains_survives_kill_and_join(tmp_path):
    with LocalSwarm(run_id="noloco-it", workdir=tmp_path, common_set=COMMON) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=90)
        workers = [swarm.start("noloco", name=f"w{i}") for i in range(4)]
        swarm.wait_ready(workers, timeout=180)

        # >= 5 outer rounds of its own on every worker, with at least one real pair. A worker that
        # comes up a few seconds after the others joins from a peer's state at that peer's round
        # (its "training_started" round), so its own rounds count from there, and the loss it
        # must beat is the untrained one of the workers that started at round 0.
        started = {w.name: wait_for(lambda w=w: events(w, "training_started"), 60, f"{w.name} training")[0]["round"]
                   for w in workers}
        # a joiner behind the swarm takes solo rounds and jumps its round label forward
        # (`round_catch_up`) until it meets a partner, so count the rounds it took, not labels, and
        # require every worker to have paired at least once by the deadline
        def taken(w: NodeProc) -> list[int]:
            return [e["group_size"] for e in events(w, "averaging_round_done")]
        wait_for(lambda: all(rounds_of(w) >= started[w.name] + 5 and len(taken(w)) >= 5 and 2 in taken(w)
                             for w in workers), 240,
                 lambda: "5 outer rounds of its own, one of them with a partner, on every worker (group sizes "
                         f"{ {w.name: taken(w) for w in workers} })")
        ok_rounds = sum(metric(w, 'swarmnode_outer_rounds_total{outcome="ok"}') for w in workers)
        assert ok_rounds >= 2, "no pair ever averaged"
        fresh = [w.metrics()["swarmnode_eval_loss_initial"] for w in workers if started[w.name] == 0]
        assert fresh, f"every worker joined from a peer: start rounds {started}"
        untrained = max(fresh)
        for w in workers:
            m = w.metrics()
            assert m["swarmnode_eval_loss"] < untrained - 0.05, (w.name, started[w.name], m["swarmnode_eval_loss"],
                                                                 untrained)
            sizes = [e["group_size"] for e in events(w, "averaging_round_done")]
            assert set(sizes) <= {1, 2} and sizes, sizes
            # every worker averaged with a peer at least once, and sent bytes
            assert 2 in sizes, f"{w.name} never paired: group sizes {sizes}"
            assert metric(w, "swarmnode_outer_sent_bytes_total") > 0, f"{w.name} paired but sent 0 bytes"

        # SIGKILL one worker: the rest keep taking rounds, none blocked past the timeout
        victim = workers[1]
        swarm.kill(victim)
        others = [w for w in workers if w is not victim]
        base = {w.name: rounds_of(w) for w in others}
        wait_for(lambda: all(rounds_of(w) >= base[w.name] + 3 for w in others), 120,
                 "3 more rounds on the survivors after a SIGKILL")
        for w in others:
            blocked = [e["blocked_s"] for e in events(w, "averaging_round_done")]
            assert max(blocked) <= ROUND_TIMEOUT + 3.0, (w.name, max(blocked))

        # three survivors: one is left solo each round and falls behind; it catches up with the
        # others' round label and pairs again (without catch-up it would stay solo for good)
        def paired_after_kill(w):
            return [e for e in events(w, "averaging_round_done")
                    if e["round"] > base[w.name] and e["group_size"] == 2]
        wait_for(lambda: all(paired_after_kill(w) for w in others), 150,
                 "a paired round on every survivor after the SIGKILL")

        # a new worker joins mid-run from the most advanced peer's state and catches up
        donor_round = max(rounds_of(w) for w in others)
        joiner = swarm.start("noloco", name="joiner")
        swarm.wait_ready([joiner], timeout=180)
        resumed = wait_for(lambda: events(joiner, "resume"), 30, "the joiner's resume event")
        assert resumed[0]["source"] == "peer" and resumed[0]["round"] >= donor_round - 2
        wait_for(lambda: rounds_of(joiner) >= resumed[0]["round"] + 2, 120, "the joiner's own rounds")
        assert joiner.metrics()["swarmnode_eval_loss"] < others[0].metrics()["swarmnode_eval_loss_initial"]

        # SIGTERM: drains, exits 0 within the budget, writes a checkpoint; --resume continues from it
        leaver = workers[2]
        t0 = time.monotonic()
        swarm.signal(leaver, signal.SIGTERM)
        assert swarm.wait_exit(leaver, 20) == 0, leaver.log_text()[-3000:]
        assert time.monotonic() - t0 <= 17
        last_round = int(max(e["round"] for e in events(leaver, "averaging_round_done")))
        again = swarm.start("noloco", name=leaver.name, resume=True)
        swarm.wait_ready([again], timeout=180)
        res = wait_for(lambda: [e for e in events(again, "resume") if e.get("source") == "checkpoint"], 30,
                       "a resume-from-checkpoint event")
        assert res[-1]["progress_key"] == "round" and res[-1]["progress"] == last_round
        assert re.search(r'"event": "drained"', leaver.log_text())
