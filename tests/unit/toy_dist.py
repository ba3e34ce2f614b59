"""A toy fourth role installed the way a real one is: a distribution with entry points.

The ``toy_installed`` fixture writes ``swarmnode_toyrole.py`` and a
``swarmnode_toyrole-0.1.dist-info`` (METADATA + entry_points.txt) into ``tmp_path`` and puts it
on ``sys.path``: ``importlib.metadata`` then lists its ``swarmnode.roles`` and
``swarmnode.sections`` entry points exactly as it lists pip-installed ones. Nothing in
``node/`` is edited or told about it. Teardown forgets the module and the registered class.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

MODULE = "swarmnode_toyrole"

TOY_SOURCE = '''
"""Toy role: one config section, one rendezvous, one service the bootstrap hosts."""
import grpc
from pydantic import BaseModel, ConfigDict, Field

from node.rendezvous import Rendezvous
from node.roles import RoleBase, Service, register


class ToyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rate: int = Field(1, ge=1)
    label: str = "toy"


class ToySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    toy: ToyConfig = ToyConfig()


class ToyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    iteration: int = Field(ge=0)
    note: str = Field(max_length=32)


TOY_RECORDS = Rendezvous("toy/records/", ToyEntry, index_field="iteration", max_ttl_s=30.0)


def schedule_handler(run_id):
    async def ping(request, context):
        return b"pong:" + run_id.encode() + b":" + request
    return grpc.method_handlers_generic_handler(
        "toy.Schedule", {"Ping": grpc.unary_unary_rpc_method_handler(ping)})


def add_handler(handler, server):
    server.add_generic_rpc_handlers((handler,))


@register
class ToyRole(RoleBase):
    name = "toy"
    Settings = ToySettings
    rendezvous = (TOY_RECORDS,)

    @classmethod
    def bootstrap_services(cls, ctx):
        return [Service(add_handler, schedule_handler(ctx.config.run_id), "toy.Schedule")]

    async def start(self):
        await self.ctx.set_role_ready(True, "ready", "")
'''


def write_toy(root: Path, entry_points: str | None = None, source: str = TOY_SOURCE) -> Path:
    """Write the toy distribution into ``root`` (put ``root`` on ``sys.path`` to install it)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{MODULE}.py").write_text(textwrap.dedent(source))
    info = root / f"{MODULE}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points if entry_points is not None else (
        f"[swarmnode.roles]\ntoy = {MODULE}\n\n[swarmnode.sections]\ntoy = {MODULE}:ToyConfig\n"))
    return root


@pytest.fixture
def toy_installed(tmp_path, monkeypatch):
    """The toy role installed for one test (on ``sys.path``), forgotten afterwards."""
    root = write_toy(tmp_path / "toydist")
    monkeypatch.syspath_prepend(str(root))
    yield root
    from node import roles
    sys.modules.pop(MODULE, None)
    roles._ROLES.pop("toy", None)
