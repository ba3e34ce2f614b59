"""Transport of the NoLoCo/DiLoCo outer step: find a group for round r, return the exact mean.

Owns group formation through the DHT roster (``optimizers/roster.py``) and the tensor
exchange over our own gRPC (``protocol/noloco.proto``). Frames, the mean and shared types are
in ``exchange_common.py``, the DiLoCo root/member side in ``exchange_group.py``. It does not own
the optimizer math (the role hands tensors in and gets means back) nor the gRPC server: the
role registers ``add_exchange_to_server(ex.servicer(), server)`` (zero-copy frames; use this)
or the generated ``noloco_pb2_grpc.add_NoLoCoServicer_to_server`` (protobuf frames, slower).

pair_average (NoLoCo, k=2; no global barrier):
  1. mark WAITING(r) (the servicer now accepts proposals for r), publish a RosterEntry;
  2. loop until matched, closed or the deadline: read the roster; candidates = entries with a
     HIGHER peer ID, same cfg_hash, not finally refused this round; pick one at random
     (``Random(f"{r}:{me}")``); holding MY match lock, open ``Exchange`` and wait for the reply
     header. The callee takes ITS lock (<= LOCK_WAIT_S, else "busy": retried later), accepts
     only if WAITING(r), in pair mode and unmatched, and marks itself MATCHED. Proposals only
     go up in peer-ID order, so lock waits cannot form a cycle. A worker matched by an incoming
     proposal stops proposing. Refusals "matched", "other_round", "stale", errors: final for
     that candidate this round. No candidate: sleep ``poll_interval_s``, re-read. Any two
     unmatched waiting workers eventually meet (the lower one tries the higher), so with enough
     time the pairing is maximal: an even number of waiting workers all pair;
  3. both sides stream their tensors at once (4 MiB chunks, netem pacer on send), decode the
     other's with TensorAssembler (expected = specs, cap = largest spec), compute
     ``(lower + higher) / 2`` themselves (ascending peer-ID order: bitwise equal on both sides)
     in one blockwise pass that also checks finiteness (NaN/inf -> "nonfinite"), then send
     "done"(accepted); a side returns ok only after the partner's "done"(accepted);
  4. anything else (refusal, stream error, digest, NaN, deadline) -> solo/failed, mean None.
group_average (DiLoCo, everyone): see ``exchange_group.py``. Root = lowest peer ID in the
  roster once it has ``expected`` entries or timeout/2 passed; members stream to the root and
  read back the one mean it computed; failures -> "failed" (the role re-fetches phi).
Every await is bounded by the call's deadline (+1 s grace for an exchange in flight). Headers
are validated (run, cfg_hash, spec hash, sender peer ID, round skew, order); refusals that mark
a bad or misconfigured peer (COUNTED) and rejected tensors call ``on_reject(reason)``. The
channel is unauthenticated (no TLS): ``sender`` is a claim, checked for form only.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from node.netem import LinkEmulator
from optimizers import exchange_common as C
from optimizers.exchange_common import (COUNTED, GRACE_S, HANDSHAKE_S, IDLE_S, LOCK_WAIT_S, METHOD, OPEN_WAIT_S,
                                         PUBLISH_WAIT_S, RETRY, SERVICE, ExchangeResult)
from optimizers.exchange_group import GroupMixin
from optimizers.roster import RosterEntry, publish_entry, read_roster
from protocol import noloco_pb2_grpc
from protocol.codec import DEFAULT_CHUNK_BYTES, ChunkView, TensorAssembler, TensorRejected
from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from security.keys import public_key_of

__all__ = ["ExchangeResult", "OuterExchange", "NoLoCoServicer", "add_exchange_to_server", "METHOD"]

log = logging.getLogger("swarmnode.noloco.exchange")



class OuterExchange(GroupMixin):
    """One per worker. ``pair_average`` / ``group_average`` one call at a time; see module doc."""

    def __init__(self, *, run_id: str, peer_id: str, cfg_hash: str, grpc_addr: str, dht: Any,
                 specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], netem: LinkEmulator | None = None,
                 max_round_skew: int = 2, poll_interval_s: float = 0.25,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 on_reject: Callable[[str], None] | None = None):
        public_key_of(peer_id)  # raises for a non-Ed25519 peer ID
        if not specs:
            raise ValueError("OuterExchange needs at least one tensor spec")
        self.specs: list[C.Spec] = [(n, d, tuple(int(x) for x in s)) for n, d, s in specs]
        names = [s[0] for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor spec names must be unique: {names[:8]}...")
        for n, d, _ in self.specs:
            if not d.is_floating_point:
                raise ValueError(f"spec {n!r} has dtype {d}; the exchange averages floating tensors only")
        self.run_id, self.peer_id, self.cfg_hash, self.grpc_addr = run_id, peer_id, cfg_hash, grpc_addr
        self.dht, self.netem, self.max_round_skew = dht, netem, int(max_round_skew)
        self.poll_interval_s, self.on_reject = float(poll_interval_s), on_reject
        self._names = names
        self._expected = {n: (d, s) for n, d, s in self.specs}
        self._cap = max(C.spec_bytes(s) for s in self.specs)
        self._spec_hash = C.spec_hash(self.specs)
        self._chan_opts = channel_options(max_message_bytes)
        self._chunk = min(DEFAULT_CHUNK_BYTES, max_message_bytes - 4096)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._addrs: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._state: C.Round | None = None
        self._last_round: int | None = None
        self._closed = False
        self._bg: set[asyncio.Task] = set()  # roster publishes finishing in the background

    # ------------------------------------------------------------------ public API
    def servicer(self) -> "NoLoCoServicer":
        return NoLoCoServicer(self)

    async def pair_average(self, round: int, tensors: list[torch.Tensor], timeout: float) -> ExchangeResult:  # noqa: A002
        """NoLoCo k=2: average with one random partner waiting for the same round, or go solo."""
        t0, st, publish = await self._enter(round, "pair", tensors, timeout)
        if st is None:
            return self._done(t0, None, C.ExchangeResult(None, 1, [], C.SOLO, "closed"))
        rng, tried, seen, polls = random.Random(f"{round}:{self.peer_id}"), set(), False, 0
        res: ExchangeResult | None = None
        # peers entering with us publish at the same moment: once our entry is stored theirs
        # usually is too, so the first roster read finds them instead of starting the poll backoff
        await asyncio.wait({publish}, timeout=min(PUBLISH_WAIT_S, max(0.0, C.remaining(st.deadline))))
        try:
            while res is None and st.matched is None and not st.closed and C.remaining(st.deadline) > 0:
                roster = await self._roster(st)
                seen = seen or bool(roster)
                cands = sorted(p for p in roster if p > self.peer_id and p not in tried)
                while cands and res is None and C.remaining(st.deadline) > 0:
                    pid = rng.choice(cands)
                    cands.remove(pid)
                    async with self._lock:
                        if st.matched is not None or st.closed:
                            break
                        verdict, call = await self._propose(st, pid, roster[pid].grpc_addr)
                        if verdict == "accepted":
                            st.matched = pid
                    if verdict == "accepted":
                        res = await self._client_pair(st, pid, call)
                    elif verdict != "retry":
                        tried.add(pid)
                if res is None and st.matched is None:
                    # partners usually arrive within moments: poll fast first, then back off
                    await self._sleep(st, min(self.poll_interval_s, 0.02 * 2 ** polls))
                    polls += 1
            if res is None:
                async with self._lock:
                    if st.matched is None:
                        st.closed = True
                if st.matched is None:
                    why = "closed" if self._closed else ("timeout" if seen else "no_partner")
                    res = C.ExchangeResult(None, 1, [], C.SOLO, why)
                else:  # matched by an incoming proposal: its handler produces the result
                    try:
                        res = await asyncio.wait_for(asyncio.shield(st.incoming),
                                                     max(0.0, C.remaining(st.deadline)) + GRACE_S)
                    except asyncio.TimeoutError:
                        res = C.ExchangeResult(None, 1, [st.matched], C.FAILED, "timeout")
        finally:
            st.closed = True
        return self._done(t0, publish, res)

    async def group_average(self, round: int, tensors: list[torch.Tensor], timeout: float,  # noqa: A002
                            expected: int) -> ExchangeResult:
        """DiLoCo: exact mean over every worker of round r (root = lowest peer ID); see module doc."""
        t0, st, publish = await self._enter(round, "group", tensors, timeout)
        if st is None:
            return self._done(t0, None, C.ExchangeResult(None, 1, [], C.SOLO, "closed"))
        loop = asyncio.get_running_loop()
        st.collect_end = loop.time() + 0.75 * timeout
        settle = loop.time() + timeout / 2
        try:
            view = await self._roster(st)
            while len(view) + 1 < expected and loop.time() < settle and not st.closed:
                await self._sleep(st, min(self.poll_interval_s, max(0.0, settle - loop.time())))
                view = await self._roster(st)
            root = min([self.peer_id, *view])
            st.root = root
            if root == self.peer_id:
                res = await self._run_root(st, expected, view)
            else:
                st.decided.set()  # contributions sent to us early are told "not_root:<root>"
                res = await self._gather(st, root, view)
        finally:
            st.closed = True
            st.decided.set()
        return self._done(t0, publish, res)

    async def close(self) -> None:
        """Stop accepting, end pending waits (solo), close client channels."""
        self._closed = True
        st = self._state
        if st is not None:
            st.closed = True
            st.wake.set()
            st.decided.set()
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            try:
                await ch.close(grace=None)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    # ------------------------------------------------------------------ call plumbing
    async def _enter(self, round: int, mode: str, tensors, timeout: float):  # noqa: A002
        t0 = time.perf_counter()
        if self._state is not None:
            raise RuntimeError(f"an outer exchange (round {self._state.round}) is still running; await "
                               f"it before starting round {round}")
        if len(tensors) != len(self.specs):
            raise ValueError(f"got {len(tensors)} tensors, the specs list {len(self.specs)}")
        for t, (n, d, s) in zip(tensors, self.specs):
            if t.dtype != d or tuple(t.shape) != s:
                raise ValueError(f"tensor {n!r} is {t.dtype}{tuple(t.shape)}, the spec says {d}{s}")
        if self._closed:
            return t0, None, None
        loop = asyncio.get_running_loop()
        st = C.Round(round=int(round), mode=mode, tensors=list(tensors), deadline=loop.time() + float(timeout))
        st.incoming = loop.create_future()
        st.digests = C.task(asyncio.to_thread(C.digests, st.tensors))  # hashed while we look for partners
        self._state, self._last_round = st, int(round)
        entry = RosterEntry(round=int(round), grpc_addr=self.grpc_addr, cfg_hash=self.cfg_hash,
                            waiting_since=time.time())
        ttl = min(120.0, max(10.0, 2.0 * float(timeout)))
        publish = C.task(publish_entry(self.dht, self.run_id, self.peer_id, entry, ttl,
                                      timeout=max(1.0, min(10.0, float(timeout)))))
        self._bg.add(publish)
        publish.add_done_callback(self._bg.discard)
        return t0, st, publish

    def _done(self, t0: float, publish: asyncio.Task | None, res: ExchangeResult) -> ExchangeResult:
        self._state = None
        res.blocked_s = time.perf_counter() - t0
        if res.outcome != C.OK:
            log.info("outer exchange gave no mean: %s (%s); the role takes a solo step", res.outcome, res.reason,
                     extra={"event": "exchange_solo", "outcome": res.outcome, "reason": res.reason})
        return res

    async def _sleep(self, st: C.Round, s: float) -> None:
        st.wake.clear()
        try:
            await asyncio.wait_for(st.wake.wait(), max(0.0, min(s, C.remaining(st.deadline))))
        except asyncio.TimeoutError:
            pass

    async def _roster(self, st: C.Round) -> dict[str, RosterEntry]:
        """Other workers of this round with our cfg_hash; {} on DHT errors (we poll again)."""
        left = C.remaining(st.deadline)
        if left <= 0:
            return {}
        try:
            roster = await read_roster(self.dht, self.run_id, st.round, timeout=min(5.0, left))
        except Exception as exc:  # noqa: BLE001 - a failed read is retried at the next poll
            log.debug("roster read failed: %r", exc)
            return {}
        out = {p: e for p, e in roster.items() if p != self.peer_id and e.cfg_hash == self.cfg_hash}
        self._addrs.update((p, e.grpc_addr) for p, e in out.items())
        return out

    def _count(self, reason: str) -> None:
        if self.on_reject is not None:
            try:
                self.on_reject(reason)
            except Exception:  # noqa: BLE001 - metrics must not break the exchange
                log.exception("on_reject callback failed")

    def _pacer(self, peer_id: str):
        if self.netem is None:
            return None
        cfg, addr = self.netem.cfg, self._addrs.get(peer_id)
        named = peer_id in cfg.links or (cfg.matrix is not None and peer_id in cfg.matrix.nodes)
        return self.netem.pacer(peer_id if named or not addr else addr)

    def _channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = grpc.aio.insecure_channel(addr, options=self._chan_opts)
        return ch

    def _open_call(self, addr: str, st: C.Round):
        method = self._channel(addr).stream_stream(METHOD, request_serializer=C.serialize,
                                                   response_deserializer=C.parse_wire)
        return method(timeout=max(0.05, C.remaining(st.deadline)))

    def _hdr(self, wire: bool, st: C.Round | None, stage: str, accepted: bool = True, reason: str = "",
             mode: str = "pair", **extra):
        return C.header_frame(wire, run_id=self.run_id, round=st.round if st else (self._last_round or 0),
                              sender=self.peer_id, cfg_hash=self.cfg_hash, n_tensors=len(self.specs),
                              mode=mode, accepted=accepted, reason=reason, spec_hash=self._spec_hash,
                              stage=stage, **extra)

    async def _next(self, read, deadline: float):
        """Next frame from ``read()`` within the idle/deadline bound; raises C.PeerError at EOF."""
        try:
            item = await asyncio.wait_for(read(), max(0.01, min(IDLE_S, C.remaining(deadline))))
        except (StopAsyncIteration, asyncio.TimeoutError) as exc:
            raise C.PeerError("timeout" if isinstance(exc, asyncio.TimeoutError) else "partner_error",
                             "the partner's stream ended or stalled") from None
        except grpc.aio.AioRpcError as exc:
            raise C.PeerError("partner_error", f"{exc.code().name}: {exc.details()}") from None
        if item is grpc.aio.EOF:
            raise C.PeerError("partner_error", "the partner closed the stream early")
        return item

    async def _read_tensors(self, read, deadline: float, check: bool = True) -> tuple[list[torch.Tensor], int]:
        """The partner's tensors in spec order (decoded, checked, finite if ``check``) and their bytes."""
        asm = TensorAssembler(self._cap, self._expected, cap_key="noloco tensor specs")
        got: dict[str, torch.Tensor] = {}
        nbytes = 0
        while len(got) < len(self.specs):
            kind, obj = C.split(await self._next(read, deadline))
            if kind == "header":
                raise C.PeerError(f"partner_{obj.reason or 'refused'}" if not obj.accepted else "partner_error",
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
        tensors = [got[n] for n in self._names]
        if check:
            await self._check_finite(tensors)
        return tensors, nbytes

    async def _check_finite(self, tensors: list[torch.Tensor], whose: str = "the partner's") -> None:
        big = sum(t.numel() * t.element_size() for t in tensors) >= C.THREAD_BYTES
        ok = await asyncio.to_thread(lambda: all(map(C.all_finite, tensors))) if big else all(map(C.all_finite, tensors))
        if not ok:
            raise TensorRejected("nonfinite", f"{whose} tensors contain NaN or inf; dropped (security.md §7)")

    async def _mean_of(self, parts: list[tuple[str, list[torch.Tensor]]]) -> list[torch.Tensor]:
        """Mean in ascending peer-ID order, written over a received buffer; raises
        TensorRejected("nonfinite") if it is not finite (our own tensors are checked then, so the
        partner is not blamed for our NaN). Received tensors are consumed."""
        order = sorted(parts, key=lambda x: x[0])
        ordered = [t for _, t in order]
        owned = {i for i, (pid, _) in enumerate(order) if pid != self.peer_id}
        if sum(C.spec_bytes(s) for s in self.specs) >= C.THREAD_BYTES:
            mean, finite = await asyncio.to_thread(C.mean_of, ordered, owned)
        else:
            mean, finite = C.mean_of(ordered, owned)
        if not finite:
            mine = dict(parts)[self.peer_id]
            if not all(map(C.all_finite, mine)):
                raise C.PeerError("local_nonfinite", "our own tensors hold NaN/inf: the role must not send them")
            raise TensorRejected("nonfinite", "the partner's tensors contain NaN or inf (the mean is not "
                                              "finite); dropped (security.md §7)")
        return mean

    # ------------------------------------------------------------------ pair: caller side
    async def _propose(self, st: C.Round, pid: str, addr: str):
        """Open Exchange to ``pid`` and wait for its reply -> ("accepted", call) | ("retry"|"tried", None)."""
        call = None
        try:
            call = self._open_call(addr, st)
            wait = max(0.05, min(HANDSHAKE_S, C.remaining(st.deadline)))
            await asyncio.wait_for(call.write(self._hdr(True, st, "open")), wait)
            kind, hdr = C.split(await self._next(call.read, min(st.deadline, asyncio.get_running_loop().time() + wait)))
        except (C.PeerError, grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError, OSError) as exc:
            log.debug("proposal to %s at %s failed: %r", pid[:16], addr, exc)
            if call is not None:
                call.cancel()
            return "tried", None
        if kind != "header" or hdr.stage != "reply" or not hdr.accepted or hdr.sender != pid:
            call.cancel()
            reason = hdr.reason if kind == "header" else "malformed"
            log.debug("proposal to %s refused: %s", pid[:16], reason)
            return ("retry" if reason in RETRY else "tried"), None
        return "accepted", call

    async def _client_pair(self, st: C.Round, pid: str, call) -> ExchangeResult:
        sent, recv, ok_to_ack = 0, 0, asyncio.get_running_loop().create_future()

        async def writer():
            nonlocal sent
            async for frame, n in C.encode_tensors(st.tensors, self._names, True, self._pacer(pid), self._chunk,
                                                    st.digests):
                await call.write(frame)
                sent += n
            if await ok_to_ack:
                await call.write(self._hdr(True, st, "done"))
                await call.done_writing()

        wtask, ok, t0 = C.task(writer()), False, time.perf_counter()
        try:
            async with asyncio.timeout(max(0.0, C.remaining(st.deadline))):
                theirs, recv = await self._read_tensors(call.read, st.deadline, check=False)
                mean = await self._mean_of([(self.peer_id, st.tensors), (pid, theirs)])
                ok_to_ack.set_result(True)
                kind, hdr = C.split(await self._next(call.read, st.deadline))
                await wtask
            if kind != "header" or hdr.stage != "done" or not hdr.accepted:
                raise C.PeerError("partner_refused", f"partner's done frame: {hdr}")
            ok = True
            return C.ExchangeResult(mean, 2, [pid], C.OK, "", sent, recv, exchange_s=time.perf_counter() - t0)
        except TensorRejected as exc:
            self._count(exc.reason)
            log.warning("tensors from %s rejected: %s; this round is solo", pid[:16], exc)
            return C.ExchangeResult(None, 1, [pid], C.FAILED, exc.reason, sent, recv)
        except (C.PeerError, grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as exc:
            reason = exc.reason if isinstance(exc, C.PeerError) else (
                "timeout" if isinstance(exc, asyncio.TimeoutError) else "partner_error")
            log.warning("pair exchange with %s failed (%s: %s); this round is solo", pid[:16], reason, exc)
            return C.ExchangeResult(None, 1, [pid], C.FAILED, reason, sent, recv)
        finally:
            if not ok_to_ack.done():
                ok_to_ack.set_result(False)
            if not wtask.done():
                wtask.cancel()
            if not ok and not call.done():
                call.cancel()

    # ------------------------------------------------------------------ server side
    def _check_open(self, h, st: C.Round | None) -> None:
        """Raise C.Refused for a header we must not serve (see ops.md §10 for the codes)."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if h.run_id != self.run_id:
            raise C.Refused(bad, "run", f"run {h.run_id[:40]!r} is not this node's run {self.run_id!r}")
        if h.cfg_hash != self.cfg_hash:
            raise C.Refused(bad, "cfg_hash", f"cfg_hash {h.cfg_hash[:32]!r} != {self.cfg_hash!r}: the peers "
                                            "run different [noloco]/model configs")
        try:
            public_key_of(h.sender)
        except ValueError:
            raise C.Refused(bad, "sender", "sender is not an Ed25519 peer ID (12D3KooC...)") from None
        if h.mode not in ("pair", "gather"):
            raise C.Refused(bad, "mode", f"mode {h.mode[:16]!r} is not 'pair' or 'gather'")
        if h.spec_hash != self._spec_hash or h.n_tensors != len(self.specs):
            raise C.Refused(bad, "specs", f"tensor specs differ ({h.n_tensors} tensors, hash {h.spec_hash[:16]!r};"
                                         f" mine {len(self.specs)}, {self._spec_hash!r})")
        mine = st.round if st is not None else self._last_round
        pre = grpc.StatusCode.FAILED_PRECONDITION
        if mine is None:
            raise C.Refused(pre, "not_waiting", "this worker has not started an outer round yet (current round: none)")
        if h.round + self.max_round_skew < mine:
            raise C.Refused(pre, "stale", f"round {h.round} is stale; current round {mine}")
        if h.round > mine + self.max_round_skew:
            raise C.Refused(pre, "future", f"round {h.round} is too far ahead; current round {mine}")
        if st is None or st.closed or st.round != h.round:
            raise C.Refused(pre, "other_round", f"not waiting for round {h.round}; current round {mine}")
        if (h.mode == "pair") != (st.mode == "pair"):
            raise C.Refused(pre, "mode_mismatch", f"this worker is in {st.mode} mode for round {mine}")
        if h.mode == "pair" and not h.sender < self.peer_id:
            raise C.Refused(bad, "order", "pair proposals go from the lower to the higher peer ID")
        if h.mode == "gather":
            if st.root not in (None, self.peer_id):
                raise C.Refused(pre, f"not_root:{st.root}", f"this worker is not the root of round {mine}")
            if st.mean is not None:
                raise C.Refused(pre, "late", f"the mean of round {mine} is already computed")
            if h.sender in st.arriving or h.sender in st.contribs:
                raise C.Refused(bad, "duplicate", f"{h.sender[:16]}... already contributes to round {mine}")

    async def serve(self, requests, context, wire: bool):
        """The Exchange handler (an async generator of response frames)."""
        it = requests.__aiter__()
        try:
            kind, h = C.split(await self._next(it.__anext__, asyncio.get_running_loop().time() + OPEN_WAIT_S))
            st = self._state
            if kind != "header" or h.stage != "open":
                raise C.Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "first frame must be an 'open' header")
            self._check_open(h, st)
            if h.mode == "pair":
                await self._claim(st, h.sender)
        except C.PeerError:
            return
        except C.Refused as r:
            if r.reason in COUNTED:
                self._count(r.reason)
            yield self._hdr(wire, self._state, "reply", False, r.reason)
            await context.abort(r.code, f"{r.reason}: {r.detail}")
            return
        gen = self._serve_pair(st, h.sender, it, context, wire) if h.mode == "pair" else \
            self._serve_gather(st, h.sender, it, context, wire)
        async for frame in gen:
            yield frame

    async def _claim(self, st: C.Round, sender: str) -> None:
        pre = grpc.StatusCode.FAILED_PRECONDITION
        try:
            await asyncio.wait_for(self._lock.acquire(), LOCK_WAIT_S)
        except asyncio.TimeoutError:
            raise C.Refused(pre, "busy", f"busy proposing; retry (round {st.round})") from None
        try:
            if st.closed or self._state is not st:
                raise C.Refused(pre, "other_round", f"no longer waiting for round {st.round}")
            if st.matched is not None:
                raise C.Refused(pre, "matched", f"already matched for round {st.round}")
            st.matched = sender
            st.wake.set()
        finally:
            self._lock.release()

    async def _serve_pair(self, st: C.Round, pid: str, it, context, wire: bool):
        sent, recv, res, abort, t0 = 0, 0, None, None, time.perf_counter()
        reader = C.task(self._read_tensors(it.__anext__, st.deadline, check=False))
        try:
            yield self._hdr(wire, st, "reply", True)
            async for frame, n in C.encode_tensors(st.tensors, self._names, wire, self._pacer(pid), self._chunk,
                                                    st.digests):
                if reader.done() and reader.exception() is not None:
                    break
                yield frame
                sent += n
            async with asyncio.timeout(max(0.0, C.remaining(st.deadline))):
                theirs, recv = await reader
                mean = await self._mean_of([(self.peer_id, st.tensors), (pid, theirs)])
            yield self._hdr(wire, st, "done")
            kind, hdr = C.split(await self._next(it.__anext__, st.deadline))
            if kind != "header" or hdr.stage != "done" or not hdr.accepted:
                raise C.PeerError("partner_refused", "partner did not confirm")
            res = C.ExchangeResult(mean, 2, [pid], C.OK, "", sent, recv, exchange_s=time.perf_counter() - t0)
        except TensorRejected as exc:
            self._count(exc.reason)
            log.warning("tensors from %s rejected: %s; this round is solo", pid[:16], exc)
            res = C.ExchangeResult(None, 1, [pid], C.FAILED, exc.reason, sent, recv)
            abort = (grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason}: {exc.message}")
        except (C.PeerError, asyncio.TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, C.PeerError) else "timeout"
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


class NoLoCoServicer(noloco_pb2_grpc.NoLoCoServicer):
    """gRPC servicer; registers with the generated ``add_NoLoCoServicer_to_server`` (protobuf
    frames) or, faster, ``add_exchange_to_server`` (hand-serialized chunks)."""

    def __init__(self, exchange: OuterExchange, wire: bool = False):
        self.exchange, self.wire = exchange, wire

    async def Exchange(self, request_iterator, context):  # noqa: N802 - gRPC API
        async for frame in self.exchange.serve(request_iterator, context, self.wire):
            yield frame


def add_exchange_to_server(servicer: NoLoCoServicer, server: grpc.aio.Server) -> None:
    """Register ``swarmnode.NoLoCo/Exchange`` with the zero-copy frame (de)serializers."""
    fast = NoLoCoServicer(servicer.exchange, wire=True)
    handler = grpc.stream_stream_rpc_method_handler(fast.Exchange, request_deserializer=C.parse_wire,
                                                    response_serializer=C.serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Exchange": handler}),))
