"""The knobs every training role shares, one name each, and the typed card details it publishes.

A role's own config section (``[grpo]``, ``[noloco]``, ``[stage]``) derives from
:class:`RunSettings`, so ``exit_after``, ``eval_every``, ``checkpoint_every`` and
``torch_threads`` mean the same thing in every role; :class:`node.training.TrainingRole` reads
them. A section that had its own name for a knob before keeps accepting it through
``legacy_keys`` (``{"exit_after_rounds": "exit_after"}``): old configs and ``--set`` lines
still work, and the value lands in the one field.

:class:`TrainingCard` is the typed form of a training role's node-card details (``cfg_hash``,
the device); a role subclasses it with its own fields (``round``, ``reward``, ...) and hands an
instance to ``TrainingRole.update_card``, never a free dict.

:func:`require_loopback` is the one guard of test and benchmark harness settings (an attacker,
a malicious weight edit): refused unless every address of the node is loopback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from security.config import is_loopback_host, is_loopback_maddr

if TYPE_CHECKING:  # pragma: no cover
    from node.config import NodeConfig


class RunSettings(BaseModel):
    """How a training role runs (not what it trains): when it stops, evaluates and checkpoints.

    The counts are in the role's unit of progress (``TrainingRole.progress``: a trained round,
    an inner step, a pipeline iteration); each role's docs say which.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    legacy_keys: ClassVar[Mapping[str, str]] = {}
    """Older key -> the field it now fills (e.g. ``{"exit_after_rounds": "exit_after"}``)."""

    exit_after: int = Field(0, ge=0)
    """Evaluate, log ``training_finished`` and drain (exit 0) after this much progress (0 = run
    until stopped). Demos, tests and benchmarks set it; production runs usually leave it 0."""

    eval_every: int = Field(0, ge=0)
    """Evaluate every this much progress (0 = only at the start and the end). Lower it to follow
    a run closely; each evaluation takes compute time from training."""

    checkpoint_every: int = Field(0, ge=0)
    """Write a local checkpoint every this much progress, and a last one when the node drains
    (0 = never; roles without checkpoints ignore it). Lower it on preemptible machines (less
    work lost), raise it when checkpoint writes show up in the step time."""

    torch_threads: int = Field(0, ge=0)
    """Intra-op threads for this node's torch compute (0 = torch's default). Set 1 when several
    nodes share one machine (the demos do), or they slow each other down."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.legacy_keys:
            return data
        data = dict(data)
        for old, new in cls.legacy_keys.items():
            if old in data:
                if new in data:
                    raise ValueError(f"{old} and {new} are the same setting ({old} is its older name): "
                                     f"keep only {new}")
                data[new] = data.pop(old)
        return data


class TrainingCard(BaseModel):
    """Node-card details every training role publishes; roles subclass it with their own.

    Values must be small scalars (the card holds at most 16 details in all); a field left unset
    is not touched on the card, a field set to None removes that detail.
    """

    model_config = ConfigDict(extra="forbid")

    cfg_hash: str | None = None
    """What must match for two nodes to work together (``node.card.peers(cfg_hash=...)``)."""
    device_kind: str | None = None
    device_name: str | None = None
    device_memory_bytes: int | None = None

    def details(self) -> dict[str, Any]:
        """The fields that were set, as ``CardPublisher.update`` takes them."""
        return self.model_dump(exclude_unset=True)


def require_loopback(config: "NodeConfig", what: str, fix: str) -> None:
    """Refuse a test or benchmark harness (an attacker, a malicious edit) unless every listen and
    peer address of ``config`` is loopback: ValueError naming the first public one and ``fix``."""
    public = [h for h in (config.host, config.advertise_host) if h and not is_loopback_host(h)]
    public += [m for m in (*config.dht.initial_peers, *config.dht.announce_maddrs) if not is_loopback_maddr(m)]
    if public:
        raise ValueError(f"{what} is a test and benchmark harness: it is refused unless every listen and peer "
                         f"address is loopback; {public[0]!r} is not. {fix}")
