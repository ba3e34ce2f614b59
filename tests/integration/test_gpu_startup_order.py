"""Start-up order (ARCHITECTURE.md): hivemind forks its DHT process before any CUDA call.

Runs on CPU: a real noloco ``Node`` is built and ``prepare()``-d (which forks the real hivemind
DHT) in a child process whose ``torch.cuda`` probes are recorded; no probe may precede the DHT,
and the device is resolved only afterwards (what the role's ``start()`` does)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    events = []
    import torch
    from node import device as nd
    rec = nd.cuda_calls_recorded()
    calls = rec.__enter__()
    from node import membership
    orig = membership.Membership.start_dht
    def start_dht(self):
        events.append(("cuda_before_dht", list(calls)))
        orig(self)
        events.append(("dht_up", None))
    membership.Membership.start_dht = start_dht
    from node.config import load_config
    from node.daemon import Node
    cfg = load_config(None, {"role": "noloco", "host": "127.0.0.1", "dht": {"host_port": 0},
                             "grpc": {"port": 0}, "ops": {"port": 0}, "state_dir": sys.argv[1],
                             "identity": {"path": sys.argv[1] + "/id.key"}}, environ={})
    node = Node(cfg)
    node.prepare()
    n_after_dht = len(calls)
    dev = nd.resolve_device(cfg.device)
    events.append(("resolved", str(dev), calls[n_after_dht:]))
    print(json.dumps({"events": events, "initialized": torch.cuda.is_initialized()}))
    node.membership.shutdown()
""")


@pytest.mark.slow
def test_no_cuda_call_before_the_dht_is_up(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    events = result["events"]
    assert events[0] == ["cuda_before_dht", []], events      # nothing touched CUDA before the fork
    assert events[1][0] == "dht_up"
    assert events[2][0] == "resolved" and "is_available" in events[2][2]  # resolution comes after
