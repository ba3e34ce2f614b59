"""The exact commands the image runs start real nodes outside Docker (issue 16; no engine here).

Read from the Dockerfile and deploy/compose.yaml, not retyped: the runtime stage's ENTRYPOINT +
CMD (``tini -- swarmnode run --config /etc/swarmnode/node.toml``), its ENV, the files its COPY
lines put in /etc/swarmnode, its HEALTHCHECK, and compose's bootstrap command and environment
(the fixed demo identity). What Docker would provide is emulated: /etc/swarmnode and the
/var/lib/swarmnode volume become folders, and the network namespace's fixed ports become free
127.0.0.1 ports given through the same SWARMNODE_* variables an operator would use. Both nodes
reach READY, the healthcheck flips from 1 to 0, and SIGTERM to tini (PID 1 in the container)
drains the node to exit 0 with every process of its group gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from node.localswarm import free_port, http_get
from tests.deploy_tools import deploy_tool
from tests.unit.test_dockerfile import exec_form, parse_dockerfile, split_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def runtime_stage() -> list[tuple[str, str]]:
    stages: list[list] = []
    for instr, rest in parse_dockerfile((REPO / "Dockerfile").read_text()):
        if instr == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((instr, rest))
    return stages[-1]


def image_files(stage, etc: Path) -> dict[str, Path]:
    """Copy what the COPY lines (not --from the builder) put under /etc/swarmnode into ``etc``."""
    placed = {}
    for instr, rest in stage:
        flags, rest = split_flags(rest)
        if instr != "COPY" or "from" in flags:
            continue
        *sources, dest = rest.split()
        for src in sources:
            for path in sorted(REPO.glob(src)):
                target = dest + path.name if dest.endswith("/") else dest
                if target.startswith("/etc/swarmnode/"):
                    local = etc / target.removeprefix("/etc/swarmnode/")
                    shutil.copy(path, local)
                    placed[target] = local
    return placed


def image_env(stage, volume: Path) -> dict[str, str]:
    env = {}
    for instr, rest in stage:
        if instr == "ENV":
            for key, value in re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", rest):
                env[key] = value.replace("/var/lib/swarmnode", str(volume))
    return env


def localize(argv: list[str], etc: Path) -> list[str]:
    """The image's argv on this host: its console script from this environment, /etc/swarmnode -> etc."""
    out = []
    for a in argv:
        if a == "swarmnode":
            a = shutil.which("swarmnode", path=str(BIN)) or pytest.fail("swarmnode console script not installed")
        elif a == "tini":
            a = shutil.which("tini") or pytest.fail("tini not installed")
        out.append(a.replace("/etc/swarmnode/", f"{etc}/"))
    return out


def container_env(base: dict[str, str], volume: Path) -> tuple[dict[str, str], int]:
    """One container's network namespace on a shared host: free 127.0.0.1 ports, key and state in
    its own volume folder. Returns the environment and the ops port."""
    ops = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMNODE_")}
    env.update(base)
    env.update({"SWARMNODE_HOST": "127.0.0.1", "SWARMNODE_DHT__HOST_PORT": str(free_port()),
                "SWARMNODE_GRPC__PORT": str(free_port()), "SWARMNODE_OPS__PORT": str(ops),
                "SWARMNODE_IDENTITY__PATH": str(volume / "identity.key"),
                "SWARMNODE_STATE_DIR": str(volume / "state"), "SWARMNODE_LOG__FORMAT": "json"})
    return env, ops


def compose_env(service: dict, peers: str) -> dict[str, str]:
    env = {}
    for key, value in service.get("environment", {}).items():
        value = re.sub(r"\$\{BOOTSTRAP_PEER_ID:\?[^}]*\}", peers, str(value))
        env[key] = value
    return env


