"""Atomic local checkpoints of any role's state (named stateful parts, as torchtitan's checkpointer).

A role hands :class:`Checkpointer` its named parts (``{"model": model, "optimizer": opt, ...}``,
each with ``state_dict()`` / ``load_state_dict()``), plus a small metadata dict (round, step, ...).
This module owns the file format and its safety, nothing role-specific:

- written to a temporary name, fsynced, renamed to ``ckpt-<seq>.pt``, directory fsynced (a reader
  never sees half a file, a crash never loses the previous checkpoint);
- the last ``keep`` files are kept, older ones deleted after the new one is durable;
- loaded with ``torch.load(weights_only=True)`` only (tensors and plain containers, never
  arbitrary pickles); a file that fails to load, has another format, another config hash or
  lacks a part raises :class:`CheckpointError` and is left in place, never applied;
- every outcome is counted in ``swarmnode_checkpoints_total{outcome}``.

Checkpoints are local files: peers' state travels as tensor streams (node/state_sync.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from node.metrics import CHECKPOINTS

_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class CheckpointError(Exception):
    """A checkpoint exists but cannot be used; the message says why and what to do.
    ``reason``: ``corrupt`` | ``format`` | ``mismatch`` (cfg hash) | ``incomplete`` | ``unfit``."""

    def __init__(self, message: str, reason: str = "corrupt"):
        super().__init__(message)
        self.reason = reason


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Checkpoints of one role in ``state_dir``.

    :param format: the role's file format name, e.g. ``"swarmnode-<role>-v1"``; bump it when the
        parts change incompatibly (old files are then refused with a clear message).
    :param cfg_hash: hash of the settings the state depends on; a file written under another
        hash is refused (``check_cfg=False`` in :meth:`read` to inspect it anyway).
    :param keep: how many checkpoint files to keep (>= 1).
    """

    def __init__(self, state_dir: str | os.PathLike, format: str, cfg_hash: str, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(state_dir).expanduser()
        self.format, self.cfg_hash, self.keep = format, cfg_hash, keep

    # ---------------- files ----------------
    def files(self) -> list[Path]:
        """Checkpoint files, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest_path(self) -> Path | None:
        files = self.files()
        return files[-1] if files else None

    # ---------------- write ----------------
    def save(self, parts: Mapping[str, Stateful], meta: Mapping[str, Any] | None = None) -> Path:
        """Atomically write every part's ``state_dict()`` and ``meta``; returns the new file."""
        payload = {"format": self.format, "cfg_hash": self.cfg_hash, "meta": dict(meta or {}),
                   "parts": {name: part.state_dict() for name, part in parts.items()}}
        self.dir.mkdir(parents=True, exist_ok=True)
        files = self.files()
        seq = int(_NAME.match(files[-1].name).group(1)) + 1 if files else 1
        path = self.dir / f"ckpt-{seq:08d}.pt"
        tmp = self.dir / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.dir)
        except BaseException:
            CHECKPOINTS.labels(outcome="failed").inc()
            tmp.unlink(missing_ok=True)
            raise
        for old in self.files()[:-self.keep]:
            old.unlink(missing_ok=True)
        CHECKPOINTS.labels(outcome="written").inc()
        return path

    # ---------------- read ----------------
    def read(self, required: tuple[str, ...] = (), check_cfg: bool = True) -> dict[str, Any] | None:
        """The latest checkpoint as ``{"format", "cfg_hash", "meta", "parts"}``, validated but not
        applied; None if there is none. Raises CheckpointError (file left in place)."""
        path = self.latest_path()
        if path is None:
            others = sorted(p.name for p in self.dir.glob("*.pt")) if self.dir.is_dir() else []
            if others:  # e.g. a file of an older release: say so rather than start fresh silently
                CHECKPOINTS.labels(outcome="corrupt").inc()
                raise CheckpointError(f"{self.dir} holds {others[:3]} but no ckpt-*.pt file of {self.format}; "
                                      "nothing was loaded. Move those files away (or point state_dir elsewhere) "
                                      "to start fresh", "format")
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - truncated zip, bad pickle opcode, ...
            CHECKPOINTS.labels(outcome="corrupt").inc()
            raise CheckpointError(f"checkpoint {path} is corrupt ({type(exc).__name__}: {str(exc)[:200]}); "
                                  "it was not loaded. Move it away to start from the previous one "
                                  "(or fresh), or restore a good copy") from None
        if not isinstance(state, dict) or state.get("format") != self.format:
            CHECKPOINTS.labels(outcome="corrupt").inc()
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"checkpoint {path} is not a {self.format} file (format {got!r}); it was not "
                                  "loaded. Point state_dir at this role's checkpoints, or move the file away", "format")
        if check_cfg and state.get("cfg_hash") != self.cfg_hash:
            CHECKPOINTS.labels(outcome="mismatch").inc()
            raise CheckpointError(f"checkpoint {path} was written with cfg_hash {state.get('cfg_hash')!r}, this "
                                  f"node runs {self.cfg_hash!r}: not loaded. Restore the settings it was written "
                                  "with, or move it away to start fresh", "mismatch")
        parts = state.get("parts")
        missing = [k for k in ("meta", "parts") if not isinstance(state.get(k), dict)]
        missing += [k for k in required if isinstance(parts, dict) and k not in parts]
        if missing:
            CHECKPOINTS.labels(outcome="corrupt").inc()
            raise CheckpointError(f"checkpoint {path} lacks {missing}; it was not loaded", "incomplete")
        state["path"] = str(path)
        return state

    def apply(self, state: Mapping[str, Any], parts: Mapping[str, Stateful]) -> None:
        """Load ``state["parts"]`` into ``parts`` (every name must be present)."""
        missing = [k for k in parts if k not in state["parts"]]
        if missing:
            raise CheckpointError(f"checkpoint {state.get('path')} lacks {missing}; it was not loaded", "incomplete")
        for name, part in parts.items():
            try:
                part.load_state_dict(state["parts"][name])
            except Exception as exc:  # noqa: BLE001 - shape/key mismatch in a part
                CHECKPOINTS.labels(outcome="corrupt").inc()
                raise CheckpointError(f"checkpoint {state.get('path')}: part {name!r} does not fit this node "
                                      f"({type(exc).__name__}: {str(exc)[:200]}); restore the settings it was "
                                      "written with, or move it away to start fresh", "unfit") from None
        CHECKPOINTS.labels(outcome="loaded").inc()

    def load(self, parts: Mapping[str, Stateful]) -> dict[str, Any] | None:
        """Read the latest checkpoint and load it into ``parts``; returns its metadata, or None
        if there is no checkpoint. Raises CheckpointError."""
        state = self.read(required=tuple(parts))
        if state is None:
            return None
        self.apply(state, parts)
        return state["meta"]
