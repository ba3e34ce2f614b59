"""The ops port under 1000 idle connections (issue 33, finding 6; docs/security.md, 'The ops port').

A real bootstrap node on 127.0.0.1 with ``ops.max_connections = 64`` and an idle timeout longer
than the test. This process opens 1000 TCP connections to its ops port and sends nothing. Measured
in the node's process (``/proc/<pid>``): its thread count stays where it was (one ops thread,
not one per connection), its open sockets grow by at most the cap, and ``/metrics`` and
``/readyz`` still answer while the idle connections are open. Every connection past the cap was
closed by the node (``swarmnode_ops_connections_closed_total{reason="evicted"}``).
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import pytest

from node.localswarm import LocalSwarm, parse_metrics
from tests.integration.hostile import rss_bytes, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CAP = 64
IDLE = 1000


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


def sockets(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def get(port: int, path: str) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read(), time.monotonic() - t0
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - t0


def test_idle_connections_are_bounded(tmp_path):
    with LocalSwarm(run_id="ops-it", workdir=tmp_path,
                    common_set=[f"ops.max_connections={CAP}", "ops.idle_timeout_s=120"]) as sw:
        node = sw.start("bootstrap")
        sw.wait_ready([node], timeout=90)
        assert get(node.ops_port, "/metrics")[0] == 200
        threads0, socks0, rss0 = threads(node.pid), sockets(node.pid), rss_bytes(node.pid)
        idle: list[socket.socket] = []
        try:
            for _ in range(IDLE):
                idle.append(socket.create_connection(("127.0.0.1", node.ops_port), timeout=5))
            # the node accepts every one and closes all but the newest CAP: wait until its socket count
            # stops moving (the accept backlog drained), then measure
            seen = [sockets(node.pid)]

            def settled() -> bool:
                seen.append(sockets(node.pid))
                return len(seen) > 3 and seen[-1] == seen[-2] == seen[-3]
            wait_for(settled, 30, "the node's socket count to settle", poll=1.0)
            peak_threads, peak_socks = threads(node.pid), sockets(node.pid)
            print(f"\nafter {IDLE} idle connections: threads {threads0} -> {peak_threads}, "
                  f"sockets {socks0} -> {peak_socks}")
            assert peak_threads <= threads0 + 2, (threads0, peak_threads)
            assert peak_socks - socks0 <= CAP, (socks0, peak_socks)
            code_m, body, dt_m = get(node.ops_port, "/metrics")
            code_r, _, dt_r = get(node.ops_port, "/readyz")
            rss1 = rss_bytes(node.pid)
            m = parse_metrics(body.decode())
            print(f"\nops port, {IDLE} idle connections, cap {CAP}: threads {threads0} -> {peak_threads}, "
                  f"sockets {socks0} -> {peak_socks}, RSS +{(rss1 - rss0) / 2**20:.1f} MiB, "
                  f"/metrics {dt_m * 1000:.0f} ms, /readyz {dt_r * 1000:.0f} ms, open {m['swarmnode_ops_connections']:.0f}")
            assert code_m == 200 and code_r == 200, (code_m, code_r)
            assert m["swarmnode_ops_connections"] <= CAP
            assert m['swarmnode_ops_connections_closed_total{reason="evicted"}'] >= IDLE - CAP
            assert dt_m < 3 and dt_r < 3, (dt_m, dt_r)
        finally:
            for s in idle:
                s.close()
        # the idle sockets' own close reaches the node; nothing stays behind
        wait_for(lambda: sockets(node.pid) <= socks0 + 1, 30, "the ops connections to be released")
        assert node.alive()
