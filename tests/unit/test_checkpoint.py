"""Role checkpoints (node/checkpoint.py): atomic write, exact round trip of named stateful parts,
keep-last-K, corrupt / foreign / other-config files reported and not loaded (N11 file layer)."""

from __future__ import annotations

import os

import pytest
import torch

from node import checkpoint
from node.checkpoint import CheckpointError, Checkpointer
from node.metrics import CHECKPOINTS

FORMAT = "swarmnode-test-v1"


class _Part:
    """A stateful part: holds one state dict."""

    def __init__(self, sd=None):
        self.sd = sd if sd is not None else {}

    def state_dict(self):
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


def _parts(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(3, 4)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 3, generator=g))
    return {"model": model,
            "outer": _Part({"phi": [torch.randn(4, 3, generator=g)], "m": [torch.zeros(4, 3)],
                            "config": {"kind": "noloco", "outer_lr": 0.7}}),
            "inner_optimizer": _Part({"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}),
            "scheduler": _Part({"last_epoch": 139})}


def _blank() -> dict:
    return {"model": torch.nn.Linear(3, 4), "outer": _Part(), "inner_optimizer": _Part(), "scheduler": _Part()}


def _ck(tmp_path, cfg="abc123", keep=1) -> Checkpointer:
    return Checkpointer(tmp_path, FORMAT, cfg, keep=keep)


def _count(outcome: str) -> float:
    return CHECKPOINTS.labels(outcome=outcome)._value.get()


def test_round_trip_is_exact(tmp_path):
    src = _parts()
    written = _count("written")
    _ck(tmp_path).save(src, {"round": 7, "step": 140})
    assert _count("written") == written + 1
    back = _blank()
    meta = _ck(tmp_path).load(back)
    assert meta["round"] == 7 and meta["step"] == 140
    assert _ck(tmp_path).read()["cfg_hash"] == "abc123"
    assert torch.equal(back["model"].weight, src["model"].weight)
    assert torch.equal(back["outer"].sd["phi"][0], src["outer"].sd["phi"][0])
    assert back["inner_optimizer"].sd["param_groups"][0]["lr"] == 0.1
    assert back["scheduler"].sd["last_epoch"] == 139


def test_missing_checkpoint_is_none(tmp_path):
    assert _ck(tmp_path / "nothing-here").load(_blank()) is None


def test_no_temp_files_left_and_overwrite_is_atomic(tmp_path):
    _ck(tmp_path).save(_parts(0), {"round": 1})
    _ck(tmp_path).save(_parts(1), {"round": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000002.pt"]
    back = _blank()
    assert _ck(tmp_path).load(back)["round"] == 2
    assert torch.equal(back["model"].weight, _parts(1)["model"].weight)


def test_keep_last_k(tmp_path):
    ck = _ck(tmp_path, keep=3)
    for r in range(5):
        ck.save(_parts(r), {"round": r})
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-0000000{i}.pt" for i in (3, 4, 5)]
    assert ck.load(_blank())["round"] == 4
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, FORMAT, "abc123", keep=0)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_is_reported_not_loaded(tmp_path, damage):
    path = _ck(tmp_path).save(_parts(), {"round": 7})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00not a checkpoint" * 10)
    corrupt = _count("corrupt")
    back = _blank()
    before = back["model"].weight.clone()
    with pytest.raises(CheckpointError, match="corrupt|not a"):
        _ck(tmp_path).load(back)
    assert path.exists()  # left in place for the operator
    assert torch.equal(back["model"].weight, before)  # nothing applied
    assert _count("corrupt") == corrupt + 1


def test_foreign_or_incomplete_file_is_refused(tmp_path):
    ck = _ck(tmp_path)
    path = tmp_path / "ckpt-00000001.pt"
    torch.save({"format": "something-else"}, path)
    with pytest.raises(CheckpointError, match="not a"):
        ck.load(_blank())
    torch.save({"format": FORMAT, "cfg_hash": "abc123", "meta": {"round": 1}, "parts": {"model": {}}}, path)
    with pytest.raises(CheckpointError, match="lacks"):
        ck.load(_blank())


def test_foreign_file_without_checkpoints_is_reported(tmp_path):
    torch.save({"format": "swarmnode-old"}, tmp_path / "latest.pt")
    with pytest.raises(CheckpointError, match=r"latest.pt.*no ckpt-\*.pt") as err:
        _ck(tmp_path).load(_blank())
    assert err.value.reason == "format"


def test_cfg_hash_mismatch_is_refused_not_loaded(tmp_path):
    path = _ck(tmp_path, cfg="abc123").save(_parts(), {"round": 7})
    mismatch = _count("mismatch")
    back = _blank()
    before = back["model"].weight.clone()
    with pytest.raises(CheckpointError, match="cfg_hash 'abc123'.*'zzz999'") as err:
        _ck(tmp_path, cfg="zzz999").load(back)
    assert err.value.reason == "mismatch"
    assert torch.equal(back["model"].weight, before) and path.exists()
    assert _count("mismatch") == mismatch + 1
    assert _ck(tmp_path, cfg="zzz999").read(check_cfg=False)["meta"]["round"] == 7


def test_part_that_does_not_fit_is_refused(tmp_path):
    _ck(tmp_path).save(_parts(), {"round": 7})
    wrong = _blank()
    wrong["model"] = torch.nn.Linear(3, 5)
    with pytest.raises(CheckpointError, match="part 'model' does not fit"):
        _ck(tmp_path).load(wrong)


def test_save_refuses_part_without_state_dict(tmp_path):
    parts = _parts()
    parts["scheduler"] = object()
    with pytest.raises(AttributeError, match="state_dict"):
        _ck(tmp_path).save(parts, {"round": 1})
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".pt") or p.endswith(".tmp")]
    assert isinstance(_parts()["model"], checkpoint.Stateful)


def test_state_digest_is_content_only_and_sees_one_changed_byte():
    a = {"b": [torch.arange(6, dtype=torch.float32).reshape(2, 3)], "a": {"step": torch.tensor(3.0), "lr": 0.1}}
    b = {"a": {"lr": 0.1, "step": torch.tensor(3.0)}, "b": [torch.arange(6, dtype=torch.float32).reshape(2, 3)]}
    assert checkpoint.state_digest(a) == checkpoint.state_digest(b)  # key order, tensor identity: no matter
    b["b"][0].view(-1).view(torch.uint8)[5] ^= 1  # one bit of one float
    assert checkpoint.state_digest(a) != checkpoint.state_digest(b)
    assert checkpoint.state_digest({"x": torch.zeros(2, 3)}) != checkpoint.state_digest({"x": torch.zeros(3, 2)})
    assert checkpoint.state_digest({"x": torch.zeros(2)}) != checkpoint.state_digest({"x": torch.zeros(2).half()})
    assert checkpoint.state_digest({"x": torch.ones(2).bfloat16(), "f": True})  # every dtype hashes


def test_a_file_changed_after_it_was_written_fails_its_digest(tmp_path):
    path = _ck(tmp_path).save(_parts(), {"round": 7})
    state = torch.load(path, weights_only=True)
    state["parts"]["model"]["weight"][0, 0] += 1.0  # loads fine, but is not what was written
    torch.save(state, path)
    back = _blank()
    before = back["model"].weight.clone()
    with pytest.raises(CheckpointError, match="digest"):
        _ck(tmp_path).load(back)
    assert torch.equal(back["model"].weight, before)


def test_the_newest_usable_checkpoint_is_read_past_damaged_newer_ones(tmp_path):
    ck = _ck(tmp_path, keep=3)
    digests = []
    for r in range(3):
        ck.save(_parts(r), {"round": r})
        digests.append(ck.last_digest)
    files = ck.files()
    files[2].write_bytes(b"\x00" * 64)  # newest: garbage
    files[1].write_bytes(files[1].read_bytes()[:-10])  # next: truncated
    state = ck.read()
    assert state["meta"] == {"round": 0} and state["digest"] == digests[0]
    assert [p for p, _ in state["skipped"]] == [str(files[2]), str(files[1])]
    files[0].write_bytes(b"")
    with pytest.raises(CheckpointError, match="older checkpoint"):
        ck.read()


def test_temp_files_of_a_killed_writer_are_removed_by_the_next_save(tmp_path):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".ckpt-00000002.pt.{int(dead.stdout)}.tmp"
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".ckpt-00000002.pt.{os.getppid()}.tmp"  # a writer still running: left alone
    live.write_bytes(b"in progress")
    _ck(tmp_path).save(_parts(), {"round": 1})
    assert not stale.exists() and live.exists()
