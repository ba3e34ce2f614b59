"""How `grpo` peers exchange rollout batches: signing, bus shards, the DHT index, gRPC Fetch, the inbox.

Owns steps 2-3 of docs/grpo.md, 'Rounds' (publish, collect) and the inbox:

- **Signing.** A batch travels as (body, signature): body = ``rl.rollout.encode(batch)`` (8 bytes
  per token, no text, no reward), signature = Ed25519 by the node key over
  ``rl.rollout.signing_bytes(batch)``. The receiver verifies it against the sender's peer ID
  (``security.keys.verify``), after checking that the batch names the peer it came from.
- **Bus path** (``ctx.eventbus`` on): the batch is cut into shards (whole prompt groups, each a
  signed batch of its own) that fit the ``rollouts`` topic cap; a shard is
  ``b"SNRS" || signature (64 B) || body``.
- **DHT path** (bus off, or ``grpo.transport = "dht"``): a signed, owner-bound index entry per
  round (``INDEX``: ``<run>/grpo/rollouts/<round>``, subkey = peer ID: digest, sizes, gRPC
  address) and ``RolloutService.Fetch`` (protocol/rollouts.proto) on the node's gRPC server.
- **Inbox.** Everything received is validated cheapest first (schema, sender binding, signature,
  round, config/tokenizer hash, temperature, caps: ``rl.rollout.check``), refusals counted by
  reason; a sender refused too often is ignored for a while. Nothing from the wire is unpickled.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field

from node.logs import emit
from node.rendezvous import Rendezvous
from protocol import rollouts_pb2, rollouts_pb2_grpc
from protocol.grpc_options import channel_options
from protocol.streams import signed_channel
from rl import rollout
from rl.rollout import Expect, RolloutBatch, RolloutRejected
from security.keys import sign, verify

log = logging.getLogger("swarmnode.grpo")

SHARD_MAGIC = b"SNRS"
SIG_BYTES = 64
REASONS = ("signature", "stale", "config", "schema", "digest", "quota")


# ---------------- signing ----------------
@dataclass(frozen=True)
class Signed:
    body: bytes
    signature: bytes


def sign_batch(key: Ed25519PrivateKey, batch: RolloutBatch) -> Signed:
    return Signed(rollout.encode(batch), sign(key, rollout.signing_bytes(batch)))


def reason_of(err: RolloutRejected) -> str:
    """Metrics label of a rejection: stale round, config mismatch (config/tokenizer hash,
    temperature, run), signature, or schema (everything malformed)."""
    if err.category == "stale":
        return "stale"
    head = err.reason.split(" ", 1)[0]
    if err.category == "schema" and head in ("config_hash", "tokenizer_hash", "temperature", "run"):
        return "config"
    return err.category if err.category in REASONS else "schema"


def open_signed(body: bytes, signature: bytes, ex: Expect, sender: str
                ) -> tuple[RolloutBatch | None, RolloutRejected | None]:
    """Decode, bind to ``sender``, verify the signature, then ``rl.rollout.check``; never raises.

    The signature is checked before the round and config so a forged batch is always counted as
    a signature failure, whatever else it gets wrong.
    """
    try:
        batch = rollout.decode(body, ex.max_tokens)
    except RolloutRejected as e:
        return None, e
    if batch.sender != sender:
        return None, RolloutRejected("schema", f"batch names sender {batch.sender!r} but came from "
                                               f"{sender!r}")
    if len(signature) != SIG_BYTES or not verify(sender, rollout.signing_bytes(batch), signature):
        return None, RolloutRejected("signature", f"signature does not verify under {sender}")
    err = rollout.check(batch, ex, sender)
    return (None, err) if err else (batch, None)


# ---------------- bus shards ----------------
def encode_shard(s: Signed) -> bytes:
    return SHARD_MAGIC + s.signature + s.body


def decode_shard(data: bytes) -> Signed:
    """Split a bus message; RolloutRejected("schema") if it is not a shard."""
    if len(data) < len(SHARD_MAGIC) + SIG_BYTES or data[:4] != SHARD_MAGIC:
        raise RolloutRejected("schema", "bus message is not a rollout shard (bad magic or too short)")
    return Signed(bytes(data[4 + SIG_BYTES:]), bytes(data[4:4 + SIG_BYTES]))


def shards(key: Ed25519PrivateKey, batch: RolloutBatch, cap: int) -> list[bytes]:
    """The batch as signed bus messages of at most ``cap`` bytes, whole prompt groups each.
    A single group over the cap raises ValueError (publish it through the DHT index instead)."""
    out: list[bytes] = []
    cur: list = []

    def flush() -> None:
        if cur:
            part = RolloutBatch(batch.run, batch.round, batch.sender, batch.tokenizer_hash,
                                batch.temperature, list(cur), batch.config_hash, batch.model_id)
            out.append(encode_shard(sign_batch(key, part)))

    for g in batch.groups:
        trial = RolloutBatch(batch.run, batch.round, batch.sender, batch.tokenizer_hash,
                             batch.temperature, [*cur, g], batch.config_hash, batch.model_id)
        if len(rollout.encode(trial)) + len(SHARD_MAGIC) + SIG_BYTES <= cap:
            cur.append(g)
            continue
        if not cur:
            raise ValueError(f"one prompt group is over the rollouts topic cap of {cap} bytes")
        flush()
        cur = [g]
        single = RolloutBatch(batch.run, batch.round, batch.sender, batch.tokenizer_hash,
                              batch.temperature, [g], batch.config_hash, batch.model_id)
        if len(rollout.encode(single)) + len(SHARD_MAGIC) + SIG_BYTES > cap:
            raise ValueError(f"one prompt group is over the rollouts topic cap of {cap} bytes")
    flush()
    return out


# ---------------- DHT index + Fetch ----------------
class RolloutIndexEntry(BaseModel):
    """One peer's entry in a round's rollout index (signed and owner-bound by the DHT validator)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    round: int = Field(ge=0)
    digest: str = Field(min_length=64, max_length=64)    # sha256(body), hex
    n_groups: int = Field(ge=0, le=65535)
    n_tokens: int = Field(ge=0)
    grpc_addr: str = Field(max_length=200)


