"""The ``grpo`` role: a GRPO learner that shares signed rollouts with its peers (F-TIS).

    swarmnode run --role grpo --initial-peers /ip4/…/p2p/12D3KooW… [--set grpo.mode=ftis]

The round policy only: the engine is ``rl/learner.py`` (sampling, local rewards, mixed groups,
re-scoring, the F-TIS / baseline step, on the compute thread), the math ``rl/grpo.py`` and
``rl/ftis.py``, the rollout exchange ``rl/grpo_peers.py`` over ``rl/grpo_exchange.py`` (signed
batches, bus shards, DHT index + gRPC Fetch, the validating inbox), the series and figures
``rl/grpo_metrics.py``. The round loop, finish, drain and the per-round report are
``node/training.py``'s ``TrainingRole``.

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
(counted). With ``exit_after`` (trained rounds) the role evaluates, logs ``training_finished``
with its figures and drains.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from models.config import ModelConfig
from node.device import record_memory
from node.logs import emit
from node.roles import NodeContext, Service, register
from node.run_settings import TrainingCard, require_loopback
from node.training import TrainingRole, TrainStep
from rl import grpo_metrics
from rl.adversary import asr_markers
from rl.defense import Defense
from rl.grpo_config import AdversaryConfig, GRPOConfig
from rl.grpo_exchange import INDEX, add_rollout_service, sign_batch
from rl.grpo_metrics import Tally
from rl.grpo_peers import RolloutPeers, now_round, round_start
from rl.learner import Learner
from security.keys import load_key_file

log = logging.getLogger("swarmnode.grpo")


class RoleSettings(BaseModel):
    """The sections the grpo role reads: ``[grpo]`` and ``[model]``."""

    model_config = ConfigDict(extra="forbid")
    grpo: GRPOConfig
    model: ModelConfig


class GRPOCard(TrainingCard):
    """The grpo role's node-card details (``swarmnode status`` shows them)."""

    model_id: str | None = None
    n_params: int | None = None
    mode: str | None = None
    adversary: bool | None = None
    """Present (True) only on the test harness's attacker."""
    round: int | None = None
    reward: float | None = None
    rejected: int | None = None
    """Rollout batches and completions refused so far (inbox + content checks)."""
    grpo_banned: int | None = None
    grpo_banned_ids: str | None = None
    """The last 8 characters of up to 8 banned senders, comma-separated."""


def derived_seed(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"grpo-model:{peer_id}".encode()).digest()[:4], "little")


