"""node/netem.py: link lookup, the delay a pacer actually adds, config validation."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from pydantic import ValidationError

from node.netem import LinkEmulator, LinkSpec, NetemConfig, modelled_allreduce_s, transfer_s

MB = 1_000_000


def _emu(**kw) -> LinkEmulator:
    return LinkEmulator(NetemConfig.model_validate({"enabled": True, **kw}))


async def _stream(pace, total: int, chunks: int) -> float:
    t0 = time.monotonic()
    for _ in range(chunks):
        await pace(total // chunks)
    return time.monotonic() - t0


@pytest.mark.timeout(20)
async def test_stream_takes_latency_plus_bytes_over_bandwidth():
    emu = _emu(default={"latency_ms": 50, "bandwidth_mbps": 8})
    took = await _stream(emu.pacer("anyone"), 1 * MB, 10)
    expected = 0.05 + 1 * MB * 8 / 8e6   # 1.05 s
    print(f"netem stream: 1 MB in 10 chunks at 50 ms + 8 Mbit/s took {took:.3f} s "
          f"(expected {expected:.3f} s)")
    assert expected * 0.85 <= took <= expected * 1.15


@pytest.mark.timeout(20)
async def test_many_small_frames_do_not_accumulate_sleep_overhead():
    emu = _emu(default={"latency_ms": 10, "bandwidth_mbps": 80})
    took = await _stream(emu.pacer("x"), 2 * MB, 400)  # 400 sleeps of ~0.5 ms each
    expected = 0.01 + 2 * MB * 8 / 80e6                # 0.21 s
    print(f"netem stream: 2 MB in 400 chunks at 10 ms + 80 Mbit/s took {took:.3f} s "
          f"(expected {expected:.3f} s)")
    assert expected * 0.9 <= took <= expected * 1.3    # 400 naive sleeps would overshoot far more


@pytest.mark.timeout(10)
async def test_latency_only_once_per_stream():
    pace = _emu(default={"latency_ms": 100}).pacer("x")
    t0 = time.monotonic()
    await pace(10)
    first = time.monotonic() - t0
    t1 = time.monotonic()
    for _ in range(5):
        await pace(10)
    rest = time.monotonic() - t1
    assert 0.085 <= first <= 0.2 and rest < 0.02


@pytest.mark.timeout(10)
async def test_disabled_and_unlimited_add_nothing():
    disabled = LinkEmulator(NetemConfig(default=LinkSpec(latency_ms=500)))  # enabled=False
    unlimited = _emu(default={"latency_ms": 0})
    for emu in (disabled, unlimited):
        assert emu.delay_s("x", 10 * MB) == 0.0
        took = await _stream(emu.pacer("x"), 10 * MB, 100)
        assert took < 0.05
    assert disabled.link_for("x") is None


async def test_unary_delay_and_idle_producer_banks_little():
    emu = _emu(default={"latency_ms": 20, "bandwidth_mbps": 8})
    t0 = time.monotonic()
    await emu.delay("x", 10_000)             # 20 ms + 10 ms
    assert 0.025 <= time.monotonic() - t0 <= 0.1
    pace = emu.pacer("x")
    await pace(1000)
    await asyncio.sleep(0.3)   # producer idle: credit capped at BURST_S
    t1 = time.monotonic()
    await pace(100_000)                      # 100 ms of link time
    assert time.monotonic() - t1 >= 0.1 - LinkEmulator.BURST_S - 0.01


def test_lookup_per_destination_and_default():
    emu = _emu(default={"latency_ms": 5},
               links={"12D3KooWpeer": {"latency_ms": 80, "bandwidth_mbps": 100},
                      "10.0.0.7:50051": {"latency_ms": 150}})
    assert emu.link_for("12D3KooWpeer") == LinkSpec(latency_ms=80, bandwidth_mbps=100)
    assert emu.link_for("10.0.0.7:50051").latency_ms == 150
    assert emu.link_for("unknown:1") == LinkSpec(latency_ms=5)
    assert emu.delay_s("12D3KooWpeer", 1 * MB) == pytest.approx(0.08 + 0.08)
    assert emu.delay_s("unknown:1", 1 * MB) == pytest.approx(0.005)
    assert _emu(links={"a": {"latency_ms": 1}}).link_for("b") is None


def test_matrix_row_and_priority():
    cfg = NetemConfig.model_validate({
        "enabled": True,
        "links": {"c": {"latency_ms": 1}},
        "matrix": {"nodes": ["a", "b", "c"],
                   "latency_ms": [[0, 40, 90], [40, 0, 60], [90, 60, 0]],
                   "bandwidth_mbps": [[math.inf, 100, 50], [100, math.inf, 200], [50, 200, math.inf]]}})
    emu = LinkEmulator(cfg, self_id="a")
    assert emu.link_for("b") == LinkSpec(latency_ms=40, bandwidth_mbps=100)
    assert emu.link_for("c") == LinkSpec(latency_ms=1)          # links win over the matrix
    assert cfg.matrix.link("b", "c").bandwidth_mbps == 200
    with pytest.raises(ValueError, match="does not list this node"):
        LinkEmulator(cfg, self_id="zzz")


def test_matrix_from_toml_with_inf():
    import tomllib
    doc = tomllib.loads("""
