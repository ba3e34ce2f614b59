"""`[noloco]` configuration: the NoLoCo / DiLoCo method, pairing and inner-optimizer knobs.

Owns the schema, the defaults (sized for the demo where the papers' recipe is too slow for a CPU,
else NoLoCo's), the start-up validators (docs/noloco.md, 'Configuration') and `cfg_hash`, the digest of the fields that
must be identical between peers that average together. Does not own the role's runtime state
(round counter, roster) or the transport; `optimizers/noloco_role.py` reads this config.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from models.optim import InnerConfig

__all__ = ["InnerConfig", "NoLoCoConfig", "HASHED_FIELDS", "DEFAULT_OUTER_MOMENTUM"]

# Fields whose values must agree between peers that average together (docs/noloco.md, 'Configuration').
HASHED_FIELDS: tuple[str, ...] = (
    "outer", "diloco_momentum", "inner_steps", "outer_lr", "outer_momentum", "consensus",
    "group_size", "seed",
)
_HASH_VERSION = "noloco-cfg-v1"
COMPRESSION_FIELDS: tuple[str, ...] = ("compression", "compression_block", "compression_topk",
                                       "compression_hold", "compression_phi_every")

# outer_momentum when the config leaves it unset, per outer form (docs/noloco.md, 'DiLoCo baseline'): NoLoCo's
# alpha 0.5; heavy-ball DiLoCo mu 0.3 (the NoLoCo authors' baseline); Nesterov DiLoCo mu 0.9 (the
# DiLoCo paper). Keys: "noloco", or the diloco_momentum form.
DEFAULT_OUTER_MOMENTUM: dict[str, float] = {"noloco": 0.5, "heavyball": 0.3, "nesterov": 0.9}


class NoLoCoConfig(BaseModel):
    """The `[noloco]` section: outer method, pairing, bookkeeping and the inner optimizer."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # ---- method -----------------------------------------------------------------------------
    outer: Literal["noloco", "diloco"] = "noloco"
    """Outer optimizer. `noloco` averages with a small random group and adds a consensus pull;
    `diloco` averages over every live worker (the baseline). Peers with different values never
    match (part of `cfg_hash`)."""

    diloco_momentum: Literal["heavyball", "nesterov"] = "heavyball"
    """DiLoCo momentum form (only used with outer = diloco). `heavyball` is the NoLoCo repo's
    baseline and what NoLoCo reduces to; `nesterov` is the DiLoCo paper / OpenDiLoCo update
    (torch SGD nesterov=True). Each form brings its own outer_momentum default (0.3 / 0.9)."""

    inner_steps: int = Field(20, ge=1)
    """H: inner steps between outer steps (demo 20; NoLoCo 50, heavy-ball DiLoCo 100,
    Nesterov DiLoCo 500). Raise it when `swarmnode_outer_blocked_seconds` is a large share of
    the round; lower it if replicas drift (`swarmnode_replica_spread` grows)."""

    outer_lr: float = Field(0.7, gt=0)
    """beta (NoLoCo) / eta (DiLoCo): outer learning rate on the mean pseudo-gradient. With
    consensus = "tied" it is also gamma. 0.7 in every reference recipe."""

    outer_momentum: float = Field(0.5, ge=0, lt=1)
    """alpha (NoLoCo) / mu (DiLoCo): outer momentum. Left unset, the form's default applies
    (`DEFAULT_OUTER_MOMENTUM`): NoLoCo 0.5, heavy-ball DiLoCo 0.3, Nesterov DiLoCo 0.9; the role
    logs the effective value at start. Lower it if the outer update norm oscillates between
    rounds."""

    consensus: Literal["tied"] | float = "tied"
    """gamma, the pull of this worker's phi toward its group's mean phi. "tied" (default, as in
    the official code) means gamma = outer_lr and only theta is exchanged; a float in [0, 2)
    (ablations, e.g. 0.0) doubles the traffic because phi must be exchanged too. NoLoCo only."""

    outer_state_device: Literal["device", "host"] = "device"
    """Where the outer state (phi and the outer momentum m, always fp32) lives: "device" (default,
    next to the model: no copies per round) or "host" (CPU RAM) to save two model-sized fp32
    buffers of GPU memory on a tight card, at the cost of a device->host copy per outer step.
    Ignored on CPU-only nodes. Local to this worker (not part of `cfg_hash`)."""

    group_size: int | Literal["all"] = 2
    """k: target group size for NoLoCo (pairs in every paper experiment). "all" makes NoLoCo a
    DiLoCo-like global average. Ignored by DiLoCo, whose group is always every live worker
    (leave it unset or "all" there)."""

    # ---- pairing ----------------------------------------------------------------------------
    pairing: Literal["seeded", "matchmaking"] = "seeded"
    """How groups form. `seeded` (default, the only mode the `noloco` role runs today): workers
    of round r meet in a signed DHT roster and pair by seeded random proposals, then exchange over
    our own gRPC (optimizers/exchange.py; no global barrier, a solo step after round_timeout).
    `matchmaking` (hivemind DecentralizedAverager groups) is reserved: the role refuses it at start
    until it is built. `optimizers/grouping.py` holds the official permutation for lock-step use."""

    matchmaking_time: float = Field(5.0, gt=0)
    """Seconds hivemind waits to assemble a group (matchmaking mode only; seeded pairing waits up
    to round_timeout). Raise it if many rounds end solo with "could not find a group"."""

    round_timeout: float = Field(10.0, gt=0)
    """Hard cap, in seconds, on one outer exchange (waiting plus transfer). NoLoCo workers
    normally stop waiting much earlier (``wait_fraction``); DiLoCo waits for its group up to this.
    Raise it on slow links if `swarmnode_outer_solo_rounds_total{reason="timeout"}` rises while
    peers are alive."""

    wait_fraction: float = Field(0.25, ge=0)
    """Waiting policy (NoLoCo, seeded pairing): the longest a worker waits for a partner, as a
    fraction of its own measured inner phase (seconds per inner step, averaged, times
    inner_steps), floored at ``min_wait_s`` and at the ``overlap_fraction`` (the worker trains
    while it waits that long), capped by ``round_timeout``. It also stops waiting at once when no
    live READY peer can still meet it at this round (all past it, draining, finishing, or
    expected later than the bound by their cards), and moves to the peers' later round label
    when they moved on. Without the overlap, 0.25 measured a blocked share of 0.16-0.18 in the
    4-worker demo on a busy 2-core machine; with it 0.04-0.06 (README; benchmarks/noloco_swarm.py
    for NoLoCo vs DiLoCo on real processes). Raise it when
    ``swarmnode_outer_solo_rounds_total{reason="wait_bound"}`` is a large share of the rounds
    (too few pairs, replicas drift); lower it when ``swarmnode_outer_blocked_fraction`` is high.
    0 waits only for a partner already waiting (``min_wait_s``)."""

    min_wait_s: float = Field(0.5, ge=0)
    """Floor of the waiting bound in seconds: time enough for a roster read and a handshake with
    a partner already waiting. Raise it on slow DHT/links if rounds go solo with
    reason="wait_bound" while partners are alive and waiting."""

    compute_while_waiting: bool = True
    """When no partner can meet this worker within its wait bound but a peer's card says it
    reaches its exchange within 1.5 inner phases, keep training (extra inner steps in this
    round) until then and pair at the frontier label, instead of a solo step. Keeps equal-speed
    workers from locking into fixed pairs with the odd one always alone. Turn it off for
    strictly H inner steps per outer step (e.g. to compare with the paper's schedule)."""

    idle_steps: float = Field(1.0, ge=0)
    """With ``compute_while_waiting``: wait idle only for a partner expected (by its card) within
    this many of our own inner steps; for one due later (but within 1.5 inner phases) keep
    training until it is due, then pair. 1 keeps the idle time per paired round under about one
    inner step plus the exchange itself. Raise it (up to the wait bound) if rounds take many
    extra steps while partners are close; a very large value restores "wait up to the bound"."""

    overlap_fraction: float = Field(0.25, ge=0, le=1)
    """NoLoCo: keep training while the outer exchange is in flight (waiting for a partner and the
    transfer), up to this fraction of inner_steps; those steps are the next round's first ones.
    The outer step is applied to the tensors that were sent and the progress made meanwhile is
    kept on top (theta <- phi_new + (theta_now - theta_sent)), as streaming DiLoCo and the NoLoCo
    paper's overlapping variant do; the worker also waits for a partner up to that long (its
    wait bound is at least the overlap), as waiting then costs nothing. Measured
    (benchmarks/noloco_swarm.py, 4 workers, H 10, two runs each): blocked fraction 0.06-0.08
    at 0, 0.007-0.014 at 0.25, 0.005-0.015 at 0.5, with validation loss 2.976 / 2.969 / 2.995
    (0.5: the outer step lags up to half a phase). 0 blocks until the exchange ends (the paper's
    plain schedule); lower it if the loss suffers on very short inner phases."""

    jitter_s: float = Field(2.5, ge=0)
    """Uniform random delay (0..jitter_s) added to each matchmaking start so that arrival order,
    and with it the pairs, changes between rounds. About matchmaking_time / 2. Raise it if the
    partner repeat ratio stays above 0.5."""

    group_bits: int | None = Field(None, ge=0, le=16)
    """Moshpit bucket bits for matchmaking (2^bits ~ W / k). None = derive from the live worker
    count. Only used with pairing = matchmaking."""

    max_round_skew: int = Field(2, ge=0)
    """A partner whose round differs from ours by more than this is ignored (solo step). Raise
    only if slow workers are frequently dropped for being a round or two behind."""

    max_solo_rounds: int = Field(3, ge=1)
    """After this many solo rounds in a row, re-draw the matchmaking bucket bits."""

    # ---- checks on peers' input (docs/noloco.md, 'Bounds and rollback'; local, not part of cfg_hash) ------------------
    max_round_jump: int = Field(16, ge=1)
    """Range check on the rounds peers claim in their node cards: a card whose round is more than
    this many rounds away from the swarm's frontier anchor (the lower median of the other READY
    workers' rounds) is ignored when this worker catches up its round label or picks a state
    donor (``node.card.frontier_card_int``). Honest workers stay within a few rounds of each
    other (``max_round_skew``); raise it only for swarms whose speeds differ so much that honest
    workers lag the median by more than this many rounds."""

    max_norm_ratio: float = Field(4.0, gt=1)
    """Norm bound on a partner's tensors, per tensor: the larger RMS of (ours, theirs) may be at
    most this times the smaller (floored at ``bound_floor_rms``). Symmetric, so both partners
    reach the same verdict. Two honest replicas trained apart for 40 inner steps measured 1.5
    (tiny test model, lr 3e-3); a violation makes the round solo and counts
    ``swarmnode_tensors_rejected_total{reason="norm"}``. Raise it if that counter rises in a
    swarm without attackers (e.g. very long ``inner_steps`` with a high LR)."""

    max_distance_ratio: float = Field(1.0, gt=0)
    """Distance bound on a partner's tensors, over the whole model: ``||theirs - ours|| <= k *
    min(||ours||, ||theirs||)`` (symmetric). Catches a partner of plausible norm but the wrong
    direction (negated or random weights: ratio 1.4-2); honest replicas never averaged for 40
    inner steps measured 0.25. Violations count ``swarmnode_tensors_rejected_total{reason=
    "distance"}``; raise it if that counter rises without an attacker, lower it (not below
    about 0.5) to bound harder what one accepted partner can move our weights."""

    bound_floor_rms: float = Field(1e-2, gt=0)
    """RMS floor used by the norm and distance bounds, so that tensors that are (near) zero on
    both sides (freshly initialised biases) never fail a ratio test. Raise it if norm
    rejections name small bias tensors early in training."""

    max_update_ratio: float = Field(1.0, gt=0)
    """Rollback bound on our own outer step: if ``||phi_new - phi_old|| > k * ||phi_old||`` (or the
    result is not finite) the step is undone (phi, momentum and weights back to the last good
    state), the node reports not-ready ("recovering") and re-downloads state from a peer if the
    next round fails again. An outer step normally moves phi by a few percent at most."""

    robust: Literal["clip", "off"] = "clip"
    """Robust averaging (docs/noloco.md, 'Robust averaging'): ``"clip"`` clips each partner's
    difference ``theirs - ours`` to a radius that follows this run's honest partners
    (``robust_multiplier`` x max(median of recent partner distances, our own move this round)),
    so one partner moves our outer step by at most radius / group size. Honest pairs are not
    clipped (``swarmnode_outer_partner_clip_factor`` stays at 1). ``"off"`` keeps only the fixed
    bounds above; use it to measure the defence, or if honest partners are clipped (that
    histogram below 1 with no attacker around) and raising ``robust_multiplier`` does not help."""

    robust_multiplier: float = Field(4.0, gt=0)
    """The radius in units of the honest scale (max of the median recent partner distance and
    our own inner move). Honest partners in ``swarmnode demo`` measured 0.04-1.7 x the scale
    (distance / radius 0.01-0.42 at 4: never clipped); the issue's attacker sits 0.95 x ||theta||
    away, tens of times the radius. Raise it if
    ``swarmnode_outer_partners_clipped_total`` rises in a swarm without attackers (very
    heterogeneous data, stragglers far behind); lower it (not below 2) to bound harder what one
    partner can do."""

    robust_backward: float | None = Field(1.5, ge=0)
    """How far, in our own moves ``||theta - phi||``, a partner may pull us back along our own
    move this round before the rest of that pull is cut (then the norm clip). At 1.5 the mean
    keeps at least a quarter of our progress whatever the partner sends. Honest partners pulled
    back a median 0.2-0.8 own moves, 95th percentile 0.9-1.5, in clean runs of
    ``benchmarks/robust_gossip.py`` (the longer the run, the closer to 1: late in training the
    inner moves are mostly noise); one that lagged (trained alone) up to 3, and is then trimmed
    (3.7% of honest contributions in the 5-minute clean run, most by a few percent). A partner that reads our theta
    and sends our progress reversed (the loss-ascent direction) is cut and clipped hard. Lower
    it (1: the pull of an honest partner whose moves had nothing in common with ours) to bound
    harder; None turns the cut off (only the norm clip)."""

    robust_redescend: float | None = Field(2.0, ge=1)
    """A partner farther than this many radii keeps a contribution of ``k * radius**2 / distance``
    (``k`` this value) instead of the radius: its influence shrinks again the farther it is
    (docs/noloco.md, 'Robust averaging'). The most one partner moves us stays ``radius / 2`` (at
    exactly ``k`` radii). It keeps a far attacker's victims near the swarm, so their honest
    partners need not clip them in turn. Raise it (or None: a plain clip) only if stragglers far
    behind must be pulled in faster by their partners' exchanges; honest partners of a running
    swarm are never 2 radii away."""

    robust_window: int = Field(16, ge=1)
    """Recent partner distances (one per averaged round) whose median sets the radius, and the
    rounds with one partner over which its hard clips are counted."""

    robust_strikes: int = Field(3, ge=1)
    """A partner clipped hard (factor < 0.5) in this many of its last ``robust_window`` rounds
    with us is charged (skipped as a partner, ``partner_charged`` with reason ``clipped``;
    each further charge twice as long). A joiner or straggler is clipped hard a round or two
    while each exchange halves its distance, so it stays below the count."""

    robust_share: float | None = Field(2.0, ge=1)
    """NoLoCo: how many times its fair share of our recent pair exchanges any one peer may take
    (``optimizers/partner_share.py``: counted over a span that holds about four exchanges with each
    peer we could pair with; with four others or more the cap is 8 of the last 4 x others). A peer
    over it is neither proposed to nor accepted this round (not charged). A member that does no
    inner work is ready at every moment and was otherwise the partner in 60% of an honest worker's
    exchanges with four others (``benchmarks/robust_gossip.py``), each one a contribution the clip
    can only bound; in a larger swarm it would take most of them. Honest partners reach the cap in
    1.5-3% of rounds and are replaced by another. Raise it if honest workers run solo while a
    partner waits (refusals with reason ``share`` in the debug log); None turns the cap off. Needs
    ``robust = "clip"``."""

    # ---- compressed exchanges (docs/noloco.md, 'Compressed exchanges'; part of `cfg_hash` when on) ----
    compression: Literal["none", "int8", "int4", "sign", "topk"] = "none"
    """What the outer exchange sends (``optimizers/compression.py``, ``optimizers/outer_codec.py``).
    ``"none"`` (default): the fp32 tensors, 4 bytes per parameter. Otherwise the pseudo-gradient
    ``theta - phi`` travels compressed with error feedback (what a round did not send is added
    to the next round's payload) and the receiver puts it on its own phi: ``"int8"`` 1 byte per
    parameter (per-block scales; pick it when the link is the bottleneck but you want the
    smallest change in the loss), ``"int4"`` half a byte, ``"sign"`` one bit plus a scale per
    block (DiLoCo's best: every coordinate moves each round), ``"topk"`` the ``compression_topk``
    largest coordinates with int8 values and int32 indices (5 bytes per kept coordinate: 0.1 B/param
    at 2%; pick it on a home uplink). NoLoCo also sends its phi every ``compression_phi_every``-th
    round (int8) so that replicas keep pulling together. Measured: ``benchmarks/compression.py``."""

    compression_block: int = Field(128, ge=8, le=65536)
    """Values per quantization scale (one fp32 scale per block). Smaller blocks cost more scale
    bytes (4 / block per value) and bound the rounding error tighter around outliers."""

    compression_topk: float = Field(0.02, gt=0, le=1)
    """``compression = "topk"``: the fraction of each tensor's coordinates sent per round (at
    least one). Raise it if the compressed run's loss trails the fp32 one; lower it to send less."""

    compression_hold: float = Field(0.0, ge=0, le=0.5)
    """``compression = "sign"``: the share of each tensor's coordinates held back per round (a
    strided set at a random offset, kept in the error feedback for a later round). 0.05 puts the
    payload under one bit per parameter (0.123 B/param at block 1024); 0 sends every sign."""

    compression_phi_every: int = Field(8, ge=1)
    """NoLoCo with compression: phi (int8) travels on round labels divisible by this; other rounds
    carry only the pseudo-gradient and the receiver uses its own phi in the partner's place (no
    consensus pull that round). Lower it if ``swarmnode_replica_spread`` grows; raise it to
    send less (it adds about 1 / N bytes per parameter)."""

    # ---- other ------------------------------------------------------------------------------
    seed: int = Field(0, ge=0)
    """Run seed: model init, data order and the seeded pairing permutation. Must match across
    peers (part of `cfg_hash`)."""

    checkpoint_every: int = Field(10, ge=0)
    """Outer rounds between atomic checkpoints; 0 disables periodic checkpoints (a checkpoint is
    still written on drain). Lower it on preemptible machines."""

    eval_every: int = Field(5, ge=0)
    """Outer rounds between validation evaluations; 0 disables them."""

    eval_batches: int = Field(8, ge=1)
    """Validation batches per evaluation. Raise it if `swarmnode_eval_loss` is too noisy."""

    inner: InnerConfig = Field(default_factory=InnerConfig)
    """Inner optimizer (AdamW, models/optim.py) and its LR schedule."""

    _momentum_defaulted: bool = PrivateAttr(False)

    # ---- validators -------------------------------------------------------------------------
    @field_validator("consensus", mode="before")
    @classmethod
    def _consensus_value(cls, v: object) -> object:
        if isinstance(v, str) and v != "tied":
            try:
                return float(v)
            except ValueError:
                raise ValueError(
                    f"consensus={v!r}: use \"tied\" (gamma = outer_lr, the official code) or a "
                    "number such as 0.7") from None
        return v

    @field_validator("consensus")
    @classmethod
    def _consensus_range(cls, v: object) -> object:
        if isinstance(v, float) and not 0.0 <= v < 2.0:
            raise ValueError(
                f"consensus={v} is outside [0, 2): a pair's phi gap is scaled by (1 - gamma) per "
                "round, so gamma >= 2 diverges and gamma < 0 pushes replicas apart; use \"tied\" "
                "or a value in [0, 1]")
        return v

    @model_validator(mode="after")
    def _form_default_momentum(self) -> "NoLoCoConfig":
        # Runs before the checks below; an explicit outer_momentum (TOML, --set, env, kwargs)
        # always wins. The effective value is what cfg_hash digests.
        if "outer_momentum" not in self.model_fields_set:
            self.outer_momentum = DEFAULT_OUTER_MOMENTUM[self.momentum_form]
            self._momentum_defaulted = True
        return self

    @model_validator(mode="after")
    def _method_consistency(self) -> "NoLoCoConfig":
        if self.outer == "noloco":
            if self.group_size == 1:
                raise ValueError(
                    "group_size=1 with outer='noloco' never averages (every round would be a "
                    "solo step); use group_size=2 (the paper's pairs), or outer='diloco' for a "
                    "global average")
            if isinstance(self.group_size, int) and self.group_size < 1:
                raise ValueError(f"group_size={self.group_size} must be >= 2 (or \"all\")")
            if self.consensus == "tied" and self.outer_lr >= 2.0:
                raise ValueError(
                    f"outer_lr={self.outer_lr} with consensus='tied' means gamma={self.outer_lr} "
                    ">= 2, which makes the consensus term diverge; lower outer_lr (0.7 is "
                    "standard) or set consensus to a float in [0, 1]")
        else:  # diloco
            if self.consensus != "tied":
                raise ValueError(
                    f"consensus={self.consensus} is set but outer='diloco' has no consensus term "
                    "(phi is identical everywhere); remove consensus or use outer='noloco'")
            if "group_size" in self.model_fields_set and self.group_size != "all":
                raise ValueError(
                    f"group_size={self.group_size} with outer='diloco': DiLoCo always averages "
                    "over every live worker; remove group_size or set it to \"all\" (use "
                    "outer='noloco' for small groups)")
        mm_deadline = self.matchmaking_time + self.jitter_s
        if self.pairing == "matchmaking" and self.round_timeout <= mm_deadline:
            raise ValueError(
                f"round_timeout={self.round_timeout} must exceed matchmaking_time + jitter_s = "
                f"{self.matchmaking_time + self.jitter_s}, or every round times out before the "
                "group forms; raise round_timeout or lower matchmaking_time/jitter_s")
        return self

    # ---- derived ----------------------------------------------------------------------------
    @property
    def momentum_form(self) -> str:
        """The outer update's momentum form: "noloco", or diloco's "heavyball" / "nesterov"."""
        return "noloco" if self.outer == "noloco" else self.diloco_momentum

    @property
    def outer_momentum_note(self) -> str:
        """One line for the start-up log: the effective outer momentum and where it came from."""
        form = {"noloco": "NoLoCo", "heavyball": "heavy-ball DiLoCo",
                "nesterov": "Nesterov DiLoCo"}[self.momentum_form]
        origin = f"the {form} default" if self._momentum_defaulted else f"set in config, {form}"
        return f"outer_momentum={self.outer_momentum:g} ({origin})"

    @property
    def gamma(self) -> float:
        """The consensus coefficient actually used (outer_lr when tied)."""
        return self.outer_lr if self.consensus == "tied" else float(self.consensus)

    @property
    def exchanges_phi(self) -> bool:
        """True when phi must be averaged as well as theta (untied NoLoCo)."""
        return self.outer == "noloco" and self.consensus != "tied"

    def cfg_hash(self) -> str:
        """Short stable hex digest (12 chars) of the fields peers must share (`HASHED_FIELDS`).

        Used in the averager prefix and node card; it contains no '.' (hivemind asserts that).
        Floats are hashed by their shortest round-trip repr, so 0.7 from TOML, env or Python all
        give the same digest."""
        payload = {name: getattr(self, name) for name in HASHED_FIELDS}
        if self.compression != "none":  # peers must compress alike; uncompressed runs keep their old digest
            payload.update({name: getattr(self, name) for name in COMPRESSION_FIELDS})
        blob = json.dumps([_HASH_VERSION, payload], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
