"""Issue 7's open-swarm attacks replayed on real processes: a bootstrap and two ``noloco``
workers on 127.0.0.1 (OS processes), and attackers in this process (``hostile.Attacker``): a
hivemind DHT client that signs its own records (node card, roster entries), gRPC calls signed
with its own key, and a gRPC server running the exchange with tensors of its choosing.

(0) honest records (cards, roster entries) are never counted as rejected by any node;
(a) a self-signed node card claiming an absurd round: no worker adopts it, both stay listed;
(b) a pairing partner serving finite but huge tensors: rejected ("norm"), honest weights do not
    move, eval loss stays finite, training goes on, /readyz says ready (truthfully);
(c) a NaN partner: rejected ("nonfinite"), the round is solo, nothing changes;
(d) a partner inside the tensor bounds whose mean would make an out-of-bound outer step: the
    robust clip pulls it in (hard clip), the partner is charged after 3, nothing is rolled
    back and /readyz stays ready (the rollback itself: tests/integration/test_robust_gossip.py,
    with ``noloco.robust=off``);
(e) strangers (no card) cannot call ``Node.Info``, download the state or pair; 64 idle streams
    that never send a frame hold no slot an honest call needs;
(f) the flood test: a member calls at 10x ``limits.peer_rps`` and holds idle streams: honest
    calls succeed within their deadlines, the workers' rounds keep their pace within 20%, and
    the flooder is banned (metrics, and ``swarmnode status`` marks it).

The swarm is shared by the tests (module fixture); each test is bounded well under 90 s.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from node.localswarm import LocalSwarm
from node.state_sync import StateFetchError, fetch_state
from optimizers.exchange_common import METHOD as EXCHANGE
from protocol import node_pb2, node_pb2_grpc
from security.keys import generate_key, load_key_file
from security.peer_auth import CallSigner, ClientAuth, client_auth, client_interceptors, set_client_auth
from tests.integration.flooder import idle_streams
from tests.integration.hostile import Attacker, client_race, metric, model_specs, status_rows, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = "attack-it"
MODEL = dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
PEER_RPS = 25
COMMON = [
    "noloco.inner_steps=6", "noloco.round_timeout=4", "noloco.eval_every=1", "noloco.eval_batches=2",
    "noloco.torch_threads=1", "noloco.checkpoint_every=0", "noloco.inner.lr=0.003", "noloco.inner.warmup=10",
    # rounds of ~1 s (an accelerator's step time, not this machine's CPU): an attacker can meet a
    # worker in its round, and the pace of (f) measures the swarm, not the CPUs the test shares
    "noloco.compute_delay_s=0.1",
    # (d): honest outer steps move phi by up to ~17% of its norm here (solo rounds early on); the
    # poison of (d) fits these looser tensor bounds and moves it by ~85%
    "noloco.max_norm_ratio=6", "noloco.max_distance_ratio=3", "noloco.max_update_ratio=0.5",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=10",
    f"limits.peer_rps={PEER_RPS}", "security.known_peers_refresh_s=2",
]
ABSURD_ROUND = 10 ** 12
INFO = "/swarmnode.Node/Info"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attacks")
    with LocalSwarm(run_id=RUN, workdir=tmp, common_set=COMMON) as sw:
        boot = sw.start("bootstrap", name="bootstrap")
        sw.wait_ready([boot], timeout=90)
        workers = [sw.start("noloco", name=f"w{i}") for i in range(2)]
        sw.wait_ready(workers, timeout=150)
        wait_for(lambda: all(metric(w, "swarmnode_outer_round") >= 1 for w in workers), 90, "a first round")
        sw.tmp = tmp
        sw.workers = workers
        sw.boot = boot
        yield sw


@pytest.fixture
def signed_calls():
    """The attacker's calls carry a valid signature with its own key (a stranger is not 'unsigned')."""
    before = client_auth()
    yield lambda attacker, swarm: set_client_auth(ClientAuth(attacker.signer, _resolver(swarm)))
    set_client_auth(before)


def _resolver(swarm: LocalSwarm):
    by_addr = {f"127.0.0.1:{n.grpc_port}": n.peer_id for n in swarm.nodes}
    return by_addr.get


