"""Issue 7's open-swarm attacks replayed on real processes: a bootstrap and two ``noloco``
workers on 127.0.0.1 (OS processes), and an attacker in this process, a stranger with a fresh
key: a hivemind DHT client that signs its own records (node card, roster entries) and a gRPC
server running the exchange protocol with tensors of its choosing (its calls are signed with
its own key, as any open-swarm member's would be).

(a) a self-signed node card claiming an absurd round: no worker adopts it, both stay listed;
(b) a pairing partner serving finite but huge tensors: rejected ("norm"), honest weights do not
    move, eval loss stays finite, training goes on, /readyz says ready (truthfully: the model is fine);
(c) a NaN partner: rejected ("nonfinite"), the round is solo, nothing changes.

The swarm is shared by the three tests (module fixture); each test is bounded well under 90 s.
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
import hivemind
import pytest
import torch

from models.config import ModelConfig
from models.hf_adapter import build_from_config
from node.card import CARD_NAMESPACE, NodeCard, cards_key, read_cards
from node.dht_records import store_entry
from node.localswarm import LocalSwarm, NodeProc
from optimizers.exchange import OuterExchange, add_exchange_to_server
from optimizers.roster import ROSTER_NAMESPACE
from protocol.grpc_options import server_options
from security.keys import generate_key, peer_id_str, write_key_file
from security.peer_auth import CallSigner, ClientAuth, client_auth, set_client_auth
from security.records import SignedRecordValidator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = "attack-it"
MODEL = dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
COMMON = [
    "noloco.inner_steps=6", "noloco.round_timeout=4", "noloco.eval_every=1", "noloco.eval_batches=2",
    "noloco.torch_threads=1", "noloco.checkpoint_every=0", "noloco.inner.lr=0.003", "noloco.inner.warmup=10",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=10",
]
ABSURD_ROUND = 10 ** 12


def metric(node: NodeProc, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(v for k, v in node.metrics().items()
               if k == name or (k.startswith(name + "{") and (not want or want in k)))


def wait_for(pred, timeout: float, what: str, poll: float = 0.5):
    t0 = time.monotonic()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def status_rows(swarm: LocalSwarm) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "node.cli", "status", "--initial-peers", swarm.bootstrap_maddr,
                          "--run-id", swarm.run_id, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class Attacker:
    """A stranger to the swarm (fresh key), with its own event loop in a thread."""

    def __init__(self, swarm: LocalSwarm, tmp, name: str):
        self.key = generate_key()
        self.peer_id = peer_id_str(self.key)
        path = write_key_file(tmp / f"{name}.key", self.key)
        self.dht = hivemind.DHT(initial_peers=[swarm.bootstrap_maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                identity_path=str(path), check_if_identity_free=False, start=True,
                                record_validators=[SignedRecordValidator(RUN, self.key,
                                                                         [CARD_NAMESPACE, ROSTER_NAMESPACE])])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.addr, self.ex, self.server, self.results = "127.0.0.1:1", None, None, []
        self._stop = threading.Event()
        self._task = None

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def cards(self):
        return await read_cards(self.dht, RUN, timeout=5.0)

    async def publish_card(self, round_: int, cfg_hash: str) -> bool:
        card = NodeCard(role="noloco", state="ready", version="0.1.0", grpc_addr=self.addr, started_at=time.time(),
                        published_at=time.time(), details={"cfg_hash": cfg_hash, "round": round_, "outer": "noloco"})
        return await store_entry(self.dht, cards_key(RUN), self.peer_id, card, 30.0)

    async def _serve(self, cfg_hash: str, specs):
        self.server = grpc.aio.server(options=server_options())
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{port}"
        self.ex = OuterExchange(run_id=RUN, peer_id=self.peer_id, cfg_hash=cfg_hash, grpc_addr=self.addr,
                                dht=self.dht, specs=specs, poll_interval_s=0.1)  # no bounds: it takes anything
        add_exchange_to_server(self.ex.servicer(), self.server)
        await self.server.start()

    async def _pair_loop(self, cfg_hash: str, tensors):
        while not self._stop.is_set():
            try:
                views = [v for v in await self.cards() if v.card.role == "noloco" and v.peer_id != self.peer_id]
            except Exception:  # noqa: BLE001 - retry the read
                await asyncio.sleep(0.2)
                continue
            rounds = [v.card.details.get("round") for v in views if isinstance(v.card.details.get("round"), int)]
            if not rounds:
                await asyncio.sleep(0.2)
                continue
            r = max(rounds)
            await self.publish_card(r, cfg_hash)  # a live card and roster entry, as S1's open mode asks
            self.results.append(await self.ex.pair_average(r, [t.clone() for t in tensors], 4.0))

    def start_partner(self, cfg_hash: str, specs, tensors) -> None:
        """Serve ``tensors`` as a pairing partner in the workers' current round, round after round."""
        self.run(self._serve(cfg_hash, specs))
        self._task = asyncio.run_coroutine_threadsafe(self._pair_loop(cfg_hash, tensors), self.loop)

    def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                self._task.result(15)
            except Exception:  # noqa: BLE001 - the loop's last exchange may fail as we stop
                pass
        if self.ex is not None:
            self.run(self.ex.close())
        if self.server is not None:
            self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.dht.shutdown()


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
    yield lambda attacker, swarm: set_client_auth(ClientAuth(CallSigner(attacker.key, RUN), _resolver(swarm)))
    set_client_auth(before)


