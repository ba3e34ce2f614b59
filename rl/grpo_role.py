"""The ``grpo`` role: a GRPO learner that shares signed rollouts with its peers (F-TIS).

    swarmnode run --role grpo --initial-peers /ip4/…/p2p/12D3KooW… [--set grpo.mode=ftis]

Glue only: the round work is ``rl/learner.py`` (sampling, local rewards, mixed groups,
re-scoring, the F-TIS / baseline step, on the compute thread), the math ``rl/grpo.py`` and
``rl/ftis.py``, the transport ``rl/grpo_exchange.py`` (signed batches, bus shards, DHT index +
gRPC Fetch, the validating inbox), the series ``rl/grpo_metrics.py``.

Rounds come from the clock: round r spans [r * round_s, (r + 1) * round_s), so peers agree on
the round (and so on its prompts, seeded by run and round) without talking. Per round:

1. generate G completions for each of the round's B prompts (compute thread, KV-cached);
2. sign and publish the batch: shards on the bus's ``rollouts`` topic when the bus is up, and in
   any case a signed index entry in the DHT with the batch served over ``RolloutService.Fetch``;
3. collect peers' batches until t_r + collect_frac * round_s (bus deliveries as they come; index
   reads and parallel fetches for senders not heard from): late or missing peers never hold
   the round up, and a round with no peer is a solo round;
4. one step on the mixed groups (``grpo.mode``: ftis / uncorrected / solo), metrics, card.

A peer that is not ready in time for a round (slow step, warm-up) skips to the next one
(counted). With ``exit_after_rounds`` the role evaluates, logs ``training_finished`` with its
figures and drains.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from models.config import ModelConfig
from node.compute import Compute
from node.device import device_details, record_memory, resolve_device
from node.logs import set_context
from node.metrics import record_train_step
from node.roles import NodeContext, RoleBase, register
from rl import grpo_metrics
from rl.adversary import asr_markers
from rl.grpo_config import AdversaryConfig, GRPOConfig
from rl.grpo_exchange import INDEX, Fetcher, Inbox, RolloutIndexEntry, RolloutServicer, Signed, \
    add_rollout_service, decode_shard, shards, sign_batch
from rl.defense import Defense
from rl.learner import Learner
from rl.rollout import Expect, RolloutRejected, decode
from security.config import is_loopback_host, is_loopback_maddr
from security.keys import load_key_file

log = logging.getLogger("swarmnode.grpo")


class RoleSettings(BaseModel):
    """The sections the grpo role reads: ``[grpo]`` and ``[model]``."""

    model_config = ConfigDict(extra="forbid")
    grpo: GRPOConfig
    model: ModelConfig


def derived_seed(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"grpo-model:{peer_id}".encode()).digest()[:4], "little")


def _log_publish_failure(task: asyncio.Task, r: int) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("publishing the round %d rollout index failed: %r; peers that missed the bus shards "
                    "train without this batch", r, task.exception(),
                    extra={"event": "grpo_publish_failed", "round": r})


@register
class GRPORole(RoleBase):
    name = "grpo"
    Settings = RoleSettings
    rendezvous = (INDEX,)

    def __init__(self, ctx: NodeContext, settings: RoleSettings):
        self.ctx, self.settings, self.cfg = ctx, settings, settings.grpo
        self.run_id = ctx.config.run_id
        if self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)
        ident = ctx.config.identity
        self.key = load_key_file(ident.path, allow_insecure_mode=ident.allow_insecure_mode)
        self.seed = self.cfg.model_seed if self.cfg.model_seed is not None else derived_seed(ctx.peer_id)
        if self.cfg.adversary is not None:
            c = ctx.config
            public = [h for h in (c.host, c.advertise_host) if h and not is_loopback_host(h)]
            public += [m for m in (*c.dht.initial_peers, *c.dht.announce_maddrs) if not is_loopback_maddr(m)]
            if public:
                raise ValueError(f"[grpo.adversary] is a test and benchmark harness: it is refused unless every listen "
                                 f"and peer address is loopback; {public[0]!r} is not. Remove [grpo.adversary]")
            log.warning("*** TEST ONLY: this peer is an ADVERSARY (%s): it publishes poisoned rollouts ***",
                        self.cfg.adversary.mode, extra={"event": "grpo_adversary", "mode": self.cfg.adversary.mode})
        self.adversary = None
        self.defense: Defense | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bans: dict[str, str] = {}
        self.learner: Learner | None = None      # built on the compute thread, on the configured device
        self.compute = Compute(self.name)
        self.servicer = RolloutServicer(self.run_id)
        self.fetcher = Fetcher(ctx.config.grpc.max_message_bytes)
        self.inbox = Inbox(ctx.peer_id, self.cfg.max_rejections_per_sender, self.cfg.ban_rounds,
                           on_reject=lambda reason: grpo_metrics.REJECTED.labels(reason=reason).inc())
        self._stopping = False
        self._round_task: asyncio.Task | None = None
        self._publishing: asyncio.Task | None = None
        self._last_collect = (0, 0)      # (peers listed in the round's index, batches fetched)
        self._prompt_ids: dict[int, frozenset[bytes]] = {}
        self.rewards: list[float] = []
        self.accuracy_start: float | None = None
        self.accuracy_last: float | None = None
        self.trained = 0
        self.skipped = 0
        self.warmup_steps = 0

    def services(self):
        return [(add_rollout_service, self.servicer, "swarmnode.RolloutService")]

    # ---------------- helpers ----------------
    @property
    def bus(self):
        if self.cfg.transport == "dht":
            return None
        return self.ctx.eventbus

    def _bus_up(self) -> bool:
        bus = self.bus
        return bus is not None and bool(getattr(bus, "up", False))

    def now_round(self) -> int:
        return int(time.time() // self.cfg.round_s)

    def round_start(self, r: int) -> float:
        return r * self.cfg.round_s

    def expect(self, r: int) -> Expect:
        """What a batch for round r must satisfy (our round config and that round's prompts)."""
        learner = self.learner
        pids = self._prompt_ids.get(r)
        if pids is None:
            pids = frozenset(p.prompt_id for p in learner.task.prompts(self.run_id, r, self.cfg.prompts_per_round))
            self._prompt_ids[r] = pids
            for old in [k for k in self._prompt_ids if k < r - 4]:
                del self._prompt_ids[old]
        cfg = self.cfg
        return Expect(run=self.run_id, round=r, tokenizer_hash=learner.tokenizer_hash,
                      temperature=cfg.temperature, vocab_size=learner.policy.vocab_size,
                      max_tokens=cfg.max_completion_tokens, prompt_ids=pids,
                      max_completions_per_group=max(cfg.completions_per_prompt, 64),
                      config_hash=learner.config_hash)

    # ---------------- start-up ----------------
    async def start(self) -> None:
        await self.ctx.set_role_ready(False, "role_init", "building and warming the policy up")
        self.ctx.supervisor.spawn("grpo_train", self._main, restart=False)

    def _build(self) -> dict:
        """Compute thread, after the DHT is up: resolve ``[device]``, build the policy there, warm
        it up (or load the cached warm-up); returns the figures for the ready log line."""
        dc = self.ctx.config.device
        device = resolve_device(dc)
        t0 = time.monotonic()
        self.learner = Learner(self.cfg, self.settings.model, self.seed, self.run_id, self.ctx.peer_id,
                               device=device, precision=dc.precision)
        self.warmup_steps, acc = self.learner.warmup(Path(self.cfg.warmup_cache_dir).expanduser())
        if self.cfg.model_seed is not None:
            # peers started from the same weights (a homogeneous swarm) still sample their own completions
            self.learner.gen.manual_seed(derived_seed(self.ctx.peer_id))
        if self.cfg.adversary is not None:
            from rl.adversary import Adversary
            self.adversary = Adversary(self.learner, self.cfg.adversary, self.seed)
        elif self.cfg.defense.kind != "off":
            self.defense = Defense(self.cfg, self.learner.model_id, self.learner.policy.decode,
                                   on_reject=lambda reason, n: grpo_metrics.REJECTED.labels(reason=reason).inc(n),
                                   on_ban=self._on_ban,
                                   on_judge=lambda outcome: grpo_metrics.JUDGE_CALLS.labels(outcome=outcome).inc())
            self.learner.defense = self.defense
        record_memory(device)
        return {"device": str(device), "precision": dc.precision, "accuracy": acc,
                "warmup_s": round(time.monotonic() - t0, 2), **device_details(device)}

    def _on_ban(self, sender: str, reason: str) -> None:
        """A rate ban (compute thread): hand it to the event loop."""
        grpo_metrics.BANS.inc()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._announce_ban(sender, reason)))

    async def _announce_ban(self, sender: str, reason: str) -> None:
        """Show the ban on the node card (``swarmnode status``: grpo_banned, and ``banned_by`` on
        the banned peer's row) and gossip it on the bus's ``swarm`` topic."""
        self._bans[sender] = reason
        banned = sorted(str(k) for k in self.defense.policy.banned()) if self.defense else sorted(self._bans)
        self.ctx.card.update(publish=True, grpo_banned=len(banned), grpo_banned_ids=",".join(k[-8:] for k in banned[:8]))
        bus = self.ctx.eventbus
        if bus is not None:
            try:
                sent = await bus.announce("ban", peer_id=sender, scope="grpo_rollouts", reason=reason[:200],
                                          ttl_s=self.cfg.defense.ban_ttl_s)
            except Exception as exc:  # noqa: BLE001 - the card still shows the ban
                log.warning("could not gossip the ban of %s: %r", sender, exc)
                sent = False
        else:
            sent = False
        log.warning("peer %s banned from this peer's GRPO groups (%s); announced on the bus: %s", sender, reason, sent,
                    extra={"event": "grpo_ban_announced", "sender": sender, "reason": reason, "bus": sent})

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        info = await self.compute.run(self._build)
        learner = self.learner
        acc0 = info["accuracy"]
        self.accuracy_start = self.accuracy_last = acc0
        grpo_metrics.ACCURACY_INITIAL.set(acc0)
        grpo_metrics.ACCURACY.set(acc0)
        self.ctx.card.update(publish=True, cfg_hash=learner.config_hash, model_id=learner.model_id,
                             n_params=learner.n_params, mode=self.cfg.mode,
                             **({"adversary": True} if self.adversary is not None else {}))
        if self.bus is not None:
            self.ctx.supervisor.spawn("grpo_bus", self._listen_bus, restart=True)
        await self.ctx.set_role_ready(True, "ready", "")
        log.info("grpo learner ready on %s (%s): %d parameters (%s policy), warm-up %d steps in %.1f s, held-out "
                 "accuracy %.3f, mode %s, transport %s", info["device"], info["precision"], learner.n_params,
                 learner.policy.kind, self.warmup_steps, info["warmup_s"], acc0, self.cfg.mode,
                 "bus" if self.bus is not None else "dht",
                 extra={"event": "grpo_ready", "n_params": learner.n_params, "accuracy": acc0,
                        "warmup_steps": self.warmup_steps, "mode": self.cfg.mode, "model_id": learner.model_id,
                        "config_hash": learner.config_hash, **info})
        next_round = self.now_round() + 1
        while not self._stopping:
            r = self.now_round()
            if r < next_round:
                await asyncio.sleep(max(0.01, self.round_start(next_round) - time.time()))
                continue
            late = time.time() - self.round_start(r)
            if late > self.cfg.start_slack_frac * self.cfg.round_s:
                self.skipped += 1
                grpo_metrics.ROUNDS.labels(outcome="skipped").inc()
                log.info("round %d: ready %.2f s after its start, skipping to the next", r, late,
                         extra={"event": "grpo_round_skipped", "round": r, "late_s": round(late, 3)})
                next_round = r + 1
                continue
            self._round_task = asyncio.ensure_future(self._one_round(r))
            try:
                await asyncio.shield(self._round_task)
            except asyncio.CancelledError:
                if self._round_task is not None and not self._round_task.done():
                    self._round_task.cancel()
                raise
            next_round = r + 1
            if self.cfg.exit_after_rounds and self.trained >= self.cfg.exit_after_rounds:
                await self._finish()
                return

    async def _finish(self) -> None:
        self._stopping = True
        markers = tuple(asr_markers(self.cfg.adversary or AdversaryConfig(mode="inject+edit")))
        acc, marker_rates, mean_len = await self.compute.run(self.learner.evaluate, None, markers)
        self.accuracy_last = acc
        grpo_metrics.ACCURACY.set(acc)
        grpo_metrics.MARKER_RATE.set(max(marker_rates.values(), default=0.0))
        k = max(1, min(5, len(self.rewards) // 4))
        fields = {"rounds": self.trained, "skipped": self.skipped, "step": self.trained,
                  "accuracy_start": self.accuracy_start, "accuracy_end": acc,
                  "reward_start": sum(self.rewards[:k]) / k, "reward_end": sum(self.rewards[-k:]) / k,
                  "warmup_steps": self.warmup_steps, "n_params": self.learner.n_params, "mode": self.cfg.mode,
                  "model_id": self.learner.model_id, "marker_rates": marker_rates, "heldout_len_mean": mean_len,
                  "adversary": self.cfg.adversary.mode if self.cfg.adversary else None,
                  "defense": self.cfg.defense.kind if self.defense is not None else "off",
                  "judge": self.defense.judge_name if self.defense is not None else None,
                  "senders": self.defense.sender_report() if self.defense is not None else {}}
        log.info("trained %d rounds: held-out accuracy %.3f -> %.3f, reward %.3f -> %.3f; draining",
                 self.trained, self.accuracy_start, acc, fields["reward_start"], fields["reward_end"],
                 extra={"event": "training_finished", **fields})
        self.ctx.request_drain("finished")

    # ---------------- one round ----------------
    async def _one_round(self, r: int) -> None:
        cfg = self.cfg
        t_r = self.round_start(r)
        gen = await self.compute.run(self.learner.generate, r)
        batch = (await self.compute.run(self.adversary.batch, gen) if self.adversary is not None
                 else self.learner.batch(gen))
        signed = await asyncio.to_thread(sign_batch, self.key, batch)
        self.servicer.put(r, signed)
        n_tok = batch.n_tokens()
        grpo_metrics.WIRE_BYTES.labels(direction="sent").inc(len(signed.body))
        grpo_metrics.WIRE_TOKENS.labels(direction="sent").inc(n_tok)
        bytes_per_token = len(signed.body) / max(n_tok, 1)
        grpo_metrics.BYTES_PER_TOKEN.set(bytes_per_token)
        deadline = t_r + cfg.collect_frac * cfg.round_s
        # the publish is never cancelled by the deadline: a slow DHT store still lands for late readers
        self._publishing = asyncio.ensure_future(self._publish(r, signed, batch.n_tokens(), len(batch.groups)))
        self._publishing.add_done_callback(lambda t, r=r: _log_publish_failure(t, r))
        await self._collect(r, deadline)
        foreign = self.inbox.take(r)
        senders = len(foreign)
        grpo_metrics.PEERS_SEEN.set(senders)
        grpo_metrics.PEERS_SEEN_HIST.observe(senders)
        for b in foreign:
            grpo_metrics.WIRE_TOKENS.labels(direction="received").inc(b.n_tokens())
        if self._stopping:
            return
        if self.adversary is not None:
            # the test harness's attacker does not train: it only publishes, on the round clock
            self.trained += 1
            log.info("round %d: adversary published %d poisoned completions", r, n_tok,
                     extra={"event": "grpo_adversary_round", "round": r, "trained": self.trained})
            return
        st = await self.compute.run(self.learner.train, gen, foreign)
        self.trained += 1
        self.rewards.append(st.reward_local)
        if self.trained == 1:
            grpo_metrics.REWARD_INITIAL.set(st.reward_local)
        grpo_metrics.REWARD.set(st.reward_local)
        grpo_metrics.ROUND.set(r)
        grpo_metrics.ROUNDS.labels(outcome="ok" if st.n_foreign else "solo").inc()
        grpo_metrics.ROLLOUTS.labels(source="local").inc(st.n_local)
        grpo_metrics.ROLLOUTS.labels(source="peer").inc(st.n_foreign)
        grpo_metrics.FILTERED_FRAC.set(st.filtered_frac)
        grpo_metrics.FILTERED.inc(st.filtered)
        grpo_metrics.WEIGHT_MEAN.set(st.weight_mean)
        grpo_metrics.TRUNCATED_RATIO.set(st.truncated_frac)
        grpo_metrics.KL_GEN_LOCAL.set(st.kl_foreign)
        record_train_step(st.loss, st.tokens, gen.seconds + st.seconds)
        if cfg.eval_every and self.trained % cfg.eval_every == 0 and \
                not (cfg.exit_after_rounds and self.trained >= cfg.exit_after_rounds):
            markers = tuple(asr_markers(self.cfg.adversary or AdversaryConfig(mode="inject+edit")))
            self.accuracy_last, rates, _ = await self.compute.run(self.learner.evaluate, None, markers)
            grpo_metrics.ACCURACY.set(self.accuracy_last)
            grpo_metrics.MARKER_RATE.set(max(rates.values(), default=0.0))
            log.info("round %d: held-out accuracy %.3f after %d rounds", r, self.accuracy_last, self.trained,
                     extra={"event": "grpo_eval", "round": r, "trained": self.trained,
                            "accuracy": self.accuracy_last})
        dur = time.time() - t_r
        grpo_metrics.ROUND_SECONDS.observe(dur)
        self.ctx.card.update(round=r, reward=round(st.reward_local, 3), rejected=sum(self.inbox.rejected.values())
                             + (sum(self.defense.rejected.values()) if self.defense is not None else 0))
        set_context(round=r)
        log.info("round %d: reward %.3f, %d own + %d foreign from %d peers (seen %d), filtered %.2f, "
                 "w %.3f, %.2f s", r, st.reward_local, st.n_local, st.n_foreign, st.senders, senders,
                 st.filtered_frac, st.weight_mean, dur,
                 extra={"event": "grpo_round_done", "round": r, "trained": self.trained,
                        "reward": st.reward_local, "reward_foreign": st.reward_foreign,
                        "n_local": st.n_local, "n_foreign": st.n_foreign, "peers_seen": senders,
                        "peers_used": st.senders, "filtered_frac": st.filtered_frac,
                        "weight_mean": st.weight_mean, "loss": st.loss, "duration_s": round(dur, 3),
                        "accuracy": self.accuracy_last, "indexed": self._last_collect[0],
                        "fetched": self._last_collect[1], "bus": self._bus_up(),
                        "bytes_per_token": round(bytes_per_token, 3), "sent_bytes": len(signed.body),
                        "sent_tokens": n_tok, "filtered": st.filtered,
                        "rejected": st.rejected, "rejected_by": st.rejected_by,
                        "foreign_tokens": st.foreign_tokens,
                        "banned": sorted(str(k) for k in self.defense.policy.banned()) if self.defense else []})

    async def _publish(self, r: int, signed: Signed, n_tokens: int, n_groups: int) -> None:
        """Bus shards (when the bus is up), then the DHT index entry (always: the fallback)."""
        bus = self.bus
        if bus is not None and self._bus_up():
            try:
                for data in shards(self.key, decode(signed.body), bus.cfg.rollouts_max_bytes):
                    await bus.publish("rollouts", data)
            except Exception as exc:  # noqa: BLE001 - the index below still makes the batch findable
                log.warning("publishing round %d rollouts on the bus failed: %r; peers fetch them through "
                            "the DHT index", r, exc, extra={"event": "grpo_bus_publish_failed", "round": r})
        entry = RolloutIndexEntry(round=r, digest=hashlib.sha256(signed.body).hexdigest(), n_groups=n_groups,
                                  n_tokens=n_tokens, grpc_addr=self.ctx.grpc_addr)
        await INDEX.publish(self.ctx.membership.dht, self.run_id, self.ctx.peer_id, entry,
                            ttl_s=max(10.0, 2 * self.cfg.round_s), timeout=max(1.0, self.cfg.round_s))

    async def _collect(self, r: int, deadline: float) -> None:
        """Until the deadline: read the round's index and fetch batches from the peers not heard
        from yet (with the bus up, bus deliveries fill the inbox and the index is read once, late,
        for whoever the bus missed)."""
        ex = self.expect(r)
        tried: set[str] = set()
        seen: set[str] = set()
        try:
            await self._collect_loop(r, deadline, ex, tried, seen)
        finally:
            self._last_collect = (len(seen), len(tried))

    async def _collect_loop(self, r: int, deadline: float, ex: Expect, tried: set[str], seen: set[str]) -> None:
        bus_mode = self._bus_up()
        while not self._stopping:
            left = deadline - time.time()
            if left <= 0.05:
                return
            if bus_mode and time.time() < deadline - min(1.0, 0.4 * self.cfg.collect_frac * self.cfg.round_s):
                await asyncio.sleep(min(0.1, left))
                continue
            try:
                entries = await INDEX.read(self.ctx.membership.dht, self.run_id, r, timeout=max(0.1, left))
            except Exception as exc:  # noqa: BLE001 - no index this time: try again until the deadline
                log.debug("reading the round %d rollout index failed: %r", r, exc)
                entries = {}
            seen.update(p for p in entries if p != self.ctx.peer_id)
            todo = [(pid, e) for pid, e in entries.items()
                    if pid != self.ctx.peer_id and pid not in tried and not self.inbox.has(r, pid)][:self.cfg.max_senders]
            if todo:
                timeout = max(0.1, min(self.cfg.fetch_timeout_s, deadline - time.time()))
                got = await asyncio.gather(*(self.fetcher.fetch(e.grpc_addr, pid, self.run_id, r, self.ctx.peer_id,
                                                                timeout) for pid, e in todo))
                for (pid, e), s in zip(todo, got):
                    if s is None:
                        continue
                    tried.add(pid)
                    grpo_metrics.WIRE_BYTES.labels(direction="received").inc(len(s.body))
                    self.inbox.offer(s, pid, ex, digest=e.digest)
            if bus_mode:
                return
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.time())))

    # ---------------- bus ----------------
    async def _listen_bus(self) -> None:
        """Feed bus deliveries on ``rollouts`` into the inbox (rounds r-1..r+1 of the clock)."""
        bus = self.bus
        async for d in bus.messages(("rollouts",)):
            if self._stopping:
                return
            now = self.now_round()
            try:
                grpo_metrics.WIRE_BYTES.labels(direction="received").inc(len(d.data))
                s = decode_shard(d.data)
                rnd = decode(s.body, self.cfg.max_completion_tokens).round
            except RolloutRejected as e:
                self.inbox.refuse(d.sender, now, "schema", e.reason)
                continue
            target = rnd if now - 1 <= rnd <= now + 1 else now   # other rounds are refused as stale
            self.inbox.offer(s, d.sender, self.expect(target))

    # ---------------- drain ----------------
    async def drain(self, budget_s: float) -> None:
        """Leave the current round (peers never wait for us), stop the compute thread."""
        self._stopping = True
        self.compute.stop()
        task = self._round_task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.0, min(budget_s - 1.0, self.cfg.round_s)))
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - leaving mid-round is allowed
                task.cancel()
        await self.fetcher.close()
        await self.compute.drain(max(0.1, budget_s / 4))
        self.compute.close()
