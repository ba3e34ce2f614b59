"""node/config.py: precedence, strictness and the messages a config mistake produces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.config import ConfigError, deep_merge, installed_roles, load_config, parse_set, redacted

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
MADDR = f"/ip4/10.0.0.7/tcp/31337/p2p/{PEER}"
MADDR2 = f"/dns4/bootstrap/tcp/31338/p2p/{PEER}"


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


# ---- precedence: defaults < TOML < env < CLI ----

def test_defaults():
    cfg = load_config(None, None, environ={})
    assert cfg.role is None              # no default role: `run` needs --role or role = "..."
    assert cfg.run_id == "swarmnode"
    assert cfg.ops.port == 9400 and cfg.grpc.port == 50051 and cfg.dht.host_port == 31337
    assert cfg.dht.initial_peers == [] and cfg.dht.bootstrap_deadline_s is None
    assert cfg.drain.budget_s == 20 and cfg.preemption.provider == "none"


def test_precedence_each_layer(tmp_path):
    path = toml(tmp_path, """
role = "bootstrap"
run_id = "from-toml"
[ops]
port = 1111
[grpc]
port = 2222
[drain]
budget_s = 7
[dht]
host_port = 4000
""")
    env = {"SWARMNODE_OPS__PORT": "4444", "SWARMNODE_GRPC__PORT": "5555", "SWARMNODE_RUN_ID": "from-env",
           "SWARMNODE_DHT__INITIAL_PEERS": f'["{MADDR}"]'}
    cfg = load_config(path, {"ops": {"port": 3333}, "role": "noloco"}, environ=env)
    assert cfg.ops.port == 3333          # CLI beats env and TOML
    assert cfg.role == "noloco"          # CLI beats TOML
    assert cfg.grpc.port == 5555         # env beats TOML
    assert cfg.run_id == "from-env"      # env beats TOML (top level)
    assert cfg.drain.budget_s == 7       # TOML beats default
    assert cfg.dht.initial_peers == [MADDR]  # env list as JSON
    assert cfg.dht.host_port == 4000     # TOML key survives an env key in the same section
    assert cfg.card.ttl_s == 30          # untouched default


def test_toml_only_and_env_only(tmp_path):
    path = toml(tmp_path, 'role = "bootstrap"\n[ops]\nport = 1234\n')
    cfg = load_config(path, None, environ={})
    assert (cfg.role, cfg.ops.port) == ("bootstrap", 1234)
    cfg = load_config(None, None, environ={"SWARMNODE_ROLE": "noloco", "SWARMNODE_OPS__PORT": "9500"})
    assert (cfg.role, cfg.ops.port) == ("noloco", 9500)


def test_env_names_case_insensitive_and_other_vars_ignored():
    cfg = load_config(None, None, environ={"swarmnode_ops__port": "9501", "PATH": "/bin", "HOME": "/root"})
    assert cfg.ops.port == 9501


def test_cli_override_merges_within_section_with_env():
    env = {"SWARMNODE_DHT__INITIAL_PEERS": f'["{MADDR}"]'}
    cfg = load_config(None, {"dht": {"host_port": 31338}}, environ=env)
    assert cfg.dht.host_port == 31338
    assert cfg.dht.initial_peers == [MADDR]


def test_environ_argument_isolated_from_process_env(monkeypatch):
    monkeypatch.setenv("SWARMNODE_OPS__PORT", "7777")
    assert load_config(None, None, environ={}).ops.port == 9400
    assert load_config(None, None, environ={"SWARMNODE_OPS__PORT": "7001"}).ops.port == 7001
    # the process env is restored afterwards
    assert os.environ["SWARMNODE_OPS__PORT"] == "7777"
    assert load_config(None, None).ops.port == 7777


def test_env_list_not_json_is_config_error():
    with pytest.raises(ConfigError) as ei:
        load_config(None, None, environ={"SWARMNODE_DHT__INITIAL_PEERS": MADDR})
    msg = str(ei.value)
    assert "SWARMNODE_DHT__INITIAL_PEERS" in msg and "JSON" in msg


# ---- strictness: unknown keys ----

def test_unknown_top_level_toml_key(tmp_path):
    path = toml(tmp_path, 'rolez = "stage"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(path, None, environ={})
    msg = str(ei.value)
    assert "rolez" in msg and "unknown key" in msg


def test_unknown_nested_toml_key(tmp_path):
    path = toml(tmp_path, "[dht]\nhost_portz = 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path, None, environ={})
    assert "dht.host_portz" in str(ei.value) and "unknown key" in str(ei.value)


def test_unknown_nested_key_in_preemption_section(tmp_path):
    path = toml(tmp_path, '[preemption]\nprovidr = "aws"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(path, None, environ={})
    assert "preemption.providr" in str(ei.value)


def test_misspelt_top_level_env_suggests_closest():
    with pytest.raises(ConfigError) as ei:
        load_config(None, None, environ={"SWARMNODE_ROLEX": "1"})
    msg = str(ei.value)
    assert "SWARMNODE_ROLEX" in msg and "SWARMNODE_ROLE" in msg and "did you mean" in msg


def test_misspelt_nested_env_rejected():
    with pytest.raises(ConfigError) as ei:
        load_config(None, None, environ={"SWARMNODE_DHT__INTIAL_PEERS": f'["{MADDR}"]'})
    assert "dht.intial_peers" in str(ei.value)


def test_misspelt_section_env_rejected():
    with pytest.raises(ConfigError) as ei:
        load_config(None, None, environ={"SWARMNODE_DTH__HOST_PORT": "1"})
    assert "SWARMNODE_DTH__HOST_PORT" in str(ei.value) and "SWARMNODE_DHT" in str(ei.value)


def test_unknown_cli_override_rejected():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"ops": {"prot": 1}}, environ={})
    assert "ops.prot" in str(ei.value)


# ---- values ----

def test_bad_role_lists_allowed_values():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"role": "nope"}, environ={})
    msg = str(ei.value)
    assert "role" in msg and "'nope'" in msg and "not installed" in msg
    assert set(installed_roles()) >= {"bootstrap", "noloco"}
    for r in installed_roles():
        assert r in msg


def test_misspelt_role_suggests_the_installed_one():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"role": "nolco"}, environ={})
    assert "did you mean 'noloco'?" in str(ei.value)


@pytest.mark.parametrize("bad", ["/ip4/foo", "/ip4/1.2.3.4/tcp/31337", "12D3KooW", "http://1.2.3.4:31337"])
def test_bad_multiaddr_names_field_and_form(bad):
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"dht": {"initial_peers": [bad]}}, environ={})
    msg = str(ei.value)
    assert "dht.initial_peers" in msg
    assert "/ip4/<ip>/tcp/<port>/p2p/<peer id>" in msg


@pytest.mark.parametrize("good", [MADDR, MADDR2, f"/ip6/::1/tcp/1/p2p/{PEER}", f"/ip4/1.2.3.4/udp/5/quic-v1/p2p/{PEER}"])
def test_good_multiaddrs_accepted(good):
    assert load_config(None, {"dht": {"initial_peers": [good]}}, environ={}).dht.initial_peers == [good]


def test_bad_port_and_host():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"ops": {"port": 70000}}, environ={})
    assert "ops.port" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"host": "localhost"}, environ={})
    assert "host" in str(ei.value) and "not an IP address" in str(ei.value)


def test_card_refresh_must_be_below_ttl():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"card": {"ttl_s": 20, "refresh_s": 20}}, environ={})
    assert "card.refresh_s" in str(ei.value) and "card.ttl_s" in str(ei.value)
    with pytest.raises(ConfigError):
        load_config(None, {"card": {"refresh_s": 45}}, environ={})  # default ttl 30
    cfg = load_config(None, {"card": {"ttl_s": 20, "refresh_s": 5}}, environ={})
    assert cfg.card.refresh_s == 5


def test_gcp_drain_budget_capped():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"preemption": {"provider": "gcp"}, "drain": {"budget_s": 40}}, environ={})
    msg = str(ei.value)
    assert "drain.budget_s=40" in msg and "25" in msg and "GCP" in msg
    assert load_config(None, {"preemption": {"provider": "gcp"}, "drain": {"budget_s": 25}},
                       environ={}).drain.budget_s == 25
    # other providers keep the larger budget
    assert load_config(None, {"preemption": {"provider": "aws"}, "drain": {"budget_s": 40}},
                       environ={}).drain.budget_s == 40


# ---- files ----

def test_invalid_toml(tmp_path):
    path = toml(tmp_path, "role = [\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path, None, environ={})
    assert "not valid TOML" in str(ei.value) and str(path) in str(ei.value)


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as ei:
        load_config(missing, None, environ={})
    assert str(missing) in str(ei.value) and "not found" in str(ei.value)


def test_config_error_exit_code():
    assert ConfigError.exit_code == 2


# ---- parse_set / deep_merge ----

def test_parse_set_json_vs_string():
    out = parse_set(["dht.host_port=31338", "run_id=abc", "drain.budget_s=12.5", "identity.create_if_missing=false",
                     'dht.initial_peers=["/ip4/1.2.3.4/tcp/1/p2p/X"]', "host=127.0.0.1", "x.y=null",
                     "noloco.name=a=b"])
    assert out["dht"] == {"host_port": 31338, "initial_peers": ["/ip4/1.2.3.4/tcp/1/p2p/X"]}
    assert out["run_id"] == "abc"
    assert out["drain"] == {"budget_s": 12.5}
    assert out["identity"] == {"create_if_missing": False}
    assert out["host"] == "127.0.0.1"    # not JSON: kept as string
    assert out["x"] == {"y": None}
    assert out["noloco"] == {"name": "a=b"}  # split on the first '=' only


def test_parse_set_nested_deep():
    assert parse_set(["a.b.c=1", "a.b.d=x", "a.e=2"]) == {"a": {"b": {"c": 1, "d": "x"}, "e": 2}}


def test_parse_set_errors():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set(["dht.host_port"])
    with pytest.raises(ConfigError, match="empty key"):
        parse_set(["=1"])
    with pytest.raises(ConfigError, match="both as a value and a section"):
        parse_set(["a=1", "a.b=2"])


def test_parse_set_feeds_load_config():
    cfg = load_config(None, parse_set(["dht.host_port=31338", "role=bootstrap", "drain.budget_s=15"]), environ={})
    assert (cfg.dht.host_port, cfg.role, cfg.drain.budget_s) == (31338, "bootstrap", 15)


def test_deep_merge():
    base = {"dht": {"host_port": 1, "initial_peers": ["a"]}, "role": "x"}
    out = deep_merge(base, {"dht": {"host_port": 2}, "run_id": "r"})
    assert out == {"dht": {"host_port": 2, "initial_peers": ["a"]}, "role": "x", "run_id": "r"}
    assert base["dht"]["host_port"] == 1  # not mutated


# ---- redaction ----

def test_redacted_masks_secrets_keeps_paths_and_urls():
    cfg = load_config(None, {"model": {"api_key": "s3cr3t", "hf_token": "hf_abc", "password": "pw",
                                       "client_secret": "cs", "key_path": "/keys/k", "token_url": "http://t/x",
                                       "tokens": ["a", "b"], "name": "llama"}}, environ={})
    red = redacted(cfg)
    m = red["model"]
    assert m["api_key"] == "***" and m["hf_token"] == "***" and m["password"] == "***"
    assert m["client_secret"] == "***"
    assert m["tokens"] == ["***", "***"]
    assert m["key_path"] == "/keys/k"
    assert m["token_url"] == "http://t/x"
    assert m["name"] == "llama"
    assert red["identity"]["path"] == cfg.identity.path
    assert red["preemption"]["aws_token_url"] == cfg.preemption.aws_token_url
    assert "s3cr3t" not in repr(red)
    # the config object itself keeps the value
    assert cfg.model["api_key"] == "s3cr3t"


# ---- role sections come from entry points, not from node/ ----

def test_registered_role_sections_are_raw_tables_read_from_toml_env_and_cli(tmp_path):
    path = toml(tmp_path, "[noloco]\ninner_steps = 7\n[model]\nd_model = 32\n")
    cfg = load_config(path, {"data": {"seq_len": 64}}, environ={"SWARMNODE_NOLOCO__OUTER": "diloco"})
    assert cfg.noloco == {"inner_steps": 7, "outer": "diloco"}   # validated later, by the role
    assert cfg.model == {"d_model": 32} and cfg.data == {"seq_len": 64}


def test_unknown_section_refused_with_closest_name(tmp_path):
    path = toml(tmp_path, "[nolocoo]\ninner_steps = 7\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path, None, environ={})
    msg = str(ei.value)
    assert "nolocoo" in msg and "unknown key" in msg and "did you mean 'noloco'?" in msg
    with pytest.raises(ConfigError) as ei:     # a role that is not installed has no section either
        load_config(None, {"trainer": {"index": 1}}, environ={})
    assert "trainer: unknown key" in str(ei.value)


def test_unknown_nested_key_suggests_closest():
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"dht": {"host_prot": 1}}, environ={})
    assert "dht.host_prot: unknown key; did you mean 'host_port'?" in str(ei.value)


def test_misspelt_role_section_env_rejected():
    with pytest.raises(ConfigError) as ei:
        load_config(None, None, environ={"SWARMNODE_NOLOC__INNER_STEPS": "5"})
    assert "SWARMNODE_NOLOC__INNER_STEPS" in str(ei.value) and "SWARMNODE_NOLOCO" in str(ei.value)


def test_fourth_role_section_registered_without_touching_node(tmp_path, monkeypatch):
    """A package that registers a role and its section through entry points is accepted, with
    nothing in node/ edited; the same config is refused before it is installed."""
    from tests.unit.toy_dist import write_toy

    with pytest.raises(ConfigError) as ei:
        load_config(None, {"role": "toy", "toy": {"rate": 3}}, environ={})
    assert "'toy' is not installed" in str(ei.value) and "toy: unknown key" in str(ei.value)
    monkeypatch.syspath_prepend(str(write_toy(tmp_path / "dist")))
    assert "toy" in installed_roles()
    cfg = load_config(None, {"role": "toy"}, environ={"SWARMNODE_TOY__RATE": "3"})
    assert cfg.role == "toy" and cfg.toy == {"rate": "3"}
    with pytest.raises(ConfigError) as ei:
        load_config(None, None, environ={"SWARMNODE_TOYY__RATE": "3"})
    assert "did you mean SWARMNODE_TOY?" in str(ei.value)


def test_config_check_imports_no_torch(tmp_path):
    """Loading and checking a config (status --local, run --check's first step) stays cheap."""
    import subprocess
    import sys
    code = ("import sys; from node.config import load_config; "
            "c = load_config(None, {'role': 'noloco', 'noloco': {'inner_steps': 3}}, environ={}); "
            "assert c.noloco == {'inner_steps': 3}; print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stderr
