"""What peer authentication costs (docs/security.md, 'Signed calls'; issue 7): signed vs plain gRPC, side by side.

Run (from the repository root)::

    .venv/bin/python benchmarks/auth_overhead.py --out /tmp/auth.json --quick

A server process (multiprocessing spawn) runs two ``node.grpc_server.GrpcHost`` servers with
the same services: one plain (no guard: ``security.peer_auth = "none"``), one behind the
node's ``CallGuard`` (signed envelopes verified, known-peer check, nonce cache, per-peer rate
and concurrency limits, bans; limits set high so nothing is refused). The client (this
process) talks to both, alternating plain and signed within every repeat so machine load hits
both alike, and measures:

* ``latency``: ``Node.Info`` round trips (p50 / p90 in ms), one call at a time;
* ``fetch``: ``WeightService.Fetch`` of one float32 tensor of 1 and 16 MiB through
  ``node.state_sync.fetch_state`` (codec frames, checksums, finite check), MB/s;
* ``stream``: a burst of 64 MiB of 4 MiB tensors sent client -> server on ONE open
  ``protocol.streams`` TensorStream (the signed request path: every chunk passes the guard's
  byte accounting), server acknowledges the burst; MB/s.

Each figure is the median over repeats (latency: 5 x 100 calls with --quick, 9 x 300 without;
fetches and bursts: 21 with --quick, 41 without; which variant runs first alternates per
repeat). Single transfers take milliseconds, so a few samples would mostly measure the other
processes of a shared machine: the many short, interleaved repeats are what make the ratio
stable. Writes JSON with
``summary.auth_throughput_ratio_16mib`` (signed / plain MB/s of the 16 MiB fetch; target
>= 0.9), ``summary.auth_throughput_ratio_stream_4mib`` (same for the stream; >= 0.9) and
``summary.auth_latency_overhead_ms`` (p50 difference). On a shared machine absolute numbers
swing; the ratios are measured side by side. MB/s = 10^6 bytes of payload per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1024 * 1024
RUN = "bench-auth"
FETCH_SIZES_MIB = (1, 16)
STREAM_MIB, BURST_MIB = 4, 64


def _tensor(mib: int):
    import torch
    g = torch.Generator().manual_seed(mib)
    return torch.randn(mib * MiB // 4, generator=g)


# ----------------------------------------------------------------------------- server process

def _server_main(client_seed: bytes, server_seed: bytes, ports_q) -> None:
    from protocol.grpc_options import tune_allocator
    tune_allocator()
    asyncio.run(_serve(client_seed, server_seed, ports_q))


async def _serve(client_seed: bytes, server_seed: bytes, ports_q) -> None:
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from node.call_guard import CallGuard
    from node.grpc_server import GrpcHost
    from node.known_peers import KnownPeers
    from node.node_service import NodeServicer
    from node.state_sync import StateServicer, StateSnapshot, add_state_service
    from protocol import node_pb2, node_pb2_grpc
    from protocol.streams import TensorStreamService, add_tensor_stream_to_server
    from security.config import LimitsConfig
    from security.keys import peer_id_str
    from security.peer_auth import PeerAuthenticator

    client_id = peer_id_str(Ed25519PrivateKey.from_private_bytes(client_seed))
    server_id = peer_id_str(Ed25519PrivateKey.from_private_bytes(server_seed))
    snaps = {m: StateSnapshot(meta={"round": 1}, weights={"w": _tensor(m)}) for m in FETCH_SIZES_MIB}
    which = {"mib": FETCH_SIZES_MIB[0]}

    async def on_stream(stream):
        n = 0
        async for got in stream:
            if got.name == "end":
                await stream.send("ack", torch.tensor([n], dtype=torch.int64))
                n = 0
                continue
            if got.name == "size":
                which["mib"] = int(got.tensor.item())
                continue
            n += got.tensor.numel() * got.tensor.element_size()

    limits = LimitsConfig(peer_rps=1e6, peer_bytes_per_s=1e12, peer_concurrency=32, service_concurrency=48)
    hosts = []
    for signed in (False, True):
        guard = None
        if signed:
            known = KnownPeers()
            known.add(client_id)
            auth = PeerAuthenticator(run_id=RUN, own_peer_id=server_id, is_known_peer=known.is_known)
            guard = CallGuard(limits, auth)
        host = GrpcHost("127.0.0.1", 0, 64 * MiB, 64, guard=guard)
        info = node_pb2.NodeInfo(peer_id=server_id, run_id=RUN, role="bench")
        host.add(node_pb2_grpc.add_NodeServicer_to_server, NodeServicer(lambda: info, lambda: {}), "swarmnode.Node")
        host.add(add_state_service, StateServicer(RUN, "cfg", lambda: snaps[which["mib"]], max_concurrent=4),
                 "swarmnode.WeightService")
        svc = TensorStreamService(run_id=RUN, peer_id=server_id, max_tensor_bytes=16 * MiB)
        svc.register("bench", on_stream)
        host.add(add_tensor_stream_to_server, svc, "swarmnode.TensorStream")
        host.bind()
        await host.start()
        hosts.append(host)
    ports_q.put({"plain": hosts[0].port, "signed": hosts[1].port, "server_id": server_id})
    await asyncio.Event().wait()


# ----------------------------------------------------------------------------- client

async def _measure(ports: dict, client_seed: bytes, repeats: int, calls: int, transfers: int) -> dict:
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from node.state_sync import fetch_state
    from protocol import node_pb2, node_pb2_grpc
    from protocol.grpc_options import channel_options
    from protocol.streams import ChannelPool, open_stream
    from security.peer_auth import CallSigner, ClientAuth, set_client_auth

    server_id = ports["server_id"]
    signer = CallSigner(Ed25519PrivateKey.from_private_bytes(client_seed), RUN)
    cauth = ClientAuth(signer, lambda addr: server_id)
    addrs = {"plain": f"127.0.0.1:{ports['plain']}", "signed": f"127.0.0.1:{ports['signed']}"}
    pools = {"plain": ChannelPool(64 * MiB, auth=None), "signed": ChannelPool(64 * MiB, auth=cauth)}
    out: dict = {"latency": {k: [] for k in addrs}, "fetch": {m: {k: [] for k in addrs} for m in FETCH_SIZES_MIB},
                 "stream": {k: [] for k in addrs}}

    # per-call latency
    stubs = {k: node_pb2_grpc.NodeStub(pools[k].get(addrs[k])) for k in addrs}
    for k in addrs:  # warm up the channels
        for _ in range(20):
            await stubs[k].Info(node_pb2.InfoRequest(), timeout=10)
    for i in range(repeats):
        for k in _order(i):
            for _ in range(calls):
                t0 = time.perf_counter()
                await stubs[k].Info(node_pb2.InfoRequest(), timeout=10)
                out["latency"][k].append((time.perf_counter() - t0) * 1000)

    # open streams, one per server; the server is told which fetch size to serve over it
    streams = {k: await open_stream(pools[k].get(addrs[k]), run_id=RUN, sender=signer.peer_id,
                                    channel_name="bench", max_tensor_bytes=16 * MiB,
                                    max_message_bytes=64 * MiB) for k in addrs}
    chunk = _tensor(STREAM_MIB)
    n_chunks = BURST_MIB // STREAM_MIB

    async def burst(k):
        s = streams[k]
        for i in range(n_chunks):
            await s.send("x", chunk)
        await s.send("end", torch.zeros(1))
        got = await s.recv(timeout=60)
        assert got.name == "ack" and int(got.tensor.item()) == n_chunks * chunk.numel() * 4, got

    async def fetch(k, mib):
        set_client_auth(cauth if k == "signed" else None)
        try:
            _, tensors = await fetch_state(addrs[k], RUN, signer.peer_id, "cfg",
                                           {"w": (torch.float32, (mib * MiB // 4,))}, timeout=60,
                                           max_message_bytes=64 * MiB, peer_id=server_id if k == "signed" else None)
        finally:
            set_client_auth(None)
        return tensors["w"]

    for mib in FETCH_SIZES_MIB:
        for k in addrs:
            await streams[k].send("size", torch.tensor(mib))
        await asyncio.sleep(0.2)
        for i in range(transfers + 1):  # run 0 warms up and checks the bytes
            for k in _order(i):
                t0 = time.perf_counter()
                w = await fetch(k, mib)
                dt = time.perf_counter() - t0
                if i == 0:
                    assert torch.equal(w, _tensor(mib)), f"{k} fetch payload differs"
                else:
                    out["fetch"][mib][k].append(mib * MiB / dt / 1e6)
    for i in range(transfers + 1):
        for k in _order(i):
            t0 = time.perf_counter()
            await burst(k)
            dt = time.perf_counter() - t0
            if i:
                out["stream"][k].append(BURST_MIB * MiB / dt / 1e6)
    for s in streams.values():
        await s.close()
    for p in pools.values():
        await p.close()
    return out


def _order(i: int) -> tuple[str, str]:
    """Which variant goes first alternates per repeat, so neither always runs on a warmer machine."""
    return ("plain", "signed") if i % 2 == 0 else ("signed", "plain")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (about 20 s instead of 60 s)")
    args = ap.parse_args(argv)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives import serialization

    from protocol.grpc_options import tune_allocator
    tune_allocator()

    def seed():
        return Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                          serialization.NoEncryption())
    client_seed, server_seed = seed(), seed()
    repeats = 5 if args.quick else 9
    calls = 100 if args.quick else 300
    transfers = 21 if args.quick else 41
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(client_seed, server_seed, q), daemon=True)
    server.start()
    try:
        ports = q.get(timeout=120)
        t0 = time.time()
        raw = asyncio.run(_measure(ports, client_seed, repeats, calls, transfers))
    finally:
        server.terminate()
        server.join(10)
    med = statistics.median
    lat = {k: {"p50_ms": round(_pct(v, 0.5), 3), "p90_ms": round(_pct(v, 0.9), 3)} for k, v in raw["latency"].items()}
    fetch = [{"mib": m, "plain_mb_s": round(med(raw["fetch"][m]["plain"]), 1),
              "signed_mb_s": round(med(raw["fetch"][m]["signed"]), 1),
              "ratio": round(med(raw["fetch"][m]["signed"]) / med(raw["fetch"][m]["plain"]), 3),
              "runs": raw["fetch"][m]} for m in FETCH_SIZES_MIB]
    stream = {"tensor_mib": STREAM_MIB, "burst_mib": BURST_MIB, "plain_mb_s": round(med(raw["stream"]["plain"]), 1),
              "signed_mb_s": round(med(raw["stream"]["signed"]), 1),
              "ratio": round(med(raw["stream"]["signed"]) / med(raw["stream"]["plain"]), 3), "runs": raw["stream"]}
    result = {
        "benchmark": "auth_overhead", "quick": args.quick, "repeats": repeats, "calls_per_repeat": calls,
        "transfer_repeats": transfers,
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                 "loadavg": os.getloadavg()},
        "wall_s": round(time.time() - t0, 1),
        "summary": {
            "auth_throughput_ratio_16mib": next(f["ratio"] for f in fetch if f["mib"] == 16),
            "auth_throughput_ratio_stream_4mib": stream["ratio"],
            "auth_latency_overhead_ms": round(lat["signed"]["p50_ms"] - lat["plain"]["p50_ms"], 3),
            "latency_p50_ms": {k: v["p50_ms"] for k, v in lat.items()},
        },
        "latency": lat, "fetch": fetch, "stream": stream,
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"{'':22}{'plain':>12}{'signed':>12}{'ratio':>8}")
    print(f"{'Info p50 (ms)':22}{lat['plain']['p50_ms']:>12.3f}{lat['signed']['p50_ms']:>12.3f}")
    for f in fetch:
        print(f"{'fetch %d MiB (MB/s)' % f['mib']:22}{f['plain_mb_s']:>12.1f}{f['signed_mb_s']:>12.1f}{f['ratio']:>8.3f}")
    print(f"{'stream 4 MiB (MB/s)':22}{stream['plain_mb_s']:>12.1f}{stream['signed_mb_s']:>12.1f}{stream['ratio']:>8.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
