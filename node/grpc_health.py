"""The standard gRPC health service, following the node's lifecycle.

Every hosted service name (and ``""``, the whole server) is NOT_SERVING until the node is READY,
SERVING while it is READY, NOT_SERVING again while it (re)joins, and NOT_SERVING for good once
it drains or stops (``enter_graceful_shutdown``): load balancers and probes stop sending work to
a node on its way out. Unauthenticated by design: anyone may probe.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2
from grpc_health.v1._async import HealthServicer as AioHealthServicer

from node.lifecycle import State


class LifecycleHealth:
    """The health servicer (``servicer``) plus the service names it answers for."""

    def __init__(self):
        self.servicer = AioHealthServicer()
        self.services = [health.SERVICE_NAME]

    def add(self, full_name: str) -> None:
        """Answer for ``full_name`` too (``package.Service``), with the server's status."""
        self.services.append(full_name)

    async def set_all(self, status) -> None:
        for name in ["", *self.services]:
            await self.servicer.set(name, status)

    async def on_state(self, state: State, reason: str, detail: str) -> None:
        """Lifecycle listener."""
        if state is State.READY:
            await self.set_all(health_pb2.HealthCheckResponse.SERVING)
        elif state is State.JOINING:
            await self.set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            await self.servicer.enter_graceful_shutdown()
