"""What the schedule coordinator keeps on disk, so a bootstrap restarted with its `state_dir`
goes on with the run instead of starting it over: the last schedule epoch it published.

The stage nodes keep the schedules they adopted by epoch and start on the newest; a restarted
coordinator that counted from epoch 1 again would publish epochs they already hold (a new plan
under an old number, ignored). With the saved epoch its next plan is `saved + 1`, and it plans
as soon as every stage has a node (the first plan's wait for `schedule.expect_nodes` is for a
run's start, not a restart). The file is `<state_dir>/schedule_coordinator.json`, written to a
temporary file, fsynced and renamed over the old one: a SIGKILL at any moment leaves the old file
or the new one, never a torn one. A file that cannot be read or names another run is ignored
(and said so); one that cannot be written is said once per error, and the coordinator goes on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATE_FILE = "schedule_coordinator.json"


def state_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir).expanduser() / STATE_FILE


def load_epoch(state_dir: str | os.PathLike, run_id: str) -> tuple[int, str]:
    """(the saved epoch, "" or why none was taken); 0 when there is no usable file."""
    path = state_path(state_dir)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return 0, ""
    except (OSError, ValueError) as exc:
        return 0, f"cannot read {path} ({exc!r}); starting at epoch 1: move the file away if it is damaged"
    if not isinstance(raw, dict) or raw.get("run_id") != run_id:
        return 0, f"{path} belongs to run {raw.get('run_id') if isinstance(raw, dict) else None!r}, not {run_id!r}; " \
                  "starting at epoch 1"
    epoch = raw.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return 0, f"{path} holds no valid epoch ({epoch!r}); starting at epoch 1"
    return epoch, ""


def save_epoch(state_dir: str | os.PathLike, run_id: str, epoch: int) -> None:
    """Atomically write the epoch (raises OSError: the caller says so and goes on)."""
    path = state_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"run_id": run_id, "epoch": epoch}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["STATE_FILE", "load_epoch", "save_epoch", "state_path"]
