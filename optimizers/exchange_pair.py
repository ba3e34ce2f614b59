"""NoLoCo pair averaging (``OuterExchange.pair_average``; protocol in ``optimizers/exchange.py``):
the proposer reads the roster and opens the exchange with a random peer after it in the round's
order (``exchange_common.proposes_to``: a hash of round and peer ID, new every round) under its
match lock; once accepted, BOTH sides run :func:`swap` on their end of the one tensor stream
(the callee from ``exchange_server.py``). The partner's tensors pass the link's bounds
(``ExchangeLink.check_bounds``) before the mean; a rejection charges the partner (skipped as a
candidate for ``distrust_rounds`` rounds).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from optimizers import exchange_common as C
from optimizers.exchange_common import GRACE_S, HANDSHAKE_S, PUBLISH_WAIT_S, RETRY, ExchangeResult
from optimizers.exchange_link import ExchangeLink, Roster, StreamRejected
from protocol.channels import remaining, task
from protocol.codec import TensorRejected
from protocol.stream_errors import PeerError, StreamError
from protocol.streams import TensorStream

log = logging.getLogger("swarmnode.noloco.exchange")


class PairExchange:
    """Runs one pair round as the proposer (and waits for the servicer when proposed to)."""

    def __init__(self, link: ExchangeLink, roster: Roster):
        self.link, self.roster = link, roster
        self._closing: set[asyncio.Task] = set()  # half-closes of finished streams

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
                cands = sorted(p for p in roster if C.proposes_to(link.peer_id, p, st.round) and p not in tried
                               and not link.is_distrusted(p, st.round) and not link.over_share(p, st))
                while cands and res is None and remaining(st.deadline) > 0:
                    pid = rng.choice(cands)
                    cands.remove(pid)
                    async with link.lock:
                        if st.matched is not None or st.closed:
                            break
                        verdict, stream = await self._propose(st, pid, roster[pid].grpc_addr)
                        if verdict == "accepted":
                            st.matched = pid
                    if verdict == "accepted":
                        res = await self._stream(st, pid, stream)
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
        """Open the exchange with ``pid`` -> ("accepted", stream) | ("retry"|"tried", None)."""
        link = self.link
        try:
            stream = await link.open(addr, pid, st, "pair", max(0.05, min(HANDSHAKE_S, remaining(st.deadline))))
        except (StreamError, OSError) as exc:
            reason = getattr(exc, "refusal", "") or "error"
            log.debug("proposal to %s at %s refused or failed: %s %r", pid[:16], addr, reason, exc)
            return ("retry" if reason in RETRY else "tried"), None
        if stream.peer.sender != pid:
            stream.cancel()
            log.debug("proposal to %s answered by %s", pid[:16], stream.peer.sender[:16])
            return "tried", None
        return "accepted", stream

    async def _stream(self, st: C.Round, pid: str, stream: TensorStream) -> ExchangeResult:
        res, bad = await swap(self.link, stream, st, pid, pid)
        if bad is None and res.outcome == C.OK:
            closing = task(stream.close())  # half-close; the callee ends the call once it read our "done"
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        else:
            stream.cancel()
        return res


async def swap(link: ExchangeLink, stream: TensorStream, st: C.Round, pid: str,
               charge_to: str | None, sent: list[int] | None = None) -> tuple[ExchangeResult, TensorRejected | None]:
    """Both sides of a matched pair run this on their end of the stream: send our tensors while
    reading the partner's, check them against ours (the bounds are symmetric: the partner
    reaches the same verdict), take the ordered mean, send "done", and count the round as
    averaged only once the partner's "done" arrives. Returns the result and, when we rejected
    the partner's tensors, why (counted, and ``charge_to`` charged: pass only a peer known to
    have sent them). ``sent[0]`` (when given) counts our payload bytes as they go out, so a
    caller whose swap is cancelled still knows what it sent."""
    sent, recv, t0 = [0] if sent is None else sent, 0, time.perf_counter()
    sender: asyncio.Task | None = None
    try:
        async with asyncio.timeout(max(0.0, remaining(st.deadline))):
            names, payload = await link.payload(st)  # fp32 tensors, or their compressed parts (outer_codec.py)
            sender = task(link.send(stream, payload, sent, names))
            theirs, recv = await link.recv_tensors(stream, check=False, names=link.incoming(st))
            await sender  # all of ours goes out before any verdict: the partner judges our tensors itself
            theirs = await link.rebuild(st, theirs)  # compressed: decoded on our phi; bounds apply to the result
            await link.check_bounds(st.tensors, theirs)
            theirs = await link.clip(st, theirs, charge_to)  # robust averaging: the partner's pull is bounded
            mean = await link.mean([(link.peer_id, st.tensors), (pid, theirs)])
            await link.send_done(stream)
            await link.recv_done(stream)
        return ExchangeResult(mean, 2, [pid], C.OK, "", sent[0], recv, exchange_s=time.perf_counter() - t0), None
    except (TensorRejected, PeerError, TimeoutError) as exc:
        return _failed(link, pid, charge_to, exc, sent[0], recv)
    finally:
        if sender is not None:
            sender.cancel()


def _failed(link: ExchangeLink, pid: str, charge_to: str | None, exc: Exception, sent: int,
            recv: int) -> tuple[ExchangeResult, TensorRejected | None]:
    if isinstance(exc, TensorRejected):
        if not isinstance(exc, StreamRejected):  # the stream's own refusals are counted where they happen
            link.count(exc.reason)
            link.charge(charge_to, exc.reason)
            log.warning("tensors from %s rejected: %s; this round is solo", pid[:16], exc)
        return ExchangeResult(None, 1, [pid], C.FAILED, exc.reason, sent, recv), exc
    reason = exc.reason if isinstance(exc, PeerError) else "timeout"
    log.warning("pair exchange with %s failed (%s: %s); this round is solo", pid[:16], reason, exc)
    return ExchangeResult(None, 1, [pid], C.FAILED, reason, sent, recv), None
