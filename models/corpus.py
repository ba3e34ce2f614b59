"""Training text: corpus loading, the train/validation split, batch streams and evaluation.

Owns where bytes come from (the embedded stdlib corpus or `data.path`), the deterministic split
(by SHA-256 of each file's relative path, so every machine with the same files gets the same
split), the per-worker batch stream (IID shards, resumable at any step in O(1)) and the fixed
validation batches. Tokens are bytes (models/tokenizer.py), stored as a uint8 stream. Does not
own the model or the optimizer; `evaluate` only calls the model's forward.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from models.config import DataConfig
from models.llama import lm_loss

TEXT_SUFFIXES = (".txt", ".md", ".py")
SUFFIXES = TEXT_SUFFIXES + (".jsonl",)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SEP = b"\n\n"


@dataclass
class Corpus:
    train: Tensor          # uint8 1-D byte-token stream
    val: Tensor            # uint8 1-D byte-token stream (may be empty if val_fraction == 0)
    train_files: int       # files that contributed to train (after the byte cap)
    val_files: int
    source: str            # human-readable description, for logs and benchmark JSON


def _is_val(rel_path: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def stdlib_files() -> tuple[Path, list[Path]]:
    """(stdlib root, sorted .py files), skipping site-packages, caches and test folders."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return root, sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _user_files(path: str) -> tuple[Path, list[Path]]:
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"data.path={path!r} does not exist. Set data.path to a file or folder of "
                         f"{'/'.join(SUFFIXES)} files, or unset it to use the embedded stdlib corpus")
    if p.is_file():
        return p.parent, [p]
    files = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                   key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise ValueError(f"data.path={path!r}: no {'/'.join(SUFFIXES)} files found under {p} "
                         "(searched recursively, hidden folders skipped). Point data.path at a "
                         "folder holding such files, or unset it to use the embedded stdlib corpus")
    return p, files


def read_text_file(path: Path, jsonl_field: str = "text") -> bytes:
    """UTF-8 bytes of one file; for .jsonl, the `jsonl_field` of each line joined by newlines."""
    if path.suffix.lower() != ".jsonl":
        return path.read_bytes().decode("utf-8", errors="replace").encode("utf-8")
    parts = []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line of a .jsonl "
                                 "file must be one JSON object") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(jsonl_field), str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field "
                                 f"{jsonl_field!r}; set data.jsonl_field to the field holding the "
                                 "text")
            parts.append(obj[jsonl_field])
    return "\n".join(parts).encode("utf-8")


