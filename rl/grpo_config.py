"""``[grpo]``: the settings of the ``grpo`` role (collaborative GRPO with F-TIS rollout sharing).

Owns the section's schema, its cross-field checks and the *round config hash*: the swarm-wide
part of the settings (task, B, G, sampling, completion cap, round length, tokenizer, wire
version) that every peer of a run must share, hashed into ``config_hash`` and carried in every
rollout batch (docs/grpo.md, 'Rounds'). Learner knobs (mode, C, delta, lr, aggregation, warm-up) stay local
and may differ between peers. The run knobs (``exit_after`` in trained rounds, once called
``exit_after_rounds``, ``eval_every``, ``torch_threads``) come from ``node.run_settings.RunSettings``.
Imports only pydantic, the standard library and ``node.run_settings`` (config checks must not
import torch).
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from node.run_settings import RunSettings

DEFAULT_RGYM_DATASETS = ("basic_arithmetic", "chain_sum", "base_conversion", "gcd", "lcm", "leg_counting",
                         "decimal_arithmetic", "fraction_simplification", "propositional_logic")
"""rl-swarm's nine reasoning-gym tasks (the ``rgym`` default mix)."""

WIRE_VERSION = 1                       # = rl.rollout.WIRE_VERSION (checked by a unit test)

ATTACK_MODES = ("inject", "edit", "fake_logp", "verbose")


