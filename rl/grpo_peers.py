"""How a ``grpo`` peer shares rollouts with the others within a round: the round clock, publishing
its signed batch, collecting the peers' batches until the round's deadline, and the bus listener.

The pieces (signed batches, bus shards, the DHT index, the gRPC fetch, the validating inbox)
are ``rl/grpo_exchange.py``; this module is the async policy that uses them, for the role
(``rl/grpo_role.py``), with the node's DHT, event bus and supervisor from its context.

Rounds come from the clock: round r spans [r * round_s, (r + 1) * round_s), so peers agree on
the round (and so on its prompts) without talking.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import TYPE_CHECKING, Callable

from node.logs import emit
from rl import grpo_metrics
from rl.grpo_config import GRPOConfig
from rl.grpo_exchange import INDEX, Fetcher, Inbox, RolloutIndexEntry, RolloutServicer, Signed, decode_shard, \
    shards
from rl.rollout import Expect, RolloutBatch, RolloutRejected, decode

if TYPE_CHECKING:  # pragma: no cover
    from node.roles import NodeContext
    from rl.learner import Learner

log = logging.getLogger("swarmnode.grpo")

PUBLISH_SLOTS = 8
"""Publishes of different rounds that may still be in flight at once (one supervised task each);
a round whose slot is still busy from PUBLISH_SLOTS rounds earlier is not indexed (logged)."""


def now_round(round_s: float) -> int:
    return int(time.time() // round_s)


def round_start(r: int, round_s: float) -> float:
    return r * round_s


class RolloutPeers:
    """One peer's side of the rollout exchange: serve, publish, collect, listen to the bus."""

    def __init__(self, ctx: "NodeContext", cfg: GRPOConfig, key):
        self.ctx, self.cfg, self.key = ctx, cfg, key
        self.servicer = RolloutServicer(ctx.config.run_id)
        self.fetcher = Fetcher(ctx.config.grpc.max_message_bytes)
        self.inbox = Inbox(ctx.peer_id, cfg.max_rejections_per_sender, cfg.ban_rounds,
                           on_reject=lambda reason: grpo_metrics.REJECTED.labels(reason=reason).inc())
        self.learner: "Learner | None" = None    # set once built: what a batch must match (expect)
        self.last_collect = (0, 0)               # (peers listed in the round's index, batches fetched)

    # ---------------- helpers ----------------
    @property
    def bus(self):
        return None if self.cfg.transport == "dht" else self.ctx.eventbus

    def bus_up(self) -> bool:
        bus = self.bus
        return bus is not None and bool(getattr(bus, "up", False))

    def expect(self, r: int, sender: str) -> Expect:
        """What ``sender``'s batch for round r must satisfy: our round config and the prompts that
        sender answers in round r (``grpo.topology``: the round's shared prompts, or, vertical, its
        own, in whole groups of G)."""
        learner, cfg = self.learner, self.cfg
        vertical = cfg.topology == "vertical"
        return Expect(run=self.ctx.config.run_id, round=r, tokenizer_hash=learner.tokenizer_hash,
                      temperature=cfg.temperature, vocab_size=learner.policy.vocab_size,
                      max_tokens=cfg.max_completion_tokens,
                      prompt_ids=frozenset(learner.round_prompts(r, sender if vertical else None)),
                      max_completions_per_group=max(cfg.completions_per_prompt, 64),
                      config_hash=learner.config_hash,
                      group_size=cfg.completions_per_prompt if vertical else None)

    # ---------------- publish ----------------
    def publish_in_background(self, r: int, signed: Signed, batch: RolloutBatch) -> None:
        """Serve the batch and publish it as a supervised task that outlives the round's
        deadline (a slow DHT store still lands for late readers); failures are logged."""
        self.servicer.put(r, signed)

        async def publish() -> None:
            try:
                await self._publish(r, signed, batch.n_tokens(), len(batch.groups))
            except Exception as exc:  # noqa: BLE001 - peers that missed the bus shards train without it
                emit(log, "grpo_publish_failed", "publishing the round {round} rollout index failed: {error}; "
                     "peers that missed the bus shards train without this batch", level=logging.WARNING,
                     round=r, error=repr(exc))

        try:
            self.ctx.supervisor.spawn(f"grpo_publish_{r % PUBLISH_SLOTS}", publish, restart=False)
        except RuntimeError:  # the slot's publish from PUBLISH_SLOTS rounds ago still runs
            emit(log, "grpo_publish_failed", "round {round} not indexed: publishes of {slots} rounds are "
                 "still in flight (the DHT is slow)", level=logging.WARNING, round=r, slots=PUBLISH_SLOTS)

    async def _publish(self, r: int, signed: Signed, n_tokens: int, n_groups: int) -> None:
        """Bus shards (when the bus is up), then the DHT index entry (always: the fallback)."""
        bus = self.bus
        if bus is not None and self.bus_up():
            try:
                for data in shards(self.key, decode(signed.body), bus.cfg.rollouts_max_bytes):
                    await bus.publish("rollouts", data)
            except Exception as exc:  # noqa: BLE001 - the index below still makes the batch findable
                emit(log, "grpo_bus_publish_failed", "publishing round {round} rollouts on the bus failed: "
                     "{error}; peers fetch them through the DHT index", level=logging.WARNING, round=r,
                     error=repr(exc))
        entry = RolloutIndexEntry(round=r, digest=hashlib.sha256(signed.body).hexdigest(), n_groups=n_groups,
                                  n_tokens=n_tokens, grpc_addr=self.ctx.grpc_addr)
        await INDEX.publish(self.ctx.membership.dht, self.ctx.config.run_id, self.ctx.peer_id, entry,
                            ttl_s=max(10.0, 2 * self.cfg.round_s), timeout=max(1.0, self.cfg.round_s))

    # ---------------- collect ----------------
    async def collect(self, r: int, deadline: float, stopping: Callable[[], bool]) -> list[RolloutBatch]:
        """Until the deadline: read the round's index and fetch batches from the peers not heard
        from yet (with the bus up, bus deliveries fill the inbox and the index is read once, late,
        for whoever the bus missed); then the round's validated foreign batches."""
        tried: set[str] = set()
        seen: set[str] = set()
        try:
            await self._collect_loop(r, deadline, tried, seen, stopping)
        finally:
            self.last_collect = (len(seen), len(tried))
        return self.inbox.take(r)

    async def _collect_loop(self, r: int, deadline: float, tried: set[str], seen: set[str],
                            stopping: Callable[[], bool]) -> None:
        cfg, me, run = self.cfg, self.ctx.peer_id, self.ctx.config.run_id
        bus_mode = self.bus_up()
        while not stopping():
            left = deadline - time.time()
            if left <= 0.05:
                return
            if bus_mode and time.time() < deadline - min(1.0, 0.4 * cfg.collect_frac * cfg.round_s):
                await asyncio.sleep(min(0.1, left))
                continue
            try:
                entries = await INDEX.read(self.ctx.membership.dht, run, r, timeout=max(0.1, left))
            except Exception as exc:  # noqa: BLE001 - no index this time: try again until the deadline
                log.debug("reading the round %d rollout index failed: %r", r, exc)
                entries = {}
            seen.update(p for p in entries if p != me)
            todo = [(pid, e) for pid, e in entries.items()
                    if pid != me and pid not in tried and not self.inbox.has(r, pid)][:cfg.max_senders]
            if todo:
                timeout = max(0.1, min(cfg.fetch_timeout_s, deadline - time.time()))
                got = await asyncio.gather(*(self.fetcher.fetch(e.grpc_addr, pid, run, r, me, timeout)
                                             for pid, e in todo))
                for (pid, e), s in zip(todo, got):
                    if s is None:
                        continue
                    tried.add(pid)
                    grpo_metrics.WIRE_BYTES.labels(direction="received").inc(len(s.body))
                    self.inbox.offer(s, pid, self.expect(r, pid), digest=e.digest)
            if bus_mode:
                return
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.time())))

    # ---------------- bus ----------------
    async def listen_bus(self, stopping: Callable[[], bool]) -> None:
        """Feed bus deliveries on ``rollouts`` into the inbox (rounds r-1..r+1 of the clock)."""
        async for d in self.bus.messages(("rollouts",)):
            if stopping():
                return
            now = now_round(self.cfg.round_s)
            try:
                grpo_metrics.WIRE_BYTES.labels(direction="received").inc(len(d.data))
                s = decode_shard(d.data)
                rnd = decode(s.body, self.cfg.max_completion_tokens).round
            except RolloutRejected as e:
                self.inbox.refuse(d.sender, now, "schema", e.reason)
                continue
            target = rnd if now - 1 <= rnd <= now + 1 else now   # other rounds are refused as stale
            self.inbox.offer(s, d.sender, self.expect(target, d.sender))

    async def close(self) -> None:
        await self.fetcher.close()
