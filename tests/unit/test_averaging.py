"""node/averaging.py: ascending peer-ID order makes every member's mean bitwise equal; the
``owned`` buffer reuse writes over a received buffer and stays exact."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.averaging import LocalNonFinite, mean_of, ordered_mean
from protocol.codec import TensorRejected


def _parts(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # values of very different magnitudes: float addition is not associative, so the order matters
    return [[(torch.randn(1000, generator=g) * 8.0 ** i).to(dtype),
             torch.randn(3, 7, generator=g).to(dtype)] for i in range(n)]


def _reference(parts):
    out = []
    for i in range(len(parts[0])):
        acc = parts[0][i].clone()
        for p in parts[1:]:
            acc = acc + p[i]
        out.append(acc / len(parts))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_both_sides_get_bitwise_the_same_mean(n, dtype):
    ids = [f"12D3KooW{c}" for c in "QbXaZ"[:n]]
    tensors = dict(zip(ids, _parts(n, dtype)))

    def side(me):  # each member holds its own copy of everyone's tensors, listed in its own order
        got = [(pid, [t.clone() for t in tensors[pid]]) for pid in ([me] + [p for p in ids if p != me])]
        return asyncio.run(ordered_mean(got, me))

    results = [side(me) for me in ids]
    want = _reference([tensors[p] for p in sorted(ids)])
    for r in results:
        for a, b in zip(r, want):
            assert a.dtype == dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def test_order_matters_so_the_ordering_is_what_makes_it_exact():
    parts = [[torch.tensor([1e8], dtype=torch.float32)], [torch.tensor([1.0])], [torch.tensor([-1e8])]]
    a, _ = mean_of(parts)
    b, _ = mean_of([parts[0], parts[2], parts[1]])
    assert not torch.equal(a[0], b[0])  # the test above would catch a mean that ignored the order


def test_owned_buffer_is_reused_and_exact():
    mine, theirs = _parts(2)
    want = _reference([mine, theirs])
    received = [t.clone() for t in theirs]
    ptrs = [t.data_ptr() for t in received]
    mine_before = [t.clone() for t in mine]
    out, finite = mean_of([mine, received], owned={1})
    assert finite
    assert [t.data_ptr() for t in out] == ptrs  # written over the received buffers, no allocation
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert all(torch.equal(a, b) for a, b in zip(mine, mine_before))  # our own tensors untouched
    out0, _ = mean_of([[t.clone() for t in theirs], [t.clone() for t in mine]], owned={0})
    assert all(torch.equal(a, b) for a, b in zip(out0, want))  # a+b == b+a bitwise


def test_no_owned_part_allocates_and_leaves_inputs():
    a, b = _parts(2)
    a0, b0 = [t.clone() for t in a], [t.clone() for t in b]
    out, _ = mean_of([a, b])
    assert all(o.data_ptr() not in (x.data_ptr(), y.data_ptr()) for o, x, y in zip(out, a, b))
    assert all(torch.equal(x, y) for x, y in zip(a + b, a0 + b0))


def test_ordered_mean_consumes_peer_buffers_not_ours():
    mine, theirs = _parts(2)
    ptr = theirs[0].data_ptr()
    out = asyncio.run(ordered_mean([("12D3KooWz", theirs), ("12D3KooWa", mine)], "12D3KooWa"))
    assert out[0].data_ptr() == ptr


def test_non_finite_blames_the_right_side():
    mine, theirs = _parts(2)
    bad = [t.clone() for t in theirs]
    bad[1][0, 0] = float("nan")
    with pytest.raises(TensorRejected) as e:
        asyncio.run(ordered_mean([("a", mine), ("b", bad)], "a"))
    assert e.value.reason == "nonfinite"
    mine[0][3] = float("inf")
    with pytest.raises(LocalNonFinite):
        asyncio.run(ordered_mean([("a", mine), ("b", theirs)], "a"))
