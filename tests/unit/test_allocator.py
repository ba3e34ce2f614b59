"""protocol.grpc_options.tune_allocator: tunes glibc once per process, honours the opt-out."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = "from protocol.grpc_options import tune_allocator as t; print(t(), t())"


def _run(env):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tunes_once_and_honours_opt_out(monkeypatch):
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    assert _run(base) == ["True", "True"]  # idempotent
    assert _run({**base, "SWARMNODE_MALLOC": "default"}) == ["False", "False"]
    assert _run({**base, "MALLOC_TRIM_THRESHOLD_": "1000000"}) == ["False", "False"]  # explicit env wins