INDEX = Rendezvous("grpo/rollouts/", RolloutIndexEntry, index_field="round", max_payload_bytes=1024,
                   max_ttl_s=600.0)


class RolloutServicer(rollouts_pb2_grpc.RolloutServiceServicer):
    """Serves this node's signed batches of the last ``keep`` rounds."""

    def __init__(self, run: str, keep: int = 4):
        self.run, self.keep = run, keep
        self._batches: dict[int, Signed] = {}

    def put(self, round_: int, s: Signed) -> None:
        self._batches[round_] = s
        for r in sorted(self._batches)[:-self.keep]:
            del self._batches[r]

    async def Fetch(self, request, context):  # noqa: N802 - gRPC method name
        if request.run != self.run:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"run {request.run!r}: this node serves run {self.run!r}")
        s = self._batches.get(int(request.round))
        if s is None:
            return rollouts_pb2.RolloutFetchReply(found=False, round=max(self._batches, default=0))
        return rollouts_pb2.RolloutFetchReply(found=True, body=s.body, signature=s.signature,
                                       round=int(request.round))


def add_rollout_service(servicer: RolloutServicer, server) -> None:
    rollouts_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)


class Fetcher:
    """gRPC client side: one signed channel per (address, peer), reused across rounds. Calls are
    signed for the peer named by the index entry (``protocol.streams.signed_channel``: the
    node's ``security.peer_auth`` setting)."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def _stub(self, addr: str, peer_id: str) -> rollouts_pb2_grpc.RolloutServiceStub:
        ch = self._channels.get((addr, peer_id))
        if ch is None:
            ch = self._channels[(addr, peer_id)] = signed_channel(
                addr, channel_options(self.max_message_bytes), peer_id=peer_id)
        return rollouts_pb2_grpc.RolloutServiceStub(ch)

    async def fetch(self, addr: str, peer_id: str, run: str, round_: int, requester: str,
                    timeout: float) -> Signed | None:
        """The peer's (body, signature) for the round; None when it has none or is unreachable."""
        try:
            reply = await self._stub(addr, peer_id).Fetch(
                rollouts_pb2.RolloutFetchRequest(run=run, round=round_, requester=requester), timeout=timeout)
        except (grpc.aio.AioRpcError, OSError, ConnectionError) as exc:
            log.debug("rollout fetch from %s failed: %r", addr, exc)
            return None
        if not reply.found:
            return None
        return Signed(bytes(reply.body), bytes(reply.signature))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


