"""A real swarm on 127.0.0.1: a bootstrap and 3 more nodes as separate OS processes.

Covers issue 2's "done when": all READY within 20 s, `swarmnode status --json` lists all four,
SIGKILL of one removes it within its card TTL, SIGTERM of another exits 0 within the drain
budget, and a forged card is rejected and counted.
"""

from __future__ import annotations

import json
import signal
import contextlib
import subprocess
import sys
import time

import pytest

from node.localswarm import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TTL_S = 10.0
BUDGET_S = 10.0


def status_json(swarm: LocalSwarm) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "node.cli", "status", "--initial-peers", swarm.bootstrap_maddr,
                          "--run-id", swarm.run_id, "--json"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(rows, list)
    return rows


@contextlib.contextmanager
def forge_card(bootstrap_maddr: str, run_id: str, victim_peer_id: str):
    """A DHT peer with its own key (and no validator) stores a card under the victim's subkey,
    signed with the wrong key, and stays in the swarm serving it; yields ``read_raw()``, the
    victim's entry as that peer reads it without validation (the forged card once it is stored)."""
    import hivemind
    import msgpack
    from hivemind.utils import get_dht_time

    from node.card import NodeCard, cards_key
    from security.keys import generate_key, sign
    from security.records import RECORD_TAG, encode_payload, signing_bytes

    attacker = hivemind.DHT(initial_peers=[bootstrap_maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        key = cards_key(run_id)
        card = NodeCard(role="noloco", state="ready", version="evil", grpc_addr="203.0.113.66:1",
                        started_at=time.time(), published_at=time.time() + 3600)
        payload = encode_payload(card)
        expiration = get_dht_time() + 25
        sig = sign(generate_key(), signing_bytes(key, victim_peer_id, payload, expiration))
        value = {"v": RECORD_TAG, "k": key, "p": payload, "s": sig}
        attacker.store(key, value, expiration, subkey=victim_peer_id)
        assert msgpack.unpackb(msgpack.packb(value)) == value  # well-formed; only the signature is wrong

        def read_raw():
            found = attacker.get(key, latest=True)
            entry = found.value.get(victim_peer_id) if found is not None else None
            return entry.value if entry is not None else None
        yield read_raw
    finally:
        attacker.shutdown()


def test_bootstrap_and_three_nodes(tmp_path):
    common = [f"card.ttl_s={TTL_S}", "card.refresh_s=3", f"drain.budget_s={BUDGET_S}"]
    with LocalSwarm(run_id="itest", workdir=tmp_path, common_set=common) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=60)
        t0 = time.monotonic()
        nodes = [swarm.start("bootstrap", name=f"node-{i}") for i in range(3)]
        waited = swarm.wait_ready(nodes, timeout=60)
        ready_s = time.monotonic() - t0
        assert ready_s <= 20.0, f"nodes took {ready_s:.1f} s to be READY (waited {waited:.1f})"

        # every card is published within a refresh period
        deadline = time.monotonic() + 30
        while True:
            rows = status_json(swarm)
            ids = {r["peer_id"] for r in rows}
            if ids >= {n.peer_id for n in swarm.nodes} or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert ids == {n.peer_id for n in swarm.nodes}
        assert all(r["state"] == "ready" and r["role"] == "bootstrap" for r in rows)

        # a forged card for node-0 is rejected (readers still see the real one) and counted
        # (asserted only after the forgery provably reached the DHT: the forger serves it raw and
        # the nodes' rejection counter rose, so "not arrived yet" cannot pass for "refused")
        victim = nodes[0]

        def rejected() -> float:
            return sum(v for n in swarm.nodes for k, v in n.metrics().items()
                       if k.startswith("swarmnode_dht_records_rejected_total"))
        rejected_before = rejected()
        with forge_card(swarm.bootstrap_maddr, swarm.run_id, victim.peer_id) as read_raw:
            assert read_raw() is not None, "the forged card is not in the forger's DHT view"
            deadline = time.monotonic() + 20
            while rejected() <= rejected_before and time.monotonic() < deadline:
                time.sleep(0.5)
            assert rejected() > rejected_before, "no node counted the forged card as rejected"
            rows = {r["peer_id"]: r for r in status_json(swarm)}
            assert rows[victim.peer_id]["version"] != "evil"
            assert rows[victim.peer_id]["address"] == f"127.0.0.1:{victim.grpc_port}"

        # SIGKILL (the whole process group, as a vanishing spot VM) removes the node within its TTL
        killed = nodes[1]
        swarm.kill(killed)
        t_kill = time.monotonic()
        while killed.peer_id in {r["peer_id"] for r in status_json(swarm)}:
            assert time.monotonic() - t_kill < TTL_S + 15, "killed node still listed long after its TTL"
            time.sleep(1)
        gone_after = time.monotonic() - t_kill
        assert gone_after <= TTL_S + 15

        # SIGTERM drains and exits 0 within the budget; its card says draining/offline or is gone
        drained = nodes[2]
        t_term = time.monotonic()
        swarm.signal(drained, signal.SIGTERM)
        code = swarm.wait_exit(drained, BUDGET_S + 5)
        took = time.monotonic() - t_term
        assert code == 0, drained.log_text()[-2000:]
        assert took <= BUDGET_S + 2, f"drain took {took:.1f} s"
        log = drained.log_text()
        assert '"event": "drained"' in log and '"to": "draining"' in log

        # the others are unaffected
        assert boot.readyz()["ready"] and victim.readyz()["ready"]
