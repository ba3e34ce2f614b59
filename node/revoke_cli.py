"""``swarmnode revoke``: withdraw admission tokens before they expire (token mode; docs/security.md,
'Revocation').

    swarmnode revoke --identity coordinator.key --run-id myrun --initial-peers MADDR \\
        --peer-id 12D3KooW... [--serial N] [--expires 7d] [--reason "key leaked"]
    swarmnode revoke --identity coordinator.key --run-id myrun --initial-peers MADDR --list

Joins the DHT as a short-lived client (its own throwaway peer ID: the coordinator key may be live
in the swarm already), reads the coordinator's ``<run>/revoked`` list, adds the new entry, signs
the list with the coordinator key and stores it, then reads it back until the entry is there.
Every node honours it within ``security.revocation_refresh_s``; the coordinator node keeps it
alive (``node/revocation_sync.py``). The serial of a token is printed by ``swarmnode admit``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from node.errors import ConfigError


def add_parser(sub) -> None:
    rv = sub.add_parser("revoke", help="revoke admission tokens (token mode): a signed list every node honours")
    rv.add_argument("--identity", required=True, help="the coordinator's Ed25519 key file (signs the list)")
    rv.add_argument("--run-id", required=True)
    rv.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer of the run")
    rv.add_argument("--peer-id", help="revoke this peer: every token it holds, or only --serial when given")
    rv.add_argument("--serial", type=int, help="revoke the token with this serial (`swarmnode admit` prints it)")
    rv.add_argument("--expires", default="7d",
                    help="how long the entry stays on the list: longer than the revoked token's life (default 7d)")
    rv.add_argument("--reason", default="", help="a short note shown in refusals and logs")
    rv.add_argument("--list", action="store_true", help="print the current list and change nothing")
    rv.add_argument("--timeout", type=float, default=30.0, help="seconds to join, store and confirm")


def cmd_revoke(args: argparse.Namespace) -> int:
    import hivemind

    from node.config import check_peer_maddr
    from security.admission import parse_expires
    from security.keys import RecordRejected, load_key_file, peer_id_str, public_key_of
    from security.records import SignedRecordValidator
    from security.revocation_record import REVOKED_NAMESPACE

    key = load_key_file(args.identity)
    coordinator = peer_id_str(key)
    try:
        peers = [check_peer_maddr(p) for p in args.initial_peers]
        if args.peer_id is not None:
            public_key_of(args.peer_id)
        if not args.list and args.peer_id is None and args.serial is None:
            raise ValueError("say what to revoke: --peer-id ID (every token of that peer), --serial N (one token), "
                             "or both; --list prints the current list")
        if args.serial is not None and not 0 <= args.serial < 2 ** 64:
            raise ValueError(f"--serial {args.serial} is not a token serial (0 <= serial < 2**64)")
        until = parse_expires(args.expires)
    except (ValueError, RecordRejected) as exc:
        raise ConfigError(f"swarmnode revoke: {exc}") from None
    validator = SignedRecordValidator(args.run_id, None, [REVOKED_NAMESPACE], coordinator_peer_id=coordinator)
    try:
        dht = hivemind.DHT(initial_peers=peers, client_mode=True, start=True, host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                           record_validators=[validator], startup_timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - hivemind raises several types here
        print(f"swarmnode revoke: could not join the swarm through {peers}: {str(exc).strip()[:300]}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_revoke(dht, args, key, coordinator, until))
    finally:
        dht.shutdown()


async def _revoke(dht, args: argparse.Namespace, key, coordinator: str, until: int) -> int:
    from hivemind.utils import get_dht_time

    from node.revocation_sync import read_revocations
    from security.revocation import REVOKED_RECORD_TTL_S, RevokedEntry, merge, revoked_key
    from security.revocation_record import signed_record_value

    found, _ = await read_revocations(dht, args.run_id, coordinator, timeout=args.timeout)
    current = list(found.entries) if found is not None else []
    if args.list:
        for e in current:
            print(json.dumps(e.model_dump()))
        print(f"# {len(current)} entries on the revocation list of run {args.run_id!r}", file=sys.stderr)
        return 0
    entry = RevokedEntry(serial=args.serial, peer_id=args.peer_id, until=until, at=int(time.time()),
                         reason=args.reason[:200])
    entries = merge(current, [entry])
    want = (entry.serial, entry.peer_id if entry.serial is None else None)
    deadline = time.monotonic() + args.timeout
    while True:  # store, then read back: a concurrent re-publish by the coordinator node may race us
        expiration = get_dht_time() + REVOKED_RECORD_TTL_S
        value = signed_record_value(key, args.run_id, entries, expiration)
        fut = dht.store(revoked_key(args.run_id), value, expiration, subkey=coordinator, return_future=True)
        stored = bool(await asyncio.wait_for(asyncio.wrap_future(fut), args.timeout))
        await asyncio.sleep(1.0)
        found, _ = await read_revocations(dht, args.run_id, coordinator, timeout=args.timeout)
        have = {(e.serial, e.peer_id if e.serial is None else None) for e in (found.entries if found else [])}
        if stored and want in have:
            break
        if time.monotonic() > deadline:
            print(f"swarmnode revoke: the swarm did not keep the list (stored={stored}); check --initial-peers "
                  "and that --identity is the key of security.coordinator_peer_id, then run it again", file=sys.stderr)
            return 1
        entries = merge(found.entries if found else [], entries)
    print(json.dumps(entry.model_dump()))
    print(f"# revoked {entry.describe()}; {len(entries)} entries on the list. Every node of run {args.run_id!r} "
          "refuses it within security.revocation_refresh_s (10 s by default)", file=sys.stderr)
    return 0