def rounds(swarm) -> dict[str, float]:
    return {w.name: metric(w, "swarmnode_outer_round") for w in swarm.workers}


def healthy(swarm, rounds_before: dict[str, float], more: int = 2) -> None:
    """Every worker: ready, kept training (``more`` rounds), finite eval loss not worse than at its
    start, outer update norm small (the attack never moved the weights): honest steps here are
    below ~2 (solo rounds; ||phi|| ~ 10-25), an accepted (b) partner would give ~1e4, (c) NaN."""
    for w in swarm.workers:
        wait_for(lambda: metric(w, "swarmnode_outer_round") >= rounds_before[w.name] + more, 60,
                 f"{w.name} to train {more} more rounds")
        r = w.readyz()
        assert r is not None and r.get("ready") is True, f"{w.name} /readyz: {r}"
        ev, ev0 = metric(w, "swarmnode_eval_loss"), metric(w, "swarmnode_eval_loss_initial")
        assert math.isfinite(ev) and ev <= ev0 + 0.05, f"{w.name}: eval loss {ev} (started at {ev0})"
        upd = metric(w, "swarmnode_outer_update_norm")
        assert math.isfinite(upd) and upd < 5.0, f"{w.name}: outer update norm {upd}"
        assert w.alive()


def test_honest_records_are_never_rejected(swarm):
    """Every record an honest node writes (cards; the workers' roster entries, stored on the
    bootstrap too) is in a registered namespace with its schema: no node counts one as rejected."""
    wait_for(lambda: all(metric(w, "swarmnode_outer_round") >= 2 for w in swarm.workers), 60, "two rounds")
    for node in (swarm.boot, *swarm.workers):
        m = node.metrics()
        assert "swarmnode_dht_peers" in m, f"{node.name}: the DHT probe did not answer, so 0 would prove nothing"
        rejected = {k: v for k, v in m.items() if k.startswith("swarmnode_dht_records_rejected_total")}
        assert not any(rejected.values()), f"{node.name} rejected honest records: {rejected}"


def test_absurd_round_in_a_self_signed_card_is_never_adopted(swarm, tmp_path):
    t0 = time.monotonic()
    attacker = Attacker(swarm, tmp_path, "forger")
    try:
        cfg_hash = attacker.worker_cfg_hash(swarm.workers)
        before = rounds(swarm)
        assert attacker.store_card(ABSURD_ROUND, cfg_hash), "the DHT refused the forged card"
        # the card provably is in the DHT (well-signed by its own writer: it passes the validator)
        wait_for(lambda: any(v.peer_id == attacker.peer_id and v.card.details.get("round") == ABSURD_ROUND
                             for v in attacker.run(attacker.cards())), 20, "the forged card in the DHT")
        rows = {r["peer_id"]: r for r in status_rows(swarm)}
        assert rows[attacker.peer_id]["round"] == ABSURD_ROUND  # readers see it: it is a valid card...
        healthy(swarm, before, more=3)                         # ...that the workers read for 3 rounds
        for w in swarm.workers:
            assert metric(w, "swarmnode_outer_round") < 10 ** 6, f"{w.name} adopted the absurd round"
            jumps = [line for line in w.log_text().splitlines() if '"event": "round_catch_up"' in line
                     and json.loads(line).get("round", 0) >= ABSURD_ROUND]
            assert not jumps, jumps[:2]
        rows = {r["peer_id"]: r for r in status_rows(swarm)}
        for w in swarm.workers:  # still listed (their card publishes never failed), with sane rounds
            assert rows[w.peer_id]["state"] == "ready" and rows[w.peer_id]["round"] < 10 ** 6, rows[w.peer_id]
    finally:
        attacker.close()
    assert time.monotonic() - t0 < 90


