"""Rollout batch wire format (pure, no pickle): codec, validation with reasons, bytes to sign.

Owns the payload a `grpo` peer publishes each round (docs/grpo.md, 'Rollout wire format'): per completion the token
ids (int32 LE) and the generator's per-token log-probs (float32 LE), 8 bytes per token, plus the
batch header (run, round, sender, tokenizer hash, sampling temperature, config hash, model id)
and prompt ids. No text, no reward: the receiver regenerates prompts from their ids and computes
rewards itself. Signing and the transport live elsewhere; `signing_bytes` is what gets signed.

Layout (all little-endian; str = u16 length + UTF-8; bytes = u16 length + raw):
  magic b"SNRB", u8 version, str run, u64 round, str sender, str tokenizer_hash,
  f64 temperature, str config_hash, str model_id, u32 n_groups,
  per group: bytes prompt_id, u16 n_completions,
    per completion: u8 truncated, u32 n_tokens, n_tokens * i32 ids, n_tokens * f32 gen_logp.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"SNRB"
WIRE_VERSION = 1
SIGN_DOMAIN = b"swarmnode/rollouts/v1"
BYTES_PER_TOKEN = 8


class RolloutRejected(ValueError):
    """A batch the receiver refuses. `category` is the metrics label ("schema" or "stale")."""

    def __init__(self, category: str, reason: str):
        super().__init__(f"{category}: {reason}")
        self.category, self.reason = category, reason


@dataclass
class Completion:
    token_ids: np.ndarray       # int32 [n]
    gen_logp: np.ndarray        # float32 [n]
    truncated: bool = False

    def __post_init__(self):
        self.token_ids = np.ascontiguousarray(self.token_ids, dtype="<i4")
        self.gen_logp = np.ascontiguousarray(self.gen_logp, dtype="<f4")


@dataclass
class PromptGroup:
    prompt_id: bytes
    completions: list[Completion] = field(default_factory=list)


@dataclass
class RolloutBatch:
    run: str
    round: int
    sender: str
    tokenizer_hash: str
    temperature: float
    groups: list[PromptGroup] = field(default_factory=list)
    config_hash: str = ""
    model_id: str = ""

    def n_tokens(self) -> int:
        return sum(len(c.token_ids) for g in self.groups for c in g.completions)


def _str(b: bytearray, s: str) -> None:
    raw = s.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("string field longer than 65535 bytes")
    b += struct.pack("<H", len(raw)) + raw


def encode(batch: RolloutBatch) -> bytes:
    """Deterministic bytes of a batch (same batch -> same bytes)."""
    b = bytearray(MAGIC) + struct.pack("<B", WIRE_VERSION)
    _str(b, batch.run)
    b += struct.pack("<Q", int(batch.round))
    _str(b, batch.sender)
    _str(b, batch.tokenizer_hash)
    b += struct.pack("<d", float(batch.temperature))
    _str(b, batch.config_hash)
    _str(b, batch.model_id)
    b += struct.pack("<I", len(batch.groups))
    for g in batch.groups:
        if len(g.prompt_id) > 0xFFFF or len(g.completions) > 0xFFFF:
            raise ValueError("prompt_id or completion count too large for the wire format")
        b += struct.pack("<H", len(g.prompt_id)) + bytes(g.prompt_id)
        b += struct.pack("<H", len(g.completions))
        for c in g.completions:
            if len(c.token_ids) != len(c.gen_logp):
                raise ValueError(f"completion has {len(c.token_ids)} token ids but "
                                 f"{len(c.gen_logp)} log-probs")
            b += struct.pack("<BI", int(bool(c.truncated)), len(c.token_ids))
            b += c.token_ids.tobytes() + c.gen_logp.tobytes()
    return bytes(b)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise RolloutRejected("schema", f"batch truncated at byte {self.pos} "
                                            f"(needed {n} more of {len(self.data)})")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def str(self) -> str:
        (n,) = self.unpack("<H")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RolloutRejected("schema", f"string field is not UTF-8: {e}") from None


def decode(data: bytes, max_tokens_per_completion: int | None = None) -> RolloutBatch:
    """Parse bytes into a batch; raises RolloutRejected("schema", reason) on any malformation.

    Sizes are checked against the bytes actually present before anything is allocated.
    """
    r = _Reader(bytes(data))
    if bytes(r.take(4)) != MAGIC:
        raise RolloutRejected("schema", "not a rollout batch (bad magic)")
    (version,) = r.unpack("<B")
    if version != WIRE_VERSION:
        raise RolloutRejected("schema", f"wire version {version}, expected {WIRE_VERSION}")
    run = r.str()
    (rnd,) = r.unpack("<Q")
    sender, tok_hash = r.str(), r.str()
    (temp,) = r.unpack("<d")
    config_hash, model_id = r.str(), r.str()
    (n_groups,) = r.unpack("<I")
    groups = []
    for _ in range(n_groups):
        (plen,) = r.unpack("<H")
        pid = bytes(r.take(plen))
        (n_comp,) = r.unpack("<H")
        comps = []
        for _ in range(n_comp):
            trunc, n = r.unpack("<BI")
            if trunc not in (0, 1):
                raise RolloutRejected("schema", f"truncated flag {trunc} is not 0 or 1")
            if max_tokens_per_completion is not None and n > max_tokens_per_completion:
                raise RolloutRejected("schema", f"completion of {n} tokens > cap "
                                                f"{max_tokens_per_completion}")
            ids = np.frombuffer(r.take(4 * n), dtype="<i4").copy()
            lps = np.frombuffer(r.take(4 * n), dtype="<f4").copy()
            comps.append(Completion(ids, lps, bool(trunc)))
        groups.append(PromptGroup(pid, comps))
    if r.pos != len(r.data):
        raise RolloutRejected("schema", f"{len(r.data) - r.pos} trailing bytes after the batch")
    return RolloutBatch(run, rnd, sender, tok_hash, temp, groups, config_hash, model_id)


def body_digest(batch: RolloutBatch) -> bytes:
    return hashlib.sha256(encode(batch)).digest()


def signing_bytes(batch: RolloutBatch) -> bytes:
    """Canonical bytes to sign: b"swarmnode/rollouts/v1" || sha256(encode(batch))."""
    return SIGN_DOMAIN + body_digest(batch)


@dataclass(frozen=True)
class Expect:
    """What the receiver requires of a batch this round (from its round config)."""

    run: str
    round: int
    tokenizer_hash: str
    temperature: float
    vocab_size: int
    max_tokens: int                           # max_completion_tokens
    prompt_ids: frozenset[bytes] | None = None  # this round's prompt ids (None: not checked)
    max_completions_per_group: int | None = None
    config_hash: str | None = None            # None: not checked
    group_size: int | None = None             # exact completions per group (vertical: the whole group, G)


def check(batch: RolloutBatch, ex: Expect, sender: str | None = None) -> RolloutRejected | None:
    """None if acceptable, else the rejection (category + reason). Never raises. Cheapest first."""
    if sender is not None and batch.sender != sender:
        return RolloutRejected("schema", f"batch names sender {batch.sender!r} but came from "
                                         f"{sender!r}")
    if batch.run != ex.run:
        return RolloutRejected("schema", f"run {batch.run!r}, expected {ex.run!r}")
    if batch.round != ex.round:
        return RolloutRejected("stale", f"round {batch.round}, expected {ex.round}")
    if ex.config_hash is not None and batch.config_hash != ex.config_hash:
        return RolloutRejected("schema", f"config_hash {batch.config_hash!r}, expected "
                                         f"{ex.config_hash!r}")
    if batch.tokenizer_hash != ex.tokenizer_hash:
        return RolloutRejected("schema", f"tokenizer_hash {batch.tokenizer_hash!r}, expected "
                                         f"{ex.tokenizer_hash!r} (shared tokenizer required)")
    if not (math.isfinite(batch.temperature) and batch.temperature == ex.temperature):
        return RolloutRejected("schema", f"temperature {batch.temperature}, expected "
                                         f"{ex.temperature}")
    if not batch.groups:
        return RolloutRejected("schema", "batch has no prompt groups")
    seen = set()
    for gi, g in enumerate(batch.groups):
        if g.prompt_id in seen:
            return RolloutRejected("schema", f"group {gi}: prompt_id repeated")
        seen.add(g.prompt_id)
        if ex.prompt_ids is not None and g.prompt_id not in ex.prompt_ids:
            return RolloutRejected("schema", f"group {gi}: prompt_id {g.prompt_id.hex()[:16]} "
                                             f"is not one of round {ex.round}'s prompts for this sender")
        if not g.completions:
            return RolloutRejected("schema", f"group {gi}: no completions")
        if ex.group_size is not None and len(g.completions) != ex.group_size:
            return RolloutRejected("schema", f"group {gi}: {len(g.completions)} completions, but the vertical "
                                             f"topology trades whole groups of G = {ex.group_size} (the "
                                             "generator's group); check that the sender runs the same "
                                             "grpo.completions_per_prompt and grpo.topology")
        if ex.max_completions_per_group is not None and \
                len(g.completions) > ex.max_completions_per_group:
            return RolloutRejected("schema", f"group {gi}: {len(g.completions)} completions > "
                                             f"{ex.max_completions_per_group}")
        for ci, c in enumerate(g.completions):
            where = f"group {gi} completion {ci}"
            n = len(c.token_ids)
            if n == 0:
                return RolloutRejected("schema", f"{where}: empty completion")
            if n != len(c.gen_logp):
                return RolloutRejected("schema", f"{where}: {n} ids but {len(c.gen_logp)} "
                                                 "log-probs")
            if n > ex.max_tokens:
                return RolloutRejected("schema", f"{where}: {n} tokens > cap {ex.max_tokens}")
            if int(c.token_ids.min()) < 0 or int(c.token_ids.max()) >= ex.vocab_size:
                return RolloutRejected("schema", f"{where}: token id outside the vocabulary "
                                                 f"[0, {ex.vocab_size})")
            if not np.isfinite(c.gen_logp).all():
                return RolloutRejected("schema", f"{where}: non-finite log-prob")
            if (c.gen_logp > 0).any():
                return RolloutRejected("schema", f"{where}: positive log-prob")
    return None


def parse(data: bytes, ex: Expect, sender: str | None = None
          ) -> tuple[RolloutBatch | None, RolloutRejected | None]:
    """decode + check without raising: (batch, None) or (None, rejection)."""
    try:
        batch = decode(data, ex.max_tokens)
    except RolloutRejected as e:
        return None, e
    err = check(batch, ex, sender)
    return (None, err) if err else (batch, None)
