"""State download for joiners and recovering nodes, for any role: ``WeightService.Fetch``.

The role supplies a snapshot callable returning a :class:`StateSnapshot` (metadata such as
round / iteration / stage, named weight tensors, optionally named optimizer tensors) taken at a
consistent point; :class:`StateServicer` streams it as tensor-stream frames
(``protocol/stream_wire.py``: the framing, digest trailer and assembler every tensor on the
wire uses; registered with :func:`add_state_service`). The metadata and the donor's cfg hash
travel in the response's initial metadata as generic keys ``x-swarmnode-state-<key>``; the
request's ``want_state`` selects weights or weights plus optimizer state (CheckFree needs
both). A donor serves at most ``max_concurrent`` downloads at once (RESOURCE_EXHAUSTED beyond).

:func:`fetch_state` checks the run, the cfg hash, every name, dtype and shape (the stream
assembler refuses anything else before allocating), that each tensor comes once, and
finiteness, and raises :class:`StateFetchError` with the reason (``transient`` when asking
the donor again a moment later may work). :func:`order_donors` picks whom to ask: live READY
peers of the same role and config, most advanced first, random among ties (joiners spread the
load).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping

import grpc
import torch

from node.card import CardView, card_int, frontier_card_int, peers
from protocol import weights_pb2
from protocol.channels import signed_channel
from protocol.codec import TensorRejected, check_finite
from protocol.grpc_options import channel_options
from protocol.stream_wire import StreamAssembler, parse, tensor_frames

log = logging.getLogger("swarmnode.state_sync")

SERVICE = "swarmnode.WeightService"
META_PREFIX = "x-swarmnode-state-"
CFG_KEY = "cfg_hash"
OPTIMIZER_PREFIX = "optimizer/"  # names of optimizer tensors in the stream and in fetch_state's result
WANT_WEIGHTS = weights_pb2.WANT_WEIGHTS
WANT_WEIGHTS_AND_OPTIMIZER = weights_pb2.WANT_WEIGHTS_AND_OPTIMIZER

Expected = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass
class StateSnapshot:
    """What a donor serves. ``meta`` values are sent as strings (keys: lowercase, [a-z0-9_.-])."""
    meta: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None = field(default=None)


class StateServicer:
    """``WeightService.Fetch`` over a role's snapshot callable (None: nothing to serve yet)."""

    def __init__(self, run_id: str, cfg_hash: str, get_snapshot: Callable[[], StateSnapshot | None],
                 netem=None, max_concurrent: int = 2,
                 history: Callable[[int], StateSnapshot | None] | None = None,
                 copies: Callable[[int], StateSnapshot | None] | None = None):
        self.run_id, self.cfg_hash, self._get = run_id, cfg_hash, get_snapshot
        self._history = history    # iteration -> a kept older snapshot (stage integrity audits replay the last step)
        self._copies = copies      # stage -> this node's copy of another stage's state (CheckFree+ embedding copy)
        self._netem = netem
        self._slots = asyncio.Semaphore(max_concurrent)
        self.max_concurrent = max_concurrent

    async def Fetch(self, request, context):  # noqa: N802 - gRPC API
        if request.run_id != self.run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"this node serves run {self.run_id!r}, not {request.run_id[:64]!r}")
        snap = self._get()
        if request.HasField("stage") and self._copies is not None and snap is not None \
                and "stage" in snap.meta and int(snap.meta["stage"]) != request.stage:
            snap = self._copies(request.stage) or snap   # a kept copy of that stage; none: refused below
        elif request.iteration and self._history is not None and snap is not None \
                and str(snap.meta.get("iteration")) != str(request.iteration):
            snap = self._history(request.iteration) or snap    # not kept: the latest (callers check `iteration`)
        if snap is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no state yet (still initialising); try another peer")
        both = request.want_state == WANT_WEIGHTS_AND_OPTIMIZER
        if both and snap.optimizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this peer serves weights only (no optimizer state); ask for WANT_WEIGHTS")
        if request.HasField("stage") and "stage" in snap.meta and int(snap.meta["stage"]) != request.stage:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this peer serves stage {snap.meta['stage']}, not {request.stage}; ask a peer of "
                                "that stage")
        if self._slots.locked():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"already serving {self.max_concurrent} state downloads; try another peer")
        async with self._slots:
            meta = [(META_PREFIX + str(k).lower(), str(v)) for k, v in snap.meta.items()]
            await context.send_initial_metadata(tuple(meta) + ((META_PREFIX + CFG_KEY, self.cfg_hash),))
            items = list(snap.weights.items())
            if both:
                items += [(OPTIMIZER_PREFIX + n, t) for n, t in snap.optimizer.items()]
            pace = self._netem.pacer(context.peer()) if self._netem is not None else None
            for seq, (name, tensor) in enumerate(items):
                for frame in tensor_frames(seq, name, tensor):
                    if pace is not None:
                        await pace(len(frame))
                    yield frame


