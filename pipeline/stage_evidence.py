"""What a stage node saw on the wire, kept for the coordinator's audits (docs/pipeline.md, 'What is caught live').

Owns one node's record of the pipeline tensors it sent and received over the last
`stage.evidence_iterations` iterations, its tally of non-finite tensors received per sender, and
both ends of the `evidence` channel of the node's tensor stream service:

- `EvidenceLog.note(way, kind, meta, peer, tensor)`: every training activation (`fwd`) and
  gradient (`bwd`) this node sends or receives, keyed by (iteration, path ID, hop). A received one
  that is not finite is also tallied (`nonfinite`), and the node's card carries the tally of its
  last iterations (`card_detail`, detail `nonfinite`): what pipeline/nonfinite_watch.py attributes;
- the node's side (`EvidenceServer`): asked (by the coordinator) for iteration `it` and a peer K,
  it answers every kept tensor of `it` it exchanged with K, then `end`;
- the coordinator's side (`fetch_evidence`).

An unreplicated stage's audit (pipeline/replica_audits.py, pipeline/stage_audit.py) takes the
inputs it needs from the honest neighbours, not from the audited node: what its predecessors sent
it (its inputs), what its successors received from it (its outputs) and sent back to it (the
gradients of its outputs), and what its predecessors received from it (the gradients it sent
upstream). Each node keeps its own copy of what it sent and received, so none has to be trusted
about another's tensors. Cost: one reference per tensor sent or received (host copies on an
accelerator) for `evidence_iterations` iterations, and one finite check per received tensor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.stage_msgs import placeholder
from protocol.channels import ChannelPool
from protocol.streams import TensorStream, open_stream

EVIDENCE_CHANNEL = "evidence"
NONFINITE_ON_CARD = 8
"""Iterations of the non-finite tally a node's card carries (newest first)."""
KINDS = ("fwd", "bwd")


@dataclass(frozen=True)
class Entry:
    """One training tensor a node sent to or received from `peer` (meta of the pipeline message)."""

    it: int
    way: str            # "sent" | "recv"
    kind: str           # "fwd" | "bwd"
    p: int
    h: int
    peer: str
    tensor: Tensor
    ep: int = 0         # the schedule epoch it ran on (an aborted iteration runs again on a newer one)


class EvidenceLog:
    """One node's kept tensors (see the module docstring). `keep` = 0 keeps none (the
    non-finite tally is kept all the same)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.entries: dict[int, list[Entry]] = {}
        self.nonfinite: dict[int, set[tuple[str, str]]] = {}     # iteration -> {(kind, sender)}

    def note(self, way: str, kind: str, meta: dict, peer: str, tensor: Tensor | None) -> None:
        if kind not in KINDS or tensor is None:
            return
        it = int(meta.get("it", -1))
        if it < 0:
            return
        if way == "recv" and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            self.nonfinite.setdefault(it, set()).add((kind, peer))
            for old in sorted(self.nonfinite)[:-NONFINITE_ON_CARD]:
                del self.nonfinite[old]
        if self.keep <= 0:
            return
        self.entries.setdefault(it, []).append(Entry(it, way, kind, int(meta.get("p", -1)), int(meta.get("h", -1)),
                                                     peer, tensor.detach().to("cpu"), int(meta.get("ep", 0))))
        for old in sorted(self.entries)[:-self.keep]:
            del self.entries[old]

    def refused(self, kind: str, meta: dict, peer: str) -> None:
        """A received tensor this node could not use (malformed): tallied like a non-finite one."""
        it = int(meta.get("it", -1))
        if kind in KINDS and it >= 0:
            self.nonfinite.setdefault(it, set()).add((kind, peer))

    def about(self, peer: str, it: int) -> list[Entry]:
        """Every kept tensor of iteration `it` exchanged with `peer`."""
        return [e for e in self.entries.get(it, []) if e.peer == peer]

    def card_detail(self) -> str:
        """`"<it>:<kind>:<sender>,..."` over the last NONFINITE_ON_CARD iterations (newest first), "" if none."""
        return ",".join(f"{it}:{kind}:{peer}" for it in sorted(self.nonfinite, reverse=True)
                        for kind, peer in sorted(self.nonfinite[it]))


def parse_nonfinite(value) -> list[tuple[int, str, str]]:
    """A card's `nonfinite` detail -> [(iteration, kind, sender)]; malformed entries are skipped
    (a card detail is untrusted input)."""
    if not isinstance(value, str) or not value:
        return []
    out = []
    for item in value.split(",")[:64]:
        it, _, rest = item.partition(":")
        kind, _, peer = rest.partition(":")
        if it.isdigit() and len(it) <= 12 and kind in KINDS and 0 < len(peer) <= 128:
            out.append((int(it), kind, peer))
    return out


class EvidenceServer:
    """A stage node's answers on the `evidence` channel: `allowed(sender)` says who may ask (the
    coordinator, when the run names one)."""

    def __init__(self, log: Callable[[], EvidenceLog | None], allowed: Callable[[str], bool]):
        self.log, self.allowed = log, allowed

    async def on_stream(self, stream: TensorStream) -> None:
        async for r in stream:
            ev = self.log()
            if ev is None or r.name != "evidence?" or not self.allowed(stream.peer.sender):
                await stream.send("err", placeholder(), {"reason": "evidence", "detail": "not answered here"},
                                  timeout=5.0)
                continue
            try:
                it, peer = int(r.meta.get("it", "-1")), str(r.meta.get("peer", ""))
            except ValueError:
                it, peer = -1, ""
            for e in ev.about(peer, it):
                await stream.send("evidence", e.tensor, {"it": str(e.it), "way": e.way, "kind": e.kind,
                                                         "p": str(e.p), "h": str(e.h), "ep": str(e.ep)}, timeout=10.0)
            await stream.send("end", placeholder(), {}, timeout=5.0)


async def fetch_evidence(pool: ChannelPool, *, run_id: str, me: str, peer_id: str, addr: str, about: str,
                         it: int, timeout_s: float = 20.0, max_bytes: int = 64 << 20) -> list[Entry]:
    """What the node `peer_id` at `addr` kept of iteration `it` about `about` (its view: `way` is
    from the answering node's side, `peer` the answering node). Raises on a refusal or timeout."""
    stream = None
    out: list[Entry] = []
    try:
        async with asyncio.timeout(timeout_s):
            stream = await open_stream(pool.get(addr, peer_id=peer_id), run_id=run_id, sender=me,
                                       channel_name=EVIDENCE_CHANNEL, max_tensor_bytes=max_bytes, timeout=timeout_s)
            await stream.send("evidence?", placeholder(), {"it": str(it), "peer": about}, timeout=timeout_s)
            while True:
                got = await stream.recv(timeout=timeout_s)
                if got.name == "end":
                    return out
                if got.name != "evidence":
                    raise ValueError(f"evidence refused by {peer_id[:16]}: {str(got.meta.get('detail', ''))[:200]}")
                m = got.meta
                out.append(Entry(int(m["it"]), m["way"], m["kind"], int(m["p"]), int(m["h"]), peer_id, got.tensor,
                                 int(m.get("ep", "0"))))
    finally:
        if stream is not None:
            stream.cancel()


__all__ = ["EVIDENCE_CHANNEL", "Entry", "EvidenceLog", "EvidenceServer", "fetch_evidence", "parse_nonfinite"]