[netem]
enabled = true
default = { latency_ms = 20, bandwidth_mbps = 1000 }
[netem.links]
"10.0.0.7:50051" = { latency_ms = 150 }
[netem.matrix]
nodes = ["a", "b"]
latency_ms = [[0, 40], [40, 0]]
bandwidth_mbps = [[inf, 100], [100, inf]]
""")
    cfg = NetemConfig.model_validate(doc["netem"])
    assert cfg.matrix.link("a", "b").bandwidth_mbps == 100
    assert LinkSpec(bandwidth_mbps=math.inf).bandwidth_mbps is None


@pytest.mark.parametrize("bad, match", [
    ({"default": {"latency_ms": -1}}, "latency_ms=-1.0 must be a finite number"),
    ({"default": {"latency_ms": 120_000}}, "not seconds"),
    ({"default": {"bandwidth_mbps": 0}}, "must be > 0 Mbit/s"),
    ({"default": {"latency_ms": 1, "jitter": 2}}, "Extra inputs are not permitted"),
    ({}, "set enabled = false"),
    ({"links": {"": {"latency_ms": 1}}}, "empty key"),
    ({"matrix": {"nodes": ["a", "b"], "latency_ms": [[0, 1]]}}, "must be 2 x 2"),
    ({"matrix": {"nodes": ["a", "a"], "latency_ms": [[0, 1], [1, 0]]}}, "duplicates"),
    ({"matrix": {"nodes": ["a", "b"], "latency_ms": [[0, 1], [1, 0]],
                 "bandwidth_mbps": [[1, -5], [1, 1]]}}, r"bandwidth_mbps\[0\]\[1\]"),
])
def test_bad_config_is_rejected_with_a_fix(bad, match):
    with pytest.raises(ValidationError, match=match):
        NetemConfig.model_validate({"enabled": True, **bad})


def test_fields_are_documented():
    for model in (NetemConfig, LinkSpec):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_modelled_allreduce():
    links = [LinkSpec(latency_ms=10, bandwidth_mbps=100), LinkSpec(latency_ms=40, bandwidth_mbps=50)]
    # 2 * 0.04 + 2 * 3/4 * 8e6 bit / 50e6 bit/s
    assert modelled_allreduce_s(MB, 4, links) == pytest.approx(0.08 + 1.5 * 8 / 50)
    assert modelled_allreduce_s(MB, 1, links) == 0.0
    assert modelled_allreduce_s(MB, 2, [LinkSpec(latency_ms=5)]) == pytest.approx(0.01)
    assert transfer_s(None, MB) == 0.0


def test_message_link_pipelines_latency_and_shares_bandwidth():
    """Back-to-back messages overlap their latency but queue for the bandwidth; an idle link
    starts afresh; no link means no delay."""
    from node.netem import MessageLink

    link = MessageLink(LinkSpec(latency_ms=100, bandwidth_mbps=8))  # 1 MB/s: 1000 B = 1 ms
    first = link.release_at(10.0, 1000)
    second = link.release_at(10.0, 1000)
    assert first == pytest.approx(10.101) and second == pytest.approx(10.102)   # not 10.202
    assert link.release_at(20.0, 2000) == pytest.approx(20.102)                   # idle link
    assert MessageLink(None).release_at(5.0, 10 ** 9) == 5.0
    emu = LinkEmulator(NetemConfig(enabled=True, default=LinkSpec(latency_ms=7)))
    assert emu.message_link("peer").release_at(1.0, 10) == pytest.approx(1.007)
