"""Revoking admission tokens on a live swarm (issue 33, finding 5; docs/security.md, 'Revocation').

Real processes on 127.0.0.1 in token mode: the bootstrap is the coordinator, a ``noloco``
worker w0 and a ``victim`` daemon hold 24 h tokens; from this process an admitted ``holder``
keeps republishing its card and calling w0 (a member that will not stop by itself), and a
``forger`` (a stranger's key) publishes revocation lists of its own.

Checked: forged lists (under the forger's subkey, and under the coordinator's subkey with the
forger's signature) are refused by the swarm's validators and change nothing. Then the operator
runs ``swarmnode revoke`` twice (the holder by peer ID, the victim by serial and peer ID): within
30 s the holder's calls get PERMISSION_DENIED saying its token was revoked, both cards drop out
of ``swarmnode status``, and the victim daemon drains and exits 2 (``admission_revoked``); w0
keeps training.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from node.localswarm import LocalSwarm
from security.admission import decode_token, encode_b64, issue_token
from security.keys import generate_key, peer_id_str, write_key_file
from security.revocation import REVOKED_RECORD_TTL_S, RevokedEntry, revoked_key
from security.revocation_record import signed_record_value
from tests.integration.hostile import Attacker, info_status, metric, status_rows, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "revoke-it"
MODEL = dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
COMMON = [
    "noloco.inner_steps=4", "noloco.round_timeout=2", "noloco.eval_every=0", "noloco.torch_threads=1",
    "noloco.checkpoint_every=0", "noloco.compute_delay_s=0.05",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=10", "security.known_peers_refresh_s=2",
    "security.revocation_refresh_s=2",
]
WITHIN_S = 30.0


def _forge(forger: Attacker, subkey: str, entries: list[RevokedEntry]) -> None:
    """Store a revocation list signed with the forger's key under ``subkey``."""
    from hivemind.utils import get_dht_time
    exp = get_dht_time() + REVOKED_RECORD_TTL_S
    value = signed_record_value(forger.key, RUN, entries, exp)
    forger.dht.store(revoked_key(RUN), value, exp, subkey=subkey)


