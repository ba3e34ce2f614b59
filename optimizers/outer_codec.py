"""What a compressed outer exchange sends, and how a receiver rebuilds the partner's tensors.

Pure torch, no transport (``optimizers/exchange_link.py`` puts the parts on the wire). Built
from ``[noloco] compression`` (``optimizers/compression.py`` holds the compressors).

NoLoCo's outer step needs the partner's ``theta_b = phi_b + delta_b`` (``delta = theta - phi``,
the pseudo-gradient of the round; untied consensus also needs ``phi_b``). What travels:

* every round: ``delta + residual``, compressed (error feedback per sender: what a round did
  not send is added to the next round's payload, whoever the next partner is);
* NoLoCo, on round labels divisible by ``phi_every``: the sender's ``phi``, int8 with per-block
  scales (no error feedback: phi is a state, not an increment, and is sent whole each time).

The receiver rebuilds ``theta_b_hat = phi_hat + decode(delta)`` where ``phi_hat`` is the
partner's decoded phi on a phi round and its OWN phi otherwise: such a round is a DiLoCo step
within the pair (the mean pseudo-gradient) with no consensus pull, and the consensus pull
comes back every ``phi_every`` rounds. Why not a phi difference from a shared reference: random
partners share no reference (each worker's phi is its own), and the seed's weights drift away
from phi within a few rounds. Everything after the rebuild (bounds, robust clip, the mean, the
outer step) sees ordinary fp32 tensors.

DiLoCo: members send their compressed ``delta``; phi is the same everywhere, so the root
rebuilds each member's theta on its own phi, averages, and sends back the mean's pseudo-gradient
compressed with the ROOT's error feedback (``encode_mean``); the root steps with exactly what it
sent (``ref + decode``), so every member applies the same mean.

    codec = OuterCodec.from_config(cfg, names, shapes)
    out = codec.encode(theta, phi)                 # compute thread; nothing committed yet
    names, parts = codec.names_for(rnd), codec.tensors_for(rnd, out)
    theirs = codec.decode(rnd, their_parts, out.ref)   # ValueError: refuse the partner
    codec.commit(out)                              # only once the round's exchange succeeded
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optimizers.compression import Compressor, ErrorFeedback, Int8, Pending, make_compressor

__all__ = ["OuterCodec", "Outgoing"]

Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass
class Outgoing:
    """One round's compressed payload of a worker."""

    delta: Pending
    """The compressed ``delta + residual`` and the residual to keep once delivered."""
    phi: list[list[Tensor]] | None
    """int8 parts of phi (NoLoCo), sent on phi rounds only; None until a phi round needs them
    (:meth:`OuterCodec.ensure_phi`), always None for DiLoCo."""
    ref: list[Tensor]
    """This worker's phi (fp32, host): what a partner's pseudo-gradient is put on."""