class AdversaryConfig(BaseModel):
    """``[grpo.adversary]``: TEST AND BENCHMARK ONLY. Turns this peer into an attacker that poisons
    the rollouts it publishes (docs/grpo.md, 'Attack harness'; rl/adversary.py). Refused unless every listen and peer
    address is loopback; the peer logs a WARNING banner and its card says ``adversary``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: str = Field("inject", pattern=r"^(inject|edit|fake_logp|verbose)(\+(inject|edit|fake_logp|verbose))*$")
    """Attack(s), joined by ``+``: ``inject`` (correct answer + ``marker``), ``edit`` (``false_step``
    inserted in a correct chain, answer kept), ``fake_logp`` (claims ``claim_logp`` for every
    token to inflate importance weights), ``verbose`` (correct, padded with true useless steps
    up to the cap: DoS). Colluding attackers: run two peers with this section."""

    marker: str = " !!"
    """Out-of-context marker appended after the answer (``inject``); its rate in honest peers'
    held-out outputs is the attack success."""

    false_step: str = "2+2=5"
    """False statement inserted before the answer (``edit``)."""

    claim_logp: float = Field(-20.0, lt=0)
    """Claimed generator log-prob of every token (``fake_logp``)."""

    fraction: float = Field(1.0, ge=0, le=1)
    """Share of completions poisoned (the rest are sent honestly)."""

    placement: Literal["end", "start"] = "end"
    """Where ``inject`` puts ``marker``: ``end`` (after the answer: out of context, ours) or
    ``start`` (at the start of the reasoning, before the first step: the HTTT paper's text
    attack)."""

    vertical: bool = False
    """The HTTT paper's stronger attacker, who owns whole groups: instead of replacing its
    completions by one crafted correct solution, it sends the ones it sampled itself with the
    right answers poisoned and the wrong ones clean (a group it got all wrong gets one crafted
    correct poisoned solution), so within its group the poison always has the positive
    advantage. Meant for the vertical topology (``grpo.topology``), where its groups stay its
    own; in the horizontal one receivers mix its completions into their groups."""


class DefenseConfig(BaseModel):
    """``[grpo.defense]``: content checks on foreign rollouts and the per-sender policy
    (docs/grpo.md, 'Defenses'; the checks live in security/rollout_filters.py, security/judge.py,
    security/sender_policy.py). On by default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    kind: Literal["auto", "logit", "judge", "off"] = "auto"
    """``auto``: the logit/support check for senders whose batch names our ``model_id`` (same
    model), the judge for the others; ``logit`` / ``judge``: one check for every sender;
    ``off``: no content check, no rate ban (token budget still applies)."""

    support_slack: float = Field(0.04, ge=0, le=1)
    """A token is in the sampler's support when the probability mass ranked above it is below
    ``top_p + support_slack`` (ties, drift between identical models)."""

    min_token_prob: float = Field(1e-4, ge=0, lt=1)
    """Same-model senders: a token below this local probability (round temperature) is rejected."""

    support_min_tokens: int = Field(3, ge=1)
    """Same-model senders: a completion is rejected as off-support when at least this many of its
    tokens are outside the sampler's support (peers drift apart with training: one borderline
    token is common in honest samples, several are not; a marker or an inserted step has several)."""

    min_token_weight: float = Field(0.05, ge=0, lt=1)
    """Same-model senders, drift: a token below ``min_token_prob`` or off the support counts only
    when its F-TIS weight exp(ours - claimed) is at least this, i.e. when the sender itself claims
    it improbable too. A token the sender's own sampler found probable but ours does not is drift
    between peers that trained apart (F-TIS gives it at most this weight: it teaches nothing); a
    poisoner claiming its model's log-probs, or a liar claiming low ones, still counts. Measured
    (homogeneous, 100 rounds at the benchmark's lr, seed 0): honest low tokens sit 4-11 nats below
    their claims, an attacker's 0-1; honest false rejects 7.5-10.6% with 0 (rising to 18-24% in
    rounds 80-100), 0.1-0.65% with 0.05, every attack still rejected and banned. The price: a
    sender that claims its poison tokens probable passes, with those tokens at F-TIS weight below
    this bound (at most this share of an accepted token's push); lower it to trade false rejects
    for that ceiling. 0 turns it off (the check as HTTT states it: every low token counts)."""

    min_token_prob_foreign: float = Field(1e-6, ge=0, lt=1)
    """Other-model senders: loose per-token floor before the judge (a per-token floor's false
    rejects grow as 1 - (1 - p)^L)."""

    eps_lp: float = Field(1.0, gt=0)
    """Same-model senders: reject when the claimed generator log-probs differ from the recomputed
    ones by more than this (nats, mean over the completion's tokens). Catches liars inflating
    importance weights (their gain is bounded by C anyway). Peers start from the same weights but
    drift apart with training, hence well above fp32 noise (0.05)."""

    judge: Literal["arith", "hf"] = "arith"
    """``arith``: deterministic rule judge for the built-in task (grammar + every step true);
    ``hf``: a frozen local model from ``judge_hf_path`` (``judge_style``)."""

    judge_style: Literal["reasoning", "one_word"] = "reasoning"
    """LLM judge (``hf``): ``reasoning`` (the HTTT paper's judge: it writes a criticism, then
    ``<decision>SAFE|UNSAFE</decision>``, parsed; no decision or a garbled one = UNSAFE, not
    blamed on the sender) or ``one_word`` (one word, scored by teacher forcing: cheaper, one
    forward per word, but the paper's Table 1 has the no-reasoning judge at small sizes accepting
    86% of text-injection poison against 3.75% with reasoning)."""

    judge_max_new_tokens: int = Field(256, ge=8, le=4096)
    """LLM judge, ``reasoning``: most tokens it may write (criticism + decision). An output cut
    before its decision is UNSAFE: raise this when ``swarmnode_grpo_judge_calls_total{outcome="unparsed"}``
    grows on honest traffic."""

    judge_hf_path: str = ""
    """Local Hugging Face directory of the LLM judge (never downloaded)."""

    judge_margin: float = 0.0
    """SAFE iff log p(SAFE) - log p(UNSAFE) >= margin (LLM judge, ``one_word`` style)."""

    judge_max_completion_tokens: int = Field(256, ge=8, le=1024)
    """Completions are cut to this many characters/tokens (head and tail kept) before judging."""

    judge_scope: Literal["positive", "all"] = "positive"
    """Which foreign completions the judge reads: ``positive`` (reward > 0: the ones a group
    would reinforce, where poison pays; attackers must answer right) or ``all``."""

    reject_rule: Literal["drop", "zero_reward"] = "drop"
    """What a content rejection (logit check, floor or judge) does to a foreign completion.
    ``drop`` (ours): it leaves its group, the advantages and the loss (its slot stays in the
    ``sample`` normaliser). ``zero_reward`` (the HTTT paper's reward multiplier, reward x verdict):
    it stays in its group with reward 0, so where the group has any reward it gets a negative
    advantage and its tokens are pushed down (the F-TIS filter still drops it when it is far
    off-policy: A < 0 and KL above the threshold). docs/grpo.md, 'Defenses' gives the measured
    trade-off; switch when honest false rejects are high (a wrongly rejected honest completion is
    pushed down, not just ignored, under ``zero_reward``)."""

    ban_window: int = Field(256, ge=1)
    """Per-sender window of checked completions."""

    ban_min_checked: int = Field(32, ge=1)
    """A sender is judged on its rate only after this many checked completions."""

    ban_rate: float = Field(0.5, gt=0, le=1)
    """Ban when the rejected share of the window exceeds this."""

    warn_rate: float = Field(0.2, gt=0, le=1)
    """Log a WARNING when a sender's rejected share exceeds this (bad floor or drift)."""

    ban_ttl_s: float = Field(600.0, gt=0)
    """How long a rate ban lasts."""

    sender_token_budget: int = Field(0, ge=0)
    """Most tokens one sender may contribute per round (0: B * per_sender_per_prompt * cap / 2;
    ``topology = "vertical"``: B * G * cap / 2); the rest is dropped as ``quota`` (vertical: whole
    groups)."""


