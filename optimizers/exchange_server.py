"""The callee's side of the outer exchange: the ``swarmnode.NoLoCo/Exchange`` servicer.

Checks every "open" header (run, cfg_hash, sender form, mode, spec hash, round skew, order),
that the signed caller is the header's sender, and that it has a live roster entry for the
round (``ExchangeLink.in_roster``: a peer that never announced itself cannot pair), then serves a pair (claim the match under the link's lock, stream both ways, mean, "done") or
a gather contribution (the root collects it, then streams the group mean back once
``exchange_group.GroupExchange`` has computed it). Refusals answer a "reply"(accepted=false)
header then a gRPC status; see ``optimizers/exchange.py`` for the protocol and ops.md §10 for
the codes. Shares one ``ExchangeLink`` with the caller side; holds no state of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from optimizers import exchange_common as C
from optimizers.exchange_common import COUNTED, LOCK_WAIT_S, SERVICE
from optimizers.exchange_link import ExchangeLink
from protocol import noloco_pb2_grpc
from protocol.codec import TensorRejected
from protocol.streams import OPEN_WAIT_S, PeerError, Refused, remaining, task
from security.keys import public_key_of
from security.peer_auth import current_peer

__all__ = ["NoLoCoServicer", "add_exchange_to_server"]

log = logging.getLogger("swarmnode.noloco.exchange")


class NoLoCoServicer(noloco_pb2_grpc.NoLoCoServicer):
    """gRPC servicer; registers with the generated ``add_NoLoCoServicer_to_server`` (protobuf
    frames) or, faster, ``add_exchange_to_server`` (hand-serialized chunks)."""

    def __init__(self, link: ExchangeLink, wire: bool = False):
        self.link, self.wire = link, wire

    async def Exchange(self, request_iterator, context):  # noqa: N802 - gRPC API
        async for frame in self.serve(request_iterator, context, self.wire):
            yield frame

    def check_open(self, h, st: C.Round | None) -> None:
        """Raise Refused for a header we must not serve (see ops.md §10 for the codes)."""
        L = self.link
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if h.run_id != L.run_id:
            raise Refused(bad, "run", f"run {h.run_id[:40]!r} is not this node's run {L.run_id!r}")
        if h.cfg_hash != L.cfg_hash:
            raise Refused(bad, "cfg_hash", f"cfg_hash {h.cfg_hash[:32]!r} != {L.cfg_hash!r}: the peers "
                                            "run different [noloco]/model configs")
        try:
            public_key_of(h.sender)
        except ValueError:
            raise Refused(bad, "sender", "sender is not an Ed25519 peer ID (12D3KooC...)") from None
        if h.mode not in ("pair", "gather"):
            raise Refused(bad, "mode", f"mode {h.mode[:16]!r} is not 'pair' or 'gather'")
        if h.spec_hash != L.spec_hash or h.n_tensors != len(L.specs):
            raise Refused(bad, "specs", f"tensor specs differ ({h.n_tensors} tensors, hash {h.spec_hash[:16]!r};"
                                         f" mine {len(L.specs)}, {L.spec_hash!r})")
        mine = st.round if st is not None else L.last_round
        pre = grpc.StatusCode.FAILED_PRECONDITION
        if mine is None:
            raise Refused(pre, "not_waiting", "this worker has not started an outer round yet (current round: none)")
        if h.round + L.max_round_skew < mine:
            raise Refused(pre, "stale", f"round {h.round} is stale; current round {mine}")
        if h.round > mine + L.max_round_skew:
            raise Refused(pre, "future", f"round {h.round} is too far ahead; current round {mine}")
        if st is None or st.closed or st.round != h.round:
            raise Refused(pre, "other_round", f"not waiting for round {h.round}; current round {mine}")
        if (h.mode == "pair") != (st.mode == "pair"):
            raise Refused(pre, "mode_mismatch", f"this worker is in {st.mode} mode for round {mine}")
        who = current_peer() or h.sender
        if L.is_distrusted(who, h.round):
            raise Refused(pre, "distrusted", f"{who[:16]}... sent rejected tensors recently; not pairing with it")
        if h.mode == "pair" and not h.sender < L.peer_id:
            raise Refused(bad, "order", "pair proposals go from the lower to the higher peer ID")
        if h.mode == "gather":
            if st.root not in (None, L.peer_id):
                raise Refused(pre, f"not_root:{st.root}", f"this worker is not the root of round {mine}")
            if st.mean is not None:
                raise Refused(pre, "late", f"the mean of round {mine} is already computed")
            if h.sender in st.arriving or h.sender in st.contribs:
                raise Refused(bad, "duplicate", f"{h.sender[:16]}... already contributes to round {mine}")

    async def serve(self, requests, context, wire: bool):
        """The Exchange handler (an async generator of response frames)."""
        L, it = self.link, requests.__aiter__()
        try:
            kind, h = C.split(await L.next(it.__anext__, asyncio.get_running_loop().time() + OPEN_WAIT_S))
            st = L.state
            if kind != "header" or h.stage != "open":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "first frame must be an 'open' header")
            self.check_open(h, st)
            verified = current_peer()  # security.md §5: the signed caller, not the header, says who it is
            if verified is not None and verified != h.sender:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "sender", f"header names ...{h.sender[-8:]} but "
                              f"the call is signed by ...{verified[-8:]}")
            if not await L.in_roster(st, h.sender):  # issue 7: partners come from the round's live roster
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "not_in_roster",
                              f"...{h.sender[-8:]} has no live roster entry for round {h.round}; publish one first")
            if h.mode == "pair":
                await self._claim(st, h.sender)
        except PeerError:
            return
        except Refused as r:
            if r.reason in COUNTED:
                L.count(r.reason)
            yield L.hdr(wire, L.state, "reply", False, r.reason)
            await context.abort(r.code, f"{r.reason}: {r.detail}")
            return
        gen = self._serve_pair(st, h.sender, it, context, wire) if h.mode == "pair" else \
            self._serve_gather(st, h.sender, it, context, wire)
        async for frame in gen:
            yield frame

    async def _claim(self, st: C.Round, sender: str) -> None:
        L = self.link
        pre = grpc.StatusCode.FAILED_PRECONDITION
        try:
            await asyncio.wait_for(L.lock.acquire(), LOCK_WAIT_S)
        except asyncio.TimeoutError:
            raise Refused(pre, "busy", f"busy proposing; retry (round {st.round})") from None
        try:
            if st.closed or L.state is not st:
                raise Refused(pre, "other_round", f"no longer waiting for round {st.round}")
            if st.matched is not None:
                raise Refused(pre, "matched", f"already matched for round {st.round}")
            st.matched = sender
            st.wake.set()
        finally:
            L.lock.release()

    async def _serve_pair(self, st: C.Round, pid: str, it, context, wire: bool):
        L = self.link
        sent, recv, res, abort, t0 = 0, 0, None, None, time.perf_counter()
        reader = task(L.read_tensors(it.__anext__, st.deadline, check=False))
        try:
            yield L.hdr(wire, st, "reply", True)
            async for frame, n in L.encode(st.tensors, wire, pid, st.digests):
                if reader.done() and reader.exception() is not None:
                    break
                yield frame
                sent += n
            async with asyncio.timeout(max(0.0, remaining(st.deadline))):
                theirs, recv = await reader
                await L.check_bounds(st.tensors, theirs)  # same verdict as the caller's (symmetric)
                mean = await L.mean([(L.peer_id, st.tensors), (pid, theirs)])
            yield L.hdr(wire, st, "done")
            kind, hdr = C.split(await L.next(it.__anext__, st.deadline))
            if kind != "header" or hdr.stage != "done" or not hdr.accepted:
                raise PeerError("partner_refused", "partner did not confirm")
            res = C.ExchangeResult(mean, 2, [pid], C.OK, "", sent, recv, exchange_s=time.perf_counter() - t0)
        except TensorRejected as exc:
            L.count(exc.reason)
            L.charge(current_peer(), exc.reason)  # only a verified caller is charged, never a claim
            log.warning("tensors from %s rejected: %s; this round is solo", pid[:16], exc)
            res = C.ExchangeResult(None, 1, [pid], C.FAILED, exc.reason, sent, recv)
            abort = (grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason}: {exc.message}")
        except (PeerError, asyncio.TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, PeerError) else "timeout"
            log.warning("pair exchange with %s failed (%s); this round is solo", pid[:16], reason)
            res = C.ExchangeResult(None, 1, [pid], C.FAILED, reason, sent, recv)
        finally:
            reader.cancel()
            if res is None:  # cancelled by gRPC (the caller went away) or closed mid-yield
                res = C.ExchangeResult(None, 1, [pid], C.FAILED, "partner_error", sent, recv)
            if not st.incoming.done():
                st.incoming.set_result(res)
        if abort is not None:
            await context.abort(*abort)

    async def _serve_gather(self, st: C.Round, pid: str, it, context, wire: bool):
        L = self.link
        me, pre = L.peer_id, grpc.StatusCode.FAILED_PRECONDITION
        st.arriving.add(pid)
        fut = st.sends[pid] = asyncio.get_running_loop().create_future()
        abort = None
        try:
            yield L.hdr(wire, st, "reply", True, mode="gather")
            try:
                theirs, recv = await L.read_tensors(it.__anext__, st.deadline)
                await L.check_bounds(st.tensors, theirs)
            finally:
                st.arriving.discard(pid)  # in transit no more: the root need not wait for it
            if st.root in (None, me) and st.mean is None and not st.closed:
                st.contribs[pid] = theirs
                st.received += recv
            st.wake.set()
            await asyncio.wait_for(st.decided.wait(), max(0.0, remaining(st.deadline)))
            if st.mean is None or pid not in st.members:
                why = f"not_root:{st.root}" if st.root not in (None, me) else "late"
                yield L.hdr(wire, st, "done", False, why, mode="gather")
                abort = (pre, f"{why} (round {st.round})")
            else:
                sent = 0
                async for frame, n in L.encode(st.mean, wire, pid, st.mean_digests):
                    yield frame
                    sent += n
                yield L.hdr(wire, st, "done", True, mode="gather", group_size=len(st.members),
                            members=st.members)
                fut.set_result(sent)
        except TensorRejected as exc:
            L.count(exc.reason)
            L.charge(current_peer(), exc.reason)
            log.warning("gather contribution from %s rejected: %s", pid[:16], exc)
            abort = (grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason}: {exc.message}")
        except (PeerError, asyncio.TimeoutError) as exc:
            log.warning("gather stream from %s failed: %r", pid[:16], exc)
        finally:
            st.arriving.discard(pid)
            if not fut.done():
                fut.set_result(0)
        if abort is not None:
            await context.abort(*abort)


def add_exchange_to_server(servicer: NoLoCoServicer, server: grpc.aio.Server) -> None:
    """Register ``swarmnode.NoLoCo/Exchange`` with the zero-copy frame (de)serializers."""
    fast = NoLoCoServicer(servicer.link, wire=True)
    handler = grpc.stream_stream_rpc_method_handler(fast.Exchange, request_deserializer=C.parse_wire,
                                                    response_serializer=C.serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Exchange": handler}),))
