"""The swarm event bus: gossipsub over py-libp2p in a sidecar process, and a reachability prober.

``sidecar`` runs in the child (py-libp2p, Trio; never hivemind), ``client`` in the daemon (spawns
and supervises the child, talks gRPC over a unix socket), ``wire`` is the pure message format
both sides agree on, ``config`` the ``[eventbus]`` section, ``metrics`` the daemon-side series.

This package imports nothing itself, so ``python -m node.eventbus.sidecar`` loads only what
the sidecar needs (py-libp2p and hivemind cannot share a process: docs/architecture.md, 'Processes').
"""