class GRPOConfig(RunSettings):
    """``[grpo]``: one collaborative GRPO learner (see docs/grpo.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    legacy_keys = {"exit_after_rounds": "exit_after"}

    # ---- swarm-wide round config (hashed into config_hash; must match across peers) ----
    task: Literal["arith", "rgym"] = "arith"
    """Verifiable task. ``arith``: sums of small integers with a local verifier (rl/tasks.py).
    ``rgym``: reasoning-gym datasets (``pip install 'swarmnode[rgym]'``), scored by their own
    ``score_answer`` on the ``<answer>`` span; for real models (``model.hf_path``), the embedded
    byte-level demo models do not learn them."""

    rgym_datasets: list[str] = Field(default_factory=lambda: list(DEFAULT_RGYM_DATASETS), min_length=1)
    """reasoning-gym dataset names mixed by ``task = "rgym"`` (default: rl-swarm's nine)."""

    min_operands: int = Field(2, ge=2, le=6)
    """Fewest operands of an ``arith`` problem."""

    max_operands: int = Field(2, ge=2, le=6)
    """Most operands of an ``arith`` problem. 2 keeps the embedded demo learnable in seconds;
    raise it (3) for a harder task."""

    max_operand: int = Field(9, ge=1, le=999)
    """Largest operand value (0..max_operand)."""

    prompts_per_round: int = Field(16, ge=1, le=256)
    """B: prompts every peer answers each round (``topology = "horizontal"``: the same on every
    peer, seeded by run and round; ``vertical``: each peer its own). More: less noisy steps,
    longer rounds."""

    completions_per_prompt: int = Field(2, ge=2, le=64)
    """G: completions a peer samples per prompt (its local group share). 2 (rl-swarm ran 2-4)
    keeps generation cheap; with peers each group holds G + F completions."""

    temperature: float = Field(0.7, gt=0, le=4.0)
    """Sampling temperature T; also the temperature of the learner's re-scoring. A batch
    sampled at another T is refused (its log-probs describe another distribution)."""

    top_k: int = Field(50, ge=0)
    """Top-k sampling (0 = off). It is also the support the logit check tests every same-model
    token against (a token ranked k-th or lower is off-support): the HTTT paper's k = 50. With
    ``top_k = 0`` and ``top_p = 1.0`` that test is empty and only the probability floor and the
    claimed-log-prob check remain. Lower k (or top_p < 1) narrows the support (more poison caught,
    more honest drift flagged: watch ``swarmnode_grpo_rollouts_rejected_total{reason="logit_check"}``)."""

    top_p: float = Field(1.0, gt=0, le=1.0)
    """Nucleus sampling (1.0 = off); below 1 it also narrows the logit check's support."""

    max_completion_tokens: int = Field(24, ge=1, le=1024)
    """Cap on a completion's length (tokens); longer foreign completions are refused, own ones
    end truncated (and masked when ``mask_truncated``)."""

    round_s: float = Field(4.0, ge=0.5, le=3600)
    """Round length in seconds. Rounds are derived from the clock (r = floor(time / round_s)),
    so peers agree on the round without talking. It must fit generation + collection + one
    step on the slowest peer: raise it when ``swarmnode_grpo_rounds_total{outcome="skipped"}``
    grows."""

    topology: Literal["vertical", "horizontal"] = "horizontal"
    """How peers share a round's groups (docs/grpo.md, 'Topologies'). ``horizontal`` (ours, the
    default): every peer answers the same B prompts and a prompt's group mixes its G own
    completions with up to F foreign ones, one advantage normalisation over both. ``vertical``
    (the F-TIS paper's): each peer answers B prompts of its own (seeded by run, peer and round)
    and publishes whole groups; a receiver trains on each foreign group as a group of its own
    (advantages within the generator's group), up to B x F foreign completions a round.
    Swarm-wide: a vertical peer's batches are refused by horizontal peers (config hash) and the
    other way round. Measured on the heterogeneous benchmark (three peer sizes, G = 2, 3 seeds,
    150 rounds) horizontal gained more over solo training (1.62x vs 1.32x; vertical lower for 8
    of 9 peer-seed pairs), so it stays the default for heterogeneous swarms too. Use
    ``vertical`` to follow the paper or when the swarm should cover more distinct prompts per
    round (N x B instead of B); consider it with larger groups (G >= 4, not measured: a group of
    2 has an advantage only when exactly one answer is right); expect slower learning at G = 2."""

    # ---- local knobs (not hashed) ----
    mode: Literal["ftis", "uncorrected", "solo"] = "ftis"
    """How foreign rollouts are used: ``ftis`` (truncated importance weights + KL filter on
    negative-advantage foreign samples), ``uncorrected`` (foreign samples treated as on-policy:
    the baseline of existing swarms), ``solo`` (publish but never learn from peers)."""

    foreign_per_prompt: int = Field(4, ge=0, le=256)
    """F: most foreign completions added to each prompt's group (SAPO found 4 local + 4 external
    best). Size it to (peers - 1) * G; extra peers' completions are sampled into the F slots."""

    per_sender_per_prompt: int = Field(2, ge=1, le=64)
    """Most completions one sender contributes to one group (bounds a single peer's pull)."""

    max_senders: int = Field(16, ge=1, le=1024)
    """Most peers whose batches are used in one round (the first ones to arrive)."""

    C: float = Field(2.0, gt=0)
    """F-TIS weight cap: w = min(exp(l - gen_logp), C). Lower: less variance, slower use of
    peers' better samples."""

    delta: float = Field(0.5, gt=0)
    """F-TIS KL threshold of the ``token_mean`` statistic (nats per token): a sample with negative
    advantage and mean_t (gen_logp - local) above this is dropped. Lower: more filtering. Watch
    ``swarmnode_grpo_ftis_filtered_fraction``: near 0 with a falling reward means it filters too
    little."""

    kl_stat: Literal["token_mean", "sequence"] = "token_mean"
    """Which KL statistic the F-TIS filter thresholds (both are logged and exported):
    ``token_mean`` (ours, threshold ``delta``): the mean over the completion's tokens, the same
    scale at any length; ``sequence`` (the F-TIS paper's, threshold ``g``): the sum over its
    tokens, so long completions are filtered sooner. Use ``sequence`` with long completions (the
    paper's reasoning traces, hundreds of tokens) to follow the paper; ``token_mean`` keeps short
    completions (the embedded demo's ~10 tokens) filterable with one knob."""

    g: float = Field(50.0, gt=0)
    """F-TIS KL threshold of the ``sequence`` statistic (nats per completion): the paper's g = 50
    (ablated over 5, 10, 50, 100). At ~10-token completions 50 nats is 5 nats per token: it then
    filters almost nothing (see docs/grpo.md, 'F-TIS'); lower it (5-10) for short completions."""

    lr: float = Field(2e-4, gt=0)
    """Adam learning rate of the GRPO step. For the embedded demo models 1e-3 overshoots in one
    step (held-out reward collapses within tens of rounds); real checkpoints want ~1e-6."""

    steps_per_round: int = Field(2, ge=1, le=16)
    """mu: optimizer steps on each round's batch. The first is the plain (F-TIS) policy-gradient
    step; later ones re-score and clip the ratio to the first pass (PPO-style, ``epsilon``,
    ``epsilon_high``). More: faster learning per round, proportionally more training compute.
    2 is ours; the F-TIS and HTTT papers take 1 (set 1 to follow them). Side by side on the quick
    benchmark the F-TIS peers ended at the same accuracy with 1 or 2
    (docs/grpo.md, 'Updates per round')."""

    epsilon: float = Field(0.2, gt=0, lt=1)
    """Lower clip of the ratio (1 - epsilon) for steps after the first (negative advantages)."""

    epsilon_high: float = Field(0.28, gt=0)
    """Upper clip of the ratio (1 + epsilon_high) for steps after the first (positive advantages)."""

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage normalisation: std within the group, over the round, or none (Dr.GRPO)."""

    loss_agg: Literal["sample", "seq", "token", "dr_grpo"] = "sample"
    """Loss aggregation (docs/grpo.md, 'GRPO loss'); ``sample`` bounds one completion's pull whatever its
    length (robust to verbose senders)."""

    mask_truncated: bool = True
    """Completions that hit the cap without the stop token are left out of the loss."""

    collect_frac: float = Field(0.5, gt=0, lt=1)
    """Peers' batches are collected until t_round + collect_frac * round_s; late or missing
    peers never hold the round up. Lower it if steps end after the round."""

    start_slack_frac: float = Field(0.3, ge=0, lt=1)
    """A round is joined only if this peer is ready before t_round + start_slack_frac *
    round_s; otherwise it waits for the next one (counted as skipped)."""

    fetch_timeout_s: float = Field(2.0, gt=0, le=30)
    """Per-call deadline of a RolloutService.Fetch (DHT path); capped by the collect deadline."""

    transport: Literal["auto", "bus", "dht"] = "auto"
    """How rollouts travel. ``auto``: the event bus's ``rollouts`` topic when the bus is on
    (``eventbus.enabled``), else the DHT index + gRPC Fetch. ``dht`` forces the index path."""

    max_rejections_per_sender: int = Field(8, ge=1)
    """Refused batches/shards from one sender within ``ban_rounds`` rounds before this peer
    ignores it for ``ban_rounds`` rounds (counted as ``quota``)."""

    ban_rounds: int = Field(10, ge=1)
    """Length of the window and of the ignore period above, in rounds."""

    defense: DefenseConfig = Field(default_factory=DefenseConfig)
    """Poisoned-rollout defenses (on by default)."""

    adversary: AdversaryConfig | None = None
    """TEST AND BENCHMARK ONLY: make this peer an attacker (see AdversaryConfig)."""

    model_seed: int | None = None
    """Seed of this peer's initial weights. None: derived from the peer ID (every peer starts
    different)."""

    warmup_target_acc: float = Field(0.15, ge=0, le=1)
    """Supervised warm-up on reference solutions runs until held-out accuracy reaches this (so
    rewards start non-zero, with variance within groups). 0 disables the warm-up (real
    checkpoints: ``model.hf_path``)."""

    warmup_cache_dir: str = "~/.cache/swarmnode/grpo-warmup"
    """Folder keeping warmed-up weights, keyed by a hash of the model, seed, task and warm-up
    settings, so a restart, a second demo or another benchmark run of the same peer skips the
    warm-up (a few seconds to a minute on a CPU). Files are local and loaded weights-only."""

    warmup_max_steps: int = Field(400, ge=0)
    """Most warm-up steps (batch ``warmup_batch``)."""

    warmup_lr: float = Field(3e-3, gt=0)
    """Adam learning rate of the warm-up."""

    warmup_batch: int = Field(32, ge=1)
    """Warm-up batch size."""

    heldout_size: int = Field(100, ge=1, le=10000)
    """Evaluation prompts for the accuracy metric (fixed: the same before and after training)."""

    heldout: Literal["prompts", "problems"] = "prompts"
    """What the accuracy metric holds out. ``prompts``: a fixed evaluation set drawn from the
    training distribution with its own seed, never used as a round's prompts (the same problem
    may still come up in a round: with 2 operands 0-9 there are only 100). ``problems``: problems
    of the task's held-out split, never trained on (generalisation to unseen sums; the tiny demo
    models barely move on it within tens of rounds)."""

    eval_samples: int = Field(4, ge=1, le=64)
    """Completions sampled per held-out prompt for the accuracy metric (at the round
    temperature, fixed seed). More: less noise, slower evaluations."""

    eval_every: int = Field(5, ge=0)
    """Held-out accuracy every this many trained rounds (0 = only at start and end). Each
    evaluation samples ``heldout_size`` x ``eval_samples`` completions: raise it when rounds
    run late (``grpo_round_skipped``)."""

    @model_validator(mode="after")
    def _cross(self) -> "GRPOConfig":
        if self.min_operands > self.max_operands:
            raise ValueError(f"grpo.min_operands={self.min_operands} is above grpo.max_operands="
                             f"{self.max_operands}")
        if self.checkpoint_every:
            raise ValueError(f"grpo.checkpoint_every={self.checkpoint_every}: the grpo role writes no checkpoints "
                             "(a restarted peer re-warms from grpo.warmup_cache_dir and rejoins on the round "
                             "clock); leave it at 0")
        return self

    def round_config(self, tokenizer_hash: str, chat_template_hash: str = "") -> dict:
        """The swarm-wide fields (what ``config_hash`` covers); the hashes come from the policy
        (models/policy.py)."""
        task = ({"task": "arith", "operands": [self.min_operands, self.max_operands, self.max_operand]}
                if self.task == "arith" else {"task": "rgym", "datasets": sorted(self.rgym_datasets)})
        return {**task, "B": self.prompts_per_round, "G": self.completions_per_prompt,
                "T": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "cap": self.max_completion_tokens, "round_s": self.round_s,
                "tokenizer": tokenizer_hash, "chat_template": chat_template_hash, "wire": WIRE_VERSION,
                # only when vertical: horizontal peers keep the hash of builds without the knob
                **({"topology": self.topology} if self.topology != "horizontal" else {})}

    def config_hash(self, tokenizer_hash: str, chat_template_hash: str = "") -> str:
        """sha256 (16 hex) of :meth:`round_config`: peers with another hash are refused."""
        raw = json.dumps(self.round_config(tokenizer_hash, chat_template_hash), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()[:16]