def _take(chunks: list[bytes], cap: int | None) -> tuple[Tensor, int]:
    """Join chunks (stopping at the byte cap) into a uint8 tensor; also return chunks used."""
    out, size, used = [], 0, 0
    for c in chunks:
        if cap is not None and size >= cap:
            break
        out.append(c)
        size += len(c) + len(_SEP)
        used += 1
    data = bytearray(_SEP.join(out))
    if cap is not None:
        del data[cap:]
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8), used


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load and split the corpus described by cfg (see DataConfig for every knob)."""
    if cfg.path is None:
        root, files = stdlib_files()
        source = f"stdlib:{root}"
        if not files:
            raise ValueError(f"no .py files found under the stdlib folder {root}; set data.path "
                             "to your own text files")
    else:
        root, files = _user_files(cfg.path)
        source = f"path:{Path(cfg.path).expanduser()}"
    train_chunks, val_chunks = [], []
    for f in files:
        data = read_text_file(f, cfg.jsonl_field)
        if not data:
            continue
        rel = f.relative_to(root).as_posix()
        (val_chunks if _is_val(rel, cfg.val_fraction) else train_chunks).append(data)
    if not train_chunks and not val_chunks:
        raise ValueError(f"{source}: {len(files)} file(s) found but all are empty; set data.path "
                         "to files that hold text")
    if cfg.val_fraction > 0 and (not train_chunks or not val_chunks):
        # one file, or the hash put every file on one side: hold out the stream's tail instead
        stream = _SEP.join(train_chunks + val_chunks)
        cut = len(stream) - max(1, int(len(stream) * cfg.val_fraction))
        train_chunks, val_chunks = [stream[:cut]], [stream[cut:]]
        source += " (split by bytes: too few files to split by file)"
    train, n_train = _take(train_chunks, cfg.max_train_bytes)
    val, n_val = _take(val_chunks, cfg.max_val_bytes)
    return Corpus(train=train, val=val, train_files=n_train, val_files=n_val, source=source)


def _mix(*parts: int) -> int:
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)
    w = tokens[idx].long()
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def batches(tokens: Tensor, batch_size: int, seq_len: int, seed: int, shard: int = 0,
            num_shards: int = 1, start_step: int = 0,
            layout: Literal["interleaved", "contiguous"] = "interleaved",
            ) -> Iterator[tuple[Tensor, Tensor]]:
    """Infinite deterministic stream of (x, y) int64 [batch_size, seq_len] windows, y = x shifted.

    The stream is cut into chunks of 4 * (seq_len + 1) tokens; with layout="interleaved" (IID)
    worker `shard` owns chunks shard, shard + num_shards, ... so every worker samples the whole
    corpus but no two workers share a window. layout="contiguous" gives each shard one contiguous
    1/num_shards of the stream instead (the non-IID variant: different files per worker).
    Step k depends only on (seed, shard, num_shards, k), so start_step=N resumes exactly.
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard={shard} must be in [0, num_shards={num_shards})")
    n, win = tokens.numel(), seq_len + 1
    if layout == "interleaved":
        chunk = 4 * win
        n_chunks = n // chunk
        owned = len(range(shard, n_chunks, num_shards))
        if n_chunks < num_shards:
            raise ValueError(f"{n} tokens make {n_chunks} chunks of {chunk}: too few for "
                             f"{num_shards} shards; use more data, fewer workers or a shorter "
                             "data.seq_len")
    elif layout == "contiguous":
        lo, hi = shard * n // num_shards, (shard + 1) * n // num_shards
        if hi - lo < win:
            raise ValueError(f"shard {shard} holds {hi - lo} tokens, fewer than seq_len + 1 = "
                             f"{win}; use more data, fewer workers or a shorter data.seq_len")
    else:
        raise ValueError(f"unknown layout {layout!r}; use 'interleaved' or 'contiguous'")
    gen = torch.Generator(device="cpu")
    step = start_step
    while True:
        gen.manual_seed(_mix(seed, shard, num_shards, step))
        if layout == "interleaved":
            chunks = shard + num_shards * torch.randint(owned, (batch_size,), generator=gen)
            starts = chunks * chunk + torch.randint(chunk - win + 1, (batch_size,), generator=gen)
        else:
            starts = lo + torch.randint(hi - lo - win + 1, (batch_size,), generator=gen)
        yield _windows(tokens, starts, seq_len)
        step += 1


def eval_batches(tokens: Tensor, batch_size: int, seq_len: int,
                 max_batches: int) -> list[tuple[Tensor, Tensor]]:
    """Fixed validation batches: up to max_batches * batch_size windows spread evenly over the
    stream (non-overlapping when the stream is short). The last batch may be smaller."""
    n_win = min(max_batches * batch_size, max(0, (tokens.numel() - 1) // seq_len))
    if n_win == 0:
        return []
    starts = torch.linspace(0, tokens.numel() - seq_len - 1, n_win).long()
    return [_windows(tokens, starts[i:i + batch_size], seq_len)
            for i in range(0, n_win, batch_size)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean lm_loss per token over the fixed batches; restores the model's train/eval mode."""
    if not batches:
        raise ValueError("no evaluation batches: the validation stream is empty or shorter than "
                         "data.seq_len + 1; raise data.val_fraction or add data")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            loss = lm_loss(model(x.to(device)), y.to(device))
            total += loss.item() * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    return total / count