def test_revoked_node_is_refused_everywhere(tmp_path):
    coord = generate_key()
    coord_id = peer_id_str(coord)
    common = [*COMMON, "security.admission=token", f"security.coordinator_peer_id={coord_id}"]

    def admit(name: str, roles=()) -> tuple[bytes, object]:
        key = generate_key()
        write_key_file(tmp_path / f"{name}.key", key)
        return issue_token(coord, run_id=RUN, peer_id=peer_id_str(key), expires_at=time.time() + 24 * 3600,
                           roles=roles), key

    write_key_file(tmp_path / "bootstrap.key", coord)
    with LocalSwarm(run_id=RUN, workdir=tmp_path, common_set=common) as sw:
        boot = sw.start("bootstrap", name="bootstrap")
        sw.wait_ready([boot], timeout=90)
        w_token, _ = admit("w0", roles=["noloco"])
        v_token, _ = admit("victim")
        h_token, h_key = admit("holder")
        w0 = sw.start("noloco", name="w0", extra_set=[f"security.admission_token={encode_b64(w_token)}"])
        victim = sw.start("bootstrap", name="victim", extra_set=[f"security.admission_token={encode_b64(v_token)}"])
        holder = Attacker(sw, tmp_path, "holder-dht", key=h_key, token=h_token, coordinator=coord_id)
        forger = Attacker(sw, tmp_path, "forger")
        try:
            sw.wait_ready([w0, victim], timeout=90)
            wait_for(lambda: metric(w0, "swarmnode_outer_round") >= 1, 60, "w0's first round")
            cfg_hash = holder.worker_cfg_hash([w0])
            holder.keep_card(None, cfg_hash, role="bootstrap", every_s=2.0)

            def listed() -> set[str]:
                return {r["peer_id"] for r in status_rows(sw, coordinator=coord_id)}
            everyone = {boot.peer_id, w0.peer_id, victim.peer_id, holder.peer_id}
            wait_for(lambda: everyone <= listed(), 40, "every admitted node in swarmnode status")

            async def holder_info():
                async with holder.channel(w0) as ch:
                    return await info_status(ch)
            assert wait_for(lambda: holder.run(holder_info())[0] == grpc.StatusCode.OK, 20, "w0 to serve the holder")

            # forged lists: under the forger's own subkey, and under the coordinator's with a wrong signature
            now = int(time.time())
            lie = [RevokedEntry(peer_id=p, until=now + 3600, at=now, reason="forged") for p in (w0.peer_id,
                                                                                             holder.peer_id)]
            def rejected(reasons) -> float:  # the forged stores reach whichever nodes are nearest the key
                return sum(metric(n, "swarmnode_dht_records_rejected_total", reason=r)
                           for n in (boot, w0, victim) for r in reasons)
            # the forger holds no token: its own subkey fails admission (or coordinator-only) first
            own_sub, coord_sub = ("admission", "coordinator"), ("signature",)
            before = rejected(own_sub), rejected(coord_sub)
            _forge(forger, forger.peer_id, lie)
            _forge(forger, coord_id, lie)
            wait_for(lambda: rejected(own_sub) > before[0] and rejected(coord_sub) > before[1], 20,
                     "the swarm's validators to refuse both forged lists")
            time.sleep(3 * 2.0)  # three revocation refreshes
            assert holder.run(holder_info())[0] == grpc.StatusCode.OK
            assert everyone <= listed()
            assert metric(w0, "swarmnode_admission_revoked") == 0 and victim.alive()

            # the operator revokes the holder (every token of that peer) and the victim's token
            v_serial = decode_token(v_token)[0].serial
            cli_s = [time.monotonic()]
            for extra in (["--peer-id", holder.peer_id, "--reason", "test: key leaked"],
                          ["--serial", str(v_serial), "--peer-id", victim.peer_id]):
                out = subprocess.run([sys.executable, "-m", "node.cli", "revoke", "--identity",
                                      str(tmp_path / "bootstrap.key"), "--run-id", RUN, "--initial-peers",
                                      sw.bootstrap_maddr, *extra], capture_output=True, text=True, timeout=60)
                assert out.returncode == 0, out.stderr[-1500:]
                assert "revoked" in out.stderr, out.stderr[-1500:]
                cli_s.append(time.monotonic())
            t_rev = cli_s[-1]  # both revocations are published: the clock for "refused everywhere" starts
            cli_s = [b - a for a, b in zip(cli_s, cli_s[1:])]  # each run: join the DHT, store, read back

            def refused():
                code, details = holder.run(holder_info())
                return (code, details) if code != grpc.StatusCode.OK else None
            code, details = wait_for(refused, WITHIN_S, "w0 to refuse the revoked holder")
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
            assert "revoked" in details and "test: key leaked" in details, details
            gone = wait_for(lambda: (lambda ids: ids if {boot.peer_id, w0.peer_id} <= ids and not
                                     {holder.peer_id, victim.peer_id} & ids else None)(listed()),
                            WITHIN_S, "the revoked nodes to drop out of swarmnode status")
            assert gone == {boot.peer_id, w0.peer_id}
            code = sw.wait_exit(victim, max(1.0, WITHIN_S - (time.monotonic() - t_rev)))
            took = time.monotonic() - t_rev
            assert code == 2, (code, victim.log_text()[-2000:])
            assert '"event": "admission_revoked"' in victim.log_text()
            print(f"\nrevoked everywhere {took:.1f} s after both `swarmnode revoke` runs returned "
                  f"(the runs took {cli_s[0]:.1f} s and {cli_s[1]:.1f} s)")
            assert took < WITHIN_S
            assert metric(w0, "swarmnode_admission_revoked") == 2
            assert metric(w0, "swarmnode_rpc_rejected_total", reason="token") >= 1
            rounds = metric(w0, "swarmnode_outer_round")
            wait_for(lambda: metric(w0, "swarmnode_outer_round") >= rounds + 2, 30, "w0 to keep training")
            assert w0.readyz()["ready"] and boot.alive()
            assert (tmp_path / "bootstrap" / "revocations.json").exists()  # the coordinator keeps the list
        finally:
            forger.close()
            holder.close()
