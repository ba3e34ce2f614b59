"""Transport benchmark: the tensor codec over gRPC vs a plain TCP socket, side by side.

Run (from the repository root)::

    . .venv/bin/activate
    python benchmarks/transport.py --out /tmp/transport.json --quick

Measures, for 1, 16 and 256 MiB float32 tensors on 127.0.0.1:

(a) ``WeightService.Fetch`` server streaming as state downloads do it: ``protocol.stream_wire``
    frames (xxh3_128 digest trailer, receiver verifying, 4 MiB chunks) and ``protocol.grpc_options`` on both ends; the server
    runs in its own process (multiprocessing spawn), the client in this one;
(b) a plain TCP socket pair (also two processes) moving the same bytes: ``sendall`` of the
    tensor's memory, ``recv_into`` a buffer preallocated per transfer (as the codec
    preallocates a fresh tensor per transfer), no checksum.

(c) stream mode: 1 and 4 MiB tensors back to back (64 MiB per burst) on ONE open
    ``protocol.streams`` TensorStream (codec, digest trailer, flow control), side by side with
    raw gRPC streaming of the same bytes (bytes in/out, no codec: gRPC Python's ceiling) and
    the socket; plus one-tensor (1 MiB) hop latency p50/p99 = half an echo round trip.

Every process calls ``protocol.grpc_options.tune_allocator()`` first (as the node should at
start; ``--malloc default`` skips it, to see what it buys: about 2x on the stream here).
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
STREAM_SIZES_MIB = (1, 4)
BURST_MIB = 64            # bytes per back-to-back burst (64 x 1 MiB, 16 x 4 MiB)
ECHO_MIB = 1              # hop latency: one 1 MiB tensor out and back


def _tensor(size_mib: int):
    import torch
    g = torch.Generator().manual_seed(size_mib)
    return torch.rand(size_mib * MiB // 4, generator=g, dtype=torch.float32)


# ----------------------------------------------------------------------------- gRPC side

def _tune(malloc: str) -> bool:
    from protocol.grpc_options import tune_allocator
    if malloc == "default":
        os.environ["SWARMNODE_MALLOC"] = "default"
    return tune_allocator()


def _grpc_server_main(port_q, stop_ev, sizes, chunk_bytes, malloc):
    _tune(malloc)
    asyncio.run(_grpc_server(port_q, stop_ev, sizes, chunk_bytes))


async def _grpc_server(port_q, stop_ev, sizes, chunk_bytes):
    import grpc
    from protocol import weights_pb2
    from protocol.grpc_options import server_options
    from protocol.stream_wire import tensor_frames

    tensors = {f"t{s}": _tensor(s) for s in sizes}

    async def fetch(request, context):  # want = tensor name (benchmark convention)
        for frame in tensor_frames(0, request.want, tensors[request.want], chunk_bytes=chunk_bytes):
            yield frame

    # WeightService.Fetch as node/state_sync registers it (frames pass as bytes)
    handler = grpc.method_handlers_generic_handler("swarmnode.WeightService", {
        "Fetch": grpc.unary_stream_rpc_method_handler(
            fetch, request_deserializer=weights_pb2.FetchRequest.FromString)})
    server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers((handler, _raw_handler(grpc)))
    _add_stream_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    while not stop_ev.is_set():
        await asyncio.sleep(0.1)
    await server.stop(0)


# ----------------------------------------------------------------------------- open-stream side
# One open TensorStream (protocol/streams.py, codec + digest trailer + flow control) and raw gRPC
# streaming of the same bytes (bytes in, bytes out, no codec: gRPC Python's own ceiling), both on
# the server above. Requests: a small control tensor / message "burst <mib> <n>" makes the server
# send n tensors back to back; "echo" returns the payload (hop latency).

def _raw_handler(grpc):
    payloads = {s: _tensor(s).numpy().tobytes() for s in STREAM_SIZES_MIB}

    async def raw(request_iterator, context):
        async for req in request_iterator:
            if req.startswith(b"burst "):
                _, mib, n = req.split()
                data = payloads[int(mib)]
                for _ in range(int(n)):
                    await context.write(data)
            else:  # echo
                await context.write(req)

    return grpc.method_handlers_generic_handler("bench.Raw", {
        "Stream": grpc.stream_stream_rpc_method_handler(raw)})


def _add_stream_service(server):
    from protocol.streams import TensorStreamService, add_tensor_stream_to_server
    tensors = {s: _tensor(s) for s in STREAM_SIZES_MIB}

    async def on_stream(stream):
        async for got in stream:
            if got.meta.get("op") == "burst":
                t = tensors[int(got.meta["mib"])]
                for i in range(int(got.meta["n"])):
                    await stream.send("t", t, {"i": str(i), "path": "0", "hop": "1"})
            else:  # echo
                await stream.send(got.name, got.tensor, got.meta)

    svc = TensorStreamService(run_id="bench", peer_id="server", max_tensor_bytes=16 * MiB)
    svc.register("bench", on_stream)
    add_tensor_stream_to_server(svc, server)


# ----------------------------------------------------------------------------- socket side

def _sock_server_main(port_q, sizes, malloc):
    """Requests are (op, MiB, n) as three little-endian u64: op 0 = send one tensor of that
    size (fetch), 1 = send n back to back (burst), 2 = read one that size and send it back."""
    _tune(malloc)
    bufs = {s: memoryview(_tensor(s).numpy()).cast("B") for s in set(sizes) | set(STREAM_SIZES_MIB)}
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            req = conn.recv(24, socket.MSG_WAITALL)
            if len(req) < 24:
                return
            op, s, n = struct.unpack("<QQQ", req)
            if op == 2:
                buf = bytearray(s * MiB)
                _recv_exact(conn, memoryview(buf))
                conn.sendall(buf)
            else:
                for _ in range(n if op == 1 else 1):
                    conn.sendall(bufs[s])


def _recv_exact(c, mv):
    got = 0
    while got < len(mv):
        n = c.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("socket peer closed early")
        got += n


def _socket_fetch(c, s, np):
    c.sendall(struct.pack("<QQQ", 0, s, 1))
    buf = np.empty(s * MiB, dtype=np.uint8)  # preallocated per transfer, like the codec's buffer
    _recv_exact(c, memoryview(buf))
    return buf


# ----------------------------------------------------------------------------- driver

async def _measure(grpc_port, sock_port, sizes, repeats, stream_repeats, echo_n):
    """Alternate gRPC and socket transfers per repeat so load changes hit both alike."""
    import grpc
    import numpy as np
    import torch
    from protocol import weights_pb2
    from protocol.grpc_options import channel_options
    from protocol.stream_wire import StreamAssembler, parse

    out = {s: {"grpc": [], "socket": []} for s in sizes}
    sock = socket.create_connection(("127.0.0.1", sock_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=channel_options()) as ch:
        fetch = ch.unary_stream("/swarmnode.WeightService/Fetch",
                                request_serializer=weights_pb2.FetchRequest.SerializeToString)
        for s in sizes:
            expect = _tensor(s)
            for i in range(repeats + 1):  # run 0 warms connections and allocators, and checks bytes
                t0 = time.perf_counter()
                call = fetch(weights_pb2.FetchRequest(run_id="bench", want=f"t{s}"), timeout=120)
                asm = StreamAssembler(s * MiB, "limits.max_state_bytes")
                got = [r.tensor async for data in call if (r := asm.feed(parse(data))) is not None]
                asm.finish()
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
        streams = await _measure_streams(ch, sock, stream_repeats, echo_n)
    sock.close()
    return out, streams


async def _measure_streams(ch, sock, repeats, echo_n):
    """Back-to-back bursts on ONE open stream each (codec stream, raw gRPC, socket), alternating
    per repeat; then echo round trips of one tensor (hop = half the round trip)."""
    import numpy as np
    import torch
    from protocol.streams import open_stream

    stream = await open_stream(ch, run_id="bench", sender="client", channel_name="bench",
                               max_tensor_bytes=16 * MiB)
    raw = ch.stream_stream("/bench.Raw/Stream")()  # bytes in, bytes out
    out = {s: {"stream": [], "raw_grpc": [], "socket": []} for s in STREAM_SIZES_MIB}
    ctrl = torch.zeros(1, dtype=torch.uint8)

    async def burst_stream(s, n):
        await stream.send("req", ctrl, {"op": "burst", "mib": str(s), "n": str(n)})
        last = None
        for i in range(n):
            last = await stream.recv(timeout=60)
            assert last.meta["i"] == str(i), "stream reordered tensors"
        return last.tensor

    async def burst_raw(s, n):
        await raw.write(f"burst {s} {n}".encode())
        for _ in range(n):
            data = await raw.read()
            assert len(data) == s * MiB

    def burst_socket(s, n):
        sock.sendall(struct.pack("<QQQ", 1, s, n))
        for _ in range(n):
            buf = np.empty(s * MiB, dtype=np.uint8)  # a fresh buffer per tensor, as the stream allocates
            _recv_exact(sock, memoryview(buf))
        return buf

    for s in STREAM_SIZES_MIB:
        n = BURST_MIB // s
        for i in range(repeats + 1):  # run 0 warms up and checks the bytes
            t0 = time.perf_counter()
            last = await burst_stream(s, n)
            t1 = time.perf_counter()
            await burst_raw(s, n)
            t2 = time.perf_counter()
            buf = burst_socket(s, n)
            t3 = time.perf_counter()
            if i == 0:
                expect = _tensor(s)
                assert torch.equal(last, expect), "stream payload differs"
                assert np.array_equal(buf, expect.numpy().view(np.uint8)), "socket payload differs"
            else:
                out[s]["stream"].append(t1 - t0)
                out[s]["raw_grpc"].append(t2 - t1)
                out[s]["socket"].append(t3 - t2)

    echo = _tensor(ECHO_MIB)
    echo_bytes = echo.numpy().tobytes()
    hops = {"stream": [], "raw_grpc": [], "socket": []}
    back = bytearray(ECHO_MIB * MiB)
    for i in range(echo_n + 5):  # 5 warm-up round trips
        t0 = time.perf_counter()
        await stream.send("x", echo, {"op": "echo", "mb": str(i), "path": "0", "hop": "0"})
        got = await stream.recv(timeout=60)
        t1 = time.perf_counter()
        await raw.write(echo_bytes)
        await raw.read()
        t2 = time.perf_counter()
        sock.sendall(struct.pack("<QQQ", 2, ECHO_MIB, 1))
        sock.sendall(echo_bytes)
        _recv_exact(sock, memoryview(back))
        t3 = time.perf_counter()
        assert got.meta["mb"] == str(i)
        if i >= 5:
            hops["stream"].append((t1 - t0) / 2)
            hops["raw_grpc"].append((t2 - t1) / 2)
            hops["socket"].append((t3 - t2) / 2)
    await raw.done_writing()
    await stream.close()
    return {"bursts": out, "hops": hops}


def run(sizes, repeats, stream_repeats=9, echo_n=100, chunk_bytes=None, malloc="tuned"):
    from protocol.codec import DEFAULT_CHUNK_BYTES
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    _tune(malloc)
    ctx = mp.get_context("spawn")
    gq, sq, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_grpc_server_main, args=(gq, stop_ev, sizes, chunk_bytes, malloc), daemon=True),
             ctx.Process(target=_sock_server_main, args=(sq, sizes, malloc), daemon=True)]
    for p in procs:
        p.start()
    try:
        return asyncio.run(_measure(gq.get(timeout=120), sq.get(timeout=120), sizes, repeats, stream_repeats, echo_n))
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
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)),
                    help="fetch sizes in MiB, comma-separated (the summary's 256 MiB ratio needs 256)")
    ap.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                    help="tuned: every process calls protocol.grpc_options.tune_allocator() as the node "
                         "daemon does; default: glibc's own settings (to see what the tuning buys)")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 7
    sizes = [int(x) for x in args.sizes.split(",") if x]

    t0 = time.time()
    stream_repeats = 9 if args.quick else 21
    times, streams = run(sizes, repeats, stream_repeats, echo_n=100 if args.quick else 300, malloc=args.malloc)

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
    stream_results = []
    for s in STREAM_SIZES_MIB:
        b = streams["bursts"][s]
        n = BURST_MIB // s
        mbs = {k: n * s * MiB / statistics.median(v) / 1e6 for k, v in b.items()}
        row = {"size_mib": s, "tensors_per_burst": n, "repeats": stream_repeats,
               **{f"{k}_s": v for k, v in b.items()}, **{f"{k}_mb_s": round(v, 1) for k, v in mbs.items()},
               "stream_vs_raw_grpc_ratio": round(mbs["stream"] / mbs["raw_grpc"], 3),
               "stream_vs_socket_throughput_ratio": round(mbs["stream"] / mbs["socket"], 3)}
        stream_results.append(row)
        summary[f"stream_vs_raw_grpc_ratio_{s}mib"] = row["stream_vs_raw_grpc_ratio"]
        summary[f"stream_vs_socket_throughput_ratio_{s}mib"] = row["stream_vs_socket_throughput_ratio"]
        summary[f"stream_mb_s_{s}mib"] = row["stream_mb_s"]
        summary[f"raw_grpc_stream_mb_s_{s}mib"] = row["raw_grpc_mb_s"]
        summary[f"socket_burst_mb_s_{s}mib"] = row["socket_mb_s"]
    hop = {}
    for k, v in streams["hops"].items():
        q = statistics.quantiles(v, n=100, method="inclusive")
        hop[k] = {"p50_ms": round(statistics.median(v) * 1e3, 3), "p99_ms": round(q[98] * 1e3, 3), "n": len(v)}
        summary[f"{k}_hop_p50_ms_{ECHO_MIB}mib"] = hop[k]["p50_ms"]
        summary[f"{k}_hop_p99_ms_{ECHO_MIB}mib"] = hop[k]["p99_ms"]
    from protocol.codec import CHECKSUM_ALG, DEFAULT_CHUNK_BYTES
    import grpc
    import torch
    doc = {"benchmark": "transport", "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
           "quick": args.quick, "summary": summary, "results": results,
           "stream_results": stream_results, "hop_latency": {"tensor_mib": ECHO_MIB, **hop},
           "config": {"chunk_bytes": DEFAULT_CHUNK_BYTES, "checksum_alg": CHECKSUM_ALG,
                      "dtype": "float32", "host": "127.0.0.1", "processes": "server and client separate",
                      "grpc": grpc.__version__, "torch": torch.__version__,
                      "python": platform.python_version(), "cpus": os.cpu_count(),
                      "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                      "malloc": args.malloc,
                      "socket_receiver": "fresh np.empty per transfer (the codec allocates a fresh tensor too)"},
           "wall_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(doc, indent=2))

    print(f"{'size':>8} {'gRPC+codec MB/s':>16} {'socket MB/s':>12} {'ratio':>6}")
    for r in results:
        print(f"{r['size_mib']:>5}MiB {r['grpc_codec_mb_s']:>16.1f} {r['socket_mb_s']:>12.1f} "
              f"{r['grpc_vs_socket_throughput_ratio']:>6.3f}")
    print(f"{'open stream':>11} {'codec MB/s':>11} {'raw gRPC':>9} {'socket':>8} {'vs raw':>7} {'vs socket':>9}")
    for r in stream_results:
        print(f"{r['size_mib']:>8}MiB {r['stream_mb_s']:>11.1f} {r['raw_grpc_mb_s']:>9.1f} {r['socket_mb_s']:>8.1f} "
              f"{r['stream_vs_raw_grpc_ratio']:>7.3f} {r['stream_vs_socket_throughput_ratio']:>9.3f}")
    for k, v in hop.items():
        print(f"hop {ECHO_MIB} MiB {k:>9}: p50 {v['p50_ms']:.3f} ms  p99 {v['p99_ms']:.3f} ms")
    print(f"wrote {args.out} in {doc['wall_s']} s")
    return doc


if __name__ == "__main__":
    main()