# ---------------- inbox ----------------
@dataclass
class Inbox:
    """Validated foreign batches per round and sender, refusal counts, and a per-sender strike
    window: a sender refused ``max_rejections`` times within ``window`` rounds is ignored for
    ``window`` rounds (its messages count as ``quota``)."""

    self_id: str
    max_rejections: int = 8
    window: int = 10
    on_reject: Callable[[str], None] = lambda reason: None
    batches: dict[int, dict[str, list[RolloutBatch]]] = field(default_factory=lambda: defaultdict(dict))
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _strikes: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    _banned_until: dict[str, int] = field(default_factory=dict)

    def banned(self, sender: str, round_: int) -> bool:
        until = self._banned_until.get(sender)
        return until is not None and round_ < until

    def refuse(self, sender: str, round_: int, reason: str, detail: str) -> None:
        """Count one refused message from ``sender`` (a strike unless it is a ``quota`` refusal)."""
        self.rejected[reason] += 1
        self.on_reject(reason)
        emit(log, "grpo_rollout_rejected", "refused rollouts from {sender} for round {round}: {reason} ({detail})",
             sender=sender, round=round_, reason=reason, detail=detail[:200])
        if reason == "quota":
            return
        q = self._strikes[sender]
        q.append(round_)
        while q and q[0] <= round_ - self.window:
            q.popleft()
        if len(q) >= self.max_rejections:
            self._banned_until[sender] = round_ + self.window
            q.clear()
            emit(log, "grpo_sender_ignored", "ignoring {sender} for {rounds} rounds: {refused} refused rollout "
                 "messages", level=logging.WARNING, sender=sender, rounds=self.window, refused=self.max_rejections,
                 until_round=round_ + self.window)

    def offer(self, s: Signed, sender: str, ex: Expect, *, digest: str | None = None) -> RolloutBatch | None:
        """Validate one signed batch or shard from ``sender`` for round ``ex.round``; keep it if
        good (prompt groups already held from this sender are ignored), else count the refusal."""
        if sender == self.self_id:
            return None
        if self.banned(sender, ex.round):
            self.refuse(sender, ex.round, "quota", "sender is being ignored after repeated refusals")
            return None
        if digest is not None:
            if hashlib.sha256(s.body).hexdigest() != digest:
                self.refuse(sender, ex.round, "digest", "fetched body does not match the index digest")
                return None
        batch, err = open_signed(s.body, s.signature, ex, sender)
        if err is not None:
            self.refuse(sender, ex.round, reason_of(err), err.reason)
            return None
        held = self.batches[ex.round].setdefault(sender, [])
        have = {g.prompt_id for b in held for g in b.groups}
        batch.groups = [g for g in batch.groups if g.prompt_id not in have]
        if batch.groups:
            held.append(batch)
        return batch

    def has(self, round_: int, sender: str) -> bool:
        return sender in self.batches.get(round_, {})

    def take(self, round_: int) -> list[RolloutBatch]:
        """The round's batches (one merged batch per sender, arrival order); drops older rounds."""
        got = self.batches.pop(round_, {})
        for r in [r for r in self.batches if r <= round_]:
            del self.batches[r]
        out = []
        for sender, parts in got.items():
            merged = RolloutBatch(parts[0].run, parts[0].round, sender, parts[0].tokenizer_hash,
                                  parts[0].temperature, [g for p in parts for g in p.groups],
                                  parts[0].config_hash, parts[0].model_id)
            out.append(merged)
        return out