def _partner_attack(swarm, tmp_path, signed_calls, poison, reason: str):
    t0 = time.monotonic()
    attacker = Attacker(swarm, tmp_path, f"partner-{reason}")
    signed_calls(attacker, swarm)
    try:
        cfg_hash = attacker.worker_cfg_hash(swarm.workers)
        specs, init = model_specs(MODEL)
        rejected0 = sum(metric(w, "swarmnode_tensors_rejected_total", reason=reason) for w in swarm.workers)
        attacker.start_partner(cfg_hash, specs, poison(init))
        wait_for(lambda: sum(metric(w, "swarmnode_tensors_rejected_total", reason=reason)
                             for w in swarm.workers) > rejected0, 60, f"a worker to reject the attacker ({reason})")
        healthy(swarm, rounds(swarm), more=2)
    finally:
        attacker.close()
    streamed = [r for r in attacker.results if r.sent_bytes > 0]
    assert streamed, f"the attacker never sent its tensors: {[(r.outcome, r.reason) for r in attacker.results]}"
    assert all(r.outcome != "ok" for r in attacker.results), "a worker confirmed an exchange with the attacker"
    assert time.monotonic() - t0 < 90


def test_huge_finite_partner_tensors_are_rejected(swarm, tmp_path, signed_calls):
    _partner_attack(swarm, tmp_path, signed_calls, lambda init: [t * 1e4 for t in init], "norm")


def test_nan_partner_gives_a_solo_round(swarm, tmp_path, signed_calls):
    _partner_attack(swarm, tmp_path, signed_calls,
                    lambda init: [torch.full_like(t, float("nan")) for t in init], "nonfinite")


class ReadyzLog:
    """Samples every worker's /readyz every 50 ms in a thread."""

    def __init__(self, workers):
        self.workers, self.samples, self._stop = workers, {w.name: [] for w in workers}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            for w in self.workers:
                r = w.readyz()
                if r is not None:
                    self.samples[w.name].append((r.get("ready"), r.get("reason")))
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self.thread.join(5)


def _charges(swarm, peer: str, reason: str) -> list[dict]:
    """The workers' ``partner_charged`` records naming ``peer`` for ``reason``."""
    out = []
    for w in swarm.workers:
        for line in w.log_text().splitlines():
            if '"event": "partner_charged"' in line:
                rec = json.loads(line)
                if rec.get("peer") == peer and rec.get("reason") == reason:
                    out.append(rec)
    return out


def _clips(swarm, peer: str) -> list[dict]:
    return [json.loads(line) for w in swarm.workers for line in w.log_text().splitlines()
            if '"event": "partner_clipped"' in line and json.loads(line).get("peer") == peer]


