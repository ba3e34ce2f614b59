"""optimizers/compression.py and optimizers/outer_codec.py: round-trip error bounds, exact error
feedback, refusal of tampered parts, and the NoLoCo / DiLoCo payload layout."""

from __future__ import annotations

import math

import pytest
import torch

from optimizers.compression import ErrorFeedback, Int4, Int8, Sign, TopK, make_compressor
from optimizers.config import NoLoCoConfig
from optimizers.outer_codec import OuterCodec


def _x(seed: int, n: int = 1000, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    if n > 7:
        x[7] = 40.0 * scale  # an outlier in the first block
    return x


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: the absmax of its block."""
    n = x.numel()
    nb = math.ceil(n / block)
    pad = torch.zeros(nb * block)
    pad[:n] = x.abs()
    return pad.view(nb, block).amax(1).repeat_interleave(block)[:n]


@pytest.mark.parametrize("cls,levels", [(Int8, 127), (Int4, 7)])
@pytest.mark.parametrize("n,block", [(1000, 128), (1, 64), (129, 64), (4096, 32)])
def test_quantizer_round_trip_is_within_half_a_step_of_its_block(cls, levels, n, block):
    c = cls(block)
    x = _x(1, n)
    parts = c.encode(x)
    c.check(parts, n)
    y = c.decode(parts, x.shape)
    bound = _block_absmax(x, block) / (2 * levels) + 1e-6
    assert torch.all((y - x).abs() <= bound), float(((y - x).abs() - bound).max())
    assert c.bytes_per_value(n) == pytest.approx(
        (1.0 if cls is Int8 else math.ceil(n / 2) / n) + 4 * math.ceil(n / block) / n)


def test_int4_packs_two_values_per_byte():
    c = Int4(64)
    parts = c.encode(_x(2, 1001))
    assert parts[0].dtype == torch.uint8 and parts[0].numel() == 501
    assert c.bytes_per_value(1 << 20) == pytest.approx(0.5 + 4 / 64)


def test_topk_keeps_the_largest_coordinates_and_quantizes_them():
    c = TopK(block=128, fraction=0.05)
    x = _x(3, 2000)
    idx, codes, scales = c.encode(x)
    k = c.k(2000)
    assert k == 100 and idx.numel() == codes.numel() == 100
    assert torch.all(idx[1:] > idx[:-1])  # ascending, each once
    kept = set(idx.tolist())
    assert min(x.abs()[list(kept)]) >= max(x.abs()[[i for i in range(2000) if i not in kept]])
    y = c.decode([idx, codes, scales], x.shape)
    assert torch.count_nonzero(y) <= k
    vals = x[idx.long()]
    assert torch.all((y[idx.long()] - vals).abs() <= _block_absmax(vals, 128) / 254 + 1e-6)
    assert c.bytes_per_value(1_000_000) == pytest.approx((50_000 * 5 + 4 * math.ceil(50_000 / 128)) / 1_000_000)


@pytest.mark.parametrize("n,block", [(1000, 128), (1, 64), (130, 64)])
def test_sign_sends_each_sign_with_its_blocks_mean_magnitude(n, block):
    c = Sign(block)
    x = _x(8, n)
    parts = c.encode(x)
    c.check(parts, n)
    assert parts[0].numel() == (n + 7) // 8 and c.bytes_per_value(1 << 20) == pytest.approx(1 / 8 + 4 / block)
    y = c.decode(parts, x.shape)
    assert torch.equal(torch.sign(y), torch.where(x >= 0, 1.0, -1.0))
    for b in range(0, n, block):  # every value of a block carries that block's mean |x|
        assert torch.allclose(y[b:b + block].abs(), x[b:b + block].abs().mean().expand(len(y[b:b + block])))
    with pytest.raises(ValueError, match="scale"):
        c.check([parts[0], -parts[1] - 1], n)


@pytest.mark.parametrize("kind", ["int8", "int4", "topk", "sign"])
def test_error_feedback_carries_the_residual_exactly(kind):
    """sum of what was delivered + residual == sum of the inputs, over many rounds."""
    comp = make_compressor(kind, block=64, topk=0.03)
    shapes = [(40, 25), (17,)]
    ef = ErrorFeedback(comp, shapes)
    total_in = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    total_out = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    g = torch.Generator().manual_seed(5)
    for rnd in range(12):
        xs = [torch.randn(s, generator=g) for s in shapes]
        pending = ef.compress(xs)
        if rnd % 4 == 3:
            continue  # not delivered: nothing committed, the round's input is not counted as sent either
        ef.commit(pending)
        for i, s in enumerate(shapes):
            total_in[i] += xs[i].double()
            total_out[i] += comp.decode(pending.parts[i], s).double()
    for tin, tout, r in zip(total_in, total_out, ef.residual):
        assert torch.allclose(tout + r.double(), tin, atol=1e-4), float((tout + r.double() - tin).abs().max())
    assert any(float(r.abs().max()) > 0 for r in ef.residual)  # the compression did lose something each round


def test_error_feedback_delivers_what_a_single_round_drops():
    """top-k drops a coordinate in round 1; with the residual it goes out in a later round."""
    comp = TopK(block=8, fraction=0.25)  # 1 of 4 coordinates per round
    ef = ErrorFeedback(comp, [(4,)])
    x = torch.tensor([1.0, 0.9, 0.0, 0.0])
    p1 = ef.compress([x])
    ef.commit(p1)
    assert comp.decode(p1.parts[0], (4,))[1] == 0  # coordinate 1 not sent in round 1
    p2 = ef.compress([torch.zeros(4)])
    assert comp.decode(p2.parts[0], (4,))[1] == pytest.approx(0.9, abs=0.01)  # sent from the residual


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p[0].view(-1).__setitem__(3, -128), "-128"),
    (lambda p: p[1].__setitem__(0, float("nan")), "scale"),
    (lambda p: p[1].__setitem__(0, -1.0), "scale"),
    (lambda p: p.__setitem__(1, torch.ones(4)), "part"),
    (lambda p: p.pop(), "parts"),
])
def test_int8_tampered_parts_are_refused(mutate, match):
    c = Int8(128)
    parts = c.encode(_x(4, 300))
    c.check(parts, 300)
    mutate(parts)
    with pytest.raises(ValueError, match=match):
        c.check(parts, 300)


def test_int4_tampered_nibble_and_scale_are_refused():
    c = Int4(64)
    parts = c.encode(_x(5, 301))
    c.check(parts, 301)
    bad = [parts[0].clone(), parts[1]]
    bad[0][10] = bad[0][10] & 0xF0  # low nibble 0: code -8
    with pytest.raises(ValueError, match="nibble"):
        c.check(bad, 301)
    with pytest.raises(ValueError, match="scale"):
        c.check([parts[0], torch.full_like(parts[1], float("inf"))], 301)


@pytest.mark.parametrize("mutate,match", [
    (lambda i: i.__setitem__(-1, 5000), "outside"),
    (lambda i: i.__setitem__(0, -1), "outside"),
    (lambda i: i.__setitem__(2, i[1]), "ascending"),
])
def test_topk_tampered_indices_are_refused(mutate, match):
    c = TopK(128, 0.05)
    parts = c.encode(_x(6, 2000))
    c.check(parts, 2000)
    mutate(parts[0])
    with pytest.raises(ValueError, match=match):
        c.check(parts, 2000)


def test_encoding_is_deterministic():
    x = _x(7, 5000)
    for kind in ("int8", "int4", "topk", "sign"):
        c = make_compressor(kind, 128, 0.02)
        assert all(torch.equal(a, b) for a, b in zip(c.encode(x), c.encode(x.clone())))


# ----------------------------------------------------------------------------- OuterCodec

NAMES, SHAPES = ["w", "b"], [(50, 40), (40,)]


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    phi = [torch.randn(s, generator=g) for s in SHAPES]
    theta = [p + 0.01 * torch.randn(p.shape, generator=g) for p in phi]
    return theta, phi


def test_noloco_phi_round_rebuilds_the_partners_theta_and_other_rounds_use_our_phi():
    cfg = NoLoCoConfig(compression="int8", compression_phi_every=4)
    a, b = (OuterCodec.from_config(cfg, NAMES, SHAPES) for _ in range(2))
    theta_a, phi_a = _state(1)
    theta_b, phi_b = _state(2)
    out_a, out_b = a.encode(theta_a, phi_a), b.encode(theta_b, phi_b)
    for rnd in (8, 9):
        wire = b.tensors_for(rnd, out_b)
        dtypes = {name: dt for name, dt, _ in a.wire_specs()}
        assert [t.dtype for t in wire] == [dtypes[n] for n in a.names_for(rnd)]
        got = a.decode(rnd, wire, out_a.ref)
        base = phi_b if rnd % 4 == 0 else phi_a  # the partner's phi on a phi round, ours otherwise
        for g_, tb, pb, base_ in zip(got, theta_b, phi_b, base):
            delta = tb - pb
            err = (g_ - (base_ + delta)).abs().max()
            tol = (pb.abs().max() / 254 if rnd % 4 == 0 else 0) + delta.abs().max() / 254 + 1e-6
            assert err <= tol
    assert a.payload_bytes(8) > a.payload_bytes(9)  # phi travels only on phi rounds
    n = sum(math.prod(s) for s in SHAPES)
    assert a.payload_bytes(9) / n == pytest.approx(1 + 4 * 17 / n, rel=0.01)  # 16 + 1 blocks of 128


def test_untied_consensus_rebuilds_phi_as_well():
    cfg = NoLoCoConfig(compression="int4", consensus=0.5, compression_phi_every=1)
    a = OuterCodec.from_config(cfg, NAMES, SHAPES)
    theta, phi = _state(3)
    out = a.encode(theta, phi)
    got = a.decode(5, a.tensors_for(5, out), out.ref)
    assert len(got) == 4
    assert torch.allclose(got[2], phi[0], atol=float(phi[0].abs().max()) / 200)


def test_a_tampered_part_is_refused_by_the_codec():
    cfg = NoLoCoConfig(compression="topk", compression_topk=0.1)
    a = OuterCodec.from_config(cfg, NAMES, SHAPES)
    theta, phi = _state(4)
    out = a.encode(theta, phi)
    wire = [t.clone() for t in a.tensors_for(3, out)]
    wire[0][-1] = 10_000  # an index outside the 2000 coordinates of "w"
    with pytest.raises(ValueError, match="'w'.*outside"):
        a.decode(3, wire, out.ref)
    with pytest.raises(ValueError, match="compressed tensors"):
        a.decode(3, wire[:-1], out.ref)


def test_diloco_members_rebuild_bitwise_the_mean_the_root_applies():
    cfg = NoLoCoConfig(outer="diloco", compression="topk", compression_topk=0.05)
    root = OuterCodec.from_config(cfg, NAMES, SHAPES)
    member = OuterCodec.from_config(cfg, NAMES, SHAPES)
    assert root.names_for(8) == root.mean_names()  # DiLoCo never sends phi
    theta, phi = _state(5)
    mean = [t + 0.001 for t in theta]
    wire, used = root.encode_mean(mean, phi)
    seen = member.decode_mean(wire, [p.clone() for p in phi])
    assert all(torch.equal(u, s) for u, s in zip(used, seen))
    # the root's downlink residual holds what the mean lost, and goes out next round
    assert any(float(r.abs().max()) > 0 for r in root.downlink.residual)


def test_commit_only_keeps_a_delivered_residual():
    cfg = NoLoCoConfig(compression="topk", compression_topk=0.02)
    c = OuterCodec.from_config(cfg, NAMES, SHAPES)
    theta, phi = _state(6)
    out = c.encode(theta, phi)
    assert all(float(r.abs().max()) == 0 for r in c.uplink.residual)
    c.commit(out)
    assert any(float(r.abs().max()) > 0 for r in c.uplink.residual)
    c.reset()
    assert all(float(r.abs().max()) == 0 for r in c.uplink.residual)


def test_compression_is_part_of_the_config_hash():
    assert NoLoCoConfig().cfg_hash() != NoLoCoConfig(compression="int8").cfg_hash()
    assert NoLoCoConfig(compression="int8").cfg_hash() != NoLoCoConfig(compression="int4").cfg_hash()
    assert (NoLoCoConfig(compression_topk=0.5).cfg_hash() == NoLoCoConfig().cfg_hash())  # off: not hashed
    assert OuterCodec.from_config(NoLoCoConfig(), NAMES, SHAPES) is None


def test_sign_with_hold_sends_under_one_bit_and_error_feedback_delivers_the_held_share():
    c = Sign(1024, hold=0.05)
    n = 200_000
    assert c.bytes_per_value(n) < 0.125
    x = _x(9, n)
    parts = c.encode(x)
    c.check(parts, n)
    y = c.decode(parts, x.shape)
    assert int((y == 0).sum()) == int(n * 0.05)  # the held coordinates, nothing else
    assert torch.equal(torch.sign(y[y != 0]), torch.where(x[y != 0] >= 0, 1.0, -1.0))
    bad = [parts[0].clone(), *parts[1:]]
    bad[0][0] = n  # the offset of the held coordinates must be within one stride
    with pytest.raises(ValueError, match="offset"):
        c.check(bad, n)
    # error feedback: over rounds, what was sent + the residual is what came in
    ef = ErrorFeedback(Sign(64, hold=0.1), [(3000,)])
    total_in, total_out = torch.zeros(3000, dtype=torch.float64), torch.zeros(3000, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        x = torch.randn(3000, generator=g)
        p = ef.compress([x])
        ef.commit(p)
        total_in += x.double()
        total_out += ef.compressor.decode(p.parts[0], (3000,)).double()
    assert torch.allclose(total_out + ef.residual[0].double(), total_in, atol=1e-4)
