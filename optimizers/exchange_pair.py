"""NoLoCo pair averaging, the caller's side (``OuterExchange.pair_average``; protocol in
``optimizers/exchange.py``): read the roster, propose to a random higher peer ID under our
match lock, stream both ways once accepted, take the ordered mean, confirm with "done".
The callee's side is ``exchange_server.py``; both share one ``ExchangeLink``. The partner's
tensors pass the link's bounds (``ExchangeLink.check_bounds``) before the mean; a rejection
charges the partner (skipped as a candidate for ``distrust_rounds`` rounds).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from optimizers import exchange_common as C
from optimizers.exchange_common import GRACE_S, HANDSHAKE_S, PUBLISH_WAIT_S, RETRY, ExchangeResult
from optimizers.exchange_link import ExchangeLink, Roster
from protocol.codec import TensorRejected
from protocol.streams import PeerError, remaining, task

log = logging.getLogger("swarmnode.noloco.exchange")


class PairExchange:
    """Runs one pair round as the proposer (and waits for the servicer when proposed to)."""

    def __init__(self, link: ExchangeLink, roster: Roster):
        self.link, self.roster = link, roster

    async def run(self, st: C.Round, publish: asyncio.Task) -> ExchangeResult:
        link = self.link
        rng, tried, seen, polls = random.Random(f"{st.round}:{link.peer_id}"), set(), False, 0
        res: ExchangeResult | None = None
        # peers entering with us publish at the same moment: once our entry is stored theirs
        # usually is too, so the first roster read finds them instead of starting the poll backoff
        await asyncio.wait({publish}, timeout=min(PUBLISH_WAIT_S, max(0.0, remaining(st.deadline))))
        try:
            while res is None and st.matched is None and not st.closed and remaining(st.deadline) > 0:
                roster = await self.roster(st)
                seen = seen or bool(roster)
                cands = sorted(p for p in roster if p > link.peer_id and p not in tried
                               and not link.is_distrusted(p, st.round))
                while cands and res is None and remaining(st.deadline) > 0:
                    pid = rng.choice(cands)
                    cands.remove(pid)
                    async with link.lock:
                        if st.matched is not None or st.closed:
                            break
                        verdict, call = await self._propose(st, pid, roster[pid].grpc_addr)
                        if verdict == "accepted":
                            st.matched = pid
                    if verdict == "accepted":
                        res = await self._stream(st, pid, call)
                    elif verdict != "retry":
                        tried.add(pid)
                if res is None and st.matched is None:
                    # partners usually arrive within moments: poll fast first, then back off
                    await link.sleep(st, min(link.poll_interval_s, 0.02 * 2 ** polls))
                    polls += 1
            if res is None:
                async with link.lock:
                    if st.matched is None:
                        st.closed = True
                if st.matched is None:
                    why = "closed" if link.closed else (st.solo_reason or ("timeout" if seen else "no_partner"))
                    res = ExchangeResult(None, 1, [], C.SOLO, why)
                else:  # matched by an incoming proposal: its handler produces the result
                    try:
                        res = await asyncio.wait_for(asyncio.shield(st.incoming),
                                                     max(0.0, remaining(st.deadline)) + GRACE_S)
                    except asyncio.TimeoutError:
                        res = ExchangeResult(None, 1, [st.matched], C.FAILED, "timeout")
        finally:
            st.closed = True
        return res

    async def _propose(self, st: C.Round, pid: str, addr: str):
        """Open Exchange to ``pid`` and wait for its reply -> ("accepted", call) | ("retry"|"tried", None)."""
        link, call = self.link, None
        try:
            call = link.open_call(addr, st)
            wait = max(0.05, min(HANDSHAKE_S, remaining(st.deadline)))
            await asyncio.wait_for(call.write(link.hdr(True, st, "open")), wait)
            kind, hdr = C.split(await link.next(call.read, min(st.deadline, asyncio.get_running_loop().time() + wait)))
        except (PeerError, grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError, OSError) as exc:
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

    async def _stream(self, st: C.Round, pid: str, call) -> ExchangeResult:
        link = self.link
        sent, recv, ok_to_ack = 0, 0, asyncio.get_running_loop().create_future()

        async def writer():
            nonlocal sent
            async for frame, n in link.encode(st.tensors, True, pid, st.digests):
                await call.write(frame)
                sent += n
            if await ok_to_ack:
                await call.write(link.hdr(True, st, "done"))
                await call.done_writing()

        wtask, ok, t0 = task(writer()), False, time.perf_counter()
        try:
            async with asyncio.timeout(max(0.0, remaining(st.deadline))):
                theirs, recv = await link.read_tensors(call.read, st.deadline, check=False)
                await link.check_bounds(st.tensors, theirs)  # symmetric: the partner's verdict is the same
                mean = await link.mean([(link.peer_id, st.tensors), (pid, theirs)])
                ok_to_ack.set_result(True)
                kind, hdr = C.split(await link.next(call.read, st.deadline))
                await wtask
            if kind != "header" or hdr.stage != "done" or not hdr.accepted:
                raise PeerError("partner_refused", f"partner's done frame: {hdr}")
            ok = True
            return ExchangeResult(mean, 2, [pid], C.OK, "", sent, recv, exchange_s=time.perf_counter() - t0)
        except TensorRejected as exc:
            link.count(exc.reason)
            link.charge(pid, exc.reason)
            log.warning("tensors from %s rejected: %s; this round is solo", pid[:16], exc)
            return ExchangeResult(None, 1, [pid], C.FAILED, exc.reason, sent, recv)
        except (PeerError, grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as exc:
            reason = exc.reason if isinstance(exc, PeerError) else (
                "timeout" if isinstance(exc, asyncio.TimeoutError) else "partner_error")
            log.warning("pair exchange with %s failed (%s: %s); this round is solo", pid[:16], reason, exc)
            return ExchangeResult(None, 1, [pid], C.FAILED, reason, sent, recv)
        finally:
            if not ok_to_ack.done():
                ok_to_ack.set_result(False)
            if not wtask.done():
                wtask.cancel()
            if not ok and not call.done():
                call.cancel()