def test_in_bound_poison_is_clipped_and_charged_and_readyz_stays_ready(swarm, tmp_path, signed_calls):
    """The attacker downloads a worker's current weights (any member may) and pairs with noise of
    2.5x each tensor's RMS added: RMS ratios 2.7 (bound 6), distance 2.5x our norm (bound 3x), so
    the exchange accepts it. Without robust averaging the outer step it causes moves phi by ~85%
    of its norm and is rolled back (the behaviour before ``noloco.robust``); with the clip (the
    default) the worker pulls the poison in to within the radius its honest partners set (a hard
    clip, factor far below 0.5), so the outer step stays small: nothing to roll back, /readyz stays
    ready the whole time, eval loss holds, and after ``robust_strikes`` (3) hard clips the
    partner is charged (``partner_charged`` reason ``clipped``,
    ``swarmnode_outer_partners_charged_clipped_total``) and
    skipped; the workers' cards count the hard clips (``clipped_hard``)."""
    t0 = time.monotonic()
    g = torch.Generator().manual_seed(7)

    def poison(current):
        return [t + 2.5 * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=g) for t in current]

    attacker = Attacker(swarm, tmp_path, "inbound")
    signed_calls(attacker, swarm)
    probe = ReadyzLog(swarm.workers)
    rollbacks = lambda: sum(metric(w, "swarmnode_outer_solo_rounds_total", reason="rolled_back")  # noqa: E731
                            for w in swarm.workers)
    hard = lambda: sum(metric(w, "swarmnode_outer_partners_clipped_total", severity="hard")  # noqa: E731
                       for w in swarm.workers)
    try:
        cfg_hash = attacker.worker_cfg_hash(swarm.workers)
        specs, _ = model_specs(MODEL)
        assert attacker.store_card(None, cfg_hash)  # a member may download the state

        def download():
            try:
                return attacker.run(attacker.fetch_weights(swarm.workers[0], specs, cfg_hash))
            except StateFetchError:
                return None
        current = wait_for(download, 20, "the attacker to download a worker's weights")
        rolled0, hard0 = rollbacks(), hard()
        charged0 = sum(metric(w, "swarmnode_outer_partners_charged_clipped_total") for w in swarm.workers)
        attacker.start_partner(cfg_hash, specs, poison(current))
        wait_for(lambda: _charges(swarm, attacker.peer_id, "clipped"), 75,
                 "a worker to charge the attacker for hard clips")
        attacker.close()
        healthy(swarm, rounds(swarm), more=2)  # ready, finite eval loss not worse than at start, small updates
    finally:
        attacker.close()
        probe.stop()
    assert any(r.outcome == "ok" for r in attacker.results), "the poison never passed the exchange bounds"
    clips = _clips(swarm, attacker.peer_id)
    # 5-11 radii away (by how far the workers' own moves went under the machine's load), so past
    # the 2 radii where the clip redescends: the factor is 2 * (radius / distance)**2, a hard clip every
    # time. Where the noise also pulled the worker back more than 1.5 of its own moves (the backward
    # cut, noloco.robust_backward; most clips under load, where own moves are small) the norm clip
    # judged the cut distance: the factor is 2 * radius**2 / (cut distance * distance), below the
    # radius / distance a plain clip would keep
    def expected(c):
        d_cut = c["cut_distance"] or c["distance"]
        if d_cut > 2 * c["radius"]:
            return 2 * c["radius"] ** 2 / (d_cut * c["distance"])
        return c["radius"] / c["distance"]
    assert len(clips) >= 3 and all(c["hard"] and c["distance"] > 2 * c["radius"] for c in clips) and all(
        c["factor"] == pytest.approx(expected(c), abs=2e-4) for c in clips), \
        [(c["factor"], c["hard"], c["pulled_back"], c["cut_distance"], c["distance"], c["radius"]) for c in clips]
    assert any(c["factor"] < 0.9 * c["radius"] / c["distance"] for c in clips), "the clip did not redescend"
    assert hard() >= hard0 + 3
    assert sum(metric(w, "swarmnode_outer_partners_charged_clipped_total") for w in swarm.workers) >= charged0 + 1
    assert rollbacks() == rolled0, "an outer step was rolled back: the clip should have kept it small"
    for w in swarm.workers:
        assert '"event": "outer_rollback"' not in w.log_text()
        assert probe.samples[w.name] and all(ready for ready, _ in probe.samples[w.name]), \
            f"{w.name} was not ready at some point: {[s for s in probe.samples[w.name] if not s[0]][:3]}"
    rows = {r["peer_id"]: r for r in status_rows(swarm)}
    victims = {c["peer_id"] for c in clips}
    assert any(rows[v].get("clipped_hard", 0) >= 1 for v in victims if v in rows), \
        {v: rows.get(v) for v in victims}
    assert time.monotonic() - t0 < 120


async def _honest_calls(swarm, node, seconds: float, every_s: float) -> list[tuple[grpc.StatusCode, float]]:
    """An honest member (the bootstrap's key) calls ``node``'s Node.Info every ``every_s`` for
    ``seconds``: [(status, seconds taken)]."""
    signer = CallSigner(load_key_file(swarm.boot.identity), RUN)
    out, t_end = [], time.monotonic() + seconds
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.grpc_port}",
                                         interceptors=client_interceptors(signer, node.peer_id)) as ch:
        while time.monotonic() < t_end:
            t = time.monotonic()
            out.append((await _call_info(ch), time.monotonic() - t))
            await asyncio.sleep(every_s)
    return out


def wait_known(attacker: Attacker, node) -> None:
    """Until ``node`` answers ``attacker``'s signed call: it has read the attacker's card."""
    async def known():
        async with attacker.channel(node) as ch:
            return await _call_info(ch) == grpc.StatusCode.OK
    wait_for(lambda: attacker.run(known()), 30, f"{node.name} to know {attacker.peer_id[-8:]}'s card")


