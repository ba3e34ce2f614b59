"""Start-up order (docs/architecture.md, 'Node lifecycle'): hivemind forks its DHT process before any CUDA call.

Runs on CPU (no GPU needed): a real noloco ``Node`` is built, ``prepare()``-d (which forks the
real hivemind DHT) and ``run()`` in a child process whose ``torch.cuda`` probes are recorded
(``node.device.cuda_calls_recorded``). No probe may precede the DHT; the role itself resolves the
device afterwards (``device = "auto"`` asks ``torch.cuda.is_available()``), on its compute thread,
and publishes the device kind and memory on its card. The node is then drained.

Checked to fail: a scratch copy whose ``NoLoCoRole.validate_config`` (run in ``Node.__init__``,
before ``prepare()``) calls ``resolve_device`` turns the first assertion red.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, threading
    events = []
    import torch
    from node import device as nd
    rec = nd.cuda_calls_recorded()
    calls = rec.__enter__()
    threads = []
    orig_available = torch.cuda.is_available
    def is_available():
        threads.append(threading.current_thread().name)
        return orig_available()
    torch.cuda.is_available = is_available
    from node import membership
    orig = membership.Membership.start_dht
    def start_dht(self):
        events.append(["cuda_before_dht", list(calls)])
        orig(self)
        events.append(["dht_up", None])
    membership.Membership.start_dht = start_dht
    from node.config import load_config
    from node.daemon import Node
    cfg = load_config(None, {"role": "noloco", "host": "127.0.0.1", "dht": {"host_port": 0},
                             "grpc": {"port": 0}, "ops": {"port": 0}, "state_dir": sys.argv[1],
                             "identity": {"path": sys.argv[1] + "/id.key"},
                             "data": {"max_train_bytes": 200000},
                             "noloco": {"torch_threads": 1, "eval_batches": 1, "checkpoint_every": 0}},
                      environ={})
    node = Node(cfg)   # validates the role's config: must not touch CUDA either
    node.prepare()     # forks the DHT
    n_after_dht = len(calls)

    async def main():
        task = asyncio.ensure_future(node.run())
        for _ in range(1200):
            await asyncio.sleep(0.1)
            role = getattr(node, "role", None)
            if role is not None and "device_kind" in node.card.details:
                break
            if task.done():
                break
        placed = {"device": str(node.role.device), "card": {k: node.card.details.get(k) for k in
                  ("device_kind", "device_name", "device_memory_bytes")}}
        node.request_drain("test")
        code = await asyncio.wait_for(task, 60)
        return placed, code

    placed, code = asyncio.run(main())
    events.append(["role_placed", placed, calls[n_after_dht:], threads])
    print(json.dumps({"events": events, "exit": code}))
""")


@pytest.mark.slow
def test_no_cuda_call_before_the_dht_is_up(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    events = result["events"]
    assert events[0] == ["cuda_before_dht", []], events      # nothing touched CUDA before the fork
    assert events[1][0] == "dht_up"
    name, placed, after, threads = events[2]
    assert name == "role_placed"
    assert "is_available" in after, events                    # the role resolved "auto" after the DHT ...
    assert any("compute" in t for t in threads), threads      # ... on its compute thread
    expected = "cuda" if placed["device"].startswith("cuda") else "cpu"
    assert placed["card"]["device_kind"] == expected and placed["card"]["device_memory_bytes"] > 0, placed
    assert result["exit"] == 0
