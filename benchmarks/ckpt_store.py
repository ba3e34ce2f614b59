"""An off-node checkpoint store for benchmarks/checkfree.py: a separate process that keeps blobs
on its own disk, reached over an emulated link (node/netem.py pacing, both directions).

A spot node's local disk dies with the node, so a checkpoint that can restore a lost stage lives
somewhere else: object storage or a peer. This is the smallest honest stand-in: a real process
on 127.0.0.1, real bytes over a TCP socket, each direction paced to the link's bandwidth by its
sender, and a put is acknowledged only after the blob is fsynced and renamed into place.

    python -m benchmarks.ckpt_store DIR BANDWIDTH_MBPS      # prints "port N", serves until killed

Wire (one request per connection): a JSON header line, then the payload bytes.
  put: ``{"op": "put", "key": K, "size": N}`` + N bytes   ->  ``ok\\n`` once durable
  get: ``{"op": "get", "key": K}``                         ->  ``{"size": N}\\n`` + N bytes
Keys are plain names (``[A-Za-z0-9_.-]``); sizes are capped (``MAX_BLOB``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from node.netem import LinkEmulator, LinkSpec, NetemConfig, transfer_s

CHUNK = 64 * 1024
MAX_BLOB = 1 << 30
_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def link(mbps: float) -> LinkSpec:
    """The store's link for pacing: bandwidth only (the benchmark adds the latency itself,
    unscaled, since a link's latency does not grow with the model)."""
    return LinkSpec(latency_ms=0, bandwidth_mbps=mbps)


# ------------------------------------------------------------------------------ server

async def _serve(root: Path, mbps: float) -> None:
    emu = LinkEmulator(NetemConfig(enabled=True, default=link(mbps)))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = json.loads(await reader.readline())
            key = str(head.get("key", ""))
            if not _KEY.match(key):
                writer.write(b'{"error": "bad key"}\n')
                return
            if head.get("op") == "put":
                size = int(head["size"])
                if not 0 <= size <= MAX_BLOB:
                    writer.write(b'{"error": "bad size"}\n')
                    return
                data = await reader.readexactly(size)
                tmp = root / f".{key}.tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, root / key)
                writer.write(b"ok\n")
            elif head.get("op") == "get":
                data = (root / key).read_bytes()
                writer.write(json.dumps({"size": len(data)}).encode() + b"\n")
                pace = emu.pacer("client")
                for i in range(0, len(data), CHUNK):
                    await pace(len(data[i:i + CHUNK]))
                    writer.write(data[i:i + CHUNK])
                    await writer.drain()
            await writer.drain()
        except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as exc:
            print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    root.mkdir(parents=True, exist_ok=True)
    asyncio.run(_serve(root, float(argv[1])))
    return 0


# ------------------------------------------------------------------------------ client

class StoreClient:
    """Blocking client (the benchmark's training loop is synchronous); sends paced like the store."""

    def __init__(self, port: int, mbps: float):
        self.port, self.link = port, link(mbps)

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=120)

    def put(self, key: str, data: bytes) -> None:
        with self._connect() as s:
            s.sendall(json.dumps({"op": "put", "key": key, "size": len(data)}).encode() + b"\n")
            start, sent = time.monotonic(), 0
            for i in range(0, len(data), CHUNK):
                chunk = data[i:i + CHUNK]
                sent += len(chunk)
                wait = start + transfer_s(self.link, sent, first=False) - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                s.sendall(chunk)
            reply = s.makefile("rb").readline()
        if reply != b"ok\n":
            raise RuntimeError(f"checkpoint store refused {key!r}: {reply[:200]!r}")

    def get(self, key: str) -> bytes:
        with self._connect() as s:
            s.sendall(json.dumps({"op": "get", "key": key}).encode() + b"\n")
            f = s.makefile("rb")
            head = json.loads(f.readline())
            if "size" not in head:
                raise RuntimeError(f"checkpoint store has no {key!r}: {head}")
            data = f.read(int(head["size"]))
        if len(data) != head["size"]:
            raise RuntimeError(f"checkpoint store sent {len(data)} of {head['size']} bytes of {key!r}")
        return data


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