async def _call_info(channel) -> grpc.StatusCode:
    try:
        await node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=2)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_strangers_cannot_call_download_or_pair_and_idle_streams_hold_nothing(swarm, tmp_path):
    t0 = time.monotonic()
    w0, w1 = swarm.workers
    stranger = Attacker(swarm, tmp_path, "stranger")  # publishes no card: not a member
    member = Attacker(swarm, tmp_path, "idler")       # a member (live card) that opens idle streams
    try:
        cfg_hash = member.worker_cfg_hash(swarm.workers)
        assert member.keep_card(None, cfg_hash, role="bootstrap")
        specs, init = model_specs(MODEL)
        denied0 = metric(w0, "swarmnode_rpc_rejected_total", reason="unknown_peer")

        async def stranger_calls():
            ch = stranger.channel(w0)
            info = await _call_info(ch)
            for _ in range(6):  # a refusal that races the client's half-close reads as INTERNAL (CORE_RACE): more often under load
                call = ch.stream_stream(EXCHANGE)(iter([b"\x0a\x00"]), timeout=3)  # any first frame: signed
                try:
                    await call.read()
                    pair, details = await call.code(), await call.details()
                except grpc.aio.AioRpcError as exc:
                    pair, details = exc.code(), exc.details()
                if not client_race(pair, details):
                    break
            await ch.close()
            set_client_auth(ClientAuth(stranger.signer, lambda addr: w0.peer_id))
            try:
                await fetch_state(f"127.0.0.1:{w0.grpc_port}", RUN, stranger.peer_id, cfg_hash,
                                  {n: (d, s) for n, d, s in specs}, timeout=10)
                fetch = "downloaded"
            except StateFetchError as exc:
                fetch = str(exc)
            finally:
                set_client_auth(None)
            return info, (pair, details), fetch
        info, (pair, details), fetch = stranger.run(stranger_calls())
        assert info == grpc.StatusCode.PERMISSION_DENIED
        assert pair == grpc.StatusCode.PERMISSION_DENIED, details
        assert "PERMISSION_DENIED" in fetch and "node card" in fetch, fetch
        assert metric(w0, "swarmnode_rpc_rejected_total", reason="unknown_peer") >= denied0 + 3

        # 64 idle streams from the member and 64 from strangers' fresh keys, held ~6 s, while an
        # honest member (the bootstrap's key) calls Info and the workers go on pairing
        wait_known(member, w0)  # its idle streams claim a member: slots of their own, capped
        before = rounds(swarm)
        strangers = [CallSigner(generate_key(), RUN) for _ in range(8)]

        w0_addr = f"127.0.0.1:{w0.grpc_port}"

        async def siege():
            idle = asyncio.ensure_future(idle_streams(w0_addr, member.signer, w0.peer_id, 64, hold_s=8))
            idle_s = [asyncio.ensure_future(idle_streams(w0_addr, s, w0.peer_id, 8, hold_s=8)) for s in strangers]
            honest = await _honest_calls(swarm, w0, 6, 0.2)
            return await idle, [c for f in idle_s for c in await f], honest
        idle_codes, stranger_codes, honest = member.run(siege(), timeout=60)
        assert all(code == grpc.StatusCode.OK and dt < 2.0 for code, dt in honest), honest
        assert len(honest) >= 20
        # the member's streams: at most the per-peer first-frame cap waited; all ended with an error
        assert idle_codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) <= 4, idle_codes
        assert idle_codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 60, idle_codes
        assert all(c == grpc.StatusCode.PERMISSION_DENIED for c in stranger_codes), stranger_codes
        healthy(swarm, before, more=2)
        assert w1.alive()
    finally:
        stranger.close()
        member.close()
    assert time.monotonic() - t0 < 90



