"""Shared pieces of the NoLoCo exchange (``optimizers/exchange.py``): the hello a caller opens
with, the result type, per-round state, the protocol's constants and the tensor bounds.

Wire: the exchange speaks the tensor stream protocol (``protocol/streams.py``, frames in
``protocol/stream_wire.py``) under its own method ``/swarmnode.NoLoCo/Exchange`` (so per-service
limits and health keep their own name). Control headers travel as frame meta: the caller's
"open" is its hello (channel = mode, meta = round, cfg hash, spec hash, tensor count); a
refusal is the callee's gRPC status (``Refused``: ``"reason: detail"``); "done" is a small
control tensor named ``DONE`` (meta: group size; payload: the group's member IDs). No grpc
server or DHT code here.

    spec_hash(specs) -> str;  hello_meta(round, cfg_hash, spec_hash, n_tensors) -> dict
    proposes_to(a, b, round) -> bool   # who may propose a pair to whom in a round
    opening(hello) -> Opening          # a caller's hello, parsed (Refused "malformed" if not)
    ExchangeResult, Round (per-call state); constants (timeouts, refusal classes, outcomes)
    TensorBounds, bound_violation(ours, theirs, bounds) -> (reason, detail) | None

Tensor bounds (``bound_violation``) are symmetric in (ours, theirs): the two partners of a pair
run the same test on the same two tensor lists and reach the same verdict, so a pair never
splits into one side applying the mean and the other not. (Should they still disagree, e.g.
different configured bounds, the "done" handshake makes both sides solo: each returns ok only
after the partner's "done", and a side that rejects never sends one.)
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import torch

from protocol.codec import dtype_name
from protocol.stream_errors import Refused

__all__ = ["Spec", "spec_hash", "spec_bytes", "hello_meta", "Opening", "opening", "ExchangeResult", "Round",
           "TensorBounds", "bound_violation", "proposes_to"]


def _pair_rank(peer: str, round_: int) -> bytes:
    return hashlib.sha256(f"swarmnode/pair-order/{int(round_)}/{peer}".encode()).digest()


def proposes_to(a: str, b: str, round_: int) -> bool:
    """Whether ``a`` may propose a NoLoCo pair to ``b`` in round ``round_``: ``a`` comes first in
    the round's order, a hash of (round, peer ID), ties by peer ID. Exactly one of two distinct
    peers may propose to the other, so two proposals never cross. The order is new every round:
    with a fixed order (peer IDs), the two highest workers of four paired with each other most
    rounds and the other two too, and the two halves drifted apart until a crossing pair clipped
    each other hard (a 5-minute clean run of benchmarks/robust_gossip.py: the same pairs for 20
    rounds in a row, then honest partners charged); and a peer that ground its key to sort last
    was a candidate for every proposer, every round."""
    ra, rb = _pair_rank(a, round_), _pair_rank(b, round_)
    return (ra, a) < (rb, b)

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def spec_hash(specs: Sequence[Spec]) -> str:
    """Digest of names, dtypes and shapes in order; peers with different specs never exchange."""
    text = ";".join(f"{n}:{dtype_name(d)}:{','.join(str(int(x)) for x in s)}" for n, d, s in specs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_bytes(spec: Spec) -> int:
    n = 1
    for x in spec[2]:
        n *= int(x)
    return n * spec[1].itemsize


def hello_meta(round: int, cfg_hash: str, spec_hash: str, n_tensors: int) -> dict[str, str]:  # noqa: A002
    """The meta of a caller's hello: what the callee checks before it accepts (``opening``)."""
    return {"round": str(int(round)), "cfg_hash": cfg_hash, "spec_hash": spec_hash, "n_tensors": str(int(n_tensors))}


class Opening(NamedTuple):
    """A caller's hello as the callee checks it (``NoLoCoServicer.check_open``)."""
    run_id: str
    round: int
    sender: str
    cfg_hash: str
    n_tensors: int
    mode: str
    spec_hash: str


