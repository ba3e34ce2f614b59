"""Transport benchmark: the tensor codec over gRPC vs a plain TCP socket, side by side.

Run (from the repository root)::

    . .venv/bin/activate
    python benchmarks/transport.py --out /tmp/transport.json --quick

Measures, for 1, 16 and 256 MiB float32 tensors on 127.0.0.1:

(a) ``WeightService.Fetch`` server streaming with ``protocol.codec`` (xxh3_128 checksum on,
    receiver verifying, 4 MiB chunks) and ``protocol.grpc_options`` on both ends; the server
    runs in its own process (multiprocessing spawn), the client in this one;
(b) a plain TCP socket pair (also two processes) moving the same bytes: ``sendall`` of the
    tensor's memory, ``recv_into`` a buffer preallocated per transfer (as the codec
    preallocates a fresh tensor per transfer), no checksum.

gRPC and socket transfers alternate within each repeat, so machine load hits both alike;
on a shared 2-core box absolute numbers still swing by 2x between runs (loadavg is
recorded in the JSON).

Each size is repeated (3x with --quick, 7x without) and the median kept. Writes JSON with a
top-level ``summary`` (MB/s and gRPC/socket ratios) and a per-size ``results`` list; prints a
table. MB/s = 10^6 bytes per second of payload, timed from request to verified tensor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20
SIZES_MIB = (1, 16, 256)


def _tensor(size_mib: int):
    import torch
    g = torch.Generator().manual_seed(size_mib)
    return torch.rand(size_mib * MiB // 4, generator=g, dtype=torch.float32)


# ----------------------------------------------------------------------------- gRPC side

def _grpc_server_main(port_q, stop_ev, sizes, chunk_bytes):
    asyncio.run(_grpc_server(port_q, stop_ev, sizes, chunk_bytes))


async def _grpc_server(port_q, stop_ev, sizes, chunk_bytes):
    import grpc
    from protocol import weights_pb2
    from protocol.codec import aencode_tensors, serialize_frame
    from protocol.grpc_options import server_options

    tensors = {f"t{s}": _tensor(s) for s in sizes}

    async def fetch(request, context):  # want = tensor name (benchmark convention)
        async for frame in aencode_tensors({request.want: tensors[request.want]}, chunk_bytes, wire=True):
            yield frame

    # WeightService.Fetch registered with the codec's wire serializer (pre-serialized frames)
    handler = grpc.method_handlers_generic_handler("swarmnode.WeightService", {
        "Fetch": grpc.unary_stream_rpc_method_handler(
            fetch, request_deserializer=weights_pb2.FetchRequest.FromString,
            response_serializer=serialize_frame)})
    server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    while not stop_ev.is_set():
        await asyncio.sleep(0.1)
    await server.stop(0)


# ----------------------------------------------------------------------------- socket side

def _sock_server_main(port_q, sizes):
    bufs = {s: memoryview(_tensor(s).numpy()).cast("B") for s in sizes}
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            req = conn.recv(8, socket.MSG_WAITALL)
            if len(req) < 8:
                return
            (s,) = struct.unpack("<Q", req)
            conn.sendall(bufs[s])


def _socket_fetch(c, s, np):
    c.sendall(struct.pack("<Q", s))
    buf = np.empty(s * MiB, dtype=np.uint8)  # preallocated per transfer, like the codec's buffer
    mv, got = memoryview(buf), 0
    while got < buf.nbytes:
        n = c.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("socket server closed early")
        got += n
    return buf


# ----------------------------------------------------------------------------- driver

async def _measure(grpc_port, sock_port, sizes, repeats):
    """Alternate gRPC and socket transfers per repeat so load changes hit both alike."""
    import grpc
    import numpy as np
    import torch
    from protocol import weights_pb2
    from protocol.codec import adecode_tensors, parse_frame
    from protocol.grpc_options import channel_options

    out = {s: {"grpc": [], "socket": []} for s in sizes}
    sock = socket.create_connection(("127.0.0.1", sock_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=channel_options()) as ch:
        fetch = ch.unary_stream("/swarmnode.WeightService/Fetch",
                                request_serializer=weights_pb2.FetchRequest.SerializeToString,
                                response_deserializer=parse_frame)  # zero-copy chunk views
        for s in sizes:
            expect = _tensor(s)
            for i in range(repeats + 1):  # run 0 warms connections and allocators, and checks bytes
                t0 = time.perf_counter()
                call = fetch(weights_pb2.FetchRequest(run_id="bench", want=f"t{s}"), timeout=120)
                got = [t async for _, t in adecode_tensors(call, max_tensor_bytes=s * MiB)]
                t1 = time.perf_counter()
                buf = _socket_fetch(sock, s, np)
                t2 = time.perf_counter()
                if i == 0:
                    assert len(got) == 1 and torch.equal(got[0], expect), "gRPC payload differs"
                    assert np.array_equal(buf, expect.numpy().view(np.uint8)), "socket payload differs"
                else:
                    out[s]["grpc"].append(t1 - t0)
                    out[s]["socket"].append(t2 - t1)
                del got, buf
    sock.close()
    return out


def run(sizes, repeats, chunk_bytes=None):
    from protocol.codec import DEFAULT_CHUNK_BYTES
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    ctx = mp.get_context("spawn")
    gq, sq, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_grpc_server_main, args=(gq, stop_ev, sizes, chunk_bytes), daemon=True),
             ctx.Process(target=_sock_server_main, args=(sq, sizes), daemon=True)]
    for p in procs:
        p.start()
    try:
        return asyncio.run(_measure(gq.get(timeout=120), sq.get(timeout=120), sizes, repeats))
    finally:
        stop_ev.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------- main

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--quick", action="store_true", help="3 repeats per size instead of 7")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 7
    sizes = list(SIZES_MIB)

    t0 = time.time()
    times = run(sizes, repeats)

    results, summary = [], {}
    for s in sizes:
        nbytes = s * MiB
        g, k = statistics.median(times[s]["grpc"]), statistics.median(times[s]["socket"])
        g_mbs, k_mbs = nbytes / g / 1e6, nbytes / k / 1e6
        results.append({"size_mib": s, "bytes": nbytes, "repeats": repeats,
                        "grpc_codec_s": times[s]["grpc"], "socket_s": times[s]["socket"],
                        "grpc_codec_median_s": g, "socket_median_s": k,
                        "grpc_codec_mb_s": round(g_mbs, 1), "socket_mb_s": round(k_mbs, 1),
                        "grpc_vs_socket_throughput_ratio": round(g_mbs / k_mbs, 3)})
        summary[f"grpc_vs_socket_throughput_ratio_{s}mib"] = round(g_mbs / k_mbs, 3)
        summary[f"grpc_codec_mb_s_{s}mib"] = round(g_mbs, 1)
        summary[f"socket_mb_s_{s}mib"] = round(k_mbs, 1)
    from protocol.codec import CHECKSUM_ALG, DEFAULT_CHUNK_BYTES
    import grpc
    import torch
    doc = {"benchmark": "transport", "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
           "quick": args.quick, "summary": summary, "results": results,
           "config": {"chunk_bytes": DEFAULT_CHUNK_BYTES, "checksum_alg": CHECKSUM_ALG,
                      "dtype": "float32", "host": "127.0.0.1", "processes": "server and client separate",
                      "grpc": grpc.__version__, "torch": torch.__version__,
                      "python": platform.python_version(), "cpus": os.cpu_count(),
                      "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                      "socket_receiver": "fresh np.empty per transfer (the codec allocates a fresh tensor too)"},
           "wall_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(doc, indent=2))

    print(f"{'size':>8} {'gRPC+codec MB/s':>16} {'socket MB/s':>12} {'ratio':>6}")
    for r in results:
        print(f"{r['size_mib']:>5}MiB {r['grpc_codec_mb_s']:>16.1f} {r['socket_mb_s']:>12.1f} "
              f"{r['grpc_vs_socket_throughput_ratio']:>6.3f}")
    print(f"wrote {args.out} in {doc['wall_s']} s")
    return doc


if __name__ == "__main__":
    main()
