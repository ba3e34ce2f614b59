"""Transport of the NoLoCo/DiLoCo outer step: find a group for round r, return the exact mean.

Owns group formation through the DHT roster (``optimizers/roster.py``) and the tensor
exchange, which runs on the tensor stream every role shares (``protocol/streams.py``) under
its own method ``/swarmnode.NoLoCo/Exchange``. ``OuterExchange`` is the facade the role calls;
the work is done by small objects over one shared ``ExchangeLink`` (``exchange_link.py``:
identity, specs, round state, stream operations):

    PairExchange   (exchange_pair.py)    the proposer's loop; ``swap``: both ends of a matched pair
    GroupExchange  (exchange_group.py)   the root's collection, the members' side, the root's handler
    NoLoCoServicer (exchange_server.py)  the callee's service: admits hellos, dispatches pair / gather

The hello, constants and shared types are in ``exchange_common.py``; the frames, the stream
and the mean are ``protocol/stream_wire.py``, ``protocol/streams.py`` and
``node/averaging.py``. It does not own the optimizer math (the role hands tensors in and gets
means back) nor the gRPC server: the role registers ``add_exchange_to_server(ex.servicer(),
server)``.

pair_average (NoLoCo, k=2; no global barrier):
  1. mark WAITING(r) (the servicer now accepts proposals for r), publish a RosterEntry;
  2. loop until matched, closed or the deadline: read the roster; candidates = entries AFTER us
     in round r's order (``proposes_to``), same cfg_hash, not finally refused this round; pick one at random
     (``Random(f"{r}:{me}")``); holding MY match lock, open ``Exchange`` (our hello carries the
     round, cfg and spec hashes) and wait for the callee's hello. The callee takes ITS lock
     (<= LOCK_WAIT_S, else "busy": retried later), accepts only if WAITING(r), in pair mode
     and unmatched, and marks itself MATCHED. Proposals only
     go forward in the round's order (``exchange_common.proposes_to``: a hash of round and peer
     ID, new every round, so no pair of workers is favoured round after round), so lock waits
     cannot form a cycle. A worker matched by an incoming
     proposal stops proposing. Refusals "matched", "other_round", "stale", errors: final for
     that candidate this round. No candidate: sleep ``poll_interval_s``, re-read. Any two
     unmatched waiting workers eventually meet (the earlier one tries the later), so with enough
     time the pairing is maximal: an even number of waiting workers all pair;
  3. both sides stream their tensors at once (one frame per tensor up to 4 MiB, netem pacer on
     send); the stream's assembler admits only the specs (checked before allocating), compute
     ``(lower + higher) / 2`` themselves (ascending peer-ID order: bitwise equal on both sides)
     in one blockwise pass that also checks finiteness (NaN/inf -> "nonfinite"), then send
     "done"; a side returns ok only after the partner's "done";
  4. anything else (refusal, stream error, digest, NaN, deadline) -> solo/failed, mean None.
Compressed (``[noloco] compression``, a ``codec`` here and the round's ``wire`` payload from the
  engine): the stream carries the compressed parts instead of the fp32 tensors (specs from
  ``optimizers/outer_codec.py``); the receiver rebuilds the partner's fp32 tensors on its own
  phi off the event loop (a malformed part: rejected "compressed"), and everything after that
  (bounds, robust clip, mean) is as above. A DiLoCo root sends the mean back compressed.
group_average (DiLoCo, everyone): see ``exchange_group.py``. Root = lowest peer ID in the
  roster once it has ``expected`` entries or timeout/2 passed (a root that later sees a lower
  peer, before any contribution, follows it); members stream to the root and read back the one
  mean it computed; the root does not wait for roster members already in the next round's
  roster; failures -> "failed" (the role re-fetches phi).
Every await is bounded by the call's deadline (+1 s grace for an exchange in flight). Hellos
are validated (run, cfg_hash, spec hash, sender peer ID, round skew, order); refusals that mark
a bad or misconfigured peer (COUNTED) and rejected tensors call ``on_reject(reason)``. Calls
are signed (``security.peer_auth``, wired in by the node's gRPC host): the callee takes the
caller's verified peer ID over the hello's ``sender``, and serves only a caller with a live
roster entry for the round (``ExchangeLink.in_roster``; refused "not_in_roster", which the
caller retries). The partner's tensors must pass the link's norm/distance bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from node.logs import emit
from node.netem import LinkEmulator
from optimizers import exchange_common as C
from optimizers.exchange_common import METHOD, ExchangeResult
from optimizers.exchange_group import GroupExchange
from optimizers.exchange_link import ExchangeLink
from optimizers.exchange_pair import PairExchange
from optimizers.exchange_server import NoLoCoServicer, add_exchange_to_server
from optimizers.outer_codec import OuterCodec, Outgoing
from optimizers.partner_share import PartnerShare
from optimizers.robust import ClipVerdict, PartnerClip
from optimizers.roster import RosterEntry, publish_entry, read_roster
from protocol.channels import remaining, task
from protocol.grpc_options import DEFAULT_MAX_MESSAGE_BYTES
from security.keys import public_key_of

__all__ = ["ExchangeResult", "OuterExchange", "NoLoCoServicer", "add_exchange_to_server", "METHOD"]

log = logging.getLogger("swarmnode.noloco.exchange")


class OuterExchange:
    """One per worker. ``pair_average`` / ``group_average`` one call at a time; see module doc."""

    def __init__(self, *, run_id: str, peer_id: str, cfg_hash: str, grpc_addr: str, dht: Any,
                 specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], netem: LinkEmulator | None = None,
                 max_round_skew: int = 2, poll_interval_s: float = 0.25,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 on_reject: Callable[[str], None] | None = None, bounds: C.TensorBounds | None = None,
                 robust: PartnerClip | None = None, on_clip: Callable[[ClipVerdict], None] | None = None,
                 codec: OuterCodec | None = None, share: PartnerShare | None = None):
        public_key_of(peer_id)  # raises for a non-Ed25519 peer ID
        if not specs:
            raise ValueError("OuterExchange needs at least one tensor spec")
        checked: list[C.Spec] = [(n, d, tuple(int(x) for x in s)) for n, d, s in specs]
        names = [s[0] for s in checked]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor spec names must be unique: {names[:8]}...")
        for n, d, _ in checked:
            if not d.is_floating_point:
                raise ValueError(f"spec {n!r} has dtype {d}; the exchange averages floating tensors only")
        self.dht = dht
        self.link = ExchangeLink(run_id=run_id, peer_id=peer_id, cfg_hash=cfg_hash, grpc_addr=grpc_addr,
                                 specs=checked, netem=netem, max_round_skew=max_round_skew,
                                 poll_interval_s=poll_interval_s, max_message_bytes=max_message_bytes,
                                 on_reject=on_reject, bounds=bounds, roster=self._roster,
                                 robust=robust, on_clip=on_clip, codec=codec, share=share)
        self._pair = PairExchange(self.link, self._roster)
        self._group = GroupExchange(self.link, self._roster, self._moved_on)
        self._bg: set[asyncio.Task] = set()  # roster publishes finishing in the background

    # read-only views used by the role and tests
    specs = property(lambda self: self.link.specs)
    peer_id = property(lambda self: self.link.peer_id)
    run_id = property(lambda self: self.link.run_id)
    cfg_hash = property(lambda self: self.link.cfg_hash)
    _state = property(lambda self: self.link.state)  # the round in progress (tests poll it)

    # ------------------------------------------------------------------ public API
    def servicer(self) -> NoLoCoServicer:
        return NoLoCoServicer(self.link, self._group)

    async def pair_average(self, round: int, tensors: list[torch.Tensor], timeout: float,  # noqa: A002
                           move: float = 0.0, wire: Outgoing | None = None,
                           origin: list[torch.Tensor] | None = None) -> ExchangeResult:
        """NoLoCo k=2: average with one random partner waiting for the same round, or go solo.
        ``move``: ||theta - phi|| of the tensors sent (the robust clip's own scale); ``origin``:
        our phi (the first ``len(origin)`` tensors moved from it: the robust clip bounds a pull
        against that move). ``wire``: the compressed payload of ``tensors`` (needed when the
        exchange has a codec)."""
        t0, st, publish = await self._enter(round, "pair", tensors, timeout, move, wire, origin)
        if st is None:
            return self._done(t0, C.ExchangeResult(None, 1, [], C.SOLO, "closed"))
        return self._done(t0, await self._pair.run(st, publish))

    async def group_average(self, round: int, tensors: list[torch.Tensor], timeout: float,  # noqa: A002
                            expected: int, move: float = 0.0, wire: Outgoing | None = None,
                            origin: list[torch.Tensor] | None = None) -> ExchangeResult:
        """DiLoCo: exact mean over every worker of round r (root = lowest peer ID); see module doc.
        ``move``, ``wire`` and ``origin`` as for :meth:`pair_average`."""
        t0, st, _ = await self._enter(round, "group", tensors, timeout, move, wire, origin)
        if st is None:
            return self._done(t0, C.ExchangeResult(None, 1, [], C.SOLO, "closed"))
        return self._done(t0, await self._group.run(st, expected, timeout))

    async def stop_waiting(self, round: int, reason: str) -> bool:  # noqa: A002
        """End the pair wait for ``round`` now, as a solo round with ``reason``, unless a partner
        is already matched (an exchange in flight always runs to its end). The role's waiting
        policy calls it when nobody can still meet this worker or its wait bound is spent.
        True if the wait was ended."""
        st = self.link.state
        if st is None or st.round != int(round) or st.mode != "pair":
            return False
        async with self.link.lock:  # the same lock a proposal holds: no match can slip in between
            if st.matched is not None or st.closed:
                return False
            st.closed, st.solo_reason = True, reason
        st.wake.set()
        return True

    def charge(self, peers: Sequence[str], reason: str) -> None:
        """The role found the mean of a round with ``peers`` unusable (its outer step was rolled
        back): skip them as partners for a while, as if their tensors had been rejected."""
        for peer in peers:
            self.link.charge(peer, reason)

    async def close(self) -> None:
        """Stop accepting, end pending waits (solo), close client channels."""
        self.link.closed = True
        st = self.link.state
        if st is not None:
            st.closed = True
            st.wake.set()
            st.decided.set()
        await self.link.close()

    # ------------------------------------------------------------------ round lifecycle, roster
    async def _enter(self, round: int, mode: str, tensors, timeout: float, move: float = 0.0,  # noqa: A002
                     wire: Outgoing | None = None, origin: list[torch.Tensor] | None = None):
        t0, link = time.perf_counter(), self.link
        if link.state is not None:
            raise RuntimeError(f"an outer exchange (round {link.state.round}) is still running; await "
                               f"it before starting round {round}")
        if len(tensors) != len(link.specs):
            raise ValueError(f"got {len(tensors)} tensors, the specs list {len(link.specs)}")
        for t, (n, d, s) in zip(tensors, link.specs):
            if t.dtype != d or tuple(t.shape) != s:
                raise ValueError(f"tensor {n!r} is {t.dtype}{tuple(t.shape)}, the spec says {d}{s}")
        if (link.codec is None) != (wire is None):
            raise ValueError("pass the round's compressed payload (wire) exactly when the exchange compresses")
        if link.closed:
            return t0, None, None
        loop = asyncio.get_running_loop()
        st = C.Round(round=int(round), mode=mode, tensors=list(tensors), deadline=loop.time() + float(timeout),
                     move=float(move), wire=wire, origin=origin)
        st.incoming = loop.create_future()
        link.state, link.last_round = st, int(round)
        entry = RosterEntry(round=int(round), grpc_addr=link.grpc_addr, cfg_hash=link.cfg_hash,
                            waiting_since=time.time())
        ttl = min(120.0, max(10.0, 2.0 * float(timeout)))
        publish = task(publish_entry(self.dht, link.run_id, link.peer_id, entry, ttl,
                                     timeout=max(1.0, min(10.0, float(timeout)))))
        self._bg.add(publish)
        publish.add_done_callback(self._bg.discard)
        return t0, st, publish

    def _done(self, t0: float, res: ExchangeResult) -> ExchangeResult:
        if self.link.state is not None:
            res.codec_s = self.link.state.codec_s
        self.link.state = None
        res.blocked_s = time.perf_counter() - t0
        if res.outcome != C.OK:
            emit(log, "exchange_solo", "outer exchange gave no mean: {outcome} ({reason}); the role takes a solo step",
                 outcome=res.outcome, reason=res.reason)
        return res

    async def _roster(self, st: C.Round) -> dict[str, RosterEntry]:
        """Other workers of this round with our cfg_hash; {} on DHT errors (we poll again)."""
        left = remaining(st.deadline)
        if left <= 0:
            return {}
        try:
            roster = await read_roster(self.dht, self.link.run_id, st.round, timeout=min(5.0, left))
        except Exception as exc:  # noqa: BLE001 - a failed read is retried at the next poll
            log.debug("roster read failed: %r", exc)
            return {}
        out = {p: e for p, e in roster.items() if p != self.link.peer_id and e.cfg_hash == self.link.cfg_hash}
        self.link.addrs.update((p, e.grpc_addr) for p, e in out.items())
        st.roster_seen.update(out)
        return out

    async def _moved_on(self, st: C.Round, peers: set[str]) -> set[str]:
        """Those of ``peers`` (this round's roster) with an entry for the next round: they have
        finished this one (a DiLoCo root stops waiting for them). set() on DHT errors."""
        left = remaining(st.deadline)
        if left <= 0 or not peers:
            return set()
        try:
            later = await read_roster(self.dht, self.link.run_id, st.round + 1, timeout=min(5.0, left))
        except Exception as exc:  # noqa: BLE001 - a failed read is retried at the next poll
            log.debug("next round's roster read failed: %r", exc)
            return set()
        return {p for p, e in later.items() if p in peers and e.cfg_hash == self.link.cfg_hash}
