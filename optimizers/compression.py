"""Compressors for the outer exchange, with error feedback: pure torch, no transport.

Each compressor turns one fp32 tensor into a few small wire tensors ("parts") and back:

    c = make_compressor("topk", block=128, topk=0.02)
    parts = c.encode(x)                 # list of tensors: what travels
    c.check(parts, x.numel())           # what a receiver runs first: ValueError if malformed
    y = c.decode(parts, x.shape)        # fp32, same shape

* ``Int8`` (``"int8"``): per block of ``block`` values, one fp32 scale = absmax / 127 and int8
  codes in [-127, 127] (-128 never appears: a code of -128 is refused). 1 + 4/block bytes per
  value; each value is off by at most scale / 2 (absmax / 254 of its block).
* ``Int4`` (``"int4"``): the same with 15 levels (codes -7..7, stored + 8 as a nibble, two per
  byte, low nibble first; nibble 0 is refused). 0.5 + 4/block bytes per value; error at most
  absmax / 14 of the block.
* ``Sign`` (``"sign"``): one bit per value (its sign, 8 per byte) and one fp32 scale per block,
  the block's mean magnitude (the scale that minimises the squared error of a sign code).
  1/8 + 4/block bytes per value; coarse per round, but every coordinate moves every round and
  error feedback carries the rest (EF-signSGD). With ``hold`` h > 0 a strided h of the
  coordinates (random offset per call, sent as one int32) is held back in the residual:
  (1 - h) (1/8 + 4/block) bytes per value, under 1 bit at h = 0.05.
* ``TopK`` (``"topk"``): the ``ceil(topk * numel)`` coordinates of largest magnitude, their
  indices ascending as int32 and their values as ``Int8`` (blocks over the kept values). About
  5 bytes per kept coordinate; what is not kept is the error (carried by error feedback).

Rounding is to nearest (deterministic: the same input gives the same bytes on every machine).
:class:`ErrorFeedback` adds the residual of earlier rounds to each new input before
compressing and keeps what the compression lost (``residual = payload - decode(encode(payload))``),
so over any number of rounds ``sum(decoded payloads) + residual == sum(inputs)`` (to float
rounding). The caller commits the residual only when the round's payload was delivered.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["Compressor", "ErrorFeedback", "Int4", "Int8", "Pending", "TopK", "make_compressor", "KINDS"]

KINDS = ("int8", "int4", "topk", "sign")
Part = tuple[str, torch.dtype, tuple[int, ...]]  # (suffix, dtype, shape) of one wire tensor


def _blocks(n: int, block: int) -> int:
    return max(1, math.ceil(n / block))


class Compressor(ABC):
    """One tensor <-> its wire parts; subclasses fix the format."""

    kind = ""

    def __init__(self, block: int = 128):
        if block < 1:
            raise ValueError(f"block={block} must be >= 1")
        self.block = int(block)

    @abstractmethod
    def parts(self, numel: int) -> list[Part]:
        """(suffix, dtype, shape) of each wire tensor for a tensor of ``numel`` values."""

    @abstractmethod
    def encode(self, x: Tensor) -> list[Tensor]:
        """The wire parts of ``x`` (any shape, any float dtype)."""

    @abstractmethod
    def decode(self, parts: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
        """fp32 tensor of ``shape`` from parts that passed :meth:`check`."""

    def check(self, parts: Sequence[Tensor], numel: int) -> None:
        """Raise ValueError (saying which part is wrong) unless ``parts`` could come from
        :meth:`encode` of a finite tensor of ``numel`` values: dtypes, shapes, finite scales
        >= 0, codes in range (indices: ascending, in range)."""
        want = self.parts(numel)
        if len(parts) != len(want):
            raise ValueError(f"{self.kind}: {len(parts)} parts, expected {len(want)}")
        for t, (suffix, dt, shape) in zip(parts, want):
            if t.dtype != dt or tuple(t.shape) != shape:
                raise ValueError(f"{self.kind} part {suffix!r} is {t.dtype}{tuple(t.shape)}, expected {dt}{shape}")

    def bytes_per_value(self, numel: int) -> float:
        """Wire bytes per value of a tensor of ``numel`` values."""
        return sum(math.prod(s) * d.itemsize for _, d, s in self.parts(numel)) / max(1, numel)


def _check_scales(scales: Tensor, what: str) -> None:
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError(f"{what}: a scale is negative, NaN or inf (tampered or corrupt payload)")


def _block_view(x: Tensor, block: int) -> Tensor:
    """Flat ``x`` as [blocks, block], zero-padded only when the last block is short."""
    n = x.numel()
    nb = _blocks(n, block)
    if n == nb * block:
        return x.view(nb, block)
    padded = torch.zeros(nb * block, dtype=x.dtype)
    padded[:n] = x
    return padded.view(nb, block)


def _quantize(x: Tensor, block: int, levels: int) -> tuple[Tensor, Tensor]:
    """(codes in [-levels, levels] as int8 [numel], fp32 scales [blocks]) of flat fp32 ``x``."""
    n = x.numel()
    xb = _block_view(x, block)
    scales = xb.abs().amax(dim=1) / levels
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round(xb * inv[:, None]).clamp_(-levels, levels).to(torch.int8)
    return codes.view(-1)[:n].contiguous(), scales


def _dequantize(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    n = codes.numel()
    return (_block_view(codes.to(torch.float32), block) * scales[:, None]).view(-1)[:n]


class Int8(Compressor):
    kind = "int8"

    def parts(self, numel: int) -> list[Part]:
        return [("q", torch.int8, (numel,)), ("s", torch.float32, (_blocks(numel, self.block),))]

    @torch.no_grad()
    def encode(self, x: Tensor) -> list[Tensor]:
        codes, scales = _quantize(x.detach().reshape(-1).to(torch.float32), self.block, 127)
        return [codes, scales]

    @torch.no_grad()
    def decode(self, parts: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
        codes, scales = parts
        return _dequantize(codes, scales, self.block).view(tuple(shape))

    def check(self, parts: Sequence[Tensor], numel: int) -> None:
        super().check(parts, numel)
        if numel and int(parts[0].min()) < -127:
            raise ValueError("int8: code -128 is outside the format's [-127, 127] (tampered payload)")
        _check_scales(parts[1], "int8")


class Int4(Compressor):
    kind = "int4"

    def parts(self, numel: int) -> list[Part]:
        return [("q", torch.uint8, ((numel + 1) // 2,)), ("s", torch.float32, (_blocks(numel, self.block),))]

    @torch.no_grad()
    def encode(self, x: Tensor) -> list[Tensor]:
        codes, scales = _quantize(x.detach().reshape(-1).to(torch.float32), self.block, 7)
        nib = (codes.to(torch.int16) + 8).to(torch.uint8)  # 1..15
        if nib.numel() % 2:
            nib = torch.cat([nib, torch.full((1,), 8, dtype=torch.uint8)])  # a zero code pads the last byte
        pairs = nib.view(-1, 2)
        return [(pairs[:, 0] | (pairs[:, 1] << 4)).contiguous(), scales]

    @staticmethod
    def _unpack(packed: Tensor, numel: int) -> Tensor:
        lo, hi = packed & 0x0F, packed >> 4
        return torch.stack([lo, hi], dim=1).view(-1)[:numel]

    @torch.no_grad()
    def decode(self, parts: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
        packed, scales = parts
        numel = math.prod(shape)
        codes = self._unpack(packed, numel).to(torch.int16) - 8
        return _dequantize(codes, scales, self.block).view(tuple(shape))

    def check(self, parts: Sequence[Tensor], numel: int) -> None:
        super().check(parts, numel)
        packed = parts[0]
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
        if numel and bool((nibbles[:numel] == 0).any()):
            raise ValueError("int4: nibble 0 (code -8) is outside the format's [-7, 7] (tampered payload)")
        _check_scales(parts[1], "int4")


class Sign(Compressor):
    kind = "sign"

    def __init__(self, block: int = 128, hold: float = 0.0, seed: int = 0):
        """``hold``: the share of each tensor's coordinates NOT sent this round (a strided set
        at a random offset each call, the offset travels as one int32): their values stay in
        the error feedback for a later round. 0.05 takes the payload under 1 bit per value."""
        super().__init__(block)
        if not 0.0 <= hold <= 0.5:
            raise ValueError(f"sign hold={hold} must be in [0, 0.5]")
        self.hold = float(hold)
        self._gen = torch.Generator().manual_seed(int(seed))

    def _held(self, numel: int) -> tuple[int, int]:
        """(coordinates held back, their stride): indices offset + stride * j, j < held."""
        d = int(numel * self.hold)
        return (d, numel // d) if d else (0, 0)

    def parts(self, numel: int) -> list[Part]:
        d, _ = self._held(numel)
        m = numel - d
        parts = [("q", torch.uint8, ((m + 7) // 8,)), ("s", torch.float32, (_blocks(m, self.block),))]
        return ([("o", torch.int32, (1,))] + parts) if d else parts

    @staticmethod
    def _kept(numel: int, d: int, stride: int, offset: int) -> Tensor:
        mask = torch.ones(numel, dtype=torch.bool)
        mask[offset:offset + stride * d:stride] = False
        return mask

    @torch.no_grad()
    def encode(self, x: Tensor) -> list[Tensor]:
        flat = x.detach().reshape(-1).to(torch.float32)
        d, stride = self._held(flat.numel())
        head: list[Tensor] = []
        if d:
            offset = int(torch.randint(stride, (1,), generator=self._gen))
            flat = flat[self._kept(flat.numel(), d, stride, offset)]
            head = [torch.tensor([offset], dtype=torch.int32)]
        n = flat.numel()
        nb = _blocks(n, self.block)
        counts = torch.full((nb,), float(self.block))
        counts[-1] = float(n - (nb - 1) * self.block) if n else 1.0
        scales = _block_view(flat.abs(), self.block).sum(1) / counts  # mean |x|: the L2-best sign scale
        bits = np.packbits((flat >= 0).numpy(), bitorder="little")
        return [*head, torch.from_numpy(bits), scales]

    @torch.no_grad()
    def decode(self, parts: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
        numel = math.prod(shape)
        d, stride = self._held(numel)
        packed, scales = parts[-2:]
        m = numel - d
        bits = np.unpackbits(packed.contiguous().numpy(), count=m, bitorder="little")
        signs = torch.from_numpy(bits).to(torch.float32).mul_(2).sub_(1)
        vals = (_block_view(signs, self.block) * scales[:, None]).view(-1)[:m]
        if not d:
            return vals.view(tuple(shape))
        out = torch.zeros(numel, dtype=torch.float32)
        out[self._kept(numel, d, stride, int(parts[0][0]))] = vals
        return out.view(tuple(shape))

    def check(self, parts: Sequence[Tensor], numel: int) -> None:
        super().check(parts, numel)
        d, stride = self._held(numel)
        if d and not 0 <= int(parts[0][0]) < stride:
            raise ValueError(f"sign: offset {int(parts[0][0])} of the held coordinates is outside [0, {stride})")
        _check_scales(parts[-1], "sign")


class TopK(Compressor):
    kind = "topk"

    def __init__(self, block: int = 128, fraction: float = 0.02):
        super().__init__(block)
        if not 0 < fraction <= 1:
            raise ValueError(f"topk fraction={fraction} must be in (0, 1]")
        self.fraction = float(fraction)
        self._values = Int8(block)

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.fraction * numel))) if numel else 0

    def parts(self, numel: int) -> list[Part]:
        k = self.k(numel)
        return [("i", torch.int32, (k,)), *self._values.parts(k)]

    @torch.no_grad()
    def encode(self, x: Tensor) -> list[Tensor]:
        flat = x.detach().reshape(-1).to(torch.float32)
        n = flat.numel()
        k = self.k(n)
        mags = flat.abs().numpy()
        # O(n) selection (numpy's introselect); torch.topk sorts and was 5x slower at k = 5%
        idx = np.sort(np.argpartition(mags, n - k)[n - k:]) if k < n else np.arange(n)
        idx = torch.from_numpy(idx.astype(np.int64))
        return [idx.to(torch.int32), *self._values.encode(flat[idx])]

    @torch.no_grad()
    def decode(self, parts: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
        idx, *vals = parts
        out = torch.zeros(math.prod(shape), dtype=torch.float32)
        out[idx.to(torch.int64)] = self._values.decode(vals, (idx.numel(),))
        return out.view(tuple(shape))

    def check(self, parts: Sequence[Tensor], numel: int) -> None:
        super().check(parts, numel)
        idx = parts[0]
        if idx.numel():
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise ValueError("topk: indices must be strictly ascending (each coordinate once)")
            if int(idx[0]) < 0 or int(idx[-1]) >= numel:  # ascending: the ends bound them all
                raise ValueError(f"topk: an index is outside [0, {numel})")
        self._values.check(parts[1:], idx.numel())


def make_compressor(kind: str, block: int = 128, topk: float = 0.02, hold: float = 0.0) -> Compressor:
    """The compressor ``kind`` ("int8" | "int4" | "sign" | "topk") with its settings (``hold``: sign only)."""
    if kind == "int8":
        return Int8(block)
    if kind == "int4":
        return Int4(block)
    if kind == "topk":
        return TopK(block, topk)
    if kind == "sign":
        return Sign(block, hold)
    raise ValueError(f"unknown compression {kind!r}; use one of {', '.join(KINDS)} (or 'none' in the config)")


@dataclass(frozen=True)
class Pending:
    """One round's compressed payload and the residual to keep if it is delivered."""

    parts: list[list[Tensor]]
    """Per input tensor, its wire parts."""
    residual: list[Tensor]
    """payload - decode(parts), per tensor: becomes the residual on :meth:`ErrorFeedback.commit`."""