def add_state_service(servicer: StateServicer, server: grpc.aio.Server) -> None:
    """Register ``swarmnode.WeightService/Fetch``; frames pass as bytes (stream_wire builds them)."""
    handler = grpc.unary_stream_rpc_method_handler(servicer.Fetch,
                                                   request_deserializer=weights_pb2.FetchRequest.FromString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Fetch": handler}),))


class StateFetchError(Exception):
    """A state download that failed, with the reason. ``transient``: the donor refused for a
    reason that passes (its view of the members has not caught up with a new node's card yet, it
    is serving its maximum of downloads, it has no state yet, the connection dropped), so asking
    it again a moment later may work; a wrong config, a malformed or non-finite state is not."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


TRANSIENT_CODES = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.UNAVAILABLE})
"""Refusals worth a retry (``StateFetchError.transient``): a donor answers PERMISSION_DENIED to a
caller whose node card it has not read yet (a joiner's first seconds), RESOURCE_EXHAUSTED when it
serves ``max_concurrent`` downloads, UNAVAILABLE before its first snapshot or when the connection
fails. DEADLINE_EXCEEDED is not among them: a donor too slow for ``timeout`` is skipped."""


def meta_int(meta: Mapping[str, str], key: str, addr: str = "the peer") -> int:
    """An integer metadata value (round, iteration, stage), or StateFetchError."""
    try:
        value = int(meta[key])
    except (KeyError, ValueError):
        raise StateFetchError(f"{addr} sent no integer {key!r} in its state header (got {meta.get(key)!r})") from None
    if value < 0:
        raise StateFetchError(f"{addr} sent a negative {key!r} ({value}) in its state header")
    return value


async def fetch_state(addr: str, run_id: str, sender: str, cfg_hash: str, expected: Expected, *,
                      optimizer: Expected | None = None, round: int = 0, iteration: int = 0,
                      stage: int | None = None, timeout: float = 60.0, max_message_bytes: int = 8 << 20,
                      offload: Callable[..., Awaitable[Any]] | None = None, peer_id: str | None = None
                      ) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Download ``(metadata, {name: tensor})`` from the node at ``addr``; raises StateFetchError.

    ``expected`` maps weight names to (dtype, shape); ``optimizer`` does the same for optimizer
    tensors and asks for them too (they come back named ``OPTIMIZER_PREFIX + name``).
    ``offload(fn, *args)`` runs the finite checks (e.g. ``Compute.run``; default
    ``asyncio.to_thread``), so whole-state passes stay off the event loop. The call is signed
    for ``peer_id`` (default: the peer whose node card names ``addr``) when the process has a
    ``ClientAuth`` (``protocol.streams.signed_channel``); donors serve only members of the run,
    or anyone with ``security.public_state``.
    """
    want = dict(expected)
    if optimizer is not None:
        want.update({OPTIMIZER_PREFIX + n: v for n, v in optimizer.items()})
    run = offload or asyncio.to_thread
    cap = max(int(torch.empty((), dtype=d).element_size() * torch.Size(s).numel()) for d, s in want.values())
    req = weights_pb2.FetchRequest(run_id=run_id, sender_peer_id=sender, round=round, iteration=iteration,
                                   want_state=WANT_WEIGHTS_AND_OPTIMIZER if optimizer is not None else WANT_WEIGHTS)
    if stage is not None:
        req.stage = stage
    async with signed_channel(addr, channel_options(max_message_bytes), peer_id=peer_id) as channel:
        method = channel.unary_stream(f"/{SERVICE}/Fetch",
                                      request_serializer=weights_pb2.FetchRequest.SerializeToString)
        call = method(req, timeout=timeout)
        try:
            raw = dict(await call.initial_metadata() or ())
            meta = {k[len(META_PREFIX):]: v for k, v in raw.items() if k.startswith(META_PREFIX)}
            if CFG_KEY not in meta:  # refused before streaming: report the server's reason
                code = await call.code()
                raise StateFetchError(f"state download from {addr} refused: {code.name}: {await call.details()}",
                                      transient=code in TRANSIENT_CODES)
            theirs = meta.pop(CFG_KEY)
            if theirs != cfg_hash:
                raise StateFetchError(f"peer {addr} runs cfg_hash {theirs!r}, ours is {cfg_hash!r}: its role/model "
                                      "settings differ; fix the config so all nodes of the role match")
            out = await _receive(call, StreamAssembler(cap, "limits.max_state_bytes", expected=want))
            await run(_check_all_finite, out)
        except TensorRejected as exc:
            call.cancel()
            raise StateFetchError(f"state from {addr} rejected ({exc.reason}): {exc}") from None
        except grpc.aio.AioRpcError as exc:
            raise StateFetchError(f"state download from {addr} failed: {exc.code().name}: {exc.details()}",
                                  transient=exc.code() in TRANSIENT_CODES) from None
        except ConnectionError as exc:  # security.peer_auth.UnresolvedTarget: no card names addr yet
            raise StateFetchError(f"state download from {addr} not attempted: {exc}", transient=True) from None
    missing = sorted(set(want) - set(out))
    if missing:
        raise StateFetchError(f"state from {addr} lacks {missing[:5]}")
    return meta, out


async def _receive(call, asm: StreamAssembler) -> dict[str, torch.Tensor]:
    """Every tensor of a download, each name once; raises TensorRejected."""
    out: dict[str, torch.Tensor] = {}
    async for data in call:
        f = parse(data)
        if not f.is_tensor:
            raise TensorRejected("malformed", "a state download carries tensor frames only; the donor speaks "
                                 "another protocol")
        got = asm.feed(f)
        if got is not None:
            if got.name in out:
                raise TensorRejected("malformed", f"tensor {got.name!r} sent twice in one download")
            out[got.name] = got.tensor
    asm.finish()
    return out


def _check_all_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        check_finite(name, tensor)


def split_optimizer(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``fetch_state``'s tensors as (weights, optimizer state with the prefix removed)."""
    w = {n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)}
    o = {n[len(OPTIMIZER_PREFIX):]: t for n, t in tensors.items() if n.startswith(OPTIMIZER_PREFIX)}
    return w, o


def order_donors(views: Iterable[CardView], *, role: str, cfg_hash: str, progress_key: str = "round",
                 exclude: str | None = None, min_progress: int | None = None,
                 rng: random.Random | None = None, max_jump: int | None = None) -> list[CardView]:
    """READY peers of ``role`` and ``cfg_hash`` to download state from: most advanced first by the
    card detail ``progress_key``, random among ties; ``min_progress`` drops those behind it;
    ``max_jump`` drops those past the robust frontier (``node.card.frontier_card_int``), so a
    forged card claiming an absurd progress is never the first donor asked."""
    donors = peers(views, role=role, cfg_hash=cfg_hash, exclude=exclude)
    if max_jump is not None:
        top = frontier_card_int(donors, progress_key, max_jump)
        donors = [v for v in donors if card_int(v, progress_key) is not None and top is not None
                  and card_int(v, progress_key) <= top]
    if min_progress is not None:
        donors = [v for v in donors if (card_int(v, progress_key) or 0) >= min_progress]
    (rng or random).shuffle(donors)
    donors.sort(key=lambda v: -(card_int(v, progress_key) or 0))
    return donors
