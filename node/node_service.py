"""The ``Node`` gRPC service: who this node is (``Info``) and where to reach it (``PeerInfo``).

Guarded like every role service (node/call_guard.py): only members of the run may ask.
Operators read the same facts from the ops port's ``/peerinfo``.
"""

from __future__ import annotations

from typing import Callable

from protocol import node_pb2, node_pb2_grpc


class NodeServicer(node_pb2_grpc.NodeServicer):
    """``info()`` builds the ``NodeInfo`` reply; ``peerinfo()`` returns a dict with ``peer_id``,
    ``maddrs`` and ``grpc_addr`` (the daemon's own view, read at each call)."""

    def __init__(self, info: Callable[[], node_pb2.NodeInfo], peerinfo: Callable[[], dict]):
        self._info, self._peerinfo = info, peerinfo

    async def Info(self, request, context):  # noqa: N802 - gRPC API
        return self._info()

    async def PeerInfo(self, request, context):  # noqa: N802 - gRPC API
        p = self._peerinfo()
        return node_pb2.PeerInfoReply(peer_id=p["peer_id"], maddrs=p["maddrs"], grpc_addr=p["grpc_addr"])
