"""How a round's training groups are laid out: ``horizontal`` (ours) or ``vertical`` (the F-TIS paper's).

Owns the pure part of ``grpo.topology`` (docs/grpo.md, 'Topologies'): which prompts a peer
answers in a round, and which foreign completions join which group.

- ``horizontal``: every peer answers the same B prompts (seeded by run and round); a prompt's
  group holds the peer's own G completions plus up to F foreign ones, so one advantage
  normalisation mixes own and foreign completions (``Learner._select_foreign``).
- ``vertical``: each peer answers B prompts of its own (seeded by run, peer and round:
  :func:`prompt_key`) and publishes whole groups; a receiver trains on every foreign group as a
  group of its own (:func:`pick_groups`), so advantages are normalised within the generator's group.

The receiver regenerates a foreign group's prompt from the sender's peer ID (signed into the
batch) and the round: the wire format is unchanged, and nothing here trusts a sender's reward.
No torch, network or node code (import-linter contract "Method modules are pure").
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, Sequence

from rl.rollout import Completion, RolloutBatch

Topology = Literal["vertical", "horizontal"]
TOPOLOGIES = ("vertical", "horizontal")


def prompt_key(run: str, topology: str, peer: str) -> str:
    """The key a round's prompts are drawn from (``task.prompts(key, round, B)``): the run for
    ``horizontal`` (every peer the same prompts), run and peer for ``vertical`` (each its own)."""
    if topology == "horizontal":
        return run
    if topology == "vertical":
        return f"{run}/vertical/{peer}"
    raise ValueError(f"grpo.topology {topology!r}; use one of {TOPOLOGIES}")


@dataclass(frozen=True)
class ForeignGroup:
    """One foreign generator's whole group for one of its prompts, as the learner will train on it."""

    sender: str
    prompt_id: bytes
    completions: tuple[Completion, ...]


def pick_groups(batches: Sequence[RolloutBatch], max_rows: int, max_senders: int,
                rng: random.Random) -> list[ForeignGroup]:
    """Whole foreign groups for a vertical round: at most ``max_rows`` completions in all (the
    ``B * F`` foreign slots of the round, so both topologies train on the same number of rows),
    from the first ``max_senders`` senders, taken round-robin across senders (each sender's groups
    in a random order) so that one sender cannot fill the slots while others wait. A group is
    taken whole or not at all: its advantages are its generator's group statistics."""
    queues = []
    for b in batches[:max_senders]:
        groups = [ForeignGroup(b.sender, g.prompt_id, tuple(g.completions)) for g in b.groups if g.completions]
        rng.shuffle(groups)
        queues.append(groups)
    out: list[ForeignGroup] = []
    rows = 0
    while any(queues):
        for q in queues:
            while q:
                grp = q.pop(0)
                if rows + len(grp.completions) <= max_rows:
                    out.append(grp)
                    rows += len(grp.completions)
                    break
        if rows >= max_rows:
            break
    return out

