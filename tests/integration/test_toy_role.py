"""A toy fourth training role on ``node.training.TrainingRole`` (no optimizers/, pipeline/, rl/ import).

The role itself (``ToySection`` .. ``ToyFit``) is an engine, ``one_round`` and a config; the base
gives it the round loop, exit-after, finish, drain within budget, checkpoints, state serving and
the per-round report. Real node pieces: the Compute thread, the Checkpointer, the Supervisor,
hivemind DHTs (p2pd on 127.0.0.1) and a gRPC server: node A trains to ``exit_after``, finishes,
drains and resumes from its checkpoint; node D is drained mid-round and a fresh node resumes it
from its checkpoint and trains on; node B picks A as donor from node cards and downloads A's
weights plus optimizer state over ``WeightService.Fetch``.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import time
from types import SimpleNamespace

import grpc
import hivemind
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from node import metrics as NM
from node.card import CARD_NAMESPACE, CardPublisher, CardView, NodeCard
from node.config import CardConfig, load_config
from node.rendezvous import Rendezvous
from node.run_settings import RunSettings, TrainingCard
from node.state_sync import StateSnapshot, order_donors, split_optimizer
from node.supervisor import Supervisor
from node.training import TrainingRole, TrainStep
from protocol.grpc_options import server_options
from security.keys import generate_key, peer_id_str, write_key_file
from security.records import SignedRecordValidator

pytestmark = pytest.mark.timeout(120)

RUN = "toyrun"


class ToyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    iteration: int = Field(ge=0)
    grpc_addr: str = Field(max_length=80)


TOY = Rendezvous("toyfit/iter/", ToyEntry, index_field="iteration", max_ttl_s=30.0)


# ---------------- the role: config + engine + one_round (kept under 80 lines) ----------------
class ToySection(RunSettings):
    steps_per_round: int = Field(5, ge=1)
    step_delay_s: float = Field(0.0, ge=0)


class ToySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    toyfit: ToySection


class ToyCard(TrainingCard):
    iteration: int | None = None
    loss: float | None = None


class ToyEngine:  # fit y = 2x: transport-free, run on the compute thread
    def __init__(self):
        self.model, self.iteration = torch.nn.Linear(4, 4), 0
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def steps(self, n: int, stopping, delay_s: float) -> list[TrainStep]:
        out = []
        for _ in range(n):
            if stopping():
                break
            t0, x = time.perf_counter(), torch.randn(16, 4)
            loss = torch.nn.functional.mse_loss(self.model(x), 2 * x)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.iteration += 1
            time.sleep(delay_s)
            out.append(TrainStep(float(loss.detach()), x.numel(), time.perf_counter() - t0))
        return out


class ToyFit(TrainingRole):
    name, Settings, run_section, Card = "toyfit", ToySettings, "toyfit", ToyCard
    checkpoint_format, serves_state, progress_key, rendezvous = "toyfit-v1", True, "iteration", (TOY,)

    def __init__(self, ctx, settings):
        super().__init__(ctx, settings)
        self.engine, self.cfg_hash, self.losses = ToyEngine(), "cfgT", []

    async def setup(self):
        self.update_card(ToyCard(cfg_hash=self.cfg_hash, **await self.compute.run(self.place)))
        await self.resume()
        await self.take_snapshot()
        await self.ctx.set_role_ready(True, "ready", "")

    async def one_round(self):
        steps = await self.compute.run(self.engine.steps, self.cfg.steps_per_round, lambda: self.compute.stopping,
                                       self.cfg.step_delay_s)
        await self.take_snapshot()
        self.losses += [s.loss for s in steps]
        self.report("toy_round_done", "iteration {iteration}: loss {loss:.4f}", steps=steps, loss=steps[-1].loss,
                    iteration=self.progress(), card=ToyCard(iteration=self.progress(), loss=steps[-1].loss))

    def progress(self):
        return self.engine.iteration

    async def summary(self):
        return {"loss_start": self.losses[0], "loss_end": self.losses[-1]}

    def parts(self):
        return {"model": self.engine.model, "opt": self.engine.opt}

    def restore(self, meta):
        self.engine.iteration = int(meta["iteration"])

    def snapshot(self):
        mom = {f"m.{n}": self.engine.opt.state[p]["momentum_buffer"].clone()
               for n, p in self.engine.model.named_parameters() if p in self.engine.opt.state}
        weights = {n: t.detach().clone() for n, t in self.engine.model.state_dict().items()}
        return StateSnapshot({"iteration": self.engine.iteration}, weights, mom or None)
# ---------------- end of the role ----------------


def _dht(tmp_path, name, key, initial=()):
    path = write_key_file(tmp_path / f"{name}.key", key)
    validator = SignedRecordValidator(RUN, key, [CARD_NAMESPACE, TOY.namespace])
    return hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial), identity_path=str(path),
                        record_validators=[validator], start=True, check_if_identity_free=False)


def _view(peer_id, role, addr, **details):
    now = time.time()
    card = NodeCard(role=role, state="ready", version="t", grpc_addr=addr, started_at=now, published_at=now,
                    details=details)
    return CardView(peer_id, card, now + 60)


def _node(tmp_path, name, peer_id, **toy):
    """A ToyFit with a real node config, card publisher and supervisor (no daemon around it)."""
    config = load_config(None, {"run_id": RUN, "state_dir": str(tmp_path / name), "resume": True,
                                "device": {"device": "cpu"}}, environ={})
    drains: list[str] = []

    async def ready(ok, reason, detail):
        return None

    card = CardPublisher(SimpleNamespace(dht=None), CardConfig(), RUN, peer_id, "toyfit", "t", "", time.time())
    ctx = SimpleNamespace(config=config, peer_id=peer_id, card=card, supervisor=Supervisor(), netem=None,
                          set_role_ready=ready, request_drain=drains.append)
    role = ToyFit(ctx, ToyFit.Settings.model_validate({"toyfit": toy}))
    return role, drains


async def _until(cond, timeout=30.0):
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, "timed out"
        await asyncio.sleep(0.02)


def _events(caplog, event):
    return [dict(r._fields) for r in caplog.records if getattr(r, "event", None) == event and hasattr(r, "_fields")]


async def test_toy_role_trains_drains_resumes_and_serves_state(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="swarmnode.toyfit")
    key_a, key_b = generate_key(), generate_key()
    pid_a, pid_b = peer_id_str(key_a), peer_id_str(key_b)
    a_dht = _dht(tmp_path, "a", key_a)
    b_dht = _dht(tmp_path, "b", key_b, a_dht.get_visible_maddrs())
    a, a_drains = _node(tmp_path, "a", pid_a, exit_after=45, checkpoint_every=10, steps_per_round=5)
    b, _ = _node(tmp_path, "b", pid_b)
    server = grpc.aio.server(options=server_options())
    for add, servicer, _ in a.services():
        add(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    nodes = [a, b]
    try:
        # A: 9 rounds of 5 steps through the base's loop, then finish (exit_after) and the daemon's drain
        steps0 = NM.TRAIN_STEPS._value.get()
        await a.start()
        await _until(lambda: a_drains == ["finished"])
        await a.drain(5.0)
        assert a.losses[-1] < a.losses[0] and NM.TRAIN_STEPS._value.get() == steps0 + 45
        [fin] = _events(caplog, "training_finished")
        assert fin["iteration"] == 45 and fin["loss_end"] == a.losses[-1]
        rounds = _events(caplog, "toy_round_done")
        assert [r["iteration"] for r in rounds] == list(range(5, 50, 5))
        assert a.ctx.card.details["iteration"] == 45 and a.ctx.card.details["cfg_hash"] == "cfgT"
        assert a.ctx.card.details["device_kind"] == "cpu"
        assert len(a.checkpoints.files()) == 2  # keep-last-2 (iterations 40 and the final 45)

        # resume from the checkpoint into a fresh node of the same role
        c, _ = _node(tmp_path, "a", pid_a)
        nodes.append(c)
        c.engine.opt.step()  # creates no state (no grads), load must still fit
        meta = await c.resume()
        assert meta["iteration"] == 45 and c.progress() == 45
        assert all(torch.equal(x, y) for x, y in zip(c.engine.model.state_dict().values(),
                                                     a.engine.model.state_dict().values()))

        # D is drained mid-round (the round cannot end in the budget: it is cancelled), checkpoints
        # on the compute thread, and E resumes from that checkpoint and trains on to exit_after
        d, d_drains = _node(tmp_path, "d", pid_b, steps_per_round=20, step_delay_s=0.03, checkpoint_every=20)
        nodes.append(d)
        await d.start()
        await _until(lambda: d.progress() >= 24)
        await d.drain(0.5)
        stopped_at = d.progress()
        assert 24 <= stopped_at < 40 and d_drains == [] and d._round.cancelled()
        assert [r["iteration"] for r in _events(caplog, "toy_round_done")][-1] == 20  # round 2 never reported
        e, e_drains = _node(tmp_path, "d", pid_b, steps_per_round=20, exit_after=stopped_at + 20,
                            checkpoint_every=20)
        nodes.append(e)
        await e.start()
        await _until(lambda: e_drains == ["finished"])
        assert _events(caplog, "resume")[-1]["progress"] == stopped_at
        assert _events(caplog, "training_finished")[-1]["iteration"] == stopped_at + 20
        await e.drain(5.0)

        assert await TOY.publish(a_dht, RUN, pid_a, ToyEntry(iteration=45, grpc_addr=addr), ttl_s=30)
        seen = {}
        for _ in range(20):
            seen = await TOY.read(b_dht, RUN, 45)
            if pid_a in seen:
                break
        assert seen[pid_a].grpc_addr == addr

        views = [_view(pid_a, "toyfit", seen[pid_a].grpc_addr, iteration=45, cfg_hash="cfgT"),
                 _view("12D3KooWbehind", "toyfit", "127.0.0.1:1", iteration=3, cfg_hash="cfgT"),
                 _view("12D3KooWother", "toyfit", "127.0.0.1:2", iteration=99, cfg_hash="cfgX"),
                 _view("12D3KooWnoloco", "other", "127.0.0.1:3", iteration=99, cfg_hash="cfgT"),
                 _view(pid_b, "toyfit", "127.0.0.1:4", iteration=0, cfg_hash="cfgT")]
        donors = order_donors(views, role="toyfit", cfg_hash="cfgT", progress_key="iteration", exclude=pid_b)
        assert [d.peer_id for d in donors] == [pid_a, "12D3KooWbehind"]

        # B downloads A's served state (weights + momentum) through the base's download_state
        exp = {n: (t.dtype, tuple(t.shape)) for n, t in b.engine.model.state_dict().items()}
        opt_exp = {f"m.{n}": (p.dtype, tuple(p.shape)) for n, p in b.engine.model.named_parameters()}
        # with the unreachable donor listed, A's download alone is not adopted: nobody confirms it
        assert await b.download_state(views, exp, optimizer=opt_exp, timeout=30) is None
        assert _events(caplog, "state_donor_unconfirmed")[-1]["donor"] == pid_a
        # once A is the only donor there is (the other's card gone), it is adopted unchecked
        got = await b.download_state([v for v in views if v.peer_id != "12D3KooWbehind"], exp, optimizer=opt_exp,
                                     timeout=30)
        weights, mom = split_optimizer(got.tensors)
        await b.compute.run(b.engine.model.load_state_dict, weights)
        b.restore(got.meta)
        assert got.donor == pid_a and got.progress == 45 and b.progress() == 45
        # the only donor: A's state is adopted unchecked, and said so
        assert got.lone and _events(caplog, "state_donor_unchecked")[-1]["donor"] == pid_a
        assert all(torch.equal(x, y) for x, y in zip(b.engine.model.state_dict().values(),
                                                     a.engine.model.state_dict().values()))
        a_w = a.engine.model.weight
        assert torch.equal(mom["m.weight"], a.engine.opt.state[a_w]["momentum_buffer"])
        tree = ast.parse(open(__file__).read())  # the role is built without optimizers/
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.split(".")[0] in ("optimizers", "pipeline", "rl") for m in imported)
        src = open(__file__).read()
        role_src = src[src.index("# ---------------- the role"):src.index("# ---------------- end of the role")]
        assert len(role_src.splitlines()) < 80
    finally:
        await server.stop(0)
        for node in nodes:
            node.compute.close()
        b_dht.shutdown()
        a_dht.shutdown()
