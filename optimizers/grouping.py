"""Seeded NoLoCo grouping: the official permutation rule, the remainder policy, roster hashes.

Owns the pure function from (roster, round, seed, H, k) to a partition into groups, computed
identically by every worker (docs/noloco.md, 'Pairing'). Does not own the roster itself (agreed
through the DHT by the role) nor what happens when a partner fails to show up (the role takes the
solo step).

Official rule [code]::

    perm  = numpy.random.default_rng(step + 1).permutation(W)     # step = H, 2H, ...
    n_grp = W // k                                                # asserts W % k == 0
    group g = [perm[i] for i in range(W) if i % n_grp == g]

swarmnode's seeded mode uses `default_rng(seed + r*H + 1)` over the sorted peer IDs, so with
seed 0 and round r it is exactly the official grouping of step r*H.

Remainder policy [ours] when W % k != 0 (let n_full = W // k, rem = W % k): the first
n_full*k entries of the permutation are grouped by the official rule; then

===========================  ==================================================================
case                         result
===========================  ==================================================================
rem == 0                     official grouping, n_full groups of exactly k
rem == 1, n_full >= 1        the leftover worker joins the *last* group, which has k+1 members
rem >= 2, n_full >= 1        the leftover workers form one extra group of rem (2 <= rem < k)
                             members; nobody is alone (only possible for k >= 3)
W < k, W >= 2 (n_full == 0)  a single group of all W workers
W == 1                       one group of 1: the worker is alone and takes the solo step
W == 0                       no groups
===========================  ==================================================================

So for k = 2 (every paper run) an odd roster gives one triple, and a group of size 1 arises only
from a one-worker roster. A worker whose partner is missing at run time also takes the solo step,
but that is the role's decision, not the partition's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["official_groups", "partition", "groups_for_roster", "my_group", "roster_hash"]


def _check_k(k: int) -> None:
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"group size k={k!r} must be an integer >= 1")


def official_groups(round_step: int, W: int, k: int) -> list[list[int]]:
    """The official code's grouping at inner step `round_step` (H, 2H, ...) for W workers.

    Requires W % k == 0, as the official code does; use `partition`/`groups_for_roster` for the
    remainder policy."""
    _check_k(k)
    if W < 1 or W % k != 0:
        raise ValueError(
            f"official grouping needs W % k == 0 (W={W}, k={k}); use groups_for_roster, which "
            "applies swarmnode's remainder policy")
    perm = np.random.default_rng(round_step + 1).permutation(W)
    n_grp = W // k
    return [[int(perm[i]) for i in range(W) if i % n_grp == g] for g in range(n_grp)]


def partition(perm: Sequence[int], k: int) -> list[list[int]]:
    """Group the entries of `perm` by the official rule plus the remainder policy (module doc)."""
    _check_k(k)
    perm = [int(p) for p in perm]
    W = len(perm)
    if W == 0:
        return []
    n_full, rem = divmod(W, k)
    if n_full == 0:
        return [perm]                       # W < k: one group of everyone (solo if W == 1)
    head = perm[: n_full * k]
    groups = [[head[i] for i in range(len(head)) if i % n_full == g] for g in range(n_full)]
    tail = perm[n_full * k:]
    if rem == 1:
        groups[-1].extend(tail)             # last group takes k+1 members
    elif rem >= 2:
        groups.append(tail)                 # a smaller group of rem >= 2 members
    return groups


def _sorted_roster(peer_ids: Sequence[str]) -> list[str]:
    ids = sorted(peer_ids)
    if len(set(ids)) != len(ids):
        dup = sorted({p for p in ids if ids.count(p) > 1})
        raise ValueError(f"roster has duplicate peer IDs {dup}; deduplicate it before grouping")
    return ids


def groups_for_roster(peer_ids: Sequence[str], round: int, seed: int, H: int,
                      k: int) -> list[list[str]]:
    """Partition of the roster for outer round `round` (docs/noloco.md, 'Pairing').

    IDs are sorted first, so every worker that read the same roster (any order) gets the same
    groups. perm = default_rng(seed + round*H + 1).permutation(W); grouping as in `partition`.
    Within each group, members appear in permutation order; for k > 2 the first is the root."""
    ids = _sorted_roster(peer_ids)
    if round < 0 or H < 1 or seed < 0:
        raise ValueError(f"need round >= 0, H >= 1, seed >= 0 (got {round}, {H}, {seed})")
    if not ids:
        return []
    perm = np.random.default_rng(seed + round * H + 1).permutation(len(ids))
    return [[ids[i] for i in group] for group in partition(perm, k)]


def my_group(peer_id: str, peer_ids: Sequence[str], round: int, seed: int, H: int,
             k: int) -> list[str]:
    """The group (including `peer_id`) that `peer_id` belongs to in round `round`.

    A one-element result means a solo step."""
    for group in groups_for_roster(peer_ids, round, seed, H, k):
        if peer_id in group:
            return group
    raise ValueError(f"peer {peer_id!r} is not in the roster of round {round}; it must publish "
                     "its roster record before the deadline or take a solo step")


def roster_hash(peer_ids: Sequence[str]) -> str:
    """Order-independent 16-hex-char digest of a roster (sent in exchange headers; peers whose
    roster hashes differ computed different groups and must not average)."""
    ids = _sorted_roster(peer_ids)
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
