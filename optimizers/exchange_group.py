"""DiLoCo group averaging, the root's collection and the members' side
(``OuterExchange.group_average``), and the root's handler of one member's stream
(``GroupExchange.serve``, which ``exchange_server.py`` dispatches gather streams to).

Policy (see ``optimizers/exchange.py`` for the whole protocol): root = lowest peer ID in the
round's roster once it has ``expected`` entries or timeout/2 passed. Members stream their
tensors to the root in mode "gather" and read the mean back; a root that is not the root in its
own view answers "not_root:<root>" and the member follows that once per try (3 tries). The root
collects until it has expected-1 contributions, or every roster member it has seen (re-read
while waiting) that has not moved on, or 0.75*timeout; late contributions are refused ("late").
A roster member with an entry for the next round has finished this one and is not waited for
(a root one round behind waited out its whole window for it, then arrived at the next round
after that round's root stopped collecting: the two live workers stayed a round apart, every
round solo; outcome "moved_on" when nobody else was seen). A root taken with nobody lower in
sight (at the settle) that then sees a lower peer, before any contribution, follows it as a
member: that peer is the root in its own view and waits for us (two roots alone, both solo).
The mean is computed once (ascending peer ID) and sent bitwise to every member; a member whose gather failed gets
outcome "failed" and must re-fetch phi (DiLoCo assumes identical phi). Bounds: the root
checks each contribution against its own tensors (``exchange_server``), a member checks the
mean it reads back against its own, by the fixed bounds and by the robust rule
(``ExchangeLink.check_mean``); a member that rejects the mean fails the round (solo, then
re-fetch phi) while the root and the others apply it: DiLoCo resolves any such split by the
re-fetch, not by agreement. A peer we charged (its mean or its contribution refused) is left
out of the root choice and not waited for while the charge lasts, and a redirect to it is not
followed: a root with the lowest peer ID that sends a poisoned mean costs each member one
round, then the group forms around the next lowest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from optimizers import exchange_common as C
from optimizers.exchange_common import GRACE_S, HANDSHAKE_S
from optimizers.exchange_link import ExchangeLink, MeanRefused, Roster, StreamRejected, peer_reason
from protocol.channels import remaining, verified_peer
from protocol.codec import TensorRejected
from protocol.stream_errors import PeerError, Refused, StreamError
from protocol.streams import TensorStream

log = logging.getLogger("swarmnode.noloco.exchange")


class GroupExchange:
    """Runs one group round: as the root (collect, mean, let the servicer answer) or as a member."""

    def __init__(self, link: ExchangeLink, roster: Roster, moved_on: MovedOn | None = None):
        self.link, self.roster, self.moved_on = link, roster, moved_on

    async def run(self, st: C.Round, expected: int, timeout: float) -> C.ExchangeResult:
        link, loop = self.link, asyncio.get_running_loop()
        st.collect_end = loop.time() + 0.75 * timeout
        settle = loop.time() + timeout / 2
        try:
            view = await self.roster(st)
            while len(view) + 1 < expected and loop.time() < settle and not st.closed:
                await link.sleep(st, min(link.poll_interval_s, max(0.0, settle - loop.time())))
                view = await self.roster(st)
            # a peer we charged (a mean or contribution we refused) is neither root nor waited for
            view = self._trusted(st, view)
            root = min([link.peer_id, *view])
            st.root = root
            if root == link.peer_id:
                return await self._run_root(st, expected, view)
            st.decided.set()  # contributions sent to us early are told "not_root:<root>"
            return await self._gather(st, root)
        finally:
            st.closed = True
            st.decided.set()

    def _trusted(self, st: C.Round, view) -> dict:
        """``view`` without the peers we distrust this round (``ExchangeLink.charge``)."""
        return {p: e for p, e in view.items() if not self.link.is_distrusted(p, st.round)}

    # ------------------------------------------------------------------ group: root and members
    async def _run_root(self, st: C.Round, expected: int, view: dict) -> C.ExchangeResult:
        link, loop = self.link, asyncio.get_running_loop()
        seen: set[str] = set(view)
        gone: set[str] = set()  # roster peers already in a later round: they will not contribute
        while loop.time() < st.collect_end and not st.closed:
            have = set(st.contribs)
            if len(have) + 1 >= expected or (seen and seen - gone <= have and not st.arriving):
                break
            await link.sleep(st, min(link.poll_interval_s, st.collect_end - loop.time()))
            seen |= set(self._trusted(st, await self.roster(st)))
            missing = seen - gone - set(st.contribs) - st.arriving
            if missing and self.moved_on is not None:
                gone |= await self.moved_on(st, missing)
            lower = sorted(p for p in seen - gone if p < link.peer_id)
            if lower and not st.contribs and not st.arriving and st.mean is None and not st.closed:
                # we took the root with nobody lower in sight (at the settle); a lower peer
                # arrived since and, seeing us, is the root in its own view, waiting for us:
                # two roots, each alone, both solo. The lowest ID is the root: follow it.
                st.root = lower[0]
                st.decided.set()  # gathers sent to us meanwhile are told "not_root:<root>"
                log.info("group round %d: %s arrived after we took the root; gathering to it",
                         st.round, lower[0][:16])
                return await self._gather(st, lower[0])
        contribs = dict(st.contribs)
        if not contribs:
            st.decided.set()
            why = "closed" if link.closed else ("moved_on" if seen and seen <= gone else "no_partner")
            return C.ExchangeResult(None, 1, [], C.SOLO, why)
        # robust averaging: each member's difference from the root's tensors is clipped (one
        # CenteredClip iteration around the root's own theta), so no member drags the group mean
        contribs = {p: await link.clip(st, t, p) for p, t in sorted(contribs.items())}
        try:
            mean = await link.mean([(link.peer_id, st.tensors), *contribs.items()])
        except (PeerError, TensorRejected) as exc:  # our own NaN, or an overflow to inf
            st.decided.set()
            reason = exc.reason
            log.warning("group mean of round %d is not finite (%s); every member fails this round", st.round, reason)
            return C.ExchangeResult(None, 1, list(contribs), C.FAILED, reason, 0, st.received)
        if link.codec is not None and st.wire is not None:  # the mean travels compressed; we apply what we send
            t0 = time.perf_counter()
            st.mean_wire, mean = await asyncio.to_thread(link.codec.encode_mean, mean, st.wire.ref)
            st.codec_s += time.perf_counter() - t0
        st.members = sorted([link.peer_id, *contribs])
        st.mean = mean
        st.decided.set()
        futs = [st.sends[p] for p in contribs]
        done, _ = await asyncio.wait(futs, timeout=max(0.0, remaining(st.deadline)) + GRACE_S)
        sent = sum(f.result() for f in done)
        partners = [p for p in st.members if p != link.peer_id]
        return C.ExchangeResult(st.mean, len(st.members), partners, C.OK, "", sent, st.received)

    async def _gather(self, st: C.Round, root: str) -> C.ExchangeResult:
        """Send to ``root`` and read the mean back. Follows a "not_root:<peer>" redirect (twice at
        most) and asks again, until the deadline, while the root answers "not_in_roster" or
        "busy" (its roster read has not seen our entry yet: without this the member went solo
        and the root waited out its whole collection window for it)."""
        link, redirects = self.link, 0
        while True:
            addr = link.addrs.get(root)
            if addr is None:
                return C.ExchangeResult(None, 1, [root], C.FAILED, "no_root")
            res, redirect = await self._gather_once(st, root, addr)
            if redirect is not None and link.is_distrusted(redirect, st.round):
                log.warning("gather root %s says the root is %s, a peer we charged; solo step", root[:16], redirect[:16])
                return C.ExchangeResult(None, 1, [root], C.FAILED, "distrusted_root")
            if redirect is not None and redirect != link.peer_id and redirects < 2 and remaining(st.deadline) > 0:
                log.info("gather root %s says the root is %s; retrying there", root[:16], redirect[:16])
                redirects += 1
                if redirect not in link.addrs:
                    await self.roster(st)
                root = redirect
                continue
            if res.reason in C.RETRY and remaining(st.deadline) > 2 * link.poll_interval_s and not link.closed:
                await asyncio.sleep(link.poll_interval_s)
                continue
            return res

    async def _gather_once(self, st: C.Round, root: str, addr: str) -> tuple[C.ExchangeResult, str | None]:
        link, sent, recv, stream = self.link, 0, 0, None
        try:
            async with asyncio.timeout(max(0.0, remaining(st.deadline))):
                stream = await link.open(addr, root, st, "gather", max(0.05, min(HANDSHAKE_S, remaining(st.deadline))))
                names, payload = await link.payload(st)
                sent = await link.send(stream, payload, names=names)
                mean, recv = await link.recv_tensors(stream, names=link.codec.mean_names() if link.codec else None)
                mean = await link.rebuild(st, mean, mean=True)
                await link.check_bounds(st.tensors, mean)  # the root's mean vs our own tensors
                await link.check_mean(st, mean, root)      # ... and vs the robust rule
                meta, members = await link.recv_done(stream)
                # half-close: the root ends the call once it sees this, so its end never races
                # our last credit frames (a credit sent into a finished call failed the read)
                await stream.close(timeout=GRACE_S)
            size = meta.get("group_size", "")
            if not size.isdigit() or int(size) < 2 or link.peer_id not in members:
                raise PeerError("partner_error", f"bad gather done frame (group_size {size[:8]!r})")
            partners = [p for p in members if p != link.peer_id]
            return C.ExchangeResult(mean, int(size), partners, C.OK, "", sent, recv), None
        except TensorRejected as exc:
            if not isinstance(exc, (StreamRejected, MeanRefused)):  # counted (and charged) where they happen
                link.count(exc.reason)
                link.charge(root, exc.reason)
            return C.ExchangeResult(None, 1, [root], C.FAILED, exc.reason, sent, recv), None
        except (StreamError, PeerError) as exc:
            reason = peer_reason(exc) if isinstance(exc, StreamError) else exc.reason
            redirect = None
            if reason.startswith("not_root:"):
                redirect, reason = reason.split(":", 1)[1], "not_root"
            if reason in C.RETRY:
                log.info("gather to root %s refused (%s): asking again", root[:16], reason)
            else:
                log.warning("gather to root %s failed (%s: %s); solo step, then re-fetch phi", root[:16], reason,
                            str(exc)[:200])
            return C.ExchangeResult(None, 1, [root], C.FAILED, reason, sent, recv), redirect
        except (OSError, TimeoutError) as exc:
            reason = "timeout" if isinstance(exc, TimeoutError) else "partner_error"
            log.warning("gather to root %s failed (%s: %r); solo step, then re-fetch phi", root[:16], reason, exc)
            return C.ExchangeResult(None, 1, [root], C.FAILED, reason, sent, recv), None
        finally:
            if stream is not None:
                stream.cancel()

    # ------------------------------------------------------------------ the root's side of one member
    async def serve(self, stream: TensorStream) -> None:
        """One member's gather stream at the root: read and check its tensors, keep them as a
        contribution, wait for the mean, send it back with "done" (group size, members).
        Refuses (``Refused``) a member left out of the mean; raises TensorRejected for bad tensors."""
        link, pid = self.link, stream.peer.sender
        st = link.state
        if st is None or st.mode != "group" or st.closed:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "other_round", "no group round in progress")
        st.arriving.add(pid)
        fut = st.sends[pid] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(max(0.0, remaining(st.deadline))):
                try:
                    theirs, recv = await link.recv_tensors(stream, names=link.incoming(st))
                    theirs = await link.rebuild(st, theirs)
                    await link.check_bounds(st.tensors, theirs)
                finally:
                    st.arriving.discard(pid)  # in transit no more: the root need not wait for it
                if st.root in (None, link.peer_id) and st.mean is None and not st.closed:
                    st.contribs[pid] = theirs
                    st.received += recv
                st.wake.set()
                await st.decided.wait()
                if st.mean is None or pid not in st.members:
                    why = f"not_root:{st.root}" if st.root not in (None, link.peer_id) else "late"
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, why, f"{why} (round {st.round})")
                if st.mean_wire is not None:
                    sent = await link.send(stream, st.mean_wire, names=link.codec.mean_names())
                else:
                    sent = await link.send(stream, st.mean)
                await link.send_done(stream, {"group_size": str(len(st.members))}, st.members)
                await _until_half_closed(stream)
            fut.set_result(sent)
        except TensorRejected as exc:
            if not isinstance(exc, StreamRejected):
                link.count(exc.reason)
                link.charge(verified_peer(), exc.reason)  # only a verified caller is charged, never a claim
                log.warning("gather contribution from %s rejected: %s", pid[:16], exc)
            raise
        except (PeerError, TimeoutError) as exc:
            log.warning("gather stream from %s failed: %r", pid[:16], exc)
        finally:
            st.arriving.discard(pid)
            if not fut.done():
                fut.set_result(0)


MovedOn = Callable[[C.Round, set[str]], Awaitable[set[str]]]
"""async (round state, peers) -> those of ``peers`` with a roster entry for a later round (they
finished this one: a root stops waiting for them)."""


async def _until_half_closed(stream: TensorStream) -> None:
    """The root's end of a gather: wait (``GRACE_S`` at most) until the member half-closes after
    reading the mean, so the call does not end while the member still sends credit frames."""
    try:
        await stream.recv(timeout=GRACE_S)
    except (StreamError, TimeoutError):
        pass