def test_flooder_is_banned_and_honest_rounds_keep_pace(swarm, tmp_path):
    """A member sends 10x ``limits.peer_rps`` to a worker's Node.Info and keeps re-opening idle
    Exchange streams for WINDOW seconds (``flooder.py``: its own process at nice 10, so its load
    generator does not take the workers' CPU on this shared 2-core machine, as it would not on a
    network). Honest calls (the bootstrap's key, 4/s, made in the WINDOW before too, so that only
    the flood differs) all succeed within their 2 s deadline, both workers train within 20% of the
    pace of the WINDOW before, and the flooder is banned:
    ``swarmnode_peer_bans_total``, ``swarmnode_peers_banned``, its calls refused as banned, and
    ``swarmnode status`` marks it ``banned_by``."""
    window = 20.0
    w0, _ = swarm.workers
    flooder = Attacker(swarm, tmp_path, "flooder")
    proc = None
    try:
        cfg_hash = flooder.worker_cfg_hash(swarm.workers)
        assert flooder.keep_card(None, cfg_hash, role="bootstrap")

        wait_known(flooder, w0)  # the flood must come from a member: rate limits, not "unknown peer"
        bans0 = metric(w0, "swarmnode_peer_bans_total")
        t0, r0 = time.monotonic(), rounds(swarm)
        # the honest caller runs in both windows, so the pace comparison isolates the flood
        honest_before = flooder.run(_honest_calls(swarm, w0, window, 0.25), timeout=window + 30)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.flooder", str(tmp_path / "flooder.key"), RUN,
             f"127.0.0.1:{w0.grpc_port}", w0.peer_id, str(PEER_RPS * 10), str(window)],
            stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "start", "the flooder did not start"
        t1, r1 = time.monotonic(), rounds(swarm)

        honest = flooder.run(_honest_calls(swarm, w0, window, 0.25), timeout=window + 30)
        out, _ = proc.communicate(timeout=30)
        t2, r2 = time.monotonic(), rounds(swarm)
        assert proc.returncode == 0, proc.returncode
        result = json.loads(out.strip().splitlines()[-1])
        sent, codes = result["sent"], result["codes"]

        # 10x the limit asked; at nice 10 on a busy 2-core box it gets less CPU (at nice 19, 490-684 calls
        # in 20 s under two busy loops): what the test needs is a flood over the limit, which earns the
        # 20 rejections of a ban within seconds (then PERMISSION_DENIED for the rest of the answered calls;
        # on a loaded machine some calls pass their 2 s deadline unanswered: 213 of 1023 seen)
        assert sent >= PEER_RPS * 1.2 * window, f"the flooder sent only {sent} calls in {window:.0f} s"
        answered = sent - codes.get("DEADLINE_EXCEEDED", 0)
        assert answered >= PEER_RPS * window and codes.get("PERMISSION_DENIED", 0) > answered * 0.8, codes
        assert result["idle_codes"] and "OK" not in result["idle_codes"], result["idle_codes"]
        assert len(honest) >= window * 2 and all(c == grpc.StatusCode.OK and dt < 2.0 for c, dt in honest), honest
        assert all(c == grpc.StatusCode.OK for c, _ in honest_before), honest_before
        pace = {w.name: ((r1[w.name] - r0[w.name]) / (t1 - t0), (r2[w.name] - r1[w.name]) / (t2 - t1))
                for w in swarm.workers}
        print(f"flood: rounds/s before, during: {pace}; flooder {sent} calls {codes}")
        for name, (before, during) in pace.items():
            assert before > 0 and during >= 0.8 * before, f"{name}: {before:.3f} rounds/s before, {during:.3f} during"
        assert metric(w0, "swarmnode_peer_bans_total") >= bans0 + 1
        assert metric(w0, "swarmnode_peers_banned") >= 1
        assert metric(w0, "swarmnode_rpc_rejected_total", reason="rate_requests") >= 20

        async def after():
            async with flooder.channel(w0) as ch:
                try:
                    await node_pb2_grpc.NodeStub(ch).Info(node_pb2.InfoRequest(), timeout=2)
                    return "answered"
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"
        assert flooder.run(after()).startswith("PERMISSION_DENIED") and "banned" in flooder.run(after())

        def marked():
            rows = {r["peer_id"]: r for r in status_rows(swarm)}
            return rows.get(flooder.peer_id, {}).get("banned_by", 0) >= 1 and rows
        rows = wait_for(marked, 30, "swarmnode status to mark the flooder banned", poll=2)
        assert rows[w0.peer_id]["banned"] >= 1 and flooder.peer_id[-8:] in rows[w0.peer_id]["banned_ids"]
        assert all(rows[w.peer_id].get("banned_by", 0) == 0 for w in swarm.workers)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        flooder.close()
