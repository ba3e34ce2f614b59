"""DiLoCo group averaging (``OuterExchange.group_average``): the root's and the members' side.

Policy (see ``optimizers/exchange.py`` for the whole protocol): root = lowest peer ID in the
round's roster once it has ``expected`` entries or timeout/2 passed. Members stream their
tensors to the root in mode "gather" and read the mean back; a root that is not the root in its
own view answers "not_root:<root>" and the member follows that once per try (3 tries). The root
collects until it has expected-1 contributions, or every roster member it has seen (re-read
while waiting), or 0.75*timeout; late contributions are refused ("late"). The mean is computed
once (ascending peer ID) and sent bitwise to every member; a member whose gather failed gets
outcome "failed" and must re-fetch phi (DiLoCo assumes identical phi).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from optimizers import exchange_common as C
from optimizers.exchange_common import GRACE_S
from optimizers.roster import RosterEntry
from protocol.codec import TensorRejected

log = logging.getLogger("swarmnode.noloco.exchange")


class GroupMixin:
    """Mixed into ``OuterExchange``; uses its helpers (_read_tensors, _mean_of, _hdr, ...)."""

    async def _serve_gather(self, st: C.Round, pid: str, it, context, wire: bool):
        me, pre = self.peer_id, grpc.StatusCode.FAILED_PRECONDITION
        st.arriving.add(pid)
        fut = st.sends[pid] = asyncio.get_running_loop().create_future()
        abort = None
        try:
            yield self._hdr(wire, st, "reply", True, mode="gather")
            try:
                theirs, recv = await self._read_tensors(it.__anext__, st.deadline)
            finally:
                st.arriving.discard(pid)  # in transit no more: the root need not wait for it
            if st.root in (None, me) and st.mean is None and not st.closed:
                st.contribs[pid] = theirs
                st.received += recv
            st.wake.set()
            await asyncio.wait_for(st.decided.wait(), max(0.0, C.remaining(st.deadline)))
            if st.mean is None or pid not in st.members:
                why = f"not_root:{st.root}" if st.root not in (None, me) else "late"
                yield self._hdr(wire, st, "done", False, why, mode="gather")
                abort = (pre, f"{why} (round {st.round})")
            else:
                sent = 0
                async for frame, n in C.encode_tensors(st.mean, self._names, wire, self._pacer(pid), self._chunk,
                                                        st.mean_digests):
                    yield frame
                    sent += n
                yield self._hdr(wire, st, "done", True, mode="gather", group_size=len(st.members),
                                members=st.members)
                fut.set_result(sent)
        except TensorRejected as exc:
            self._count(exc.reason)
            log.warning("gather contribution from %s rejected: %s", pid[:16], exc)
            abort = (grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason}: {exc.message}")
        except (C.PeerError, asyncio.TimeoutError) as exc:
            log.warning("gather stream from %s failed: %r", pid[:16], exc)
        finally:
            st.arriving.discard(pid)
            if not fut.done():
                fut.set_result(0)
        if abort is not None:
            await context.abort(*abort)

    # ------------------------------------------------------------------ group: root and members
    async def _run_root(self, st: C.Round, expected: int, view: dict[str, RosterEntry]) -> C.ExchangeResult:
        loop = asyncio.get_running_loop()
        seen: set[str] = set(view)
        while loop.time() < st.collect_end and not st.closed:
            have = set(st.contribs)
            if len(have) + 1 >= expected or (seen and seen <= have and not st.arriving):
                break
            await self._sleep(st, min(self.poll_interval_s, st.collect_end - loop.time()))
            seen |= set(await self._roster(st))
        contribs = dict(st.contribs)
        if not contribs:
            st.decided.set()
            return C.ExchangeResult(None, 1, [], C.SOLO, "closed" if self._closed else "no_partner")
        try:
            mean = await self._mean_of([(self.peer_id, st.tensors), *contribs.items()])
        except (C.PeerError, TensorRejected) as exc:  # our own NaN, or an overflow to inf
            st.decided.set()
            reason = exc.reason
            log.warning("group mean of round %d is not finite (%s); every member fails this round", st.round, reason)
            return C.ExchangeResult(None, 1, list(contribs), C.FAILED, reason, 0, st.received)
        st.members = sorted([self.peer_id, *contribs])
        st.mean_digests = C.task(asyncio.to_thread(C.digests, mean))  # hashed once for every reply
        st.mean = mean
        st.decided.set()
        futs = [st.sends[p] for p in contribs]
        done, _ = await asyncio.wait(futs, timeout=max(0.0, C.remaining(st.deadline)) + GRACE_S)
        sent = sum(f.result() for f in done)
        partners = [p for p in st.members if p != self.peer_id]
        return C.ExchangeResult(st.mean, len(st.members), partners, C.OK, "", sent, st.received)

    async def _gather(self, st: C.Round, root: str, view: dict[str, RosterEntry]) -> C.ExchangeResult:
        for _ in range(3):
            addr = self._addrs.get(root)
            if addr is None:
                return C.ExchangeResult(None, 1, [root], C.FAILED, "no_root")
            res, redirect = await self._gather_once(st, root, addr)
            if redirect is None or redirect == self.peer_id or C.remaining(st.deadline) <= 0:
                return res
            log.info("gather root %s says the root is %s; retrying there", root[:16], redirect[:16])
            if redirect not in self._addrs:
                await self._roster(st)
            root = redirect
        return res

    async def _gather_once(self, st: C.Round, root: str, addr: str) -> tuple[C.ExchangeResult, str | None]:
        sent = recv = 0
        call = None
        try:
            async with asyncio.timeout(max(0.0, C.remaining(st.deadline))):
                call = self._open_call(addr, st)
                await call.write(self._hdr(True, st, "open", mode="gather"))
                kind, hdr = C.split(await self._next(call.read, st.deadline))
                if kind == "header" and not hdr.accepted:
                    raise C.PeerError(hdr.reason or "refused")
                async for frame, n in C.encode_tensors(st.tensors, self._names, True, self._pacer(root), self._chunk,
                                                        st.digests):
                    await call.write(frame)
                    sent += n
                await call.done_writing()
                mean, recv = await self._read_tensors(call.read, st.deadline)
                kind, hdr = C.split(await self._next(call.read, st.deadline))
            if kind != "header" or not hdr.accepted or hdr.group_size < 2 or self.peer_id not in hdr.members:
                raise C.PeerError("partner_error", "bad gather done frame")
            partners = [p for p in hdr.members if p != self.peer_id]
            return C.ExchangeResult(mean, int(hdr.group_size), partners, C.OK, "", sent, recv), None
        except TensorRejected as exc:
            self._count(exc.reason)
            return C.ExchangeResult(None, 1, [root], C.FAILED, exc.reason, sent, recv), None
        except C.PeerError as exc:
            redirect = None
            reason = exc.reason.removeprefix("partner_")
            if reason.startswith("not_root:"):
                redirect, reason = reason.split(":", 1)[1], "not_root"
            log.warning("gather to root %s failed (%s); solo step, then re-fetch phi", root[:16], reason)
            return C.ExchangeResult(None, 1, [root], C.FAILED, reason, sent, recv), redirect
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError) as exc:
            reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else "partner_error"
            log.warning("gather to root %s failed (%s: %r); solo step, then re-fetch phi", root[:16], reason, exc)
            return C.ExchangeResult(None, 1, [root], C.FAILED, reason, sent, recv), None
        finally:
            if call is not None and not call.done():
                call.cancel()
