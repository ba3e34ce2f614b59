"""Moving a `stage` node's executor messages: one open tensor stream per neighbour (docs/pipeline.md, 'Stage execution').

Owns the wire side of the stage role:
- outbound: a FIFO queue and one sender task per destination peer, each with one open tensor
  stream (``protocol/streams.py``, channel ``pipe``) on a channel signed for that peer ID
  (the schedule names peers by ID); the emulated link (``node/netem.py`` ``MessageLink``:
  latency overlaps between messages, bandwidth is shared in order) is applied per message
  before it is sent; a send that fails (peer not reachable yet, stream broken, peer's card not
  yet known) is retried on a fresh stream with backoff until it goes through or the node
  drains: a lost activation or gradient would stall the whole iteration, so nothing is dropped
  here (the receiver drops duplicates); the senders run under the node's supervisor (`spawn`:
  one that fails on a bug is restarted on its queue, not lost with the link's messages);
- inbound: every stream's tensors go into one inbox (``Msg``, reply stream); a message whose
  meta is not integers is dropped and counted; ``answer_error`` replies ``err`` on the stream a
  bad message came on;
- hop timing: each message carries when it was queued (``ts``, unix microseconds) and the
  emulated link's share (``lk``); the receiver splits queued->arrival into emulated link and
  transport (codec + gRPC + waiting for stream credit), in ``HopStats`` and the metrics.

Knows nothing of routing or training (pipeline/stage_exec.py) nor of schedules (it learns
addresses through ``addrs``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from node.logs import emit
from node.netem import LinkEmulator
from pipeline import stage_metrics as M
from pipeline.stage_msgs import Msg, Out, placeholder
from protocol.channels import task
from protocol.streams import ChannelPool, StreamError, TensorStream, TensorStreamService, open_stream

log = logging.getLogger("swarmnode.stage")

CHANNEL = "pipe"
RETRY_MAX_S = 2.0
"""Longest pause between two attempts to deliver one message."""
TIMING_KEYS = ("ts", "lk")


class HopStats:
    """Received messages' hop times: queued at the sender -> in this node's inbox."""

    def __init__(self) -> None:
        self.count, self.hop_s, self.link_s = 0, 0.0, 0.0

    def add(self, hop_s: float, link_s: float) -> None:
        self.count += 1
        self.hop_s += hop_s
        self.link_s += link_s
        M.HOP_SECONDS.observe(hop_s)
        M.HOP_LINK_SECONDS.inc(link_s)

    def summary(self) -> dict[str, float | int]:
        n = max(1, self.count)
        return {"hops": self.count, "hop_s_mean": self.hop_s / n, "link_s_mean": self.link_s / n,
                "transport_s_mean": (self.hop_s - self.link_s) / n}


class StageTransport:
    """The stage role's streams. `send(outs)` never blocks; `inbox` yields `(Msg, reply stream)`.
    `spawn(name, factory)` starts a long-lived sender (the node passes `ctx.supervisor.spawn`;
    default a plain task, for tests of the transport alone)."""

    def __init__(self, *, run_id: str, me: str, netem: LinkEmulator, max_tensor_bytes: int,
                 send_timeout_s: float, on_reject: Callable[[str], None] | None = None,
                 spawn: Callable[[str, Callable[[], Awaitable[None]]], asyncio.Task] | None = None):
        self.run_id, self.me, self.netem = run_id, me, netem
        self.max_bytes, self.send_timeout_s = max_tensor_bytes, send_timeout_s
        self.service = TensorStreamService(run_id=run_id, peer_id=me, max_tensor_bytes=max_tensor_bytes,
                                           on_reject=on_reject)
        self.service.register(CHANNEL, self._on_stream)
        self.pool = ChannelPool()
        self.addrs: dict[str, str] = {}
        """Peer ID -> gRPC "host:port" (from the schedule replies)."""
        self.inbox: asyncio.Queue[tuple[Msg, TensorStream | None]] = asyncio.Queue()
        self.hops = HopStats()
        self.retries = 0
        self._queues: dict[str, asyncio.Queue] = {}
        self._senders: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []       # reply readers, one per open outgoing stream
        self._spawn = spawn or (lambda name, factory: asyncio.get_running_loop().create_task(factory(), name=name))
        self._spawned = 0

    # ------------------------------------------------------------------ outbound
    def send(self, outs: list[Out]) -> None:
        """Queue `outs` (messages to this node itself go straight to the inbox)."""
        now = time.monotonic()
        for o in outs:
            if o.dest == self.me:
                self.inbox.put_nowait((Msg(o.kind, self.me, o.meta, o.tensor), None))
                continue
            q = self._queues.get(o.dest)
            if q is None:
                q = self._queues[o.dest] = asyncio.Queue()
                self._spawned += 1          # a sender forgotten and started again gets a new name
                self._senders[o.dest] = self._spawn(f"stage_send_{o.dest[:16]}_{self._spawned}",
                                                    lambda dest=o.dest, q=q: self._sender(dest, q))
            q.put_nowait((o, now))

    def forget(self, dests) -> int:
        """Stop delivering to `dests` (nodes a newer schedule dropped: lost, their iteration
        aborted): their queued messages are discarded; returns how many."""
        n = 0
        for d in dests:
            sender, q = self._senders.pop(d, None), self._queues.pop(d, None)
            if sender is not None:
                sender.cancel()
            if q is not None:
                n += q.qsize()
        return n

    async def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far has been sent (False after `timeout` s)."""
        try:
            async with asyncio.timeout(timeout):
                for q in list(self._queues.values()):
                    await q.join()
            return True
        except TimeoutError:
            return False

    def _link_key(self, dest: str) -> str:
        """`[netem]` names a link by peer ID or by gRPC address: use whichever it lists."""
        cfg = self.netem.cfg
        named = dest in cfg.links or (cfg.matrix is not None and dest in cfg.matrix.nodes)
        return dest if named or dest not in self.addrs else self.addrs[dest]

    async def _sender(self, dest: str, q: asyncio.Queue) -> None:
        stream: TensorStream | None = None
        link = None
        while True:
            o, queued = await q.get()
            try:
                if link is None:
                    link = self.netem.message_link(self._link_key(dest))
                tensor = o.tensor.detach().cpu().contiguous()
                release = link.release_at(queued, tensor.numel() * tensor.element_size())
                wait = release - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                meta = {k: str(v) for k, v in o.meta.items()}
                meta["ts"] = str(int((time.time() - (time.monotonic() - queued)) * 1e6))
                meta["lk"] = str(int((release - queued) * 1e6))
                stream = await self._deliver(dest, stream, o.kind, tensor, meta)
            finally:
                q.task_done()

    async def _deliver(self, dest: str, stream: TensorStream | None, kind: str, tensor: torch.Tensor,
                       meta: dict[str, str]) -> TensorStream:
        attempt = 0
        while True:
            try:
                if stream is None or stream.error is not None:
                    stream = await self._open(dest)
                await stream.send(kind, tensor, meta, timeout=self.send_timeout_s)
                return stream
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is retried: a lost message stalls the iteration
                attempt += 1
                self.retries += 1
                M.SEND_RETRIES.inc()
                if attempt == 1 or attempt % 10 == 0:
                    emit(log, "pipeline_send_retry", "send {kind} to {dest} failed (attempt {attempt}, retrying): "
                         "{error}", level=logging.WARNING, kind=kind, dest=dest[:16], attempt=attempt,
                         error=repr(exc))
                if stream is not None:
                    stream.cancel()
                stream = None
                await asyncio.sleep(min(RETRY_MAX_S, 0.05 * 2 ** attempt))

    async def _open(self, dest: str) -> TensorStream:
        addr = self.addrs.get(dest)
        if addr is None:
            raise StreamError("refused", f"no address for {dest[:16]} in any schedule seen")
        stream = await open_stream(self.pool.get(addr, peer_id=dest), run_id=self.run_id, sender=self.me,
                                   channel_name=CHANNEL, max_tensor_bytes=self.max_bytes)
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(task(self._replies(dest, stream)))
        return stream

    async def _replies(self, dest: str, stream: TensorStream) -> None:
        """Errors a peer answers on our outgoing stream (e.g. wrong-shape activations)."""
        try:
            async for r in stream:
                if r.name == "err":
                    emit(log, "pipeline_error_reply", "{dest} refused a message: {detail}", level=logging.WARNING,
                         dest=dest[:16], detail=r.meta.get("detail", ""), reason=r.meta.get("reason", ""))
        except StreamError:
            pass

    # ------------------------------------------------------------------ inbound
    async def _on_stream(self, stream: TensorStream) -> None:
        sender = stream.peer.sender
        async for r in stream:
            try:
                meta = {k: int(v) for k, v in r.meta.items()}
            except ValueError:
                M.DROPPED.labels(reason="malformed").inc()
                continue
            ts, lk = meta.pop("ts", None), meta.pop("lk", None)
            if ts is not None and lk is not None:
                self.hops.add(max(0.0, time.time() - ts / 1e6), lk / 1e6)
            self.inbox.put_nowait((Msg(r.name, sender, meta, r.tensor), stream))

    async def answer_error(self, reply: TensorStream | None, reason: str, detail: str) -> None:
        """Tell the sender of a message we could not use why (best effort)."""
        if reply is None:
            return
        try:
            await reply.send("err", placeholder(), {"reason": reason, "detail": detail[:300]}, timeout=5.0)
        except (StreamError, TimeoutError):
            pass

    async def close(self) -> None:
        for t in [*self._tasks, *self._senders.values()]:
            t.cancel()
        for stream in list(self.service.open_streams):
            stream.cancel()
        await self.pool.close()


__all__ = ["CHANNEL", "HopStats", "StageTransport"]
