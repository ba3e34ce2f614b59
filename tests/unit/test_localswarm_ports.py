"""node/localswarm.py free_port: the ports handed to test nodes come from below the kernel's
ephemeral range (a bind-to-0 port can be handed to another socket before the node binds it: a
CI run lost a pipeline test to "Address already in use"), are bindable, and never repeat."""

from __future__ import annotations

import socket

from node.localswarm import _ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(60)]
    assert len(set(ports)) == len(ports)
    if lo > 12000:
        assert all(10000 <= p < lo for p in ports), (lo, hi, ports)
    for p in ports[:10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