def _resolver(swarm: LocalSwarm):
    by_addr = {f"127.0.0.1:{n.grpc_port}": n.peer_id for n in swarm.nodes}
    return by_addr.get


def worker_cfg_hash(attacker: Attacker, swarm) -> str:
    def find():
        views = attacker.run(attacker.cards())
        hashes = {v.card.details.get("cfg_hash") for v in views if v.peer_id in {w.peer_id for w in swarm.workers}}
        hashes.discard(None)
        return hashes.pop() if len(hashes) == 1 else None
    return wait_for(find, 30, "the workers' cfg_hash in their cards")


def exchange_specs(cfg_hash: str):
    model = build_from_config(ModelConfig(**MODEL), seed=0)
    init = [p.detach().clone() for _, p in model.named_parameters()]
    specs = [(n, torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
    return specs, init


def healthy(swarm, rounds_before: dict[str, float], more: int = 2) -> None:
    """Every worker: ready, kept training (``more`` rounds), finite eval loss not worse than at its
    start, outer update norm small (the attack never moved the weights)."""
    for w in swarm.workers:
        wait_for(lambda: metric(w, "swarmnode_outer_round") >= rounds_before[w.name] + more, 60,
                 f"{w.name} to train {more} more rounds")
        r = w.readyz()
        assert r is not None and r.get("ready") is True, f"{w.name} /readyz: {r}"
        ev, ev0 = metric(w, "swarmnode_eval_loss"), metric(w, "swarmnode_eval_loss_initial")
        assert math.isfinite(ev) and ev <= ev0 + 0.05, f"{w.name}: eval loss {ev} (started at {ev0})"
        upd = metric(w, "swarmnode_outer_update_norm")
        assert math.isfinite(upd) and upd < 1.0, f"{w.name}: outer update norm {upd}"
        assert w.alive()


def test_absurd_round_in_a_self_signed_card_is_never_adopted(swarm, tmp_path):
    t0 = time.monotonic()
    attacker = Attacker(swarm, tmp_path, "forger")
    try:
        cfg_hash = worker_cfg_hash(attacker, swarm)
        before = {w.name: metric(w, "swarmnode_outer_round") for w in swarm.workers}
        assert attacker.run(attacker.publish_card(ABSURD_ROUND, cfg_hash)), "the DHT refused the forged card"
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
        cfg_hash = worker_cfg_hash(attacker, swarm)
        specs, init = exchange_specs(cfg_hash)
        rejected0 = sum(metric(w, "swarmnode_tensors_rejected_total", reason=reason) for w in swarm.workers)
        attacker.start_partner(cfg_hash, specs, poison(init))
        wait_for(lambda: sum(metric(w, "swarmnode_tensors_rejected_total", reason=reason)
                             for w in swarm.workers) > rejected0, 60, f"a worker to reject the attacker ({reason})")
        before = {w.name: metric(w, "swarmnode_outer_round") for w in swarm.workers}
        healthy(swarm, before, more=2)
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