def opening(hello) -> Opening:
    """Parse a ``StreamHello`` (run_id, sender, channel = mode, meta = ``hello_meta``)."""
    meta: Mapping[str, str] = hello.meta
    try:
        rnd, n = int(meta.get("round", "")), int(meta.get("n_tensors", ""))
    except ValueError:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                      "the hello's meta needs integer 'round' and 'n_tensors'") from None
    if rnd < 0 or n < 0:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "round and n_tensors must be >= 0")
    return Opening(hello.run_id, rnd, hello.sender, meta.get("cfg_hash", ""), n, hello.channel,
                   meta.get("spec_hash", ""))


SERVICE = "swarmnode.NoLoCo"
METHOD = f"/{SERVICE}/Exchange"
DONE = "done"            # the control tensor that ends a side's part of an exchange
CAP_KEY = "noloco tensor specs"  # what bounds a received tensor (named in size errors)
MEMBERS_CAP = 64 * 1024  # bytes of member IDs a "done" may carry (about 1,200 peer IDs)
LOCK_WAIT_S = 0.5        # callee waits this long for its match lock, then answers "busy"
HANDSHAKE_S = 3.5        # caller waits this long for the callee's hello (> 2 x LOCK_WAIT_S)
# OPEN_WAIT_S (a server waits this long for the caller's hello) is protocol.streams'.
GRACE_S = 1.0            # extra wait for an exchange already in flight at the deadline
PUBLISH_WAIT_S = 0.5     # pair mode: wait at most this long for our roster entry before the first read
# the callee may not have seen our roster entry ("not_in_roster") or our node card ("unknown_peer",
# its auth layer's refusal) yet, or is matched: ask again until the round's deadline
RETRY = frozenset({"busy", "not_in_roster", "unknown_peer"})
COUNTED = frozenset({"run", "cfg_hash", "specs", "sender", "order", "mode", "stale", "future", "malformed"})
OK, SOLO, FAILED = "ok", "solo", "failed"


@dataclass
class ExchangeResult:
    mean: list[torch.Tensor] | None  # verified and finite whenever outcome == "ok"
    n: int
    partners: list[str]
    outcome: str                 # "ok" | "solo" | "failed"
    reason: str = ""             # "" | no_partner | timeout | partner_error | nonfinite | rejected | ...
    sent_bytes: int = 0
    received_bytes: int = 0
    blocked_s: float = 0.0
    exchange_s: float = 0.0      # time spent streaming once the group was formed (0 if never)
    codec_s: float = 0.0         # compressed: decoding partners' payloads (a DiLoCo root: + encoding the mean)


@dataclass(eq=False)
class Round:
    round: int
    mode: str                                   # "pair" | "group"
    tensors: list[torch.Tensor]
    deadline: float                             # loop.time()
    move: float = 0.0                           # ||theta - phi|| sent this round: the robust clip's own scale
    origin: list[torch.Tensor] | None = None    # our phi (for the first tensors): the robust clip's direction
    collect_end: float = 0.0
    matched: str | None = None
    closed: bool = False                        # no more accepts (solo decided / closing)
    solo_reason: str = ""                       # why the caller ended the wait early (stop_waiting)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    incoming: asyncio.Future | None = None      # result of an exchange served by the handler
    root: str | None = None                     # group: decided root
    contribs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    arriving: set[str] = field(default_factory=set)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    mean: list[torch.Tensor] | None = None
    members: list[str] = field(default_factory=list)
    sends: dict[str, asyncio.Future] = field(default_factory=dict)
    received: int = 0
    roster_seen: set[str] = field(default_factory=set)  # peers our roster reads listed this round
    roster_read: asyncio.Task | None = None     # the servicer's last re-read (ExchangeLink.in_roster)
    wire: Any = None                            # compressed payload (outer_codec.Outgoing); None: fp32
    mean_wire: list[torch.Tensor] | None = None  # group root, compressed: the mean's parts it sends back
    codec_s: float = 0.0                        # seconds spent decoding / encoding compressed payloads


