"""The reachability prober, inside the sidecar: can this node dial each known peer's advertised
gossip address, and what do peers report about dialling us.

Owns the probe loop (every ``eventbus.probe_interval_s``: a fresh dial from a throwaway identity
to each address a peer's card advertises, then ping and identify), the ``reachability`` notice
it gossips on ``swarm`` (``ok``: peers reached; ``fail``: peer -> [address, error]), the
reports peers send about us (only members' count: ``Bus.screen`` drops strangers' notices, and
reports of peers that left stop counting), and the hint for a node nobody can reach (which address failed,
and what to set). Runs on the sidecar's Trio thread; imports libp2p, never hivemind.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.host.ping import PingService
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.pb.identify_pb2 import Identify as IdentifyMsg
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.utils.varint import read_length_prefixed_protobuf

from node.eventbus.wire import Notice, encode_notice
from protocol import eventbus_pb2

if TYPE_CHECKING:  # pragma: no cover
    from node.eventbus.sidecar import Bus

log = logging.getLogger("swarmnode.eventbus.sidecar")
#: Reports about us older than this many probe intervals are forgotten.
_REPORT_WINDOW = 3.0


class Prober:
    def __init__(self, bus: "Bus", probe_host: Any):
        self.bus, self.cfg, self.probe_host = bus, bus.cfg, probe_host
        self.probes: dict[str, dict[str, Any]] = {}   # peer -> our last ProbeResult fields
        self.reports: dict[str, tuple[bool, list[str], str, float]] = {}  # reporter -> (ok, addrs, error, at)

    def forget(self, known: dict[str, list[str]]) -> None:
        for p in list(self.probes):
            if p not in known:
                del self.probes[p]

    async def run(self) -> None:
        await trio.sleep(min(2.0, self.cfg.probe_interval_s))
        while True:
            known = list(self.bus.known.items())
            results: dict[str, dict[str, Any]] = {}
            async with trio.open_nursery() as n:
                for peer, addrs in known:
                    n.start_soon(self._probe_peer, peer, addrs, results)
            self.probes.update(results)
            if results:
                await self._publish(results)
            await trio.sleep(self.cfg.probe_interval_s)

    async def _probe_peer(self, peer: str, addrs: list[str], out: dict) -> None:
        """Dial each advertised address from a throwaway host (so an existing connection, maybe
        one the peer opened to us, proves nothing), then ping and identify over it."""
        result: dict[str, Any] = {}
        for addr in addrs:
            result = await self._probe_addr(peer, addr)
            if result["reachable"]:
                break
        out[peer] = result

    async def _probe_addr(self, peer: str, addr: str) -> dict[str, Any]:
        res: dict[str, Any] = {"peer_id": peer, "addr": addr, "reachable": False, "rtt_ms": 0.0, "agent": "",
                               "error": "", "checked_at": time.time()}
        probe_host = self.probe_host
        network = probe_host.get_network()
        pid = None
        try:
            pid = ID.from_base58(peer)
            with trio.fail_after(self.cfg.probe_timeout_s):
                await network.dial_addr(multiaddr.Multiaddr(addr), pid)
                t0 = time.perf_counter()
                await PingService(probe_host).ping(pid, 1)
                res["rtt_ms"] = round((time.perf_counter() - t0) * 1000, 3)
                stream = await probe_host.new_stream(pid, [IDENTIFY_PROTOCOL])
                ident = IdentifyMsg()
                ident.ParseFromString(await read_length_prefixed_protobuf(stream, use_varint_format=True))
                res["agent"] = ident.agent_version[:64]
                if PROTOCOL_ID_V11 not in ident.protocols:
                    res["error"] = f"answers but does not speak {PROTOCOL_ID_V11}"
                    return res
            res["reachable"] = True
        except trio.TooSlowError:
            res["error"] = f"timeout {self.cfg.probe_timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - reported per address
            text = str(exc)
            if "handshake" in text or "security" in text:
                res["error"] = "another peer ID answers there (handshake failed)"
            elif "open connection" in text or "TCP" in text:
                res["error"] = "connection refused or no route"
            else:
                res["error"] = (text.splitlines()[0] if text else type(exc).__name__)[:120]
        finally:
            if pid is not None:
                with trio.move_on_after(1.0):
                    try:
                        await network.close_peer(pid)
                    except Exception:  # noqa: BLE001 - best effort
                        pass
        return res

    async def _publish(self, results: dict[str, dict[str, Any]]) -> None:
        ok = [p for p, r in results.items() if r["reachable"]]
        fail = {p: [r["addr"], r["error"]] for p, r in results.items() if not r["reachable"]}
        bus = self.bus
        cap = bus.caps["swarm"]
        while True:  # trim to the topic cap: failures first (they carry the hints), then successes
            data = encode_notice("reachability", bus.run_id, bus.peer_id, ok=ok, fail=fail)
            if len(data) <= cap or (not ok and not fail):
                break
            if ok:
                ok = ok[: len(ok) // 2]
            else:
                fail = dict(list(fail.items())[: len(fail) // 2])
        try:
            await bus.publish("swarm", data)
        except Exception as exc:  # noqa: BLE001 - no mesh yet, etc.
            log.debug("reachability notice not sent: %r", exc)

    def self_reachability(self) -> eventbus_pb2.SelfReachability:
        """What peers reported about dialling us, and what to fix when none could."""
        horizon = time.time() - _REPORT_WINDOW * self.cfg.probe_interval_s - 5
        recent = {r: v for r, v in self.reports.items() if v[3] >= horizon}
        if self.bus.members_only:  # only members' reports count (a stranger must not vouch for us)
            recent = {r: v for r, v in recent.items() if self.bus.members.refusal(r, "swarm") is None}
        reached = sum(1 for v in recent.values() if v[0])
        failed_addrs = sorted({a for v in recent.values() if not v[0] for a in v[1]})
        hint = ""
        if recent and reached == 0:
            errors = sorted({v[2] for v in recent.values() if v[2]})
            port = self.cfg.port
            hint = (f"no peer could dial this node's gossip address {', '.join(failed_addrs) or self.bus.advertised} "
                    f"({'; '.join(errors) or 'unreachable'}): open TCP port {port or 'eventbus.port'} to the swarm, "
                    "or set eventbus.announce_addrs (and advertise_host) to an address peers can reach")
        return eventbus_pb2.SelfReachability(reporters=len(recent), reached_by=reached,
                                             failed_addrs=failed_addrs, hint=hint, reporter_ids=sorted(recent))


    def on_notice(self, notice: Notice) -> None:
        """A peer's ``reachability`` notice: keep what it says about us."""
        me, fields = self.bus.peer_id, notice.fields
        if me in (fields.get("ok") or []):
            self.reports[notice.sender] = (True, [], "", time.time())
        fail = fields.get("fail") or {}
        if isinstance(fail, dict) and me in fail:
            entry = fail[me]
            addrs = [str(a) for a in entry[:1]] if isinstance(entry, list) else []
            err = str(entry[1]) if isinstance(entry, list) and len(entry) > 1 else ""
            self.reports[notice.sender] = (False, addrs, err, time.time())
