"""gRPC channel and server options shared by every swarmnode service.

Owns: explicit, symmetric message-size caps (``grpc.max_message_bytes``, 8 MiB default),
keepalive settings that clients and servers agree on (a server that sees pings more often
than it allows answers GOAWAY), and HTTP/2 / TCP settings that help 1-4 MiB tensor chunks
stream fast (``benchmarks/transport.py`` measures them).

    server_options(max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, ...) -> list[tuple[str, int]]
    channel_options(max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, ...) -> list[tuple[str, int]]
    tune_allocator() -> bool      # once per process, at start: keep freed 1-32 MiB buffers
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MiB = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 8 * MiB
MAX_CHUNK_BYTES = 4 * MiB  # = protocol.codec.MAX_CHUNK_BYTES (not imported: the codec pulls in torch)

CLIENT_KEEPALIVE_TIME_MS = 30_000
CLIENT_KEEPALIVE_TIMEOUT_MS = 10_000
#: Servers must accept pings at least as often as clients send them, or they send GOAWAY.
SERVER_MIN_PING_INTERVAL_MS = 20_000

#: Throughput settings for large streams: bigger HTTP/2 frames and write buffers mean fewer
#: syscalls and wakeups per 4 MiB chunk; large TCP reads let one read take a whole frame.
_STREAMING = [
    ("grpc.http2.bdp_probe", 1),                       # let the flow-control window grow
    ("grpc.http2.lookahead_bytes", 16 * MiB),          # initial per-stream window hint
    ("grpc.http2.max_frame_size", 16 * MiB - 1),       # HTTP/2 maximum
    ("grpc.http2.write_buffer_size", 8 * MiB),
    ("grpc.experimental.tcp_read_chunk_size", 4 * MiB),
    ("grpc.experimental.tcp_min_read_chunk_size", 256 * 1024),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 * MiB),
]


def _check(max_message_bytes: int) -> int:
    if not isinstance(max_message_bytes, int) or max_message_bytes < MAX_CHUNK_BYTES + 4096:
        raise ValueError(f"grpc.max_message_bytes={max_message_bytes!r} must be an int above the "
                         f"largest chunk ({MAX_CHUNK_BYTES} bytes plus framing); stream large "
                         "payloads instead of lowering chunks below 1 MiB")
    return max_message_bytes


def _sizes(max_message_bytes: int) -> list[tuple[str, int]]:
    n = _check(max_message_bytes)
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                   min_ping_interval_ms: int = SERVER_MIN_PING_INTERVAL_MS,
                   streaming: bool = True) -> list[tuple[str, int]]:
    """Options for ``grpc.aio.server(options=...)``; pass ``grpc.max_message_bytes`` here."""
    if min_ping_interval_ms > CLIENT_KEEPALIVE_TIME_MS:
        raise ValueError(f"min_ping_interval_ms={min_ping_interval_ms} is above the clients' "
                         f"keepalive_time_ms={CLIENT_KEEPALIVE_TIME_MS}: servers would answer "
                         "keepalive pings with GOAWAY; keep it at or below 30000")
    opts = _sizes(max_message_bytes) + [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    return opts + (_STREAMING if streaming else [])


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                    keepalive_time_ms: int = CLIENT_KEEPALIVE_TIME_MS,
                    keepalive_timeout_ms: int = CLIENT_KEEPALIVE_TIMEOUT_MS,
                    streaming: bool = True) -> list[tuple[str, int]]:
    """Options for ``grpc.aio.insecure_channel``/``secure_channel``; symmetric with servers."""
    if keepalive_time_ms < SERVER_MIN_PING_INTERVAL_MS:
        raise ValueError(f"keepalive_time_ms={keepalive_time_ms} is below the servers' "
                         f"min_ping_interval ({SERVER_MIN_PING_INTERVAL_MS} ms): they would send GOAWAY")
    opts = _sizes(max_message_bytes) + [
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    return opts + (_STREAMING if streaming else [])


#: glibc ``mallopt`` parameters (malloc.h) and the values ``tune_allocator`` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
ALLOC_MMAP_THRESHOLD = 32 * MiB    # buffers below this come from the heap (reused, no page faults)
ALLOC_TRIM_THRESHOLD = 128 * MiB   # free heap kept for reuse before it goes back to the kernel
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Make glibc keep freed 1-32 MiB buffers for reuse instead of returning them to the kernel.

    Every tensor on a stream allocates fresh multi-MiB buffers (our frame, gRPC's copy of it, the
    receiver's tensor). With glibc's defaults (dynamic mmap threshold, trim at 2x it) those often
    come straight from the kernel as fresh pages, and the page faults cost more than the
    transport: measured here, an open stream of 1-4 MiB tensors ran at 0.45-0.8 GB/s untuned and
    1.2-1.6 GB/s tuned, raw gRPC streaming 1.3 -> 1.8-2.3 GB/s, the 256 MiB fetch 0.9 -> 1.3 GB/s
    (``benchmarks/transport.py --malloc default`` vs the default ``tuned``). Cost: up to
    ``ALLOC_TRIM_THRESHOLD`` of freed memory stays mapped in the process.

    Call once per process, at start (the node daemon, benchmark processes); process-wide, so it
    is never done on import. Idempotent; returns False (and changes nothing) off glibc or when
    ``SWARMNODE_MALLOC=default`` is set (use that to compare, or if resident memory matters more
    than stream throughput). An explicit ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``
    in the environment wins as well.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if (not sys.platform.startswith("linux") or os.environ.get("SWARMNODE_MALLOC", "tuned") == "default"
            or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and friends: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, ALLOC_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                      ALLOC_TRIM_THRESHOLD))
    return _tuned
