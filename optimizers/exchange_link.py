"""The one stream helper both sides of the outer exchange share (``optimizers/exchange.py``).

``ExchangeLink`` holds who we are (run, peer ID, config hash, tensor specs), the current
round's state, the match lock and the channel pool, and offers the operations every part of
the exchange needs: build a header, open a call, read the next frame within the deadline,
read and check a peer's tensors (codec checks, then the norm/distance bounds of
``exchange_common.bound_violation``), stream ours (paced by netem), take the ordered mean,
count a rejection and charge the peer that sent it (a charged peer is neither proposed to nor
accepted for ``distrust_rounds`` rounds). The pair client (``exchange_pair.py``), the group client (``exchange_group.py``)
and the servicer (``exchange_server.py``) each hold a link; none of them reaches into another.
Roster publishing and reading stay in ``exchange.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from node.averaging import LocalNonFinite, ordered_mean
from node.netem import LinkEmulator
from optimizers import exchange_common as C
from protocol.codec import DEFAULT_CHUNK_BYTES, THREAD_BYTES, ChunkView, TensorAssembler, TensorRejected, all_finite
from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES
from protocol.streams import IDLE_S, ChannelPool, PeerError, StreamCall, next_frame, remaining

log = logging.getLogger("swarmnode.noloco.exchange")


class ExchangeLink:
    """Identity, specs, per-round state and stream operations of one worker's exchange."""

    def __init__(self, *, run_id: str, peer_id: str, cfg_hash: str, grpc_addr: str,
                 specs: Sequence[C.Spec], netem: LinkEmulator | None, max_round_skew: int,
                 poll_interval_s: float, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 on_reject: Callable[[str], None] | None = None, bounds: C.TensorBounds | None = None,
                 distrust_rounds: int = 10, roster: "Roster | None" = None):
        self.specs = list(specs)
        self.names = [s[0] for s in self.specs]
        self.run_id, self.peer_id, self.cfg_hash, self.grpc_addr = run_id, peer_id, cfg_hash, grpc_addr
        self.netem, self.max_round_skew = netem, int(max_round_skew)
        self.poll_interval_s, self.on_reject = float(poll_interval_s), on_reject
        self.expected = {n: (d, s) for n, d, s in self.specs}
        self.cap = max(C.spec_bytes(s) for s in self.specs)
        self.spec_hash = C.spec_hash(self.specs)
        self.chunk = min(DEFAULT_CHUNK_BYTES, max_message_bytes - 4096)
        self.pool = ChannelPool(max_message_bytes)
        self.addrs: dict[str, str] = {}        # peer ID -> gRPC address, from roster reads
        self.lock = asyncio.Lock()             # the match lock (pair mode)
        self.state: C.Round | None = None      # the round in progress
        self.last_round: int | None = None
        self.closed = False
        self.bounds = bounds                   # None: codec checks only (no norm/distance bounds)
        self.distrust_rounds = int(distrust_rounds)
        self.distrusted: dict[str, int] = {}   # peer ID -> last round it is refused/skipped
        self.roster = roster                   # async (round state) -> roster view; None: no roster check

    # ------------------------------------------------------------------ frames and calls
    def hdr(self, wire: bool, st: C.Round | None, stage: str, accepted: bool = True, reason: str = "",
            mode: str = "pair", **extra):
        return C.header_frame(wire, run_id=self.run_id, round=st.round if st else (self.last_round or 0),
                              sender=self.peer_id, cfg_hash=self.cfg_hash, n_tensors=len(self.specs),
                              mode=mode, accepted=accepted, reason=reason, spec_hash=self.spec_hash,
                              stage=stage, **extra)

    def open_call(self, addr: str, st: C.Round):
        pid = next((p for p, a in self.addrs.items() if a == addr), None)  # the roster says whose it is
        method = self.pool.get(addr, pid).stream_stream(C.METHOD, request_serializer=C.serialize,
                                                   response_deserializer=C.parse_wire)
        return StreamCall(method, timeout=max(0.05, remaining(st.deadline)))  # signable first frame

    async def next(self, read, deadline: float):
        """Next frame from ``read()`` within the idle/deadline bound; raises PeerError at EOF."""
        return await next_frame(read, deadline, IDLE_S)

    def encode(self, tensors: list[torch.Tensor], wire: bool, peer: str, digests: asyncio.Task | None):
        """Our tensors as ExchangeFrames, paced for ``peer``: async iterator of (frame, payload bytes)."""
        return C.encode_tensors(tensors, self.names, wire, self.pacer(peer), self.chunk, digests)

    def pacer(self, peer_id: str):
        if self.netem is None:
            return None
        cfg, addr = self.netem.cfg, self.addrs.get(peer_id)
        named = peer_id in cfg.links or (cfg.matrix is not None and peer_id in cfg.matrix.nodes)
        return self.netem.pacer(peer_id if named or not addr else addr)

    # ------------------------------------------------------------------ tensors
    async def read_tensors(self, read, deadline: float, check: bool = True) -> tuple[list[torch.Tensor], int]:
        """The partner's tensors in spec order (decoded, checked, finite if ``check``) and their bytes."""
        asm = TensorAssembler(self.cap, self.expected, cap_key="noloco tensor specs")
        got: dict[str, torch.Tensor] = {}
        nbytes = 0
        while len(got) < len(self.specs):
            kind, obj = C.split(await self.next(read, deadline))
            if kind == "header":
                raise PeerError(f"partner_{obj.reason or 'refused'}" if not obj.accepted else "partner_error",
                                f"the partner sent a header instead of tensors ({obj.reason!r})")
            if kind != "tensor":
                raise TensorRejected("malformed", "empty ExchangeFrame; the partner speaks another protocol")
            if isinstance(obj, ChunkView):
                nbytes += len(obj.data)
            elif obj.WhichOneof("kind") == "chunk":
                nbytes += len(obj.chunk.data)
            out = asm.feed(obj)
            if out is not None:
                got[out[0]] = out[1]
        tensors = [got[n] for n in self.names]
        if check:
            await self.check_finite(tensors)
        return tensors, nbytes

    async def check_finite(self, tensors: list[torch.Tensor], whose: str = "the partner's") -> None:
        big = sum(t.numel() * t.element_size() for t in tensors) >= THREAD_BYTES
        ok = await asyncio.to_thread(lambda: all(map(all_finite, tensors))) if big else all(map(all_finite, tensors))
        if not ok:
            raise TensorRejected("nonfinite", f"{whose} tensors contain NaN or inf; dropped (security.md §7)")

    async def check_bounds(self, ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
        """Raise TensorRejected("norm" | "distance" | "nonfinite") when ``theirs`` is outside the
        bounds relative to ``ours`` (no-op without bounds); PeerError("local_nonfinite") for our own."""
        if self.bounds is None:
            return
        big = sum(t.numel() * t.element_size() for t in ours) >= THREAD_BYTES
        check = lambda: C.bound_violation(ours, theirs, self.bounds, self.names)  # noqa: E731
        bad = await asyncio.to_thread(check) if big else check()
        if bad is None:
            return
        reason, detail = bad
        if reason == "local_nonfinite":
            raise PeerError("local_nonfinite", detail)
        raise TensorRejected(reason, f"{detail}; dropped, this round is solo (security.md §7)")

    def charge(self, peer: str | None, reason: str) -> None:
        """``peer`` sent input we rejected: skip it as a partner for ``distrust_rounds`` rounds.
        Pass only a peer we know sent it (the one we called, or the caller's verified ID)."""
        if not peer or self.distrust_rounds <= 0:
            return
        until = (self.last_round or 0) + self.distrust_rounds
        self.distrusted[peer] = max(until, self.distrusted.get(peer, 0))
        log.warning("partner %s charged (%s): not paired with until round %d", peer[:16], reason, until,
                    extra={"event": "partner_charged", "peer": peer, "reason": reason, "until_round": until})
        if len(self.distrusted) > 4096:  # bounded: forget the oldest charges
            for p, _ in sorted(self.distrusted.items(), key=lambda kv: kv[1])[:1024]:
                del self.distrusted[p]

    async def in_roster(self, st: C.Round, peer: str) -> bool:
        """Does ``peer`` have a live roster entry for ``st.round`` (with our cfg_hash)? Answered
        from this round's roster reads; a peer not seen yet costs one fresh read, shared by
        concurrent callers and bounded by ``LOCK_WAIT_S``. Always True without a roster reader."""
        if self.roster is None or peer in st.roster_seen:
            return True
        if st.roster_read is None or st.roster_read.done():
            st.roster_read = asyncio.ensure_future(self.roster(st))
        try:
            await asyncio.wait_for(asyncio.shield(st.roster_read), C.LOCK_WAIT_S)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - a slow or failed read: not seen
            pass
        return peer in st.roster_seen

    def is_distrusted(self, peer: str, round: int) -> bool:  # noqa: A002 - the protocol's word
        until = self.distrusted.get(peer)
        return until is not None and round <= until

    async def mean(self, parts: list[tuple[str, list[torch.Tensor]]]) -> list[torch.Tensor]:
        """``node.averaging.ordered_mean`` (ascending peer ID, over a received buffer); our own
        NaN -> PeerError("local_nonfinite"), a partner's -> TensorRejected("nonfinite")."""
        try:
            return await ordered_mean(parts, self.peer_id)
        except LocalNonFinite as exc:
            raise PeerError("local_nonfinite", str(exc)) from None

    # ------------------------------------------------------------------ bookkeeping
    def count(self, reason: str) -> None:
        if self.on_reject is not None:
            try:
                self.on_reject(reason)
            except Exception:  # noqa: BLE001 - metrics must not break the exchange
                log.exception("on_reject callback failed")

    async def sleep(self, st: C.Round, s: float) -> None:
        """Sleep up to ``s`` (bounded by the deadline); woken early by ``st.wake``."""
        st.wake.clear()
        try:
            await asyncio.wait_for(st.wake.wait(), max(0.0, min(s, remaining(st.deadline))))
        except asyncio.TimeoutError:
            pass

    async def close(self) -> None:
        await self.pool.close()


Roster = Callable[[C.Round], Any]  # async (round state) -> {peer_id: RosterEntry}; {} on DHT errors
__all__ = ["ExchangeLink", "Roster"]
