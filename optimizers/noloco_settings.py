"""The ``noloco`` role's settings and node-card details.

Owns ``[noloco]`` as the worker reads it (:class:`WorkerConfig`: the method knobs of
``optimizers/config.py``, the run knobs every training role shares, and how this worker runs),
the sections the role validates (:class:`RoleSettings`) and the typed details its node card
carries (:class:`NoLoCoCard`). The role is ``optimizers/noloco_role.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.config import DataConfig, ModelConfig
from node.donor_choice import DonorCheckSettings
from node.run_settings import RunSettings, TrainingCard
from optimizers.config import NoLoCoConfig

__all__ = ["NoLoCoCard", "RoleSettings", "WorkerConfig"]


class WorkerConfig(NoLoCoConfig, RunSettings, DonorCheckSettings):
    """``[noloco]``: the method knobs (optimizers/config.py), the run knobs every training role
    shares (node/run_settings.py; ``eval_every`` and ``checkpoint_every`` count outer rounds),
    the checks on donors and round labels (node/donor_choice.py: ``donors_compared``,
    ``donor_max_distance``, ``round_label_quorum``) and how this worker runs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    legacy_keys = {"exit_after_steps": "exit_after"}

    exit_after: int = Field(0, ge=0)
    """Evaluate, log ``training_finished``, drain and exit 0 after this many inner steps (0 =
    train until stopped). The demo sets it. Older configs call it ``exit_after_steps``."""

    data_shards: int = Field(16, ge=1)
    """The training stream is cut into this many IID shards; a worker picks one from its peer ID.
    Raise it above the worker count so that workers rarely share a shard."""

    compute_delay_s: float = Field(0.0, ge=0)
    """Extra seconds slept per inner step, to emulate a slower accelerator in experiments."""

    join_from_peers: bool = True
    """A new worker in a run that already has trained rounds downloads a peer's state first
    (compared across ``donors_compared`` live peers; docs/noloco.md, 'Joining and catching up')."""

    catch_up: bool = True
    """Before each exchange, adopt the highest round label that ``round_label_quorum`` live peers'
    node cards have reached (one card alone never moves it, unless it is the only peer), so a
    worker that fell behind (a solo round, slower hardware, a restart) meets the others again
    instead of waiting alone in an old round. Only the label moves: no inner steps are skipped.
    NoLoCo only (DiLoCo re-fetches phi and the round after a missed round). Turn it off only to
    study strictly lock-step round labels."""

    @model_validator(mode="after")
    def _supported_pairing(self) -> "WorkerConfig":
        if self.pairing != "seeded":
            raise ValueError(f"pairing={self.pairing!r} is not available in this version of the noloco role; "
                             "use pairing = \"seeded\" (the DHT roster + gRPC exchange)")
        if self.outer == "noloco" and self.group_size != 2:
            raise ValueError(f"group_size={self.group_size!r}: the noloco role averages in pairs only (the "
                             "paper's k = 2); use group_size = 2, or outer = \"diloco\" for a global average")
        return self


class RoleSettings(BaseModel):
    """The sections the noloco role reads: ``[noloco]``, ``[model]``, ``[data]``."""

    model_config = ConfigDict(extra="forbid")
    noloco: WorkerConfig
    model: ModelConfig
    data: DataConfig


class NoLoCoCard(TrainingCard):
    """The noloco worker's node-card details: what peers pair, wait and catch up by."""

    round: int | None = None
    """The round label of the worker's next exchange (donors are picked and followed by it)."""
    outer: str | None = None
    """``noloco`` or ``diloco``."""
    blocked: float | None = None
    """Share of the last round's wall time spent waiting for the group (``swarmnode status``)."""
    next_exchange_at: float | None = None
    """Unix time the worker expects its next exchange (``optimizers.waiting.NEXT_EXCHANGE_AT``)."""
    finishing: bool | None = None
    """True with the worker's last round: nobody waits for it (``optimizers.waiting.FINISHING``)."""
    clipped_hard: int | None = None
    """Partner contributions this worker clipped hard since it started (``noloco.robust``; each
    also logged as ``partner_clipped``): above 0 only with a partner far from the swarm, which
    means an attacker, or a peer that kept training alone on other data. Set from the first."""
