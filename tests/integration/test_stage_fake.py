"""A fake stage cannot stall the pipeline (issue 33, finding 3; docs/pipeline.md, 'Admission probes and stalls').

Token mode, real processes on 127.0.0.1: a bootstrap (coordinator) and one honest node per stage
(0, 1, 2). From this process a member holding a `stage` token publishes a card for stage 1
backed by a gRPC server of its own, before the honest nodes start, so the coordinator's first
plan can take it:

- the probe's case: the server answers health checks only (what the probe of the issue used).
  Today it was planned within ~5 s and the pipeline made 0 steps until every honest node drained
  with `pipeline_stuck` and exited 0. Asserted: it fails its stage probe (`stage_probe_failed`),
  no published schedule ever names it, and the run trains to the end (every honest node exits 0).
- a smarter fake answers its first stage probe correctly, is planned, then answers nothing (not
  its pipeline streams, not later probes). Asserted: the coordinator sees the plan stall
  (`pipeline_stalled`), drops it (`stage_dropped`) within 30 s of the schedule that named it, the
  re-planned pipeline trains again (iterations advance after the drop) and the run finishes.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from node.card import NodeCard, cards_key
from node.dht_records import store_entry
from node.localswarm import LocalSwarm, NodeProc
from pipeline.stage_probe import PROBE_CHANNEL
from protocol.grpc_options import server_options
from protocol.streams import TensorStreamService, add_tensor_stream_to_server
from security.admission import encode_b64, issue_token
from security.keys import generate_key, peer_id_str, write_key_file
from tests.integration.hostile import Attacker, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "fake-stage"
ITERATIONS = 30
D_MODEL = 32
STALL_S = 8.0
DROP_BOUND_S = 30.0          # the issue's bound: dropped within 30 s with the pipeline training again


def events(node: NodeProc, event: str) -> list[dict]:
    text = node.log_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if f'"event": "{event}"' in line]


def settings() -> list[str]:
    return ["schedule.stages=3", "schedule.skip_ratio=0", "schedule.mb_per_origin=2", "schedule.memory=4",
            "schedule.max_swaps=0", "schedule.settle_s=1.0", "schedule.time_budget_s=1.0",
            f"schedule.stall_s={STALL_S}", "schedule.probe_timeout_s=5",
            f"model.d_model={D_MODEL}", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
            "data.seq_len=32", "data.batch_size=4", "data.max_train_bytes=200000", "data.max_val_bytes=20000",
            "stage.torch_threads=1", "stage.eval_every=0", "stage.optim.lr=0.003", "stage.optim.warmup=0",
            f"stage.iterations={ITERATIONS}", "stage.iteration_timeout_s=60", "card.refresh_s=1",
            "drain.budget_s=10", "security.known_peers_refresh_s=2"]


class FakeStage:
    """A member's fake stage-1 node: a signed card (it holds a stage token) and a gRPC server
    that answers health checks and, with `answer_first_probe`, its first stage probe only."""

    def __init__(self, attacker: Attacker, answer_first_probe: bool):
        self.att, self.answer_first = attacker, answer_first_probe
        self.probes = 0

    async def _probe(self, stream) -> None:
        async for r in stream:
            self.probes += 1
            if self.answer_first and self.probes == 1:
                out = torch.randn(1, r.tensor.shape[1], D_MODEL)
                await stream.send("probe_out", out, {}, timeout=5)
            else:
                await asyncio.sleep(3600)        # silent from now on

    async def serve(self) -> None:
        server = grpc.aio.server(options=server_options())
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        if self.answer_first:
            svc = TensorStreamService(run_id=RUN, peer_id=self.att.peer_id, max_tensor_bytes=1 << 20)
            svc.register(PROBE_CHANNEL, self._probe)
            add_tensor_stream_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.att.server, self.att.addr = server, f"127.0.0.1:{port}"

    async def publish(self) -> bool:
        card = NodeCard(role="stage", state="ready", version="0.1.0", grpc_addr=self.att.addr, started_at=time.time(),
                        published_at=time.time(), details={"stage": 1, "memory": 4, "compute_ms": 1, "iteration": 0})
        return await store_entry(self.att.dht, cards_key(RUN), self.att.peer_id, card, 20.0)

    def start(self) -> None:
        self.att.run(self.serve())
        assert self.att.run(self.publish())

        async def keep():
            while not self.att.stopping:
                await asyncio.sleep(3.0)
                try:
                    await self.publish()
                except Exception:  # noqa: BLE001 - the next try republishes
                    pass
        self.att.spawn(keep())


def run(tmp_path, answer_first_probe: bool) -> dict:
    coord = generate_key()
    write_key_file(tmp_path / "bootstrap.key", coord)
    common = [*settings(), "security.admission=token", f"security.coordinator_peer_id={peer_id_str(coord)}"]

    def admit(name: str | None, key=None) -> tuple[list[str], bytes]:
        key = key or generate_key()
        if name:
            write_key_file(tmp_path / f"{name}.key", key)
        token = issue_token(coord, run_id=RUN, peer_id=peer_id_str(key), expires_at=time.time() + 3600,
                            roles=["stage"])
        return [f"security.admission_token={encode_b64(token)}"], token

    with LocalSwarm(run_id=RUN, workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        fake_key = generate_key()
        _, fake_token = admit(None, fake_key)
        att = Attacker(swarm, tmp_path, "fake", key=fake_key, token=fake_token, coordinator=peer_id_str(coord))
        try:
            fake = FakeStage(att, answer_first_probe)
            fake.start()
            nodes = [swarm.start("stage", name=f"s{s}", extra_set=[f"stage.index={s}", "schedule.expect_nodes=3",
                                                                  *admit(f"s{s}")[0]]) for s in range(3)]
            t0 = time.monotonic()
            for n in nodes:
                rc = swarm.wait_exit(n, timeout=max(1.0, 200 - (time.monotonic() - t0)))
                assert rc == 0, f"{n.name} exited with {rc}: {n.log_text()[-3000:]}\n{boot.log_text()[-4000:]}"
            metrics = boot.metrics()
        finally:
            att.close()
    return {"boot": boot, "nodes": nodes, "fake": att.peer_id, "probes": fake.probes, "metrics": metrics}


def scheduled_with(boot: NodeProc, peer: str) -> list[dict]:
    return [e for e in events(boot, "schedule_published") if peer in e["schedule"]["names"]]


def test_a_health_only_fake_stage_is_never_scheduled_and_the_pipeline_trains(tmp_path):
    r = run(tmp_path, answer_first_probe=False)
    boot, fake = r["boot"], r["fake"]
    failed = [e for e in events(boot, "stage_probe_failed") if e["peer"] == fake]
    assert failed and failed[0]["stage"] == 1, events(boot, "stage_probe_failed")
    published = events(boot, "schedule_published")
    assert published and not scheduled_with(boot, fake), [e["schedule"]["names"] for e in published]
    steps = [e["iteration"] for e in events(r["nodes"][1], "stage_step")]
    assert steps[-1] == ITERATIONS - 1, steps[-5:]
    assert r["metrics"].get('swarmnode_pipeline_probes_total{outcome="failed"}', 0) >= 1, r["metrics"]
    print(f"\nhealth-only fake: probe failed ({failed[0]['why'][:80]}), never scheduled; {len(steps)} steps")


def test_a_fake_that_passes_its_probe_then_stalls_is_dropped_and_the_pipeline_trains_again(tmp_path):
    r = run(tmp_path, answer_first_probe=True)
    boot, fake, honest1 = r["boot"], r["fake"], r["nodes"][1]
    named = scheduled_with(boot, fake)
    assert named, "the fake passed its first probe but was never planned"
    dropped = [e for e in events(boot, "stage_dropped") if e["peer"] == fake]
    assert dropped, events(boot, "pipeline_stalled")
    t_named = min(_t(e) for e in named)
    t_drop = _t(dropped[0])
    assert t_drop - t_named <= DROP_BOUND_S, (t_drop - t_named)
    after = [e for e in events(boot, "schedule_published") if _t(e) >= t_drop]
    assert after and fake not in after[0]["schedule"]["names"], after[:1]
    steps = events(honest1, "stage_step")
    assert [e for e in steps if _t(e) > t_drop], "no step after the drop"
    assert steps[-1]["iteration"] == ITERATIONS - 1, steps[-1]
    assert r["metrics"].get("swarmnode_pipeline_stalls_total", 0) >= 1, r["metrics"]
    print(f"\nfake answering one probe: planned, dropped {t_drop - t_named:.1f} s after the schedule that named "
          f"it; first step after the drop {min(_t(e) for e in steps if _t(e) > t_drop) - t_drop:.1f} s later; "
          f"{len(steps)} steps on stage 1")


def _t(e: dict) -> float:
    from datetime import datetime
    return datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
