"""``swarmnode status``: the run's live nodes as their signed node cards show them.

Default mode joins the DHT as a short-lived client (no key file needed, nothing stored), reads
``<run>/nodes`` and prints one table per role, or a JSON array with ``--json``. Each role's table
has that role's own card details as columns (a NoLoCo worker's round and blocked share, a stage's
index and iteration, a GRPO peer's round, reward and rejections) and the event bus's
reachability (``BUS_REACH``: peers that could dial the node / peers that tried). ``--watch``
refreshes every 2 s under a one-line summary. Table cells are for reading (a wall-clock detail
as ``in 0.4 s``, a flag only where it is set); ``--json`` keeps every raw value. ``--local`` asks this host's ops port instead and
imports neither torch nor hivemind, which makes it a cheap container healthcheck (``--ready``:
exit 0 only when READY).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

from node import coordinator_wait


class StatusError(Exception):
    exit_code = 4


def _local(args: argparse.Namespace) -> int:
    port, host = args.metrics_port, "127.0.0.1"
    if port is None:
        from node.config import load_config
        ops = load_config(args.config).ops
        port = ops.port
        if ops.host not in ("private", "host", "0.0.0.0", "::"):
            host = ops.host  # the ops port listens only there (ops.host)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError) as exc:
        print(json.dumps({"ready": False, "reason": "unreachable",
                          "detail": f"no node answers on {url} ({exc}); is it running with ops.port={port}?"}))
        return 1
    print(json.dumps(body))
    if args.ready:
        return 0 if body.get("ready") else 1
    return 0


def card_rows(views: list, now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    rows = []
    for v in views:
        c = v.card
        rows.append({"peer_id": v.peer_id, "role": c.role, "state": c.state, "version": c.version,
                     "address": c.grpc_addr, "age_s": round(max(0.0, now - c.published_at), 1),
                     "uptime_s": round(max(0.0, now - c.started_at), 1), **{k: v2 for k, v2 in c.details.items()}})
        hint = bus_reach_hint(c.details)
        if hint:
            rows[-1]["bus_hint"] = hint
        waits = coordinator_wait.status_hint(c.details, now)
        if waits:
            rows[-1]["coordinator_hint"] = waits
    mark_banned(rows)
    mark_quarantined(rows)
    return rows


def mark_quarantined(rows: list[dict[str, Any]]) -> None:
    """Add ``quarantined_why`` to the rows of stage nodes the schedule coordinator (a bootstrap
    card's ``quarantined`` detail: ``<last 8 of peer ID>=<why>;...``, pipeline/coordinator.py)
    left out of the schedule after a failed integrity audit."""
    for r in rows:
        for item in str(r.get("quarantined") or "").split(";"):
            tail, _, why = item.partition("=")
            if not tail:
                continue
            for row in rows:
                if row["peer_id"] != r["peer_id"] and str(row["peer_id"]).endswith(tail):
                    row["quarantined_why"] = why


def mark_banned(rows: list[dict[str, Any]]) -> None:
    """Add ``banned_by`` (how many other nodes ban it) to the rows of peers that other nodes'
    cards list in ``banned_ids`` (node/call_guard.py: the last 8 characters of each banned key)
    or ``grpo_banned_ids`` (a ``grpo`` peer's rollout-poisoning bans, rl/grpo_role.py)."""
    bans = [(r["peer_id"], (set(str(r.get("banned_ids") or "").split(","))
                            | set(str(r.get("grpo_banned_ids") or "").split(","))) - {""}) for r in rows]
    for row in rows:
        n = sum(1 for who, ids in bans if who != row["peer_id"] and row["peer_id"][-8:] in ids)
        if n:
            row["banned_by"] = n


def bus_reach_hint(details: dict[str, Any]) -> str:
    """What an event-bus node that no peer could dial should fix (from its card's ``bus_reach``,
    "<peers that reached it>/<peers that probed it>", and ``gossip_addr``); "" when fine."""
    reach = str(details.get("bus_reach") or "")
    reached, _, reporters = reach.partition("/")
    if not (reached.isdigit() and reporters.isdigit()) or int(reporters) == 0 or int(reached) > 0:
        return ""
    addr = details.get("gossip_addr") or "(none advertised)"
    return (f"gossip UNREACHABLE: none of {reporters} peers could dial {addr}; open that TCP port "
            "(eventbus.port) or set eventbus.announce_addrs to a public address")


TABLE_HIDDEN_SUFFIXES = ("_hash", "_id", "_name", "_bytes")
"""Card details left out of the table (identities, hashes, sizes; ``--json`` has every detail)."""


WALL_CLOCK_SUFFIX = "_at"
"""Card details named ``*_at`` hold a wall-clock time (Unix seconds, e.g. NoLoCo's
``next_exchange_at``); the table shows them relative to now (``in 0.4 s``, ``2.0 s ago``)."""


def _header(key: str) -> str:
    """Column title: the detail's name, less ``_at`` for a wall-clock time (``NEXT_EXCHANGE``)."""
    return (key[:-len(WALL_CLOCK_SUFFIX)] if key.endswith(WALL_CLOCK_SUFFIX) else key).upper()


def _cell(value: Any, key: str = "", now: float | None = None) -> str:
    """What an operator reads: a wall-clock time relative to ``now``, ``yes`` for a true flag and
    nothing for a false or unset one, floats to 3 significant digits."""
    if value is None or value is False:
        return ""
    if value is True:
        return "yes"
    if key.endswith(WALL_CLOCK_SUFFIX) and isinstance(value, (int, float)) and math.isfinite(value):
        delta = value - (time.time() if now is None else now)
        return f"in {delta:.1f} s" if delta >= 0 else f"{-delta:.1f} s ago"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _role_table(rows: list[dict[str, Any]], now: float | None = None) -> list[str]:
    """One role's nodes: the common columns, then that role's own card details in the order its
    nodes publish them (NoLoCo: round, blocked; stage: stage, iteration; grpo: round, reward,
    rejected; the event bus adds bus_reach and gossip_addr), then address and card age. A detail
    no node of the role has set (None, False or missing: e.g. ``finishing`` before a worker's last
    round) gets no column; ``--json`` keeps every raw value."""
    head = ["peer_id", "role", "state"]
    tail = ["address", "age_s"]
    own: list[str] = []
    for r in rows:
        for k in r:
            if k not in own and k not in head and k not in tail and k not in ("version", "uptime_s", "bus_hint", "banned_ids",
                                                                                 "grpo_banned_ids", "quarantined",
                                                                                 "quarantined_why", "coordinator_hint",
                                                                                 coordinator_wait.CARD_DETAIL) \
                    and not k.endswith(TABLE_HIDDEN_SUFFIXES) \
                    and any(row.get(k) not in (None, False) for row in rows):
                own.append(k)
    cols = head + own + tail
    table = [[str(r[c])[:16] + "…" if c == "peer_id" else _cell(r.get(c), c, now) for c in cols] for r in rows]
    heads = [_header(c) for c in cols]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
    lines += ["  ".join(x.ljust(w) for x, w in zip(t, widths)).rstrip() for t in table]
    # under the table, not in it: a hint is a sentence
    lines += [f"{str(r['peer_id'])[:16]}…: {r['bus_hint']}" for r in rows if r.get("bus_hint")]
    lines += [f"{str(r['peer_id'])[:16]}…: {r['coordinator_hint']}" for r in rows if r.get("coordinator_hint")]
    lines += [f"{str(r['peer_id'])[:16]}…: QUARANTINED by the schedule coordinator: {r['quarantined_why']}"
              for r in rows if r.get("quarantined_why")]
    return lines


def format_table(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """One table per role (rows keep their order: bootstrap first), separated by a blank line;
    ``now`` (default: the clock) is what wall-clock details are shown relative to."""
    if not rows:
        return "no live nodes in this run (wrong --run-id? cards expire 30 s after a node stops)"
    roles = list(dict.fromkeys(r["role"] for r in rows))
    blocks = ["\n".join(_role_table([r for r in rows if r["role"] == role], now)) for role in roles]
    return "\n\n".join(blocks)


def summary_line(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """``12:00:05  7 nodes: bootstrap 1 ready; noloco 2 ready, 1 joining`` (the ``--watch`` header)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    parts = []
    for role in dict.fromkeys(r["role"] for r in rows):
        states = Counter(r["state"] for r in rows if r["role"] == role)
        parts.append(f"{role} " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    return f"{stamp}  {len(rows)} nodes: " + "; ".join(parts) if rows else f"{stamp}  0 nodes"


class SwarmReader:
    """A client-mode DHT that reads the run's cards; use as a context manager."""

    def __init__(self, initial_peers: list[str], run_id: str, timeout: float = 15.0, coordinator: str | None = None):
        """``coordinator``: token mode, list only cards carrying a valid admission token it signed."""
        self.initial_peers, self.run_id, self.timeout = initial_peers, run_id, timeout
        self.coordinator = coordinator
        self.dht = None

    def __enter__(self) -> "SwarmReader":
        import hivemind

        from node.card import CARD_NAMESPACE
        from security.records import SignedRecordValidator
        from security.revocation_record import REVOKED_NAMESPACE

        validator = SignedRecordValidator(self.run_id, None, [CARD_NAMESPACE, REVOKED_NAMESPACE],
                                          coordinator_peer_id=self.coordinator,
                                          require_admission=self.coordinator is not None)
        try:
            self.dht = hivemind.DHT(initial_peers=self.initial_peers, client_mode=True, start=True,
                                    host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[validator],
                                    startup_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - hivemind raises several types here
            raise StatusError(f"could not join the swarm through {self.initial_peers}: "
                              f"{str(exc).strip()[:300]}. Check the multiaddr (as printed by `swarmnode bootstrap` "
                              "or /peerinfo) and that the bootstrap is up; with the bootstrap down, pass any live node's multiaddr "
                              "(the maddrs of its /peerinfo)") from None
        return self

    def read(self) -> list:
        """The live cards; in token mode without those of peers the coordinator revoked."""
        from node.card import read_cards

        async def both() -> list:
            if self.coordinator is not None:
                from node.revocation_sync import read_revocations
                from security.revocation import REVOKED
                found, _ = await read_revocations(self.dht, self.run_id, self.coordinator, timeout=self.timeout)
                REVOKED.update(found.entries if found is not None else ())
            return await read_cards(self.dht, self.run_id, timeout=self.timeout)
        return asyncio.run(both())

    def __exit__(self, *exc: Any) -> None:
        if self.dht is not None:
            self.dht.shutdown()


def cmd_status(args: argparse.Namespace) -> int:
    if args.local:
        return _local(args)
    from node.config import ConfigError, check_peer_maddr, load_config

    cfg = load_config(args.config) if args.config else None
    peers = args.initial_peers or (cfg.dht.initial_peers if cfg else [])
    if not peers:
        raise ConfigError("swarmnode status needs --initial-peers MADDR (or a --config with dht.initial_peers)")
    try:
        peers = [check_peer_maddr(p) for p in peers]
    except ValueError as exc:
        raise ConfigError(f"--initial-peers: {exc}") from None
    run_id = args.run_id or (cfg.run_id if cfg else "swarmnode")
    coordinator = args.coordinator or (cfg.security.coordinator_peer_id
                                       if cfg and cfg.security.admission == "token" else None)
    if coordinator is not None:
        from security.keys import RecordRejected, public_key_of
        try:
            public_key_of(coordinator)
        except RecordRejected as exc:
            raise ConfigError(f"--coordinator {coordinator[:60]!r} is not an Ed25519 peer ID (12D3KooW…): {exc}") \
                from None
    with SwarmReader(peers, run_id, coordinator=coordinator) as reader:
        while True:
            rows = card_rows(reader.read())
            if args.json:
                print(json.dumps(rows), flush=True)
            elif args.watch:
                clear = "\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n"
                print(f"{clear}{summary_line(rows)}\n\n{format_table(rows)}", flush=True)
            else:
                print(format_table(rows), flush=True)
            if not args.watch:
                return 0
            try:
                time.sleep(2.0)
            except KeyboardInterrupt:
                return 0
