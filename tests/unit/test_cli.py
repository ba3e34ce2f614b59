"""node/cli.py: identity commands, ``run --check``, config errors -> exit 2, ``status`` errors.

Most cases call ``node.cli.main(argv)`` in-process (fast); one runs the real ``python -m node.cli``
to cover the module entry point and the exit status the OS sees.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys

import pytest

from node.cli import main
from node.config import installed_roles

pytestmark = pytest.mark.timeout(120)

PEER_ID = re.compile(r"^12D3KooW[1-9A-HJ-NP-Za-km-z]{44}$")
GOOD_PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.upper().startswith("SWARMNODE_"):
            monkeypatch.delenv(k)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- identity ----

def test_identity_init_show_and_refuse_overwrite(tmp_path, capsys):
    path = tmp_path / "sub" / "id.key"
    assert main(["identity", "init", "--path", str(path)]) == 0
    pid = capsys.readouterr().out.strip()
    assert PEER_ID.match(pid), pid
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    original = path.read_bytes()

    assert main(["identity", "show", str(path)]) == 0
    assert capsys.readouterr().out.strip() == pid

    assert main(["identity", "init", "--path", str(path)]) == 3
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err
    assert path.read_bytes() == original  # untouched

    assert main(["identity", "init", "--path", str(path), "--force"]) == 0
    new_pid = capsys.readouterr().out.strip()
    assert PEER_ID.match(new_pid) and new_pid != pid
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_identity_show_missing_or_garbage(tmp_path, capsys):
    assert main(["identity", "show", str(tmp_path / "missing.key")]) == 3
    assert "missing.key" in capsys.readouterr().err
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    bad.chmod(0o600)
    assert main(["identity", "show", str(bad)]) == 3


# ---- run --check ----

def test_run_check_prints_config_without_touching_key(tmp_path, capsys):
    key = tmp_path / "node.key"
    code = main(["run", "--role", "bootstrap", "--identity", str(key), "--metrics-port", "9555",
                 "--set", "drain.budget_s=15", "--check"])
    out = capsys.readouterr().out
    assert code == 0
    cfg = json.loads(out)
    assert cfg["role"] == "bootstrap" and cfg["ops"]["port"] == 9555 and cfg["drain"]["budget_s"] == 15
    assert cfg["identity"]["path"] == str(key)
    assert not key.exists()


def test_bootstrap_subcommand_check(tmp_path, capsys):
    assert main(["bootstrap", "--identity", str(tmp_path / "k"), "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "bootstrap"


def test_run_check_reads_config_file(tmp_path, capsys):
    conf = tmp_path / "node.toml"
    conf.write_text('role = "bootstrap"\nrun_id = "r1"\n[grpc]\nport = 50999\n')
    assert main(["run", "--config", str(conf), "--check"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["role"], cfg["run_id"], cfg["grpc"]["port"]) == ("bootstrap", "r1", 50999)


def test_run_bad_initial_peer_exit_2(capsys):
    assert main(["run", "--role", "bootstrap", "--initial-peers", "/ip4/foo", "--check"]) == 2
    err = capsys.readouterr().err
    assert "dht.initial_peers" in err and "/p2p/<peer id>" in err


def test_run_bad_role_exit_2(capsys):
    assert main(["run", "--role", "nope", "--check"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err
    for r in installed_roles():
        assert r in err


def test_run_without_role_exit_2(capsys):
    assert main(["run", "--check"]) == 2
    assert "--role" in capsys.readouterr().err


def test_run_misspelt_env_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("SWARMNODE_ROLEX", "1")
    assert main(["run", "--role", "bootstrap", "--check"]) == 2
    err = capsys.readouterr().err
    assert "SWARMNODE_ROLEX" in err and "SWARMNODE_ROLE" in err


def test_run_env_overridden_by_cli(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SWARMNODE_OPS__PORT", "9501")
    monkeypatch.setenv("SWARMNODE_GRPC__PORT", "50100")
    assert main(["run", "--role", "bootstrap", "--metrics-port", "9502", "--identity", str(tmp_path / "k"),
                 "--check"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["ops"]["port"] == 9502 and cfg["grpc"]["port"] == 50100


def test_run_bad_set_exit_2(capsys):
    assert main(["run", "--role", "bootstrap", "--set", "dht.nope=1", "--check"]) == 2
    assert "dht.nope" in capsys.readouterr().err
    assert main(["run", "--role", "bootstrap", "--set", "drain.budget_s", "--check"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_run_missing_config_file_exit_2(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "nope.toml"), "--check"]) == 2
    assert "nope.toml" in capsys.readouterr().err


# ---- status ----

def test_status_local_closed_port_exit_1(capsys):
    port = closed_port()
    assert main(["status", "--local", "--metrics-port", str(port)]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["ready"] is False and body["reason"] == "unreachable" and str(port) in body["detail"]


def test_status_local_ready_against_fake_ops(capsys):
    from node.lifecycle import Lifecycle
    from node.ops_http import OpsServer

    srv = OpsServer("127.0.0.1", 0, Lifecycle(), lambda: (True, "ok"), lambda: {})
    srv.start()
    try:
        assert main(["status", "--local", "--metrics-port", str(srv.port)]) == 0
        assert json.loads(capsys.readouterr().out)["reason"] == "dht_starting"
        assert main(["status", "--local", "--ready", "--metrics-port", str(srv.port)]) == 1
        capsys.readouterr()
    finally:
        srv.stop()


def test_status_without_peers_exit_2(capsys):
    assert main(["status"]) == 2
    assert "--initial-peers" in capsys.readouterr().err


def test_status_bad_peer_exit_2(capsys):
    assert main(["status", "--initial-peers", "/ip4/1.2.3.4/tcp/1"]) == 2
    assert "--initial-peers" in capsys.readouterr().err


def test_status_table_is_readable_and_json_stays_raw(monkeypatch, capsys):
    """A NoLoCo card's ``next_exchange_at`` (a Unix time) and ``finishing`` flag: the table says
    ``in N s`` and leaves an unset flag out; ``--json`` carries both values as published."""
    import time

    from node import status
    from node.card import CardView, NodeCard

    now = time.time()
    card = NodeCard(role="noloco", state="ready", version="0.1.0", grpc_addr="127.0.0.1:5000", started_at=now - 60,
                    published_at=now, details={"round": 4, "next_exchange_at": now + 30.0, "finishing": False})

    class FakeReader:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def read(self):
            return [CardView(peer_id=GOOD_PEER, card=card, expiration=now + 30)]

    monkeypatch.setattr(status, "SwarmReader", FakeReader)
    peer = f"/ip4/127.0.0.1/tcp/31337/p2p/{GOOD_PEER}"
    assert main(["status", "--initial-peers", peer]) == 0
    table = capsys.readouterr().out
    assert re.search(r"NEXT_EXCHANGE\s", table) and re.search(r"\bin (29|30)\.\d s\b", table), table
    assert "e+09" not in table and "FINISHING" not in table and "False" not in table, table
    assert main(["status", "--initial-peers", peer, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["next_exchange_at"] == pytest.approx(now + 30.0) and row["finishing"] is False


# ---- the real entry point ----

def test_module_entry_point_exit_codes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SWARMNODE_")}
    run = lambda *argv, **kw: subprocess.run([sys.executable, "-m", "node.cli", *argv], capture_output=True,  # noqa: E731
                                             text=True, timeout=90, env={**env, **kw.get("extra", {})})
    key = tmp_path / "k.key"
    out = run("run", "--role", "bootstrap", "--identity", str(key), "--check")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["role"] == "bootstrap" and not key.exists()
    out = run("run", "--role", "bootstrap", "--check", extra={"SWARMNODE_ROLEX": "1"})
    assert out.returncode == 2 and "SWARMNODE_ROLE" in out.stderr
    out = run("identity", "init", "--path", str(key))
    assert out.returncode == 0 and PEER_ID.match(out.stdout.strip())
    out = run("identity", "init", "--path", str(key))
    assert out.returncode == 3
