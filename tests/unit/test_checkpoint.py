"""Worker checkpoints: atomic write, exact round trip, corrupt files reported and not loaded (N11 file layer)."""

from __future__ import annotations

import os

import pytest
import torch

from optimizers import checkpoint


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"round": 7, "step": 140, "cfg_hash": "abc123",
            "model": {"w": torch.randn(4, 3, generator=g)},
            "outer": {"phi": [torch.randn(4, 3, generator=g)], "m": [torch.zeros(4, 3)],
                      "config": {"kind": "noloco", "outer_lr": 0.7}},
            "inner_optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
            "scheduler": {"last_epoch": 139}}


def test_round_trip_is_exact(tmp_path):
    st = _state()
    checkpoint.save(tmp_path, st)
    back = checkpoint.load(tmp_path)
    assert back["round"] == 7 and back["step"] == 140 and back["cfg_hash"] == "abc123"
    assert torch.equal(back["model"]["w"], st["model"]["w"])
    assert torch.equal(back["outer"]["phi"][0], st["outer"]["phi"][0])
    assert back["inner_optimizer"]["param_groups"][0]["lr"] == 0.1


def test_missing_checkpoint_is_none(tmp_path):
    assert checkpoint.load(tmp_path / "nothing-here") is None


def test_no_temp_files_left_and_overwrite_is_atomic(tmp_path):
    checkpoint.save(tmp_path, _state(0))
    checkpoint.save(tmp_path, _state(1))
    assert sorted(os.listdir(tmp_path)) == ["latest.pt"]
    assert torch.equal(checkpoint.load(tmp_path)["model"]["w"], _state(1)["model"]["w"])


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_is_reported_not_loaded(tmp_path, damage):
    path = checkpoint.save(tmp_path, _state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00not a checkpoint" * 10)
    with pytest.raises(checkpoint.CheckpointError, match="corrupt|not a"):
        checkpoint.load(tmp_path)
    assert path.exists()  # left in place for the operator


def test_foreign_or_incomplete_file_is_refused(tmp_path):
    path = checkpoint.checkpoint_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "something-else"}, path)
    with pytest.raises(checkpoint.CheckpointError, match="not a"):
        checkpoint.load(tmp_path)
    torch.save({"format": checkpoint.FORMAT, "round": 1}, path)
    with pytest.raises(checkpoint.CheckpointError, match="lacks"):
        checkpoint.load(tmp_path)


def test_save_refuses_incomplete_state(tmp_path):
    st = _state()
    del st["scheduler"]
    with pytest.raises(ValueError, match="scheduler"):
        checkpoint.save(tmp_path, st)
