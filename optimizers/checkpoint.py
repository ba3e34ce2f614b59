"""Atomic local checkpoints of a NoLoCo/DiLoCo worker.

Owns the file format and its safety: written to a temporary name, fsynced, then renamed over
``latest.pt`` (a reader never sees half a file); loaded with ``torch.load(weights_only=True)``
(tensors and plain containers only, never arbitrary pickles); a file that fails to load or
lacks a field is reported as :class:`CheckpointError` and left in place, never half-applied.
Checkpoints are local files: peers' weights travel as tensor streams, never as files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT = "swarmnode-noloco-v1"
REQUIRED = ("format", "round", "step", "cfg_hash", "model", "outer", "inner_optimizer", "scheduler")


class CheckpointError(Exception):
    pass


def checkpoint_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir).expanduser() / "latest.pt"


def save(state_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Atomically write ``state`` (must hold the REQUIRED keys but ``format``)."""
    path = checkpoint_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = {"format": FORMAT, **state}
    missing = [k for k in REQUIRED if k not in payload]
    if missing:
        raise ValueError(f"checkpoint state lacks {missing}")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load(state_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The latest checkpoint, None if there is none; CheckpointError if it is unusable."""
    path = checkpoint_path(state_dir)
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle opcode, ...
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(exc).__name__}: {str(exc)[:200]}); "
                              "it was not loaded. Move it away to start fresh, or restore a good copy") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file; it was not loaded")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it was not loaded")
    return state
