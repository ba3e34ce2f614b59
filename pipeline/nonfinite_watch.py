"""Which stage node produces non-finite tensors (docs/pipeline.md, 'What is caught live').

Every stage node tallies the non-finite (or malformed) activations and gradients it receives, by
iteration and sender, on its card (pipeline/stage_evidence.py, detail `nonfinite`). A NaN spreads:
the activations after the first bad stage, the loss, and every gradient back to the data node are
non-finite too, so the receivers name several senders. The coordinator keeps the tallies and, once
every scheduled node has stepped an iteration, attributes it (`first_producers`):

- forward: a sender of a non-finite activation that itself received none in that iteration is
  where the NaN started (its inputs were finite, its outputs are not);
- only when no activation was non-finite, backward: a sender of a non-finite gradient that itself
  received none.

A node named in `SUSPECT_AFTER` consecutive attributed iterations is suspected (`NonfiniteWatch.note`
returns it; the coordinator quarantines it and a hot spare rebuilds the stage by CheckFree). One
bad iteration (an honest overflow) suspects nobody: an iteration with nothing non-finite resets
every count. Pure Python; the tallies come from untrusted cards: a node that lies about what it
received can shift the blame onto its honest predecessor (the audits of pipeline/replica_audits.py
are the layer that checks a node's outputs against its inputs).
"""

from __future__ import annotations

from collections.abc import Iterable

SUSPECT_AFTER = 3
"""Consecutive iterations attributed to one node that make it a suspect."""
ITERATIONS_KEPT = 32
"""Iterations of tallies kept while waiting for every scheduled node to step them."""


def first_producers(received: dict[str, set[tuple[str, str]]]) -> set[str]:
    """One iteration's tallies, receiver -> {(kind, sender)} -> the nodes where the non-finite
    values started (see the module docstring); empty when nothing was non-finite."""
    for kind in ("fwd", "bwd"):
        senders = {s for got in received.values() for k, s in got if k == kind}
        tainted = {r for r, got in received.items() if any(k == kind for k, _ in got)}
        if senders:
            return senders - tainted
    return set()


class NonfiniteWatch:
    """The coordinator's view of the tallies (see the module docstring)."""

    def __init__(self, suspect_after: int = SUSPECT_AFTER):
        self.suspect_after = suspect_after
        self.tallies: dict[int, dict[str, set[tuple[str, str]]]] = {}   # iteration -> receiver -> {(kind, sender)}
        self.done = -1                                                 # iterations up to this one attributed
        self.streak: dict[str, list[int]] = {}                         # node -> consecutive attributed iterations
        self.suspected: set[str] = set()

    def note(self, reports: Iterable[tuple[str, int | None, list[tuple[int, str, str]]]],
             scheduled: set[str]) -> list[tuple[str, list[int]]]:
        """`reports`: (reporter, its completed iterations, its tallies [(iteration, kind, sender)])
        of every live node. Returns the newly suspected nodes with the iterations that name them."""
        stepped: list[int] = []
        for reporter, iteration, tallies in reports:
            if reporter in scheduled and iteration is not None:
                stepped.append(iteration)
            for it, kind, sender in tallies:
                if it > self.done:
                    self.tallies.setdefault(it, {}).setdefault(reporter, set()).add((kind, sender))
        if len(stepped) < len(scheduled) or not stepped:
            return []
        upto = min(stepped) - 1                     # every scheduled node stepped up to this one
        out: list[tuple[str, list[int]]] = []
        for it in range(self.done + 1, upto + 1):
            culprits = first_producers(self.tallies.pop(it, {})) & scheduled
            for node in list(self.streak):
                if node not in culprits:
                    del self.streak[node]
            for node in culprits:
                self.streak.setdefault(node, []).append(it)
                if len(self.streak[node]) >= self.suspect_after and node not in self.suspected:
                    self.suspected.add(node)
                    out.append((node, list(self.streak[node])))
        self.done = max(self.done, upto)
        for it in sorted(self.tallies)[:-ITERATIONS_KEPT]:
            del self.tallies[it]
        return out


__all__ = ["ITERATIONS_KEPT", "NonfiniteWatch", "SUSPECT_AFTER", "first_producers"]
