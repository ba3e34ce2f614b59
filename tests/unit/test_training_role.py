"""``node.training.TrainingRole`` and ``node.run_settings``: the run knobs, exit-after and eval
cadence, the round loop under the supervisor, the drain (a round that ends in budget vs one that
does not), checkpoints, the per-round report and the loopback-only harness guard. No network."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from node import metrics as NM
from node.card import CardPublisher
from node.config import CardConfig, load_config
from node.run_settings import RunSettings, TrainingCard
from node.supervisor import Supervisor
from node.training import TrainingRole, TrainStep, require_loopback


class Section(RunSettings):
    legacy_keys = {"exit_after_rounds": "exit_after"}
    round_s: float = Field(0.05, gt=0)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    toy: Section


class Card(TrainingCard):
    round: int | None = None


class Role(TrainingRole):
    name, Settings, run_section, Card = "unittoy", Settings, "toy", Card
    checkpoint_format = "unittoy-v1"

    def __init__(self, ctx, settings):
        super().__init__(ctx, settings)
        self.model, self.rounds, self.fail_at = torch.nn.Linear(2, 2), 0, None

    async def setup(self):
        await self.ctx.set_role_ready(True, "ready", "")

    async def one_round(self):
        if await self.pause(self.cfg.round_s):
            return
        if self.rounds + 1 == self.fail_at:
            raise RuntimeError("round failed")
        self.rounds += 1
        self.report("unit_round", "round {round}: loss {loss:.2f}", round=self.rounds, loss=0.5,
                    steps=TrainStep(0.5, 8, 0.01), card=Card(round=self.rounds))

    def progress(self):
        return self.rounds

    async def summary(self):
        return {"rounds": self.rounds}

    def parts(self):
        return {"model": self.model}

    def restore(self, meta):
        self.rounds = int(meta["round"])


def _role(tmp_path, **toy) -> Role:
    config = load_config(None, {"run_id": "unit", "state_dir": str(tmp_path), "resume": True,
                                "device": {"device": "cpu"}}, environ={})

    async def ready(ok, reason, detail):
        return None

    drains: list[str] = []
    card = CardPublisher(SimpleNamespace(dht=None), CardConfig(), "unit", "me", "unittoy", "t", "", time.time())
    ctx = SimpleNamespace(config=config, peer_id="me", card=card, supervisor=Supervisor(), netem=None,
                          set_role_ready=ready, request_drain=drains.append, drains=drains)
    return Role(ctx, Settings.model_validate({"toy": toy}))


def _events(caplog, event):
    return [r for r in caplog.records if getattr(r, "event", None) == event]


async def _until(cond, timeout=10.0):
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, "timed out"
        await asyncio.sleep(0.01)


# ---------------- settings ----------------
def test_run_settings_one_name_per_knob_and_legacy_names():
    assert Section.model_validate({"exit_after_rounds": 7}).exit_after == 7
    assert Section.model_validate({"exit_after": 3, "eval_every": 2}).model_dump()["exit_after"] == 3
    with pytest.raises(ValidationError, match="same setting"):
        Section.model_validate({"exit_after": 3, "exit_after_rounds": 4})
    for bad in ({"exit_after": -1}, {"checkpoint_every": -2}, {"torch_threads": -1}, {"exit_afterr": 1}):
        with pytest.raises(ValidationError):
            Section.model_validate(bad)
    with pytest.raises(ValidationError):
        RunSettings.model_validate({"exit_after_rounds": 1})  # no legacy names on the base
    assert all(RunSettings.model_fields[k].description for k in RunSettings.model_fields)  # documented


def test_a_training_role_must_declare_its_section_and_hooks():
    with pytest.raises(TypeError, match="run_section"):
        class NoSection(Role):
            name, run_section = "bad1", "nope"
    with pytest.raises(TypeError, match="progress"):
        class NoProgress(TrainingRole):
            name, Settings, run_section = "bad2", Settings, "toy"

            async def setup(self):
                return None

            async def one_round(self):
                return None


def test_exit_after_and_eval_cadence(tmp_path):
    r = _role(tmp_path, exit_after=6, eval_every=3)
    r.rounds = 3
    assert r.eval_due() and not r.exit_reached()
    r.rounds = 4
    assert not r.eval_due() and r.eval_due(count=6)
    r.rounds = 6
    assert r.exit_reached() and not r.eval_due()  # the last round: finish() evaluates, not the cadence
    assert not _role(tmp_path).exit_reached()    # exit_after = 0: run until stopped


# ---------------- the loop ----------------
async def test_rounds_run_until_exit_after_then_finish_and_report(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="swarmnode.unittoy")
    r = _role(tmp_path, exit_after_rounds=3, checkpoint_every=2)
    steps0 = NM.TRAIN_STEPS._value.get()
    await r.start()
    await _until(lambda: r.ctx.drains == ["finished"])
    assert r.rounds == 3 and r.stopping
    rounds = _events(caplog, "unit_round")
    assert [x._fields["round"] for x in rounds] == [1, 2, 3] and rounds[0].getMessage() == "round 1: loss 0.50"
    assert NM.TRAIN_STEPS._value.get() == steps0 + 3
    assert r.ctx.card.details == {"round": 3}
    [fin] = _events(caplog, "training_finished")
    assert fin._fields == {"rounds": 3, "round": 3}
    assert [int(p.name[5:13]) for p in r.checkpoints.files()] == [1]  # round 2 only (3 is not due)
    await r.drain(1.0)
    assert len(r.checkpoints.files()) == 2  # the final checkpoint at the drain


async def test_a_failing_round_stops_the_loop_as_a_task_failure(tmp_path):
    r = _role(tmp_path)
    r.fail_at = 2
    fatal = []
    r.ctx.supervisor = Supervisor(on_fatal=lambda name, exc: fatal.append((name, str(exc))))
    await r.start()
    await _until(lambda: fatal)
    assert fatal == [("unittoy_round", "round failed")] and r.rounds == 1
    await asyncio.sleep(0.2)
    assert r.rounds == 1  # no round after the failed one
    await r.drain(1.0)


# ---------------- drain ----------------
async def test_drain_waits_for_a_round_that_ends_in_budget(tmp_path):
    r = _role(tmp_path, checkpoint_every=100)
    gate = asyncio.Event()
    r.rounds = 5

    async def slow_round():
        await gate.wait()
        await asyncio.sleep(0.2)
        r.rounds += 1

    r.one_round = slow_round
    await r.start()
    await asyncio.sleep(0.05)
    gate.set()
    await r.drain(3.0)  # 1 s to wait for the round: it ends after 0.2 s
    assert r.rounds == 6 and not r._round.cancelled()
    meta = r.checkpoints.read()["meta"]
    assert meta == {"round": 6}  # the final checkpoint holds the finished round
    with pytest.raises(Exception):
        await r.compute.run(int)  # the compute thread is closed


async def test_drain_cancels_a_round_that_does_not_end_in_budget(tmp_path):
    r = _role(tmp_path, checkpoint_every=100)
    r.rounds = 5
    done = []

    async def endless_round():
        await asyncio.sleep(30)
        done.append(1)

    r.one_round = endless_round
    await r.start()
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await r.drain(2.5)  # 0.5 s for the round
    assert time.monotonic() - t0 < 2.0 and r._round.cancelled() and not done
    assert r.checkpoints.read()["meta"] == {"round": 5}


async def test_drain_without_progress_or_checkpoints_writes_none(tmp_path):
    r = _role(tmp_path, checkpoint_every=0)
    r.rounds = 4
    await r.drain(1.0)
    assert r.checkpoints.files() == []
    r = _role(tmp_path, checkpoint_every=3)
    await r.drain(1.0)  # progress 0: nothing worth a checkpoint
    assert r.checkpoints.files() == []


# ---------------- checkpoints ----------------
async def test_resume_loads_parts_and_restores_counters(tmp_path, caplog):
    a = _role(tmp_path, checkpoint_every=1)
    a.rounds = 7
    await a.compute.run(a.save_checkpoint)
    b = _role(tmp_path)
    assert (await b.resume()) == {"round": 7} and b.rounds == 7
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    b.cfg_hash = "other"
    assert await b.resume() is None  # written under another cfg hash: refused, logged
    assert _events(caplog, "checkpoint_mismatch")
    b.ctx.config.resume = False
    b.cfg_hash = ""
    assert await b.resume() is None  # resume off
    for r in (a, b):
        r.compute.close()


async def test_a_checkpoint_without_the_counters_is_not_loaded(tmp_path, caplog):
    a = _role(tmp_path)
    await a.compute.run(lambda: a.checkpoints.save(a.parts(), {"step": 3}))
    b = _role(tmp_path)
    before = [t.clone() for t in b.model.state_dict().values()]
    assert await b.resume() is None and b.rounds == 0
    assert all(torch.equal(x, y) for x, y in zip(before, b.model.state_dict().values()))
    assert "lacks metadata ['round']" in _events(caplog, "checkpoint_corrupt")[0]._fields["error"]
    for r in (a, b):
        r.compute.close()


async def test_resume_skips_a_damaged_newest_checkpoint_for_the_one_before(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    a = _role(tmp_path, checkpoint_every=1)
    for rounds in (3, 5):
        a.rounds = rounds
        await a.compute.run(a.save_checkpoint)
    written = {r._fields["progress"]: r._fields["digest"] for r in _events(caplog, "checkpoint_written")}
    assert set(written) == {3, 5} and written[3] != written[5]
    newest = a.checkpoints.files()[-1]
    newest.write_bytes(newest.read_bytes()[:-100])  # the end of the newest file is lost
    b = _role(tmp_path)
    assert await b.resume() == {"round": 3} and b.rounds == 3
    assert _events(caplog, "resume")[-1]._fields["digest"] == written[3]  # exactly the file written at 3
    assert _events(caplog, "checkpoint_skipped")[0]._fields["path"] == str(newest) and newest.exists()
    for r in (a, b):
        r.compute.close()


async def test_a_failed_checkpoint_write_is_said_and_training_goes_on(tmp_path, caplog, monkeypatch):
    r = _role(tmp_path, checkpoint_every=1)
    r.rounds = 2
    await r.compute.run(r.save_checkpoint)
    good = r.checkpoints.files()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    await r.start()
    await _until(lambda: r.rounds >= 6 and len(_events(caplog, "checkpoint_failed")) >= 3)
    failed = _events(caplog, "checkpoint_failed")[0]
    assert failed.levelno == logging.ERROR and "No space left" in failed._fields["error"]
    assert "point state_dir at a writable disk" in failed.getMessage()
    assert r.checkpoints.files() == good and not list(tmp_path.glob(".*.tmp"))  # the last good one kept
    await r.drain(1.0)
    assert r.ctx.supervisor.failed is None


async def test_an_unwritable_checkpoint_dir_is_said_at_start(tmp_path, caplog):
    (tmp_path / "a-file").write_text("not a directory")
    r = _role(tmp_path / "a-file" / "state", checkpoint_every=1)  # fails for root too
    await r.start()
    await _until(lambda: r.rounds >= 2)
    ev = _events(caplog, "checkpoint_dir_unwritable")
    assert len(ev) == 1 and ev[0].levelno == logging.ERROR and "a-file" in ev[0]._fields["dir"]
    await r.drain(1.0)
    r = _role(tmp_path / "fine", checkpoint_every=1)
    assert await r.compute.run(r.check_checkpoint_dir) and not list((tmp_path / "fine").iterdir())
    r.compute.close()


def test_snapshot_serves_the_model_part_with_the_progress(tmp_path):
    r = _role(tmp_path)
    r.rounds = 2
    snap = r.snapshot()
    assert snap.meta == {"round": 2} and set(snap.weights) == {"weight", "bias"} and snap.optimizer is None
    assert snap.weights["weight"].data_ptr() != r.model.weight.data_ptr()  # a copy
    r.compute.close()


# ---------------- card, report, guard ----------------
def test_update_card_takes_only_the_roles_typed_details(tmp_path):
    r = _role(tmp_path)
    r.update_card(Card(cfg_hash="h", round=2))
    r.update_card(Card(round=3))  # unset fields stay
    assert r.ctx.card.details == {"cfg_hash": "h", "round": 3}
    r.update_card(Card(round=None))  # None removes
    assert r.ctx.card.details == {"cfg_hash": "h"}
    with pytest.raises(TypeError, match="are a Card, not a TrainingCard"):
        r.update_card(TrainingCard(cfg_hash="x"))
    with pytest.raises(ValidationError):
        Card(round=1, reward=0.5)  # not a field of the role's card
    r.compute.close()


def test_require_loopback_refuses_public_addresses():
    ok = SimpleNamespace(host="127.0.0.1", advertise_host=None,
                         dht=SimpleNamespace(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/x"], announce_maddrs=[]))
    require_loopback(ok, "[x.harness]", "Remove it")
    bad = SimpleNamespace(host="127.0.0.1", advertise_host=None,
                          dht=SimpleNamespace(initial_peers=["/ip4/10.0.0.2/tcp/1/p2p/x"], announce_maddrs=[]))
    with pytest.raises(ValueError, match=r"\[x.harness\] is a test and benchmark harness.*10.0.0.2.*Remove it"):
        require_loopback(bad, "[x.harness]", "Remove it")
    bad.host, bad.dht.initial_peers = "0.0.0.0", []
    with pytest.raises(ValueError, match="'0.0.0.0'"):
        require_loopback(bad, "[x.harness]", "Remove it")
