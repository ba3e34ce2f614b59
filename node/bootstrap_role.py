"""The ``bootstrap`` role: the swarm's stable DHT entry point and its coordinator services.

Ready as soon as it listens (it needs no peers). Serves ``Coordinator.ListNodes`` (the run's
live node cards) and reads those cards every ``CENSUS_INTERVAL_S`` into the swarm view its ops
HTTP serves at ``/metrics/swarm`` (nodes by role and state, joins and leaves, each node's card
details: ``node/swarm_metrics.py``).
Hosts what the other installed roles ask of it, found through their entry points and never
named here: every role's ``bootstrap_services`` (e.g. the SkipPipe schedule service) joins its
gRPC server, and every role's record namespaces join its DHT validator, so the bootstrap
stores and serves those records like any peer.

One or more standby bootstraps (``bootstrap.standby = true``, joined through the first one's
multiaddr) run the same services; the coordinator lease (node/coordinator_lease.py) says which
one is active, and the hosted coordinators serve only there. docs/operations.md, 'Two bootstraps'.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict

from node.card import CardView, read_cards
from node.coordinator_lease import CoordinatorLease, LeaseConfig
from node.logs import emit
from node.metrics import RPC_REJECTED
from node.roles import NodeContext, RoleBase, Service, load_installed_roles, register
from node.swarm_metrics import CENSUS
from protocol import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("swarmnode.bootstrap")

CENSUS_INTERVAL_S = 5.0
"""Seconds between two reads of the run's cards for ``/metrics/swarm`` (a Prometheus scrape
interval is about as long)."""


def card_view_pb(view: CardView) -> coordinator_pb2.NodeCardView:
    c = view.card
    return coordinator_pb2.NodeCardView(
        peer_id=view.peer_id, role=c.role, state=c.state, version=c.version, grpc_addr=c.grpc_addr,
        started_at=c.started_at, age_s=view.age_s, details={k: str(v) for k, v in c.details.items()})


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, ctx: NodeContext):
        self.ctx = ctx

    async def ListNodes(self, request, context):  # noqa: N802 - gRPC API
        if request.run_id and request.run_id != self.ctx.config.run_id:
            RPC_REJECTED.labels(reason="schema").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this coordinator serves run {self.ctx.config.run_id!r}, not {request.run_id!r}; "
                                "pass the right --run-id")
        views = await read_cards(self.ctx.membership.dht, self.ctx.config.run_id)
        return coordinator_pb2.ListNodesReply(nodes=[card_view_pb(v) for v in views])


class BootstrapSettings(BaseModel):
    """The bootstrap's config sections: ``[bootstrap]`` (the coordinator lease)."""

    model_config = ConfigDict(extra="forbid")
    bootstrap: LeaseConfig = LeaseConfig()


@register
class BootstrapRole(RoleBase):
    name = "bootstrap"
    Settings = BootstrapSettings

    def __init__(self, ctx: NodeContext, settings: BootstrapSettings):
        super().__init__(ctx, settings)
        self.lease = CoordinatorLease(ctx, settings.bootstrap)
        ctx.coordinator_lease = self.lease      # the hosted coordinators follow it (bootstrap_services)

    @classmethod
    def namespaces(cls, config: Any) -> list:
        """Every other installed role's namespaces: the bootstrap validates and stores their records."""
        out, seen = [], set()
        for role in load_installed_roles(skip=(cls.name,)).values():
            for ns in getattr(role, "namespaces", lambda cfg: [])(config):
                if ns.name not in seen:
                    seen.add(ns.name)
                    out.append(ns)
        return out

    def services(self) -> list[Service]:
        hosted = [Service(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(self.ctx),
                          "swarmnode.Coordinator")]
        for name, role in load_installed_roles(skip=(self.name,)).items():
            for service in getattr(role, "bootstrap_services", lambda ctx: [])(self.ctx):
                emit(log, "bootstrap_service", "hosting {service} for role {role_name}", service=service.name,
                     role_name=name)
                hosted.append(Service(*service))
        return hosted

    async def start(self) -> None:
        self.ctx.supervisor.spawn("swarm_census", self._census)
        self.ctx.supervisor.spawn("coordinator_lease", self.lease.run)
        await self.ctx.set_role_ready(True, "ready", "")

    async def _census(self) -> None:
        while True:
            try:
                views = await read_cards(self.ctx.membership.dht, self.ctx.config.run_id)
            except Exception as exc:  # noqa: BLE001 - census is best-effort; the next tick retries
                log.debug("census failed: %r", exc)
                CENSUS.failed()
            else:
                CENSUS.update(self.ctx.config.run_id, views)
            await asyncio.sleep(CENSUS_INTERVAL_S)

    async def drain(self, budget_s: float) -> None:
        return None
