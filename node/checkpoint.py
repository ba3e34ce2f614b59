"""Atomic local checkpoints of any role's state (named stateful parts, as torchtitan's checkpointer).

A role hands :class:`Checkpointer` its named parts (``{"model": model, "optimizer": opt, ...}``,
each with ``state_dict()`` / ``load_state_dict()``), plus a small metadata dict (round, step, ...).
This module owns the file format and its safety, nothing role-specific:

- written to a temporary name, fsynced, renamed to ``ckpt-<seq>.pt``, directory fsynced (a reader
  never sees half a file, a crash never loses the previous checkpoint); temporary files a killed
  writer left behind are removed by the next save;
- each file carries a digest of its whole content (format, config hash, metadata and every
  tensor's dtype, shape and bytes: :func:`state_digest`), checked after loading: a file whose
  bytes changed after it was written (a torn write on a filesystem that reorders, a bad disk)
  is refused even when ``torch.load`` accepts it;
- the last ``keep`` files are kept, older ones deleted after the new one is durable;
- loaded with ``torch.load(weights_only=True)`` only (tensors and plain containers, never
  arbitrary pickles); a file that fails to load, has another format, a wrong digest or lacks a
  part is skipped (left in place, never applied) and the next older one is tried: a node resumes
  from the newest complete checkpoint; :class:`CheckpointError` when none is usable, or when the
  newest was written under another config hash;
- every outcome is counted in ``swarmnode_checkpoints_total{outcome}``.

Checkpoints are local files: peers' state travels as tensor streams (node/state_sync.py).
"""

from __future__ import annotations

import hashlib
import io
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


_TMP = re.compile(r"^\.ckpt-\d{8,}\.pt\.(\d+)\.tmp$")


def state_digest(obj: Any) -> str:
    """SHA-256 over a checkpoint payload in a fixed order: dict keys sorted (as text), every
    tensor's dtype, shape and raw bytes, every other leaf's type and ``repr``. The same state
    gives the same digest in any process; one changed byte of any tensor changes it."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, no copy
        elif isinstance(x, dict):
            h.update(f"D{len(x)}|".encode())
            for k in sorted(x, key=str):
                h.update(f"K{type(k).__name__}:{k}|".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__[0]}{len(x)}|".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"V{type(x).__name__}:{x!r}|".encode())

    walk(obj)
    return h.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        self.last_digest: str | None = None
        """Digest of the last file :meth:`save` wrote (logged, so a resume can be matched to it)."""

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
    def remove_stale_temps(self) -> list[Path]:
        """Delete temporary files of writers that no longer run (a save killed mid-write); the
        removed paths."""
        gone = []
        for p in self.dir.iterdir() if self.dir.is_dir() else ():
            m = _TMP.match(p.name)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                p.unlink(missing_ok=True)
                gone.append(p)
        return gone

    def save(self, parts: Mapping[str, Stateful], meta: Mapping[str, Any] | None = None) -> Path:
        """Atomically write every part's ``state_dict()`` and ``meta`` with their digest
        (:attr:`last_digest`); returns the new file. Raises OSError (full disk, no permission):
        the previous checkpoints are then untouched."""
        payload = {"format": self.format, "cfg_hash": self.cfg_hash, "meta": dict(meta or {}),
                   "parts": {name: part.state_dict() for name, part in parts.items()}}
        payload["digest"] = state_digest(payload)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temps()
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
        self.last_digest = payload["digest"]
        return path

    # ---------------- read ----------------
    def read(self, required: tuple[str, ...] = (), check_cfg: bool = True) -> dict[str, Any] | None:
        """The newest usable checkpoint as ``{"format", "cfg_hash", "meta", "parts", "digest",
        "path", "skipped"}``, validated but not applied; None if there is none. A file that is
        corrupt, of another format, incomplete or fails its digest is skipped (left in place; its
        path and error in ``skipped``) for the next older one. Raises CheckpointError when no
        file is usable (the newest one's error) or the newest usable one has another cfg hash."""
        files = self.files()
        if not files:
            others = sorted(p.name for p in self.dir.glob("*.pt")) if self.dir.is_dir() else []
            if others:  # e.g. a file of an older release: say so rather than start fresh silently
                CHECKPOINTS.labels(outcome="corrupt").inc()
                raise CheckpointError(f"{self.dir} holds {others[:3]} but no ckpt-*.pt file of {self.format}; "
                                      "nothing was loaded. Move those files away (or point state_dir elsewhere) "
                                      "to start fresh", "format")
            return None
        skipped: list[tuple[str, str]] = []
        first_error: CheckpointError | None = None
        for path in reversed(files):
            try:
                state = self._read_one(path, required, check_cfg)
            except CheckpointError as exc:
                if exc.reason == "mismatch":
                    raise
                first_error = first_error or exc
                skipped.append((str(path), str(exc)))
                continue
            state["skipped"] = skipped
            return state
        assert first_error is not None
        if len(files) > 1:
            first_error.args = (f"{first_error} (and the {len(files) - 1} older checkpoint(s) in {self.dir} "
                                "are not usable either)",)
        raise first_error

    def _read_one(self, path: Path, required: tuple[str, ...], check_cfg: bool) -> dict[str, Any]:
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
        digest = state.pop("digest", None)
        if digest is not None and state_digest(state) != digest:
            CHECKPOINTS.labels(outcome="corrupt").inc()
            raise CheckpointError(f"checkpoint {path} does not match the digest it was written with (its bytes "
                                  "changed after the write: a torn write or a bad disk); it was not loaded. Move it "
                                  "away, or restore a good copy")
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
        state["digest"] = digest
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