class ErrorFeedback:
    """Error feedback over a fixed list of tensor shapes (the residual lives in fp32)."""

    def __init__(self, compressor: Compressor, shapes: Sequence[Sequence[int]]):
        self.compressor = compressor
        self.shapes = [tuple(int(x) for x in s) for s in shapes]
        self.residual = [torch.zeros(s, dtype=torch.float32) for s in self.shapes]

    @torch.no_grad()
    def compress(self, inputs: Sequence[Tensor]) -> Pending:
        """Compress ``inputs + residual``; the residual is unchanged until :meth:`commit`."""
        if len(inputs) != len(self.shapes):
            raise ValueError(f"{len(inputs)} tensors, error feedback holds {len(self.shapes)}")
        parts, residual = [], []
        for x, r, shape in zip(inputs, self.residual, self.shapes):
            payload = x.detach().to(torch.float32).reshape(shape) + r
            p = self.compressor.encode(payload)
            parts.append(p)
            residual.append(payload - self.compressor.decode(p, shape))
        return Pending(parts, residual)

    def commit(self, pending: Pending) -> None:
        """The payload of ``pending`` was delivered: its residual is carried to the next round."""
        self.residual = pending.residual

    def reset(self) -> None:
        """Forget the residual (after adopting another worker's state)."""
        self.residual = [torch.zeros(s, dtype=torch.float32) for s in self.shapes]