# ----------------------------------------------------------------------------- tensor bounds

@dataclass(frozen=True)
class TensorBounds:
    """Norm and distance bounds on a partner's tensors relative to ours (``[noloco]``
    ``max_norm_ratio``, ``max_distance_ratio``, ``bound_floor_rms``; see optimizers/config.py)."""

    max_norm_ratio: float = 4.0
    max_distance_ratio: float = 1.0
    floor_rms: float = 1e-2

    def __post_init__(self):
        if not self.max_norm_ratio > 1 or not self.max_distance_ratio > 0 or not self.floor_rms > 0:
            raise ValueError(f"bad tensor bounds {self}: need max_norm_ratio > 1, max_distance_ratio > 0, "
                             "floor_rms > 0")


_BOUND_BLOCK = 1 << 20  # elements per pass: float64 temporaries stay at 8 MiB


def _sums(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(sum a^2, sum b^2, sum (a-b)^2) accumulated in float64 (finite fp32 values up to 3.4e38
    do not overflow), blockwise. Identical under swapping a and b (a-b == -(b-a) exactly)."""
    fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
    sa = sb = sd = 0.0
    for s in range(0, fa.numel(), _BOUND_BLOCK):
        x, y = fa[s:s + _BOUND_BLOCK].to(torch.float64), fb[s:s + _BOUND_BLOCK].to(torch.float64)
        sa += float(torch.dot(x, x))
        sb += float(torch.dot(y, y))
        d = x - y
        sd += float(torch.dot(d, d))
    return sa, sb, sd


def bound_violation(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor], bounds: TensorBounds,
                    names: Sequence[str] | None = None) -> tuple[str, str] | None:
    """None if ``theirs`` is within ``bounds`` of ``ours``, else ``(reason, detail)``:

    * ``"local_nonfinite"``: our own tensors hold NaN/inf (the partner is not blamed);
    * ``"nonfinite"``: theirs do;
    * ``"norm"``: for some tensor, max(rms_ours, rms_theirs) > max_norm_ratio * max(min(...), floor_rms);
    * ``"distance"``: over the whole list, ||theirs - ours|| > max_distance_ratio *
      max(min(||ours||, ||theirs||), floor_rms * sqrt(numel)).

    Symmetric: swapping ours and theirs gives the same verdict (with the two nonfinite labels
    swapped), which keeps both partners of a pair consistent (module docstring)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} tensors of ours vs {len(theirs)} of theirs")
    tot_a = tot_b = tot_d = 0.0
    numel = 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        name = names[i] if names is not None else f"#{i}"
        n = max(1, a.numel())
        sa, sb, sd = _sums(a, b)
        if not math.isfinite(sa):
            return "local_nonfinite", f"our tensor {name!r} is not finite"
        if not math.isfinite(sb):
            return "nonfinite", f"the partner's tensor {name!r} holds NaN or inf"
        ra, rb = math.sqrt(sa / n), math.sqrt(sb / n)
        hi, lo = max(ra, rb), min(ra, rb)
        if hi > bounds.max_norm_ratio * max(lo, bounds.floor_rms):
            return "norm", (f"tensor {name!r}: RMS {rb:.3g} (partner) vs {ra:.3g} (ours) exceeds the ratio bound "
                            f"{bounds.max_norm_ratio:g} (noloco.max_norm_ratio)")
        tot_a, tot_b, tot_d, numel = tot_a + sa, tot_b + sb, tot_d + sd, numel + n
    dist, ref = math.sqrt(tot_d), max(math.sqrt(min(tot_a, tot_b)), bounds.floor_rms * math.sqrt(numel))
    if not dist <= bounds.max_distance_ratio * ref:
        return "distance", (f"||theirs - ours|| = {dist:.4g} exceeds {bounds.max_distance_ratio:g} x {ref:.4g} "
                            "(noloco.max_distance_ratio)")
    return None
