"""A Byzantine NoLoCo / DiLoCo partner as its own OS process (issue 32), built on
``hostile.Attacker``: its own Ed25519 key, a DHT client signing its own node card and roster
entries, a gRPC server running the exchange. It joins an open swarm as an ordinary member and
pairs (NoLoCo) or joins the global average as a member (DiLoCo, ``noloco.outer=diloco``).
Used by ``benchmarks/robust_gossip.py`` and ``tests/integration/test_robust_gossip.py``; it is
a test tool, not a daemon role.

Kinds (``--kind``):

* ``recipe``: the issue's attacker. It answers every exchange with
  ``0.55 * theta + 0.835 * perm(theta)`` of the current weights (each tensor's own values
  shuffled: the honest RMS, a whole-model distance of about 0.95 x ||theta||, inside the fixed
  bounds ``max_norm_ratio`` 4 and ``max_distance_ratio`` 1). The issue's attacker downloaded
  the weights once and served them for 45 s; this one is there from the first round, so it
  takes the latest phi it downloaded (the closest one to the victim's theta in a pair):
  weights of the initial model would fail the norm bound against a trained one.
* ``adaptive``: knows the public clip rule (``optimizers/robust.py``: radius = multiplier x
  max(median partner distance, the victim's own move ||theta - phi||); a pull back along that
  move cut to ``backward`` own moves) and measures the scale itself: it downloads every
  worker's phi about once a second. In a NoLoCo pair it reads the victim's theta before it
  sends its own (nothing in the protocol forbids that), takes the victim's own move
  ``u = theta - phi`` against the closest phi it holds, and sends a difference that sits just
  inside both bounds, round after round: ``fraction * backward`` own moves straight back
  against the victim's progress (the first-order loss-ascent direction) plus, across it, the
  issue's poison direction (the recipe's, with its component along ``u`` removed) for the rest
  of ``fraction`` x the radius. ``--backward inf`` is the attacker of the rule without the cut
  (all of ``fraction`` x the radius straight back). As a DiLoCo member it cannot read first; it
  does the same around ``phi + d``, with ``d`` the previous round's group progress (mean - phi)
  standing in for the root's move (an underestimate of any one member's own move, so it stays
  inside).
* ``rare``: honest-looking most rounds (it sends the victim's phi: one own-move away, the honest
  scale; DiLoCo: ``phi + d``) and the recipe poison in one exchange of every ``--every``.
* ``root`` (DiLoCo only): a member whose key has the lowest peer ID of the swarm (the best of 4096
  fresh keys), so it is the root of every round it joins; it contributes honestly (``phi + d``)
  and sends every member the recipe of the true mean instead of the mean (inside the fixed
  bounds, as the recipe is).

    python -m tests.integration.attacker --bootstrap MADDR --run-id RUN --kind adaptive \\
        --outer noloco --model '{"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}' \\
        --seconds 60 --out /tmp/attacker.json

Prints ``loaded`` once its DHT is up (it then waits for the workers' cards), ``start <peer_id>``
once it serves, then, at the end (``--seconds`` or SIGTERM), one JSON
line of its tallies (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from node.card import NodeCard, cards_key, read_cards
from node.dht_records import store_entry
from node.state_sync import fetch_state
from optimizers.robust import distance
from security.keys import generate_key, peer_id_str
from security.peer_auth import ClientAuth, set_client_auth
from tests.integration.hostile import Attacker, model_specs

KINDS = ("recipe", "adaptive", "rare", "root")


def high_key(tries: int = 64):
    """The fresh key with the highest peer ID of ``tries``: it sorts after the honest workers' in
    practice, so as a DiLoCo member it is never the root (the lowest ID in the round). (It once
    also made it every NoLoCo worker's candidate, when pair proposals went to higher peer IDs;
    the pair order is now a hash of round and peer ID, which no key can sort last in.)"""
    return max((generate_key() for _ in range(tries)), key=peer_id_str)


def low_key(tries: int = 4096):
    """The fresh key with the lowest peer ID of ``tries``: a DiLoCo root (the lowest ID in the
    round) against a few honest workers with random keys in practice."""
    return min((generate_key() for _ in range(tries)), key=peer_id_str)


def recipe(theta: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """``0.55 * theta + 0.835 * perm(theta)``, each tensor shuffled within itself."""
    out = []
    for t in theta:
        flat = t.detach().to(torch.float32).reshape(-1)
        out.append((0.55 * flat + 0.835 * flat[torch.randperm(flat.numel(), generator=gen)]).reshape(t.shape)
                   .to(t.dtype))
    return out


def toward(base: list[torch.Tensor], ref: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """``base + scale * (base - ref)`` per tensor."""
    return [b + scale * (b - r) for b, r in zip(base, ref)]


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))


def inside(base: list[torch.Tensor], u: list[torch.Tensor], across: list[torch.Tensor], *, multiplier: float,
           fraction: float, backward: float) -> list[torch.Tensor]:
    """``base`` plus the largest poison the clip lets through, for a victim whose own move is
    ``u``: ``fraction * backward`` moves along ``-u`` (all of ``fraction * multiplier`` when
    ``backward`` is at least ``multiplier``) and the rest of ``fraction * multiplier * ||u||``
    along ``across`` with its component along ``u`` removed."""
    m2 = _dot(u, u)
    if not m2 > 0:
        return [b.clone() for b in base]
    m = m2 ** 0.5
    radius = fraction * multiplier * m
    back = min(fraction * backward * m, radius)
    w = [a - (_dot(across, u) / m2) * x for a, x in zip(across, u)]
    wn = _dot(w, w) ** 0.5
    side = (max(0.0, radius * radius - back * back)) ** 0.5
    scale_w = side / wn if wn > 0 else 0.0
    return [b - (back / m) * x + scale_w * y for b, x, y in zip(base, u, w)]


class ByzantinePartner:
    """The attack policy and its tallies, on top of a ``hostile.Attacker`` (its loop, DHT, server)."""

    def __init__(self, att: Attacker, kind: str, outer: str, specs, *, multiplier: float = 4.0,
                 fraction: float = 0.95, every: int = 5, round_timeout: float = 4.0, seed: int = 0,
                 after_round: int = 0, backward: float = 1.5):
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: choose one of {KINDS}")
        self.att, self.kind, self.outer, self.specs = att, kind, outer, specs
        self.multiplier, self.fraction, self.every = multiplier, fraction, max(1, every)
        self.backward = backward
        self.round_timeout, self.after_round = round_timeout, after_round
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg_hash: str | None = None
        self.addrs: dict[str, str] = {}            # worker gRPC address -> peer ID (signing resolver)
        self.workers: dict[str, str] = {}          # worker peer ID -> gRPC address
        self.phis: dict[str, list[torch.Tensor]] = {}  # worker peer ID -> its latest downloaded phi
        self.progress: list[torch.Tensor] | None = None  # DiLoCo: the last group mean - phi
        self.sends = 0
        self.tally: dict[str, Any] = {"kind": kind, "outer": outer, "peer_id": att.peer_id, "tries": 0, "ok": 0,
                                      "poisoned": 0, "outcomes": {}}
        self._pending: dict[int, asyncio.Future] = {}

    # ---- the swarm, as a member reads it
    async def refresh(self) -> list[int]:
        views = await read_cards(self.att.dht, self.att.run_id, timeout=5.0)
        rounds = []
        for v in views:
            if v.card.role != "noloco" or v.peer_id == self.att.peer_id:
                continue
            h = v.card.details.get("cfg_hash")
            if self.cfg_hash is None and h:
                self.cfg_hash = h
            if h != self.cfg_hash or not v.card.grpc_addr:
                continue
            self.workers[v.peer_id] = v.card.grpc_addr
            self.addrs[v.card.grpc_addr] = v.peer_id
            r = v.card.details.get("round")
            if isinstance(r, int) and not isinstance(r, bool) and r < 10 ** 6:
                rounds.append(r)
        return rounds

    async def fetch_phi(self, peer: str) -> list[torch.Tensor] | None:
        try:
            _, tensors = await fetch_state(self.workers[peer], self.att.run_id, self.att.peer_id, self.cfg_hash,
                                           {n: (d, s) for n, d, s in self.specs}, timeout=10, peer_id=peer)
        except Exception as exc:  # noqa: BLE001 - not known yet, busy, gone: try again later
            print(f"phi download from {peer[-8:]} failed: {exc!r}"[:300], file=sys.stderr, flush=True)
            return None
        phi = [tensors[n] for n, _, _ in self.specs]
        self.phis[peer] = phi
        return phi

    async def watch_phis(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Download every worker's phi about once a second (any member may)."""
        while not stop.is_set():
            for peer in list(self.workers):
                await self.fetch_phi(peer)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass

    async def publish(self, round_: int | None) -> None:
        details: dict[str, Any] = {"cfg_hash": self.cfg_hash, "outer": self.outer}
        if round_ is not None:
            details["round"] = round_
        card = NodeCard(role="noloco", state="ready", version="0.1.0", grpc_addr=self.att.addr,
                        started_at=time.time(), published_at=time.time(), details=details)
        await store_entry(self.att.dht, cards_key(self.att.run_id), self.att.peer_id, card, 30.0)

    # ---- what to send
    def _poison_due(self) -> bool:
        self.sends += 1
        return self.kind == "recipe" or (self.kind == "rare" and self.sends % self.every == 0)

    def pair_tensors(self, theirs: list[torch.Tensor]) -> list[torch.Tensor]:
        """NoLoCo: our contribution, chosen after reading the victim's theta."""
        theirs = [t.detach().to(torch.float32) for t in theirs]
        phi = min(self.phis.values(), key=lambda p: distance(theirs, p)) if self.phis else None
        if self.kind == "recipe":
            self.tally["poisoned"] += 1
            return recipe(phi if phi is not None else theirs, self.gen)
        if self.kind == "rare":
            if self._poison_due():
                self.tally["poisoned"] += 1
                return recipe(theirs, self.gen)
            return [t.clone() for t in phi] if phi is not None else theirs
        if phi is None:  # no scale measured yet: agree
            return theirs
        self.tally["poisoned"] += 1
        u = [t - p for t, p in zip(theirs, phi)]
        across = [r - t for r, t in zip(recipe(theirs, self.gen), theirs)]
        return inside(theirs, u, across, multiplier=self.multiplier, fraction=self.fraction, backward=self.backward)

    def member_tensors(self, phi: list[torch.Tensor]) -> list[torch.Tensor]:
        """DiLoCo: our contribution to the group, chosen before seeing anyone's theta."""
        honest = phi if self.progress is None else [p + d for p, d in zip(phi, self.progress)]
        if self.kind == "recipe":
            self.tally["poisoned"] += 1
            return recipe(phi, self.gen)
        if self.kind == "rare":
            if self._poison_due():
                self.tally["poisoned"] += 1
                return recipe(honest, self.gen)
            return honest
        if self.kind == "root" or self.progress is None:
            return honest
        self.tally["poisoned"] += 1
        across = [r - h for r, h in zip(recipe(honest, self.gen), honest)]
        return inside(honest, self.progress, across, multiplier=self.multiplier, fraction=self.fraction,
                      backward=self.backward)

    # ---- DiLoCo root: the mean every member reads back
    def poison_means(self) -> None:
        link = self.att.ex.link
        mean = link.mean

        async def poisoned(parts):
            true = await mean(parts)
            if len(parts) < 2:  # alone: nobody to poison
                return true
            self.tally["poisoned"] += 1
            return recipe([t.to(torch.float32) for t in true], self.gen)

        link.mean = poisoned

    # ---- NoLoCo: read the partner's tensors before sending ours
    def read_first(self) -> None:
        link = self.att.ex.link
        send, recv = link.send, link.recv_tensors

        def fut(stream) -> asyncio.Future:
            return self._pending.setdefault(id(stream), asyncio.get_running_loop().create_future())

        async def recv_tensors(stream, check: bool = True, names=None):
            got = await recv(stream, check, names)
            f = fut(stream)
            if not f.done():
                f.set_result(got[0])
            return got

        # the same signatures as ExchangeLink.send / recv_tensors (a mismatch made every exchange
        # fail with partner_error, so the attacker never paired: tests/unit/test_robust_clip.py checks them)
        async def send_after(stream, tensors, sent=None, names=None):
            try:
                theirs = await fut(stream)
            finally:
                self._pending.pop(id(stream), None)
            return await send(stream, self.pair_tensors(theirs), sent, names)

        link.recv_tensors, link.send = recv_tensors, send_after

    # ---- the rounds
    async def run(self, seconds: float, stop: asyncio.Event) -> None:
        end = time.monotonic() + seconds
        while not stop.is_set() and time.monotonic() < end:
            try:
                rounds = await self.refresh()
            except Exception:  # noqa: BLE001 - a failed DHT read: try again
                rounds = []
            phi = next(iter(self.phis.values()), None)
            if not rounds or phi is None or max(rounds) < self.after_round:
                await asyncio.sleep(0.2)
                continue
            r = max(rounds)
            await self.publish(r)
            self.tally["tries"] += 1
            if self.outer == "noloco":
                res = await self.att.ex.pair_average(r, [t.clone() for t in phi], self.round_timeout)
            else:
                peer = min(self.workers, key=lambda p: p)  # any: DiLoCo members share phi
                phi = await self.fetch_phi(peer) or phi
                res = await self.att.ex.group_average(r, self.member_tensors(phi), self.round_timeout,
                                                      expected=len(self.workers) + 1)
                if res.mean is not None:
                    self.progress = [m.to(torch.float32) - p for m, p in zip(res.mean, phi)]
            key = res.outcome if res.outcome == "ok" else f"{res.outcome}:{res.reason}"
            print(f"round {r}: {key} with {[p[-8:] for p in res.partners]}", file=sys.stderr, flush=True)
            self.tally["outcomes"][key] = self.tally["outcomes"].get(key, 0) + 1
            if res.outcome == "ok":
                self.tally["ok"] += 1
            else:
                await asyncio.sleep(0.2)


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bootstrap", required=True, help="the swarm's bootstrap multiaddr")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--model", required=True, help="the workers' [model] section as JSON")
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--outer", choices=("noloco", "diloco"), default="noloco")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--round-timeout", type=float, default=4.0, help="the workers' noloco.round_timeout")
    ap.add_argument("--multiplier", type=float, default=4.0, help="the clip rule it assumes (noloco.robust_multiplier)")
    ap.add_argument("--fraction", type=float, default=0.95, help="adaptive: where in the radius to sit")
    ap.add_argument("--backward", type=float, default=1.5,
                    help="adaptive: the backward cut it assumes (noloco.robust_backward; inf: no cut, all straight back)")
    ap.add_argument("--every", type=int, default=5, help="rare: poison one exchange in this many")
    ap.add_argument("--after-round", type=int, default=0,
                    help="attack once the workers reached this round (the issue's attacker joins a trained swarm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the tallies here (JSON)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))  # until the loop runs: end after set-up
    signal.signal(signal.SIGINT, lambda *_: stopped.append(1))
    tmp = Path(tempfile.mkdtemp(prefix="attacker-"))
    swarm = SimpleNamespace(run_id=args.run_id, bootstrap_maddr=args.bootstrap)
    if args.kind == "root" and args.outer != "diloco":
        raise SystemExit("--kind root is a DiLoCo attack (--outer diloco): NoLoCo has no root")
    att = Attacker(swarm, tmp, "attacker", key=low_key() if args.kind == "root" else high_key())
    specs, _ = model_specs(json.loads(args.model))
    bz = ByzantinePartner(att, args.kind, args.outer, specs, multiplier=args.multiplier, fraction=args.fraction,
                          every=args.every, round_timeout=args.round_timeout, seed=args.seed,
                          after_round=args.after_round, backward=args.backward)
    set_client_auth(ClientAuth(att.signer, bz.addrs.get))
    print("loaded", flush=True)  # imports done, DHT up: a harness may start the workers now
    stop = asyncio.Event()

    def on_term(*_):
        att.loop.call_soon_threadsafe(stop.set)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if stopped:
        on_term()
    t0 = time.monotonic()
    try:
        while bz.cfg_hash is None:  # the workers' config, from their cards
            att.run(bz.refresh())
            if bz.cfg_hash is None:
                if stop.is_set() or time.monotonic() - t0 > 120:
                    raise SystemExit("no noloco worker card in the swarm after 120 s")
                time.sleep(0.5)
        att.run(att._serve(bz.cfg_hash, specs))
        if args.outer == "noloco":
            bz.read_first()
        elif args.kind == "root":
            bz.poison_means()
        att.run(bz.publish(None))
        print(f"start {att.peer_id}", flush=True)
        print(f"serving at {att.addr} as {att.peer_id}; workers {list(bz.workers)}", file=sys.stderr, flush=True)
        watcher = att.spawn(bz.watch_phis(stop))
        att.run(bz.run(args.seconds, stop), timeout=args.seconds + 120)
        att.loop.call_soon_threadsafe(stop.set)
        watcher.result(30)
    finally:
        tally = dict(bz.tally, seconds=round(time.monotonic() - t0, 1))
        line = json.dumps(tally)
        if args.out:
            Path(args.out).write_text(line)
        print(line, flush=True)
        att.close()
        shutil.rmtree(tmp, ignore_errors=True)  # its key file: nothing else is kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
