"""Group means every averaging role shares: exact, order-fixed, finite-checked.

Owns the arithmetic of "average these members' tensors" so that every member of a group who
computes it gets bitwise the same result: parts are summed left to right in ascending
peer-ID order, then divided by n, in one blockwise numpy pass that also checks finiteness
(torch's add/isfinite made several passes with temporaries and were 5-10x slower here).
Does not own moving the tensors (``optimizers/exchange*.py``, ``protocol/streams.py``) nor
what the role does with the mean.

    mean_of(parts, owned=()) -> (mean, finite)                 # pure, in the order given
    await ordered_mean([(peer_id, tensors), ...], me) -> mean  # ascending peer ID, thread if big
    LocalNonFinite                                             # our own tensors hold NaN/inf
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import torch

from protocol.codec import THREAD_BYTES, TensorRejected, all_finite, flat_numpy

__all__ = ["mean_of", "ordered_mean", "LocalNonFinite"]

_BLOCK = 1 << 18  # elements per cache-sized block


class LocalNonFinite(ValueError):
    """The mean is not finite because OUR tensors hold NaN/inf: the role must not send them
    (the partner is not blamed)."""


def mean_of(parts: Sequence[Sequence[torch.Tensor]], owned: set[int] | frozenset[int] = frozenset()
            ) -> tuple[list[torch.Tensor], bool]:
    """Elementwise mean of ``parts`` (one list of tensors per member, summed in the order given:
    pass ascending peer-ID order so every member gets bitwise the same result) and whether it
    is all finite. ``owned`` lists indices of parts whose buffers may be overwritten (received
    tensors): the result then reuses one of them (part 0 or 1) instead of allocating; since
    a+b == b+a bitwise, writing over either keeps the result exact."""
    n, out, finite = len(parts), [], True
    if n == 0:
        raise ValueError("mean_of needs at least one part")
    for i in range(len(parts[0])):
        xs = [p[i] for p in parts]
        reuse = next((j for j in (0, 1) if j in owned and j < n), None)
        res = xs[reuse] if reuse is not None and xs[reuse].is_contiguous() else \
            torch.empty(xs[0].shape, dtype=xs[0].dtype)
        arrs, r = [flat_numpy(x) for x in xs], flat_numpy(res)
        if r is None or any(a is None for a in arrs):  # bfloat16 and friends: torch, same order
            acc = xs[0].detach().clone()
            for x in xs[1:]:
                acc.add_(x)
            out.append(acc.div_(n))
            finite = finite and all_finite(acc)
            continue
        div = r.dtype.type(n)
        for s in range(0, r.size, _BLOCK):
            blk = r[s:s + _BLOCK]
            if n == 1:
                blk[:] = arrs[0][s:s + _BLOCK]
            else:
                np.add(arrs[0][s:s + _BLOCK], arrs[1][s:s + _BLOCK], out=blk)
            for a in arrs[2:]:
                np.add(blk, a[s:s + _BLOCK], out=blk)
            np.divide(blk, div, out=blk)
            if finite and not np.isfinite(blk).all():
                finite = False
        out.append(res)
    return out, finite


async def ordered_mean(parts: Sequence[tuple[str, Sequence[torch.Tensor]]], me: str) -> list[torch.Tensor]:
    """Mean of every member's tensors in ascending peer-ID order, written over a received
    buffer (parts other than ``me``'s are consumed), in a worker thread when the payload is
    ``THREAD_BYTES`` or more. Raises ``LocalNonFinite`` when our own tensors are not finite,
    ``TensorRejected("nonfinite")`` when a peer's made the mean non-finite."""
    order = sorted(parts, key=lambda x: x[0])
    ordered = [list(t) for _, t in order]
    owned = {i for i, (pid, _) in enumerate(order) if pid != me}
    size = sum(t.numel() * t.element_size() for t in ordered[0])
    if size >= THREAD_BYTES:
        mean, finite = await asyncio.to_thread(mean_of, ordered, owned)
    else:
        mean, finite = mean_of(ordered, owned)
    if not finite:
        mine = dict(parts).get(me)
        if mine is not None and not all(map(all_finite, mine)):
            raise LocalNonFinite("our own tensors hold NaN/inf: the role must not send them")
        raise TensorRejected("nonfinite", "a peer's tensors contain NaN or inf (the mean is not finite); "
                                          "dropped")
    return mean
