"""Helpers for the hostile-peer suites (test_attacks.py, test_fuzz.py, test_admission_live.py):
an attacker in the test process and small probes of real nodes.

:class:`Attacker` is a peer with a fresh (or given) Ed25519 key: a hivemind DHT client whose
validator signs its own records (node card, roster entries), an event loop in a thread for
its gRPC calls and, on demand, a gRPC server running the NoLoCo exchange with tensors of its
choosing. It is what a stranger to the swarm can build from the public code.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import hivemind
import torch

from models.config import ModelConfig
from models.hf_adapter import build_from_config
from node.card import CARD_NAMESPACE, NodeCard, cards_key, read_cards
from node.dht_records import store_entry
from node.localswarm import LocalSwarm, NodeProc
from node.state_sync import fetch_state
from optimizers.exchange import OuterExchange, add_exchange_to_server
from optimizers.roster import ROSTER_NAMESPACE, RosterEntry, publish_entry
from protocol import node_pb2, node_pb2_grpc
from protocol.grpc_options import server_options
from security.admission import decode_token
from security.keys import generate_key, peer_id_str, write_key_file
from security.peer_auth import CallSigner, ClientAuth, client_auth, client_interceptors, set_client_auth
from security.records import SignedRecordValidator


def metric(node: NodeProc, name: str, **labels) -> float:
    """Sum of a metric's samples on ``node`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in node.metrics().items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def wait_for(pred, timeout: float, what: str, poll: float = 0.5):
    t0 = time.monotonic()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def status_rows(swarm: LocalSwarm, coordinator: str | None = None) -> list[dict]:
    """``swarmnode status --json`` as a real operator runs it (``--coordinator``: token mode)."""
    extra = ["--coordinator", coordinator] if coordinator else []
    out = subprocess.run([sys.executable, "-m", "node.cli", "status", "--initial-peers", swarm.bootstrap_maddr,
                          "--run-id", swarm.run_id, "--json", *extra], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_specs(model_kw: dict) -> tuple[list, list[torch.Tensor]]:
    """The exchange specs of the noloco workers' model and its initial weights (seed 0)."""
    model = build_from_config(ModelConfig(**model_kw), seed=0)
    init = [p.detach().clone() for _, p in model.named_parameters()]
    specs = [(n, torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
    return specs, init


CORE_RACE = "Internal error from Core"
"""What a grpc.aio client reports instead of the server's status when the server ends a call
while the client is still sending (grpc/grpc#36066, fix pending in grpc/grpc#43486): the
client's own write failed; the server's reply is lost, not wrong."""


def client_race(code: grpc.StatusCode, details: str | None) -> bool:
    return code == grpc.StatusCode.INTERNAL and (details or "") == CORE_RACE


async def info_status(channel) -> tuple[grpc.StatusCode, str]:
    """Call Node.Info on `channel`: (OK, "") or the refusal's code and details (retried on the
    client race above)."""
    for _ in range(3):  # a refusal racing the client's send can read as a client error: ask again
        try:
            await node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=3)
            return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            if not client_race(exc.code(), exc.details()):
                return exc.code(), exc.details() or ""
    return exc.code(), exc.details() or ""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Attacker:
    """A peer outside the swarm's control, with its own event loop in a thread."""

    def __init__(self, swarm: LocalSwarm, tmp: Path, name: str, key=None, *, token: bytes | None = None,
                 coordinator: str | None = None):
        """``token`` (token mode): the admission token its records and calls carry;
        ``coordinator``: the run's coordinator peer ID (needed with a token)."""
        self.swarm, self.run_id = swarm, swarm.run_id
        self.key = key if key is not None else generate_key()
        self.peer_id = peer_id_str(self.key)
        self.signer = CallSigner(self.key, self.run_id, token=token)
        self.token_expires_at = decode_token(token)[0].expires_at if token else None
        path = write_key_file(tmp / f"{name}.key", self.key)
        validator = SignedRecordValidator(self.run_id, self.key, [CARD_NAMESPACE, ROSTER_NAMESPACE],
                                          coordinator_peer_id=coordinator, admission_token=token)
        # hivemind forks its DHT process from this (threaded, gRPC-using) test process: collect the
        # earlier tests' gRPC garbage first, so the child's garbage collector never finalizes an
        # inherited gRPC object (a clean-clone CI run saw the forked child segfault doing that).
        gc.collect()
        self.dht = hivemind.DHT(initial_peers=[swarm.bootstrap_maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                identity_path=str(path), check_if_identity_free=False, start=True,
                                record_validators=[validator])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.addr, self.ex, self.server, self.results = "127.0.0.1:1", None, None, []
        self._stop = threading.Event()
        self._tasks: list = []

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._tasks.append(fut)
        return fut

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ---- DHT: the attacker's own, well-signed records
    async def cards(self):
        return await read_cards(self.dht, self.run_id, timeout=5.0)

    async def publish_card(self, round_: int | None, cfg_hash: str, role: str = "noloco") -> bool:
        details: dict[str, Any] = {"cfg_hash": cfg_hash, "outer": "noloco"}
        if round_ is not None:
            details["round"] = round_
        card = NodeCard(role=role, state="ready", version="0.1.0", grpc_addr=self.addr, started_at=time.time(),
                        published_at=time.time(), details=details)
        ttl = 30.0  # capped to the token's life while it has one (records may not outlive it); after, it still tries
        if self.token_expires_at is not None and self.token_expires_at - time.time() > 1:
            ttl = min(ttl, self.token_expires_at - time.time() - 1)
        return await store_entry(self.dht, cards_key(self.run_id), self.peer_id, card, ttl)

    async def _try_card(self, round_: int | None, cfg_hash: str, role: str) -> bool:
        """One :meth:`publish_card`; a store no replica answered in time is False, not an error."""
        try:
            return await self.publish_card(round_, cfg_hash, role)
        except (asyncio.TimeoutError, TimeoutError):
            return False

    def store_card(self, round_: int | None, cfg_hash: str, role: str = "noloco", within_s: float = 30.0) -> bool:
        """Publish the card, trying again (as a node's republish loop does) until a DHT replica
        accepts it or ``within_s`` passes: a fresh DHT client on a loaded machine can see its first
        store answered by nobody (no neighbour yet, or none in time); ``within_s`` 0: one try.
        Returns whether one worked."""
        deadline = time.monotonic() + within_s
        while True:
            if self.run(self._try_card(round_, cfg_hash, role)):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)

    def keep_card(self, round_: int | None, cfg_hash: str, role: str = "noloco", every_s: float = 5.0,
                  within_s: float = 30.0) -> bool:
        """Publish the card now and keep republishing it until :meth:`close` (a member that
        stays, or a refused writer that keeps trying); returns whether a first store worked
        (tried for up to ``within_s``, see :meth:`store_card`; pass 0 for a writer the swarm is
        expected to refuse: one try, the republish loop keeps trying)."""
        stored = self.store_card(round_, cfg_hash, role, within_s)

        async def loop():
            while not self._stop.is_set():
                await asyncio.sleep(every_s)
                await self._try_card(round_, cfg_hash, role)  # unanswered: the next republish tries again
        self.spawn(loop())
        return stored

    async def publish_roster(self, round_: int, cfg_hash: str) -> bool:
        entry = RosterEntry(round=round_, grpc_addr=self.addr, cfg_hash=cfg_hash, waiting_since=time.time())
        return await publish_entry(self.dht, self.run_id, self.peer_id, entry, 60.0)

    async def worker_rounds(self) -> list[int]:
        views = [v for v in await self.cards() if v.card.role == "noloco" and v.peer_id != self.peer_id]
        return [r for r in (v.card.details.get("round") for v in views) if isinstance(r, int) and r < 10 ** 6]

    def worker_cfg_hash(self, workers: list[NodeProc]) -> str:
        ids = {w.peer_id for w in workers}

        def find():
            hashes = {v.card.details.get("cfg_hash") for v in self.run(self.cards()) if v.peer_id in ids}
            hashes.discard(None)
            return hashes.pop() if len(hashes) == 1 else None
        return wait_for(find, 30, "the workers' cfg_hash in their cards")

    # ---- gRPC: signed calls with the attacker's key
    def channel(self, node: NodeProc, signer: CallSigner | None = None, signed: bool = True) -> grpc.aio.Channel:
        """A channel to ``node`` signing with ``signer`` (default: the attacker's key); must be
        made and used on the attacker's loop (inside a coroutine passed to :meth:`run`)."""
        ics = client_interceptors(signer or self.signer, node.peer_id) if signed else None
        return grpc.aio.insecure_channel(f"127.0.0.1:{node.grpc_port}", interceptors=ics)

    async def fetch_weights(self, node: NodeProc, specs, cfg_hash: str) -> list[torch.Tensor]:
        """Download ``node``'s current phi as any member may (open mode), signed with our key."""
        before = client_auth()
        set_client_auth(ClientAuth(self.signer, lambda addr: node.peer_id))
        try:
            _, tensors = await fetch_state(f"127.0.0.1:{node.grpc_port}", self.run_id, self.peer_id, cfg_hash,
                                           {n: (d, s) for n, d, s in specs}, timeout=20)
        finally:
            set_client_auth(before)
        return [tensors[n] for n, _, _ in specs]

    # ---- a pairing partner that serves tensors of its choosing
    async def _serve(self, cfg_hash: str, specs):
        self.server = grpc.aio.server(options=server_options())
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{port}"
        self.ex = OuterExchange(run_id=self.run_id, peer_id=self.peer_id, cfg_hash=cfg_hash, grpc_addr=self.addr,
                                dht=self.dht, specs=specs, poll_interval_s=0.1)  # no bounds: it takes anything
        add_exchange_to_server(self.ex.servicer(), self.server)
        await self.server.start()

    async def _pair_loop(self, cfg_hash: str, tensors):
        while not self._stop.is_set():
            try:
                rounds = await self.worker_rounds()
            except Exception:  # noqa: BLE001 - retry the read
                await asyncio.sleep(0.2)
                continue
            if not rounds:
                await asyncio.sleep(0.2)
                continue
            r = max(rounds)
            await self.publish_card(r, cfg_hash)  # a live card and roster entry, as open mode allows
            self.results.append(await self.ex.pair_average(r, [t.clone() for t in tensors], 4.0))

    def start_partner(self, cfg_hash: str, specs, tensors) -> None:
        """Serve ``tensors`` as a pairing partner in the workers' current round, round after round."""
        self.run(self._serve(cfg_hash, specs))
        self.spawn(self._pair_loop(cfg_hash, tensors))

    def close(self) -> None:
        if not self.thread.is_alive():
            return  # closed already
        self._stop.set()
        for fut in self._tasks:
            try:
                fut.result(15)
            except Exception:  # noqa: BLE001 - a loop's last call may fail as we stop
                pass
        if self.ex is not None:
            self.run(self.ex.close())
        if self.server is not None:
            self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.dht.shutdown()