def wait_ready(proc: subprocess.Popen, ops: int, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode} before READY:\n{log.read_text()[-3000:]}"
        try:
            code, body = http_get(f"http://127.0.0.1:{ops}/readyz", timeout=1.0)
            if code == 200 and json.loads(body)["ready"]:
                return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"not READY after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_image_commands_start_nodes_and_sigterm_to_tini_drains(tmp_path):
    stage = runtime_stage()
    entry = exec_form(next(r for i, r in stage if i == "ENTRYPOINT"), "ENTRYPOINT")
    if entry[0] == "tini":
        deploy_tool("tini", "tini")
    cmd = exec_form(next(r for i, r in stage if i == "CMD"), "CMD")
    _, hc = split_flags(next(r for i, r in stage if i == "HEALTHCHECK"))
    health = exec_form(hc.removeprefix("CMD "), "HEALTHCHECK")
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())["services"]
    etc = tmp_path / "etc"
    etc.mkdir()
    placed = image_files(stage, etc)
    assert {"/etc/swarmnode/node.toml", "/etc/swarmnode/bootstrap.toml"} <= set(placed)
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen(localize(argv, etc), env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=env.get("HOME"))
        procs.append(proc)
        return proc, log

    try:
        # the bootstrap: compose's command and environment, the public demo key in its volume
        boot_vol = tmp_path / "bootstrap-volume"
        boot_vol.mkdir()
        shutil.copy(REPO / "deploy" / "keys" / "bootstrap-demo.key", boot_vol / "identity.key")
        os.chmod(boot_vol / "identity.key", 0o644)   # as mounted from git: world-readable, allowed by its env
        boot_env, boot_ops = container_env({**image_env(stage, boot_vol), **compose_env(compose["bootstrap"], "")},
                                           boot_vol)
        boot, boot_log = start("bootstrap", [*entry, *compose["bootstrap"]["command"]], boot_env)
        wait_ready(boot, boot_ops, boot_log)
        info = json.loads(http_get(f"http://127.0.0.1:{boot_ops}/peerinfo")[1])
        dotenv = dict(line.split("=", 1) for line in (REPO / "deploy" / ".env").read_text().split())
        assert info["peer_id"] == dotenv["BOOTSTRAP_PEER_ID"] and info["role"] == "bootstrap"

        # a worker: the image's default ENTRYPOINT + CMD with compose's worker environment
        vol = tmp_path / "worker-volume"
        vol.mkdir()
        peer = f"/ip4/127.0.0.1/tcp/{boot_env['SWARMNODE_DHT__HOST_PORT']}/p2p/{info['peer_id']}"
        env, ops = container_env(image_env(stage, vol), vol)
        env.update(compose_env(compose["noloco"], info["peer_id"]))
        env["SWARMNODE_DHT__INITIAL_PEERS"] = json.dumps([peer])   # /dns4/bootstrap/... -> this host
        check = subprocess.run(localize(health, etc), env=env, capture_output=True, text=True, timeout=30)
        assert check.returncode == 1 and '"ready": false' in check.stdout      # nothing listens yet
        worker, log = start("worker", [*entry, *cmd], env)
        wait_ready(worker, ops, log)
        check = subprocess.run(localize(health, etc), env=env, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and json.loads(check.stdout)["state"] == "ready", check.stdout + check.stderr
        assert (vol / "identity.key").exists() and oct((vol / "identity.key").stat().st_mode & 0o777) == "0o600"
        role = json.loads(http_get(f"http://127.0.0.1:{ops}/peerinfo")[1])["role"]
        assert role == "noloco"   # the default CMD's config is deploy/configs/noloco.toml

        # docker stop: SIGTERM to PID 1 (tini), which forwards it; the node drains and exits 0
        for proc, name in ((worker, "worker"), (boot, "bootstrap")):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
            deadline = time.monotonic() + 5
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not group_alive(proc.pid), f"{name}: processes of its group outlived it (p2pd, forks)"
        events = [json.loads(line).get("event") for line in log.read_text().splitlines() if line.startswith("{")]
        assert "drained" in events
    finally:
        for proc in procs:
            if proc.poll() is None or group_alive(proc.pid):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
