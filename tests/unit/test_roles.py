"""node/roles.py: roles declare themselves (RoleBase), are found through entry points, and the
bootstrap hosts their services; a toy fourth role (tests/unit/toy_dist.py) needs no node/ edit."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node.config import ConfigError, load_config, registered_sections
from node.roles import NodeContext, RoleBase, load_installed_roles, load_role, register
from tests.unit.toy_dist import MODULE, toy_installed, write_toy  # noqa: F401 - the fixture

RUN = "toyrun"


def _ctx(cfg) -> NodeContext:
    async def set_ready(ready, reason="", detail=""):
        return None
    return NodeContext(config=cfg, peer_id="12D3KooWtoy", lifecycle=None, membership=None, card=None, server=None,
                       grpc_addr="127.0.0.1:0", supervisor=None, netem=None, set_role_ready=set_ready)


def test_rolebase_requires_a_pydantic_settings_model_and_a_name():
    with pytest.raises(TypeError, match="Settings must be a pydantic model"):
        class Bad(RoleBase):  # noqa: F841
            name = "bad"
            Settings = dict
    with pytest.raises(TypeError, match="name"):
        register(type("Nameless", (RoleBase,), {}))


def test_no_role_set_is_a_config_error():
    with pytest.raises(ConfigError, match="no role set: pass --role"):
        load_role(None)


def test_noloco_declares_its_sections_and_namespace():
    noloco = load_role("noloco")
    assert issubclass(noloco, RoleBase)
    assert noloco.sections() == ["noloco", "model", "data"]
    assert set(noloco.sections()) <= set(registered_sections())
    assert [ns.name for ns in noloco.namespaces(None)] == ["noloco/roster/"]
    assert load_role("bootstrap").sections() == ["bootstrap"]     # the coordinator lease (node/coordinator_lease.py)


def test_every_installed_role_reads_only_registered_sections():
    roles = load_installed_roles()
    assert {"bootstrap", "noloco"} <= set(roles)
    for name, cls in roles.items():
        assert set(cls.sections()) <= set(registered_sections()), name


def test_toy_role_found_validated_and_declares_its_rendezvous(toy_installed):
    toy = load_role("toy")
    assert toy.__module__ == MODULE and issubclass(toy, RoleBase)
    cfg = load_config(None, {"role": "toy", "toy": {"rate": 4}}, environ={"SWARMNODE_TOY__LABEL": "x"})
    settings = toy.validate_config(cfg)
    assert settings.toy.rate == 4 and settings.toy.label == "x"
    with pytest.raises(ConfigError) as ei:
        toy.validate_config(load_config(None, {"role": "toy", "toy": {"rat": 4}}, environ={}))
    assert "toy.rat: unknown key; did you mean 'rate'?" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        toy.validate_config(load_config(None, {"role": "toy", "toy": {"rate": 0}}, environ={}))
    assert "toy.rate" in str(ei.value)
    assert [ns.name for ns in toy.namespaces(cfg)] == ["toy/records/"]


def test_role_reading_an_unregistered_section_is_refused(tmp_path, monkeypatch):
    root = write_toy(tmp_path / "dist", entry_points=f"[swarmnode.roles]\ntoy = {MODULE}\n")
    monkeypatch.syspath_prepend(str(root))
    try:
        with pytest.raises(ConfigError) as ei:
            load_role("toy")
        msg = str(ei.value)
        assert "['toy']" in msg and "swarmnode.sections" in msg and "pip install -e ." in msg
    finally:
        import sys

        from node import roles
        sys.modules.pop(MODULE, None)
        roles._ROLES.pop("toy", None)


def test_broken_role_is_skipped_with_an_error(tmp_path, monkeypatch, caplog):
    root = write_toy(tmp_path / "dist", source="raise ImportError('missing dependency frobnicate')\n")
    monkeypatch.syspath_prepend(str(root))
    with caplog.at_level(logging.ERROR, logger="swarmnode.roles"):
        roles = load_installed_roles()
    assert "toy" not in roles and "noloco" in roles
    assert any("'toy'" in r.getMessage() and "frobnicate" in r.getMessage() for r in caplog.records)
    [failed] = [r for r in caplog.records if getattr(r, "event", None) == "role_load_failed"]
    assert failed._fields["role_name"] == "toy" and "frobnicate" in failed._fields["error"]


async def test_bootstrap_hosts_the_services_and_namespaces_installed_roles_declare(toy_installed):
    from node.grpc_server import GrpcHost

    bootstrap = load_role("bootstrap")
    cfg = load_config(None, {"role": "bootstrap", "run_id": RUN}, environ={})
    names = [ns.name for ns in bootstrap.namespaces(cfg)]
    assert "toy/records/" in names and "noloco/roster/" in names   # it validates every role's records
    role = bootstrap(_ctx(cfg), bootstrap.validate_config(cfg))
    host = GrpcHost("127.0.0.1", 0, 8 * 1024 * 1024, 8)
    for add_fn, servicer, name in role.services():
        host.add(add_fn, servicer, name)
    port = host.bind()
    await host.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            ping = channel.unary_unary("/toy.Schedule/Ping")
            assert await ping(b"hi", timeout=5) == f"pong:{RUN}:hi".encode()
            check = health_pb2_grpc.HealthStub(channel).Check
            reply = await check(health_pb2.HealthCheckRequest(service="toy.Schedule"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # known; node not READY yet
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await check(health_pb2.HealthCheckRequest(service="toy.Nothing"), timeout=5)
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await host.stop(0)


async def test_without_the_toy_the_bootstrap_hosts_no_toy_service():
    bootstrap = load_role("bootstrap")
    cfg = load_config(None, {"role": "bootstrap"}, environ={})
    role = bootstrap(_ctx(cfg), bootstrap.validate_config(cfg))
    names = [s.name for s in role.services()]
    assert names[0] == "swarmnode.Coordinator" and not any(n.startswith("toy.") for n in names), names


def test_register_refuses_a_role_without_an_async_start():
    """RoleBase has no default start(): a role that forgets it fails at registration, not at run."""
    from node.roles import RoleBase, register

    class NoStart(RoleBase):
        name = "nostart-test"

    with pytest.raises(TypeError, match="async def start"):
        register(NoStart)

    class SyncStart(RoleBase):
        name = "syncstart-test"

        def start(self):
            return None

    with pytest.raises(TypeError, match="async def start"):
        register(SyncStart)