class OuterCodec:
    """Compression of one worker's outer exchange (module docstring)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], compressor: Compressor,
                 *, outer: str = "noloco", phi_every: int = 8, exchanges_phi: bool = False):
        if outer not in ("noloco", "diloco"):
            raise ValueError(f"outer={outer!r} must be 'noloco' or 'diloco'")
        if phi_every < 1:
            raise ValueError(f"phi_every={phi_every} must be >= 1")
        self.names = list(names)
        self.shapes = [tuple(int(x) for x in s) for s in shapes]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.compressor, self.outer, self.phi_every = compressor, outer, int(phi_every)
        self.exchanges_phi = bool(exchanges_phi)
        self.phi_codec = Int8(compressor.block)
        self.uplink = ErrorFeedback(compressor, self.shapes)
        self.downlink = ErrorFeedback(compressor, self.shapes)  # DiLoCo root: the mean it sends back
        self._delta_specs = self._specs("d", compressor)
        self._phi_specs = self._specs("p", self.phi_codec) if outer == "noloco" else []

    @classmethod
    def from_config(cls, cfg: Any, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> "OuterCodec | None":
        """From a ``NoLoCoConfig``; None when ``compression = "none"``."""
        if cfg.compression == "none":
            return None
        comp = make_compressor(cfg.compression, cfg.compression_block, cfg.compression_topk, cfg.compression_hold)
        return cls(names, shapes, comp, outer=cfg.outer, phi_every=cfg.compression_phi_every,
                   exchanges_phi=cfg.exchanges_phi)

    def _specs(self, tag: str, comp: Compressor) -> list[Spec]:
        return [(f"{tag}:{name}:{suffix}", dt, shape)
                for name, n in zip(self.names, self.numels) for suffix, dt, shape in comp.parts(n)]

    # ------------------------------------------------------------------ wire layout
    def wire_specs(self) -> list[Spec]:
        """Every wire tensor a peer may send (pseudo-gradient parts, then phi parts)."""
        return self._delta_specs + self._phi_specs

    def sends_phi(self, rnd: int) -> bool:
        """Does round label ``rnd`` carry phi? (NoLoCo, labels divisible by ``phi_every``.)"""
        return self.outer == "noloco" and int(rnd) % self.phi_every == 0

    def names_for(self, rnd: int) -> list[str]:
        """The wire tensors of a payload for round label ``rnd``, in order."""
        specs = self._delta_specs + (self._phi_specs if self.sends_phi(rnd) else [])
        return [s[0] for s in specs]

    def mean_names(self) -> list[str]:
        """The wire tensors of a DiLoCo root's mean (pseudo-gradient parts only)."""
        return [s[0] for s in self._delta_specs]

    def tensors_for(self, rnd: int, out: Outgoing) -> list[Tensor]:
        """``out``'s wire tensors for round label ``rnd`` (``names_for`` order)."""
        flat = [t for parts in out.delta.parts for t in parts]
        if self.sends_phi(rnd):
            self.ensure_phi(out)
            flat += [t for parts in out.phi for t in parts]
        return flat

    @torch.no_grad()
    def ensure_phi(self, out: Outgoing) -> None:
        """Compress ``out``'s phi (int8) unless done: only phi rounds pay for it."""
        if out.phi is None:
            out.phi = [self.phi_codec.encode(r) for r in out.ref]

    def payload_bytes(self, rnd: int) -> int:
        """Bytes of a payload for round label ``rnd``."""
        specs = self._delta_specs + (self._phi_specs if self.sends_phi(rnd) else [])
        return sum(torch.Size(s).numel() * d.itemsize for _, d, s in specs)

    # ------------------------------------------------------------------ sender
    @torch.no_grad()
    def encode(self, theta: Sequence[Tensor], phi: Sequence[Tensor]) -> Outgoing:
        """Compress ``theta - phi`` (plus the residual); phi itself is compressed when a phi round
        asks for it (:meth:`ensure_phi`). Nothing is committed: call :meth:`commit` when the
        round's exchange succeeded."""
        ref = [p.detach().to(device="cpu", dtype=torch.float32, copy=True) for p in phi]
        delta = [t.detach().to(device="cpu", dtype=torch.float32) - r for t, r in zip(theta, ref)]
        return Outgoing(self.uplink.compress(delta), None, ref)

    def commit(self, out: Outgoing) -> None:
        """``out`` was delivered: keep its residual for the next round."""
        self.uplink.commit(out.delta)

    def reset(self) -> None:
        """Forget both residuals (after adopting another worker's state or a rollback)."""
        self.uplink.reset()
        self.downlink.reset()

    # ------------------------------------------------------------------ receiver
    @torch.no_grad()
    def decode(self, rnd: int, wire: Sequence[Tensor], ref: Sequence[Tensor]) -> list[Tensor]:
        """The partner's exchange tensors (theta, then phi when untied) rebuilt from its
        ``wire`` tensors of round label ``rnd`` on our phi ``ref``; ValueError when a part is
        malformed (wrong count, dtype or shape, a NaN or negative scale, a code or index out
        of range)."""
        want = len(self.names_for(rnd))
        if len(wire) != want:
            raise ValueError(f"{len(wire)} compressed tensors, round {rnd} carries {want}")
        delta = self._decode_all(self.compressor, wire, 0)
        if self.sends_phi(rnd):
            phi = self._decode_all(self.phi_codec, wire, len(self._delta_specs))
        else:
            phi = [r.to(torch.float32) for r in ref]
        theta = [p + d for p, d in zip(phi, delta)]
        return theta + ([p.clone() for p in phi] if self.exchanges_phi else [])

    def _decode_all(self, comp: Compressor, wire: Sequence[Tensor], start: int) -> list[Tensor]:
        out, i = [], start
        for name, n, shape in zip(self.names, self.numels, self.shapes):
            k = len(comp.parts(n))
            parts = list(wire[i:i + k])
            i += k
            try:
                comp.check(parts, n)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
            out.append(comp.decode(parts, shape))
        return out

    # ------------------------------------------------------------------ DiLoCo root
    @torch.no_grad()
    def encode_mean(self, mean: Sequence[Tensor], ref: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """The group mean's pseudo-gradient ``mean - ref`` compressed with the root's error
        feedback (committed at once: the root has decided) -> (wire tensors in ``mean_names``
        order, the mean every member will rebuild: ``ref + decode``), which the root applies too."""
        delta = [m.detach().to(torch.float32) - r for m, r in zip(mean, ref)]
        pending = self.downlink.compress(delta)
        self.downlink.commit(pending)
        used = [r + self.compressor.decode(p, s) for r, p, s in zip(ref, pending.parts, self.shapes)]
        return [t for parts in pending.parts for t in parts], used

    @torch.no_grad()
    def decode_mean(self, wire: Sequence[Tensor], ref: Sequence[Tensor]) -> list[Tensor]:
        """A DiLoCo member's view of the root's mean: ``ref + decode(wire)``; ValueError when malformed."""
        if len(wire) != len(self._delta_specs):
            raise ValueError(f"{len(wire)} compressed tensors in the mean, expected {len(self._delta_specs)}")
        return [r + d for r, d in zip(ref, self._decode_all(self.compressor, wire, 0))]
