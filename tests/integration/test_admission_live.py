"""Token admission on a live swarm (docs/security.md, 'Admission tokens'; issue 7): ``security.admission = "token"``.

Real processes on 127.0.0.1: the bootstrap is the coordinator (its key signs the tokens, as
``swarmnode admit`` does), a ``noloco`` worker holds a 24 h token, and a second daemon ("short")
holds a token that expires while the test watches. From this process: a stranger (fresh key,
no token) and a holder of a soon-expiring token that keeps republishing its card and calling
after the expiry (a node that does not stop by itself).

Checked: a daemon started without a token exits 2 before touching the network, naming
``swarmnode admit``; the stranger is never listed, and cannot call ``Node.Info``, download the
state or pair; admitted nodes are listed and serve each other; at expiry the short-token
daemon drains and exits 2 (``admission_expired``); the uncooperative holder, which keeps
republishing and calling, is no longer listed (its records expire with its token, and new ones
are refused) and its calls are refused; the worker keeps training throughout.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from node.localswarm import LocalSwarm
from node.state_sync import StateFetchError
from optimizers.exchange_common import METHOD as EXCHANGE
from security.admission import encode_b64, issue_token
from security.keys import generate_key, peer_id_str, write_key_file
from tests.integration.hostile import Attacker, client_race, info_status, metric, model_specs, status_rows, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RUN = "admission-it"
MODEL = dict(d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
SHORT_S = 60.0  # the short tokens' lifetime, from the moment they are issued
COMMON = [
    "noloco.inner_steps=4", "noloco.round_timeout=2", "noloco.eval_every=0", "noloco.torch_threads=1",
    "noloco.checkpoint_every=0", "noloco.compute_delay_s=0.05",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2", "drain.budget_s=10", "security.known_peers_refresh_s=2",
]


def test_token_admission_on_a_live_swarm(tmp_path):
    coord = generate_key()
    coord_id = peer_id_str(coord)
    common = [*COMMON, "security.admission=token", f"security.coordinator_peer_id={coord_id}"]

    def admit(name: str, ttl_s: float, roles=()) -> tuple[bytes, object]:
        key = generate_key()
        write_key_file(tmp_path / f"{name}.key", key)  # LocalSwarm starts the node with this key
        return issue_token(coord, run_id=RUN, peer_id=peer_id_str(key), expires_at=time.time() + ttl_s,
                           roles=roles), key

    write_key_file(tmp_path / "bootstrap.key", coord)
    with LocalSwarm(run_id=RUN, workdir=tmp_path, common_set=common) as sw:
        boot = sw.start("bootstrap", name="bootstrap")
        # a daemon without a token stops at start, before any network use, saying what to do
        out = subprocess.run([sys.executable, "-m", "node.cli", "run", "--role", "bootstrap", "--run-id", RUN,
                              "--identity", str(tmp_path / "tokenless.key"), "--set", "identity.create_if_missing=true",
                              "--set", "security.admission=token", "--set", f"security.coordinator_peer_id={coord_id}",
                              "--initial-peers", sw.bootstrap_maddr], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (out.returncode, out.stderr[-1500:])
        assert "no admission token" in out.stderr and "swarmnode admit" in out.stderr, out.stderr[-1500:]
        sw.wait_ready([boot], timeout=90)

        w_token, _ = admit("w0", 24 * 3600, roles=["noloco"])
        w0 = sw.start("noloco", name="w0", extra_set=[f"security.admission_token={encode_b64(w_token)}"])
        sw.wait_ready([w0], timeout=90)
        wait_for(lambda: metric(w0, "swarmnode_outer_round") >= 1, 60, "w0's first round")
        # the short tokens are issued only now: on a loaded machine w0's start alone can take most of
        # SHORT_S, and the checks below must run while they are still valid
        s_token, _ = admit("short", SHORT_S)
        h_token, h_key = admit("holder", SHORT_S)
        expiry = time.time() + SHORT_S - 1
        short = sw.start("bootstrap", name="short", extra_set=[f"security.admission_token={encode_b64(s_token)}"])
        stranger = Attacker(sw, tmp_path, "stranger", coordinator=coord_id)
        holder = Attacker(sw, tmp_path, "holder-dht", key=h_key, token=h_token, coordinator=coord_id)
        try:
            sw.wait_ready([short], timeout=60)
            specs, _ = model_specs(MODEL)
            cfg_hash = holder.worker_cfg_hash([w0])
            assert holder.keep_card(None, cfg_hash, role="bootstrap", every_s=2.0)
            # no token: every swarm node's validator refuses the card (only the stranger's own DHT node
            # may keep it), and the stranger keeps trying
            stranger.keep_card(None, cfg_hash, role="noloco", every_s=2.0, within_s=0)

            def listed() -> set[str]:
                return {r["peer_id"] for r in status_rows(sw, coordinator=coord_id)}
            ids = wait_for(lambda: (lambda s: s if {boot.peer_id, w0.peer_id, short.peer_id, holder.peer_id} <= s
                                    else None)(listed()), 45, "the admitted nodes in swarmnode status")
            assert stranger.peer_id not in ids
            assert metric(boot, "swarmnode_dht_records_rejected_total", reason="admission") > 0

            # the admitted holder is served; the stranger can neither call, nor download, nor pair
            async def holder_info():
                async with holder.channel(w0) as ch:
                    return await info_status(ch)
            assert wait_for(lambda: holder.run(holder_info())[0] == grpc.StatusCode.OK, 20, "w0 to serve the holder")

            async def stranger_tries():
                async with stranger.channel(w0) as ch:
                    info = await info_status(ch)
                    # the server reads the first (signed) frame, then refuses; a client half-close that reaches
                    # Core after that status turns it into INTERNAL (hostile.CORE_RACE, grpc/grpc#36066,
                    # a client-side race): try up to 3 times, every answer a refusal, one a clean PERMISSION_DENIED
                    pairs = []
                    while len(pairs) < 3 and (not pairs or pairs[-1][0] != grpc.StatusCode.PERMISSION_DENIED):
                        call = ch.stream_stream(EXCHANGE)(iter([b"\x0a\x00"]), timeout=3)
                        try:
                            await call.read()
                            pairs.append((await call.code(), ""))
                        except grpc.aio.AioRpcError as exc:
                            pairs.append((exc.code(), exc.details()))
                    assert all(client_race(*p) for p in pairs[:-1]), pairs
                    pair = pairs[-1]
                try:
                    await stranger.fetch_weights(w0, specs, cfg_hash)
                    fetch = "downloaded"
                except StateFetchError as exc:
                    fetch = str(exc)
                return info, pair, fetch
            info, pair, fetch = stranger.run(stranger_tries())
            assert info[0] == grpc.StatusCode.PERMISSION_DENIED, info
            assert pair[0] == grpc.StatusCode.PERMISSION_DENIED, pair
            assert "PERMISSION_DENIED" in fetch, fetch
            assert metric(w0, "swarmnode_rpc_rejected_total", reason="unknown_peer") >= 3

            # expiry: the daemon leaves by itself (exit 2); the holder is dropped by the swarm
            time.sleep(max(0.0, expiry - time.time()))
            code = sw.wait_exit(short, 30)
            assert code == 2, (code, short.log_text()[-2000:])
            assert '"event": "admission_expired"' in short.log_text()
            wait_for(lambda: (lambda ids: {boot.peer_id, w0.peer_id} <= ids and not {short.peer_id, holder.peer_id}
                              & ids)(listed()), 45, "the expired nodes to drop out of swarmnode status")
            refused = lambda: sum(metric(w0, "swarmnode_rpc_rejected_total", reason=r)  # noqa: E731
                                  for r in ("token", "unknown_peer"))
            before = refused()
            code, details = holder.run(holder_info())  # its records expired with its token: no member now
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
            assert "expired" in details or "not a live member" in details, details
            assert refused() == before + 1
            rounds = metric(w0, "swarmnode_outer_round")
            wait_for(lambda: metric(w0, "swarmnode_outer_round") >= rounds + 2, 30, "w0 to keep training")
            assert w0.readyz()["ready"] and boot.alive()
        finally:
            stranger.close()
            holder.close()