@register
class GRPORole(TrainingRole):
    name = "grpo"
    Settings = RoleSettings
    run_section = "grpo"
    Card = GRPOCard
    rendezvous = (INDEX,)
    progress_key = "rounds"
    finished_msg = ("trained {rounds} rounds: held-out accuracy {accuracy_start:.3f} -> {accuracy_end:.3f}, "
                    "reward {reward_start:.3f} -> {reward_end:.3f}; draining")
    cfg: GRPOConfig

    def __init__(self, ctx: NodeContext, settings: RoleSettings):
        super().__init__(ctx, settings)
        ident = ctx.config.identity
        self.seed = self.cfg.model_seed if self.cfg.model_seed is not None else derived_seed(ctx.peer_id)
        if self.cfg.adversary is not None:
            require_loopback(ctx.config, "[grpo.adversary]", "Remove [grpo.adversary]")
            emit(log, "grpo_adversary", "*** TEST ONLY: this peer is an ADVERSARY ({mode}): it publishes poisoned "
                 "rollouts ***", level=logging.WARNING, mode=self.cfg.adversary.mode)
        self.adversary = None
        self.defense: Defense | None = None
        self.learner: Learner | None = None      # built on the compute thread, on the configured device
        key = load_key_file(ident.path, allow_insecure_mode=ident.allow_insecure_mode)
        self.peers = RolloutPeers(ctx, self.cfg, key)
        self.tally = Tally()

    def services(self) -> list[Service]:
        return [Service(add_rollout_service, self.peers.servicer, "swarmnode.RolloutService")]

    def progress(self) -> int:
        return self.tally.trained

    def round_wait_s(self, budget_s: float) -> float:
        """Leave the current round within a round length at most (peers never wait for us)."""
        return max(0.0, min(budget_s - 1.0, self.cfg.round_s))

    async def close_transport(self) -> None:
        await self.peers.close()

    # ---------------- start-up ----------------
    async def setup(self) -> None:
        info = await self.compute.run(self._build, asyncio.get_running_loop())
        learner, tally = self.learner, self.tally
        self.peers.learner = learner
        self.cfg_hash = learner.config_hash
        tally.accuracy_start = tally.accuracy_last = info["accuracy"]
        grpo_metrics.ACCURACY_INITIAL.set(info["accuracy"])
        grpo_metrics.ACCURACY.set(info["accuracy"])
        self.update_card(GRPOCard(cfg_hash=learner.config_hash, model_id=learner.model_id, n_params=learner.n_params,
                                  mode=self.cfg.mode, **({"adversary": True} if self.adversary is not None else {})),
                         publish=True)
        if self.peers.bus is not None:
            self.ctx.supervisor.spawn("grpo_bus", lambda: self.peers.listen_bus(lambda: self.stopping), restart=True)
        await self.ctx.set_role_ready(True, "ready", "")
        emit(log, "grpo_ready", "grpo learner ready on {device} ({precision}): {n_params} parameters ({policy} "
             "policy), warm-up {warmup_steps} steps in {warmup_s:.1f} s, held-out accuracy {accuracy:.3f}, "
             "mode {mode}, transport {transport}", n_params=learner.n_params, warmup_steps=tally.warmup_steps, mode=self.cfg.mode,
             model_id=learner.model_id, config_hash=learner.config_hash, policy=learner.policy.kind,
             transport="bus" if self.peers.bus is not None else "dht", **info)
        tally.next_round = now_round(self.cfg.round_s) + 1

    def _build(self, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
        """Compute thread, after the DHT is up: resolve ``[device]``, build the policy there, warm
        it up (or load the cached warm-up); returns the figures for the ready log line."""
        details = self.place()
        precision = self.ctx.config.device.precision
        t0 = time.monotonic()
        self.learner = Learner(self.cfg, self.settings.model, self.seed, self.ctx.config.run_id, self.ctx.peer_id,
                               device=self.device, precision=precision)
        self.tally.warmup_steps, acc = self.learner.warmup(Path(self.cfg.warmup_cache_dir).expanduser())
        if self.cfg.model_seed is not None:
            # peers started from the same weights (a homogeneous swarm) still sample their own completions
            self.learner.gen.manual_seed(derived_seed(self.ctx.peer_id))
        if self.cfg.adversary is not None:
            from rl.adversary import Adversary
            self.adversary = Adversary(self.learner, self.cfg.adversary, self.seed)
        elif self.cfg.defense.kind != "off":
            self.defense = Defense(self.cfg, self.learner.model_id, self.learner.policy.decode,
                                   on_reject=lambda reason, n: grpo_metrics.REJECTED.labels(reason=reason).inc(n),
                                   on_ban=lambda sender, reason: self._on_ban(loop, sender, reason),
                                   on_judge=lambda outcome: grpo_metrics.JUDGE_CALLS.labels(outcome=outcome).inc())
            self.learner.defense = self.defense
        record_memory(self.device)
        return {"device": str(self.device), "precision": precision, "accuracy": acc,
                "warmup_s": round(time.monotonic() - t0, 2), **details}

    # ---------------- bans ----------------
    def _on_ban(self, loop: asyncio.AbstractEventLoop, sender: str, reason: str) -> None:
        """A rate ban (compute thread): announce it from the event loop, as a supervised task."""
        grpo_metrics.BANS.inc()
        loop.call_soon_threadsafe(self._spawn_announce, sender, reason)

    def _spawn_announce(self, sender: str, reason: str) -> None:
        try:
            self.ctx.supervisor.spawn(f"grpo_ban_{sender[-12:]}", lambda: self._announce_ban(sender, reason),
                                      restart=False)
        except RuntimeError:  # this sender's ban is being announced already
            pass

    async def _announce_ban(self, sender: str, reason: str) -> None:
        """Show the ban on the node card (``swarmnode status``: grpo_banned, and ``banned_by`` on
        the banned peer's row) and gossip it on the bus's ``swarm`` topic."""
        banned = sorted(str(k) for k in self.defense.policy.banned())
        self.update_card(GRPOCard(grpo_banned=len(banned), grpo_banned_ids=",".join(k[-8:] for k in banned[:8])),
                         publish=True)
        bus, sent = self.ctx.eventbus, False
        if bus is not None:
            try:
                sent = await bus.announce("ban", peer_id=sender, scope="grpo_rollouts", reason=reason[:200],
                                          ttl_s=self.cfg.defense.ban_ttl_s)
            except Exception as exc:  # noqa: BLE001 - the card still shows the ban
                emit(log, "grpo_ban_gossip_failed", "could not gossip the ban of {sender}: {error}",
                     level=logging.WARNING, sender=sender, error=repr(exc))
        emit(log, "grpo_ban_announced", "peer {sender} banned from this peer's GRPO groups ({reason}); announced "
             "on the bus: {bus}", level=logging.WARNING, sender=sender, reason=reason, bus=sent)

    # ---------------- rounds ----------------
    async def one_round(self) -> None:
        """Wait for the next round of the clock; skip it when it started too long ago; else play it."""
        cfg, tally = self.cfg, self.tally
        while (r := now_round(cfg.round_s)) < tally.next_round:
            if await self.pause(max(0.01, round_start(tally.next_round, cfg.round_s) - time.time())):
                return
        tally.next_round = r + 1
        late = time.time() - round_start(r, cfg.round_s)
        if late > cfg.start_slack_frac * cfg.round_s:
            tally.skipped += 1
            grpo_metrics.ROUNDS.labels(outcome="skipped").inc()
            emit(log, "grpo_round_skipped", "round {round}: ready {late_s:.2f} s after its start, skipping to the "
                 "next", round=r, late_s=round(late, 3))
            return
        await self._play(r)

    async def _play(self, r: int) -> None:
        cfg, learner, tally = self.cfg, self.learner, self.tally
        t_r = round_start(r, cfg.round_s)
        gen = await self.compute.run(learner.generate, r)
        batch = (await self.compute.run(self.adversary.batch, gen) if self.adversary is not None
                 else learner.batch(gen))
        signed = await asyncio.to_thread(sign_batch, self.peers.key, batch)
        n_tok = batch.n_tokens()
        bytes_per_token = grpo_metrics.record_sent(len(signed.body), n_tok)
        self.peers.publish_in_background(r, signed, batch)
        foreign = await self.peers.collect(r, t_r + cfg.collect_frac * cfg.round_s, lambda: self.stopping)
        senders = len(foreign)
        grpo_metrics.record_received(senders, sum(b.n_tokens() for b in foreign))
        if self.stopping:
            return
        if self.adversary is not None:
            # the test harness's attacker does not train: it only publishes, on the round clock
            tally.trained += 1
            emit(log, "grpo_adversary_round", "round {round}: adversary published {completion_tokens} poisoned "
                 "completions", round=r, trained=tally.trained, completion_tokens=n_tok)
            return
        st = await self.compute.run(learner.train, gen, foreign)
        tally.trained += 1
        tally.rewards.append(st.reward_local)
        grpo_metrics.record_step(st, r, first=tally.trained == 1)
        if self.eval_due():
            tally.accuracy_last, rates, _ = await self.compute.run(learner.evaluate, None, self._markers())
            grpo_metrics.record_eval(tally.accuracy_last, rates)
            emit(log, "grpo_eval", "round {round}: held-out accuracy {accuracy:.3f} after {trained} rounds",
                 round=r, trained=tally.trained, accuracy=tally.accuracy_last)
        dur = time.time() - t_r
        grpo_metrics.ROUND_SECONDS.observe(dur)
        defense = self.defense
        rejected = sum(self.peers.inbox.rejected.values()) + (sum(defense.rejected.values()) if defense else 0)
        self.report(
            "grpo_round_done", "round {round}: reward {reward:.3f}, {n_local} own + {n_foreign} foreign from "
            "{peers_used} peers (seen {peers_seen}), filtered {filtered_frac:.2f}, w {weight_mean:.3f}, "
            "{duration_s:.2f} s", round=r, steps=TrainStep(st.loss, st.tokens, gen.seconds + st.seconds),
            card=GRPOCard(round=r, reward=round(st.reward_local, 3), rejected=rejected),
            trained=tally.trained, reward=st.reward_local, reward_foreign=st.reward_foreign, n_local=st.n_local,
            n_foreign=st.n_foreign, peers_seen=senders, peers_used=st.senders, filtered_frac=st.filtered_frac,
            weight_mean=st.weight_mean, kl_token=round(st.kl_foreign, 4), kl_seq=round(st.kl_seq_foreign, 4),
            loss=st.loss, duration_s=round(dur, 3), accuracy=tally.accuracy_last,
            indexed=self.peers.last_collect[0], fetched=self.peers.last_collect[1], bus=self.peers.bus_up(),
            bytes_per_token=round(bytes_per_token, 3), sent_bytes=len(signed.body), sent_tokens=n_tok,
            filtered=st.filtered, rejected=st.rejected, rejected_by=st.rejected_by,
            foreign_tokens=st.foreign_tokens,
            banned=sorted(str(k) for k in defense.policy.banned()) if defense else [])

    def _markers(self) -> tuple[str, ...]:
        """The attack markers the held-out evaluation counts (the harness's, else every known one)."""
        return tuple(asr_markers(self.cfg.adversary or AdversaryConfig(mode="inject+edit")))

    # ---------------- finish ----------------
    async def summary(self) -> dict[str, Any]:
        """Final held-out evaluation and the run's figures (the ``training_finished`` fields)."""
        tally, defense = self.tally, self.defense
        acc, marker_rates, mean_len = await self.compute.run(self.learner.evaluate, None, self._markers())
        tally.accuracy_last = acc
        grpo_metrics.record_eval(acc, marker_rates)
        reward_start, reward_end = tally.reward_span()
        return {"rounds": tally.trained, "skipped": tally.skipped, "step": tally.trained,
                "accuracy_start": tally.accuracy_start, "accuracy_end": acc,
                "reward_start": reward_start, "reward_end": reward_end,
                "warmup_steps": tally.warmup_steps, "n_params": self.learner.n_params, "mode": self.cfg.mode,
                "topology": self.cfg.topology,
                "model_id": self.learner.model_id, "marker_rates": marker_rates, "heldout_len_mean": mean_len,
                "adversary": self.cfg.adversary.mode if self.cfg.adversary else None,
                "defense": self.cfg.defense.kind if defense is not None else "off",
                "judge": defense.judge_name if defense is not None else None,
                "senders": defense.sender_report() if defense is not None else {}}
