"""The callee's side of the outer exchange: ``/swarmnode.NoLoCo/Exchange``, a tensor stream.

``NoLoCoServicer`` is a ``protocol.streams.TensorStreamService`` under the exchange's own method
(its calls keep their own per-service limits and health name) with one ``accept`` and two
channels. ``accept`` checks every caller's hello (run, cfg_hash, sender form, mode, spec hash,
round skew, order), that the signed caller is the hello's sender, and that it has a live
roster entry for the round (``ExchangeLink.in_roster``: a peer that never announced itself
cannot pair); for a pair it then claims the match under the link's lock. A refusal is the
call's gRPC status with ``"reason: detail"`` (bad or misconfigured peers' reasons counted).
The "pair" channel runs ``exchange_pair.swap`` (the same code as the caller) and hands the
result to the waiting round; the "gather" channel is ``exchange_group.GroupExchange.serve``.
See ``optimizers/exchange.py`` for the protocol. Holds no state of its own.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from optimizers import exchange_common as C
from optimizers.exchange_common import COUNTED, LOCK_WAIT_S
from optimizers.exchange_group import GroupExchange
from optimizers.exchange_link import ExchangeLink
from optimizers.exchange_pair import swap
from protocol.channels import verified_peer
from protocol.stream_errors import Refused
from protocol.streams import TensorStream, TensorStreamService, add_tensor_stream_to_server
from security.keys import public_key_of

__all__ = ["NoLoCoServicer", "add_exchange_to_server"]

log = logging.getLogger("swarmnode.noloco.exchange")


class NoLoCoServicer:
    """The exchange's stream service; register it with :func:`add_exchange_to_server`."""

    def __init__(self, link: ExchangeLink, group: GroupExchange):
        self.link = link
        self.service = TensorStreamService(
            run_id=link.run_id, peer_id=link.peer_id, max_tensor_bytes=link.cap, cap_key=C.CAP_KEY,
            window=link.window, max_message_bytes=link.max_message_bytes, accept=self.accept, pace=link.pacer,
            on_reject=lambda reason: link.rejected(verified_peer(), reason), expected=link.expected)
        self.service.register("pair", self._serve_pair)
        self.service.register("gather", group.serve)

    async def accept(self, hello) -> None:
        """Admit a caller's hello or raise Refused (counted when it marks a bad peer)."""
        L = self.link
        try:
            h, st = C.opening(hello), L.state
            self.check_open(h, st)
            verified = verified_peer()  # the signed caller, not the hello, says who it is
            if verified is not None and verified != h.sender:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "sender", f"hello names ...{h.sender[-8:]} but "
                              f"the call is signed by ...{verified[-8:]}")
            if not await L.in_roster(st, h.sender):  # partners come from the round's live roster
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "not_in_roster",
                              f"...{h.sender[-8:]} has no live roster entry for round {h.round}; publish one first")
            if h.mode == "pair":
                await self._claim(st, h.sender)
        except Refused as r:
            if r.reason in COUNTED:
                L.count(r.reason)
            raise

    def check_open(self, h: C.Opening, st: C.Round | None) -> None:
        """Raise Refused for a hello we must not serve."""
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
        who = verified_peer() or h.sender
        if L.is_distrusted(who, h.round):
            raise Refused(pre, "distrusted", f"{who[:16]}... sent rejected tensors recently; not pairing with it")
        if h.mode == "pair" and not C.proposes_to(h.sender, L.peer_id, h.round):
            raise Refused(bad, "order", "pair proposals go from the earlier to the later peer in the round's "
                                        "order (optimizers/exchange_common.py, proposes_to)")
        if h.mode == "pair" and L.over_share(who, st):
            raise Refused(pre, "share", f"{who[:16]}... had its share of this worker's recent exchanges "
                                        "(optimizers/partner_share.py); pair with another peer")
        if h.mode == "gather":
            if st.root not in (None, L.peer_id):
                raise Refused(pre, f"not_root:{st.root}", f"this worker is not the root of round {mine}")
            if st.mean is not None:
                raise Refused(pre, "late", f"the mean of round {mine} is already computed")
            if h.sender in st.arriving or h.sender in st.contribs:
                raise Refused(bad, "duplicate", f"{h.sender[:16]}... already contributes to round {mine}")

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

    async def _serve_pair(self, stream: TensorStream) -> None:
        """The callee's end of a pair: ``swap``, then hand the result to the waiting round."""
        st, pid, res, bad, sent = self.link.state, stream.peer.sender, None, None, [0]
        if st is None or st.matched != pid:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "other_round", "this pair's round is over")
        try:
            res, bad = await swap(self.link, stream, st, pid, verified_peer(), sent)
        finally:
            if res is None:  # cancelled: the stream refused a frame, or the caller went away
                why = stream.error.reason if stream.rejected.is_set() and stream.error else "partner_error"
                res = C.ExchangeResult(None, 1, [pid], C.FAILED, why, sent[0])
            if not st.incoming.done():
                st.incoming.set_result(res)
        if bad is not None:
            raise bad  # the service answers INVALID_ARGUMENT "[reason] message"


def add_exchange_to_server(servicer: NoLoCoServicer, server: grpc.aio.Server) -> None:
    """Register ``/swarmnode.NoLoCo/Exchange`` (tensor stream frames, passed as bytes)."""
    add_tensor_stream_to_server(servicer.service, server, C.METHOD)
