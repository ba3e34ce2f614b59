"""A toy second training role built only from the role toolkit in node/ (no optimizers/ import).

Two toy nodes on real hivemind DHTs (p2pd on 127.0.0.1) and real gRPC servers: node A trains a
tiny model on its compute thread (shared train metrics), checkpoints it and resumes from it,
publishes its per-iteration rendezvous entry; node B reads that entry, picks A as donor from
node cards (``order_donors`` over ``node.card.peers``) and downloads A's weights plus optimizer
state over ``WeightService.Fetch``.
"""

from __future__ import annotations

import ast
import time
from types import SimpleNamespace

import grpc
import hivemind
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from node import metrics as NM
from node.card import CARD_NAMESPACE, CardView, NodeCard
from node.checkpoint import Checkpointer
from node.compute import Compute
from node.rendezvous import Rendezvous
from node.roles import RoleBase
from node.state_sync import StateServicer, StateSnapshot, add_state_service, fetch_state, meta_int, order_donors, \
    split_optimizer
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


class ToyFit(RoleBase):
    """The whole role: fit y = 2x on the compute thread, checkpoint, serve state."""
    name = "toyfit"
    rendezvous = (TOY,)

    def __init__(self, ctx, settings=None):
        self.ctx, self.iteration, self.compute = ctx, 0, Compute(self.name)
        self.model = torch.nn.Linear(4, 4)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.ckpt = Checkpointer(ctx.state_dir, "toyfit-v1", "cfgT", keep=2)
        self.servicer = StateServicer(RUN, "cfgT", self.snapshot)

    def services(self):
        return [(add_state_service, self.servicer, "swarmnode.WeightService")]

    def _steps(self, n):
        for _ in range(n):
            t0, x = time.perf_counter(), torch.randn(16, 4)
            loss = torch.nn.functional.mse_loss(self.model(x), 2 * x)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.iteration += 1
            NM.record_train_step(float(loss.detach()), x.numel(), time.perf_counter() - t0)
        self.ckpt.save({"model": self.model, "opt": self.opt}, {"iteration": self.iteration})
        return float(loss)

    def snapshot(self):
        mom = {f"m.{n}": self.opt.state[p]["momentum_buffer"] for n, p in self.model.named_parameters()}
        return StateSnapshot({"iteration": self.iteration}, dict(self.model.state_dict()), mom)


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


async def test_toy_role_reuses_the_toolkit(tmp_path):
    key_a, key_b = generate_key(), generate_key()
    pid_a, pid_b = peer_id_str(key_a), peer_id_str(key_b)
    a_dht = _dht(tmp_path, "a", key_a)
    b_dht = _dht(tmp_path, "b", key_b, a_dht.get_visible_maddrs())
    a = ToyFit(SimpleNamespace(state_dir=tmp_path / "a"))
    b = ToyFit(SimpleNamespace(state_dir=tmp_path / "b"))
    server = grpc.aio.server(options=server_options())
    for add, servicer, _ in a.services():
        add(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        steps0 = NM.TRAIN_STEPS._value.get()
        first = await a.compute.run(a._steps, 5)
        last = await a.compute.run(a._steps, 40)
        assert last < first and NM.TRAIN_STEPS._value.get() == steps0 + 45
        assert len(a.ckpt.files()) == 2  # keep-last-2

        # resume from the checkpoint into a fresh node of the same role
        c = ToyFit(SimpleNamespace(state_dir=tmp_path / "a"))
        c.opt.step()  # creates no state (no grads), load must still fit
        meta = await c.compute.run(c.ckpt.load, {"model": c.model, "opt": c.opt})
        assert meta["iteration"] == 45
        assert all(torch.equal(x, y) for x, y in zip(c.model.state_dict().values(), a.model.state_dict().values()))

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

        exp = {n: (t.dtype, tuple(t.shape)) for n, t in b.model.state_dict().items()}
        opt_exp = {f"m.{n}": (p.dtype, tuple(p.shape)) for n, p in b.model.named_parameters()}
        meta, tensors = await fetch_state(donors[0].card.grpc_addr, RUN, pid_b, "cfgT", exp, optimizer=opt_exp,
                                          offload=b.compute.run, timeout=30)
        weights, mom = split_optimizer(tensors)
        await b.compute.run(b.model.load_state_dict, weights)
        b.iteration = meta_int(meta, "iteration")
        assert b.iteration == 45
        assert all(torch.equal(x, y) for x, y in zip(b.model.state_dict().values(), a.model.state_dict().values()))
        assert torch.equal(mom["m.weight"], a.opt.state[a.model.weight]["momentum_buffer"])
        tree = ast.parse(open(__file__).read())  # the role is built without optimizers/
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.split(".")[0] in ("optimizers", "pipeline", "rl") for m in imported)
    finally:
        await server.stop(0)
        for node in (a, b):
            node.compute.close()
        b_dht.shutdown()
        a_dht.shutdown()
