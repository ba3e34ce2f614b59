"""The one stream helper both sides of the outer exchange share (``optimizers/exchange.py``).

``ExchangeLink`` holds who we are (run, peer ID, config hash, tensor specs), the current
round's state, the match lock and the channel pool, and offers the operations every part of
the exchange needs on a tensor stream (``protocol/streams.py``): open one to a peer, send our
tensors (paced by netem), receive the peer's in spec order (the stream's assembler checks each
head against the specs before allocating; then finiteness and the norm/distance bounds of
``exchange_common.bound_violation``), the "done" handshake, the ordered mean, and counting a
rejection and charging the peer that sent it (a charged peer is neither proposed to nor
accepted for ``distrust_rounds`` rounds). The pair swap (``exchange_pair.py``), the group
rounds (``exchange_group.py``) and the servicer (``exchange_server.py``) each hold a link.
Roster publishing and reading stay in ``exchange.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from node.averaging import LocalNonFinite, ordered_mean
from node.logs import emit
from node.netem import LinkEmulator
from optimizers import exchange_common as C
from optimizers.outer_codec import OuterCodec
from optimizers.partner_share import PartnerShare
from optimizers.robust import ClipVerdict, PartnerClip
from protocol.channels import ChannelPool, remaining, task
from protocol.codec import THREAD_BYTES, TensorRejected, all_finite
from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES
from protocol.stream_errors import PeerError, StreamClosed, StreamError
from protocol.streams import TensorStream, open_stream

log = logging.getLogger("swarmnode.noloco.exchange")

_NO_MEMBERS = torch.empty(0, dtype=torch.uint8)


class ExchangeLink:
    """Identity, specs, per-round state and stream operations of one worker's exchange."""

    def __init__(self, *, run_id: str, peer_id: str, cfg_hash: str, grpc_addr: str,
                 specs: Sequence[C.Spec], netem: LinkEmulator | None, max_round_skew: int,
                 poll_interval_s: float, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 on_reject: Callable[[str], None] | None = None, bounds: C.TensorBounds | None = None,
                 distrust_rounds: int = 10, roster: "Roster | None" = None,
                 robust: PartnerClip | None = None,
                 on_clip: Callable[[ClipVerdict], None] | None = None,
                 codec: OuterCodec | None = None, share: PartnerShare | None = None):
        self.specs = list(specs)
        self.codec = codec                     # None: the fp32 tensors travel as they are
        wire = codec.wire_specs() if codec is not None else self.specs
        self.names = [s[0] for s in self.specs]
        self.run_id, self.peer_id, self.cfg_hash, self.grpc_addr = run_id, peer_id, cfg_hash, grpc_addr
        self.netem, self.max_round_skew = netem, int(max_round_skew)
        self.poll_interval_s, self.on_reject = float(poll_interval_s), on_reject
        # what a peer may send: our specs, and the "done" control tensor (member IDs, 1-D uint8)
        self.expected: dict[str, tuple[torch.dtype, tuple[int, ...] | None]] = {n: (d, s) for n, d, s in wire}
        self.expected[C.DONE] = (torch.uint8, None)
        self.cap = max(C.MEMBERS_CAP, *(C.spec_bytes(s) for s in wire))
        self.window = min(1024, len(wire) + 2)  # a side sends all its tensors and "done" without waiting
        self.spec_hash = C.spec_hash(self.specs if codec is None else [*self.specs, *wire])
        self.max_message_bytes = max_message_bytes
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
        self.robust, self.on_clip = robust, on_clip  # None: partners' tensors are averaged as sent
        self.share = share                     # None: any partner may pair with us every round

    # ------------------------------------------------------------------ streams
    async def open(self, addr: str, pid: str, st: C.Round, mode: str, timeout: float) -> TensorStream:
        """Open the exchange with ``pid`` at ``addr`` for round ``st`` in ``mode`` ("pair" |
        "gather"); raises StreamError (``refusal``: the callee's reason) or OSError."""
        return await open_stream(
            self.pool.get(addr, pid), run_id=self.run_id, sender=self.peer_id, channel_name=mode,
            max_tensor_bytes=self.cap, cap_key=C.CAP_KEY, window=self.window,
            max_message_bytes=self.max_message_bytes,
            meta=C.hello_meta(st.round, self.cfg_hash, self.spec_hash, len(self.specs)),
            pace=self.pacer(pid), timeout=timeout, method=C.METHOD, expected=self.expected,
            on_reject=lambda reason: self.rejected(pid, reason))

    async def send(self, stream: TensorStream, tensors: Sequence[torch.Tensor], sent: list[int] | None = None,
                   names: Sequence[str] | None = None) -> int:
        """Stream ``tensors`` under ``names`` (default: the spec names); returns their payload
        bytes. ``sent[0]`` (when given) counts them as they go, so a round that fails midway
        still reports what left."""
        sent = [0] if sent is None else sent
        for name, t in zip(self.names if names is None else names, tensors):
            await self._io(stream, stream.send(name, t))
            sent[0] += t.numel() * t.element_size()
        return sent[0]

    async def recv_tensors(self, stream: TensorStream, check: bool = True,
                           names: Sequence[str] | None = None) -> tuple[list[torch.Tensor], int]:
        """The partner's tensors in the order of ``names`` (default: the specs; checked, finite
        if ``check``) and their bytes."""
        got, nbytes = [], 0
        for name in self.names if names is None else names:
            r = await self._recv(stream)
            if r.name != name:
                raise TensorRejected("malformed", f"got tensor {r.name!r} where {name!r} comes next; tensors "
                                     "travel in spec order, once each")
            got.append(r.tensor)
            nbytes += r.tensor.numel() * r.tensor.element_size()
        if check:
            await self.check_finite(got)
        return got, nbytes

    # ------------------------------------------------------------------ compression (optimizers/outer_codec.py)
    async def payload(self, st: C.Round) -> tuple[list[str], list[torch.Tensor]]:
        """(names, tensors) we send for round ``st``: the fp32 tensors, or their compressed parts
        (phi, on a phi round, compressed now, off the event loop)."""
        if self.codec is None or st.wire is None:
            return self.names, st.tensors
        if self.codec.sends_phi(st.round) and st.wire.phi is None:
            t0 = time.perf_counter()
            await asyncio.to_thread(self.codec.ensure_phi, st.wire)
            st.codec_s += time.perf_counter() - t0
        return self.codec.names_for(st.round), self.codec.tensors_for(st.round, st.wire)

    def incoming(self, st: C.Round) -> list[str]:
        """The names a partner's payload for round ``st`` carries, in order."""
        return self.names if self.codec is None else self.codec.names_for(st.round)

    async def rebuild(self, st: C.Round, wire: list[torch.Tensor], mean: bool = False) -> list[torch.Tensor]:
        """The partner's fp32 tensors from what it sent (the same list without compression),
        rebuilt off the event loop on our phi; a malformed part -> TensorRejected("compressed")."""
        if self.codec is None:
            return wire
        if st.wire is None:
            raise PeerError("local_error", "compressed exchange without our own payload (no reference phi)")
        codec, ref = self.codec, st.wire.ref
        work = (lambda: codec.decode_mean(wire, ref)) if mean else (lambda: codec.decode(st.round, wire, ref))
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(work)
        except ValueError as exc:
            raise TensorRejected("compressed", f"the partner's compressed tensors are malformed: {exc}") from None
        finally:
            st.codec_s += time.perf_counter() - t0

    async def send_done(self, stream: TensorStream, meta: Mapping[str, str] | None = None,
                        members: Sequence[str] = ()) -> None:
        """End our side: the "done" control tensor (``meta``; payload: ``members``, comma-joined)."""
        payload = torch.frombuffer(bytearray(",".join(members).encode()), dtype=torch.uint8) if members else _NO_MEMBERS
        await self._io(stream, stream.send(C.DONE, payload, meta))

    async def recv_done(self, stream: TensorStream) -> tuple[dict[str, str], list[str]]:
        """The partner's "done": its meta and member IDs."""
        r = await self._recv(stream)
        if r.name != C.DONE:
            raise TensorRejected("malformed", f"got tensor {r.name!r} where the partner's {C.DONE!r} comes next")
        text = r.tensor.numpy().tobytes().decode("utf-8", "replace")
        return r.meta, text.split(",") if text else []

    async def _recv(self, stream: TensorStream):
        return await self._io(stream, stream.recv())

    @staticmethod
    async def _io(stream: TensorStream, op):
        """Await a send or recv of ``stream``: a frame we rejected -> StreamRejected, any other
        end of the stream -> PeerError (the partner's refusal word, timeout or partner_error)."""
        try:
            return await op
        except StreamError as exc:
            if stream.rejected.is_set():
                raise StreamRejected(exc.reason, exc.detail.removeprefix(f"[{exc.reason}] ")) from None
            if isinstance(exc, StreamClosed):
                raise PeerError("partner_error", "the partner closed the stream early") from None
            raise PeerError(peer_reason(exc), exc.detail) from None

    def pacer(self, peer_id: str):
        if self.netem is None:
            return None
        cfg, addr = self.netem.cfg, self.addrs.get(peer_id)
        named = peer_id in cfg.links or (cfg.matrix is not None and peer_id in cfg.matrix.nodes)
        return self.netem.pacer(peer_id if named or not addr else addr)

    # ------------------------------------------------------------------ tensors
    async def check_finite(self, tensors: list[torch.Tensor], whose: str = "the partner's") -> None:
        big = sum(t.numel() * t.element_size() for t in tensors) >= THREAD_BYTES
        ok = await asyncio.to_thread(lambda: all(map(all_finite, tensors))) if big else all(map(all_finite, tensors))
        if not ok:
            raise TensorRejected("nonfinite", f"{whose} tensors contain NaN or inf; dropped")

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
        raise TensorRejected(reason, f"{detail}; dropped, this round is solo")

    async def clip(self, st: C.Round, theirs: list[torch.Tensor], peer: str | None) -> list[torch.Tensor]:
        """``theirs`` clipped toward our tensors by the robust rule (``optimizers/robust.py``;
        the same list when not clipped or without ``robust``). Counts the clip factor, logs a
        clipped contribution (``partner_clipped``) and charges ``peer`` (pass only a verified
        one) once it was clipped hard in ``strikes`` of its last ``window`` rounds with us
        (each further charge skips it twice as long)."""
        if self.share is not None and peer and st.mode == "pair":
            self.share.record(peer)
        if self.robust is None:
            return theirs
        big = sum(t.numel() * t.element_size() for t in theirs) >= THREAD_BYTES
        judge = lambda: self.robust.clip(st.tensors, theirs, st.move, peer, st.origin)  # noqa: E731
        v = await asyncio.to_thread(judge) if big else judge()
        if self.on_clip is not None:
            try:
                self.on_clip(v)
            except Exception:  # noqa: BLE001 - metrics must not break the exchange
                log.exception("on_clip callback failed")
        if v.factor < 1.0:
            emit(log, "partner_clipped", "round {round}: partner {short} clipped to factor {factor:.3g} "
                 "(distance {distance:.4g}, radius {radius:.4g}; pulled back {pulled_back:.3g} own moves)",
                 level=logging.WARNING if v.hard else logging.INFO,
                 round=st.round, short=(peer or "?")[:16], peer=peer, factor=round(v.factor, 4),
                 distance=round(v.distance, 6), radius=round(v.radius, 6), hard=v.hard,
                 pulled_back=round(v.pulled_back, 4),
                 cut_distance=None if v.cut_distance is None else round(v.cut_distance, 6),
                 hard_count=self.robust.hard_count(peer) if peer else None)
        if v.charge:  # counted by on_clip (swarmnode_outer_partners_charged_clipped_total)
            self.charge(peer, "clipped", v.charges)
        return v.tensors

    async def check_mean(self, st: C.Round, mean: list[torch.Tensor], root: str) -> None:
        """DiLoCo member: raise MeanRefused("robust_mean") when the ``root``'s ``mean`` is outside
        the robust rule against our own tensors (``PartnerClip.outside``: past the radius, or a
        pull back along our own move past the cut). A member cannot clip the mean (the group must
        apply one mean): it refuses it, steps solo and re-fetches phi, like a mean outside the
        fixed bounds; the root is charged at its second refused mean among its last
        ``robust_window`` (``PartnerClip.judge_mean``: a member whose own phi had drifted, say
        one that took a poisoned mean the others refused, refuses one honest mean, then re-syncs).
        No-op without ``robust``."""
        if self.robust is None:
            return
        big = sum(t.numel() * t.element_size() for t in mean) >= THREAD_BYTES
        judge = lambda: self.robust.outside(st.tensors, mean, st.move, st.origin)  # noqa: E731
        why = await asyncio.to_thread(judge) if big else judge()
        charge, charges = self.robust.judge_mean(root, why is not None)
        if why is None:
            return
        self.count("robust_mean")
        log.warning("group mean of round %d from root %s refused: %s", st.round, root[:16], why)
        if charge:
            self.charge(root, "robust_mean", charges)
        raise MeanRefused("robust_mean", f"the root's mean is outside the robust clip rule: {why}; "
                                         "dropped, this round is solo")

    def rejected(self, peer: str | None, reason: str) -> None:
        """A stream's assembler refused ``peer``'s frame (digest, size, dtype, ...): count it and
        charge the peer (the stream's ``on_reject``; pass only a peer known to have sent it)."""
        log.warning("tensors from %s rejected (%s); this round is solo", (peer or "an unverified caller")[:16], reason)
        self.count(reason)
        self.charge(peer, reason)

    def charge(self, peer: str | None, reason: str, times: int = 1) -> None:
        """``peer`` sent input we rejected: skip it as a partner for ``distrust_rounds`` rounds
        (``times``: its n-th charge of this kind, skipped 2**(n-1) times as long, at most 64x).
        Pass only a peer we know sent it (the one we called, or the caller's verified ID)."""
        if not peer or self.distrust_rounds <= 0:
            return
        until = (self.last_round or 0) + self.distrust_rounds * 2 ** min(6, max(0, times - 1))
        self.distrusted[peer] = max(until, self.distrusted.get(peer, 0))
        emit(log, "partner_charged", "partner {short} charged ({reason}): not paired with until round {until_round}",
             level=logging.WARNING, short=peer[:16], peer=peer, reason=reason, until_round=until)
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
            st.roster_read = task(self.roster(st))
        try:
            await asyncio.wait_for(asyncio.shield(st.roster_read), C.LOCK_WAIT_S)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - a slow or failed read: not seen
            pass
        return peer in st.roster_seen

    def over_share(self, peer: str, st: C.Round) -> bool:
        """Has ``peer`` had its share of our recent pair exchanges (``optimizers/partner_share.py``)?
        Then it is neither proposed to nor accepted this round."""
        if self.share is None:
            return False
        return self.share.over(peer, len(st.roster_seen - {self.peer_id, peer}) + 1)

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


class MeanRefused(TensorRejected):
    """A DiLoCo root's mean refused by the robust rule: already counted, and the root charged when
    due (``ExchangeLink.check_mean``)."""


class StreamRejected(TensorRejected):
    """The stream's assembler refused the partner's frame: already counted and charged
    (``ExchangeLink.rejected``); the stream is over."""


def peer_reason(exc: StreamError) -> str:
    """The result reason of a stream the partner ended: its refusal word, else timeout /
    partner_error."""
    if exc.refusal:
        return exc.refusal
    return "timeout" if exc.reason == "timeout" else "partner_error"


Roster = Callable[[C.Round], Any]  # async (round state) -> {peer_id: RosterEntry}; {} on DHT errors
__all__ = ["ExchangeLink", "Roster", "StreamRejected", "peer_reason"]
