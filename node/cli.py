"""The ``swarmnode`` command line. The flag set is small and frozen: new knobs go into the
config tree (``--set section.key=value``, TOML, ``SWARMNODE_*`` env).

    swarmnode demo                                   # a local swarm on 127.0.0.1
    swarmnode bootstrap --host 0.0.0.0 --dht-port 31337
    swarmnode run --role noloco --initial-peers /ip4/203.0.113.10/tcp/31337/p2p/12D3KooW...
    swarmnode status --initial-peers /ip4/203.0.113.10/tcp/31337/p2p/12D3KooW... --json
    swarmnode identity init --path ./identity.key
    swarmnode revoke --identity coordinator.key --run-id myrun --initial-peers MADDR --peer-id 12D3KooW...

Exit codes: 0 clean stop (incl. drain), 1 unexpected error, 2 config/usage error, 3 identity
error, 4 bootstrap gave up (``dht.bootstrap_deadline_s``), 130 second Ctrl-C.
Heavy imports (torch, hivemind) happen only in the subcommands that need them, so
``swarmnode status --local`` stays cheap enough for a container healthcheck.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _node_flags(p: argparse.ArgumentParser, with_role: bool) -> None:
    if with_role:
        p.add_argument("--role", help="an installed role (swarmnode.roles entry points), e.g. bootstrap")
    p.add_argument("--config", help="TOML config file (see deploy/configs/)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of live peers (…/p2p/<peer id>)")
    p.add_argument("--host", help="IP to bind (DHT, gRPC, ops HTTP)")
    p.add_argument("--dht-port", type=int, help="libp2p TCP port (dht.host_port)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (grpc.port)")
    p.add_argument("--metrics-port", type=int, help="ops HTTP port for /metrics, /readyz (ops.port)")
    p.add_argument("--identity", help="Ed25519 key file (identity.path)")
    p.add_argument("--run-id", help="run name (run_id)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, e.g. --set drain.budget_s=15 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in state_dir")
    p.add_argument("--check", action="store_true", help="print the validated effective config and exit")


def _overrides(args: argparse.Namespace, role: str | None) -> dict[str, Any]:
    from node.config import deep_merge, parse_set

    o: dict[str, Any] = {}
    if role:
        o["role"] = role
    if args.initial_peers is not None:
        o.setdefault("dht", {})["initial_peers"] = args.initial_peers
    if args.host is not None:
        o["host"] = args.host
    if args.dht_port is not None:
        o.setdefault("dht", {})["host_port"] = args.dht_port
    if args.grpc_port is not None:
        o.setdefault("grpc", {})["port"] = args.grpc_port
    if args.metrics_port is not None:
        o.setdefault("ops", {})["port"] = args.metrics_port
    if args.identity is not None:
        o.setdefault("identity", {})["path"] = args.identity
    if args.run_id is not None:
        o["run_id"] = args.run_id
    if args.resume:
        o["resume"] = True
    return deep_merge(o, parse_set(args.set))


def cmd_run(args: argparse.Namespace, role: str | None) -> int:
    from node.config import load_config, redacted
    from node.logs import setup_logging, shutdown_logging

    cfg = load_config(args.config, _overrides(args, role or args.role))
    if args.check:
        from node.roles import load_role
        load_role(cfg.role).validate_config(cfg)
        print(json.dumps(redacted(cfg), indent=2))
        return 0
    setup_logging(cfg.log)
    try:
        from node.daemon import run_node
        from node.shm import warn_if_small
        warn_if_small()
        return run_node(cfg)
    finally:
        shutdown_logging()


def cmd_identity(args: argparse.Namespace) -> int:
    from security.keys import generate_key, load_key_file, peer_id_str, write_key_file

    if args.identity_cmd == "init":
        key = generate_key()
        write_key_file(args.path, key, overwrite=args.force)
        print(peer_id_str(key.public_key()))
        return 0
    key = load_key_file(args.path, allow_insecure_mode=True)
    print(peer_id_str(key.public_key()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmnode", description="Node daemon for decentralized training swarms.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    _node_flags(sub.add_parser("run", help="start a node"), with_role=True)
    _node_flags(sub.add_parser("bootstrap", help="start a bootstrap/coordinator node (= run --role bootstrap)"),
                with_role=False)

    st = sub.add_parser("status", help="list the run's live nodes (reads node cards from the DHT)")
    st.add_argument("--initial-peers", nargs="+", metavar="MADDR")
    st.add_argument("--config", help="take initial_peers and run_id from this TOML file")
    st.add_argument("--run-id")
    st.add_argument("--coordinator", metavar="PEER_ID",
                    help="token mode: list only nodes admitted by this coordinator (default: the config's "
                         "security.coordinator_peer_id when security.admission = 'token')")
    st.add_argument("--json", action="store_true",
                    help="print one JSON array with every card detail raw (Unix times, flags); the table is for reading")
    st.add_argument("--watch", action="store_true", help="refresh every 2 s until Ctrl-C")
    st.add_argument("--local", action="store_true", help="ask this host's ops port instead of the DHT")
    st.add_argument("--ready", action="store_true", help="with --local: exit 0 only when the node is READY")
    st.add_argument("--metrics-port", type=int, help="with --local: the node's ops port (default from config)")

    ident = sub.add_parser("identity", help="manage the node's Ed25519 key")
    isub = ident.add_subparsers(dest="identity_cmd", required=True)
    init = isub.add_parser("init", help="write a new key and print its peer ID")
    init.add_argument("--path", required=True)
    init.add_argument("--force", action="store_true", help="overwrite an existing key (changes the peer ID)")
    show = isub.add_parser("show", help="print a key file's peer ID")
    show.add_argument("path")

    admit = sub.add_parser("admit", help="issue an admission token (token mode) and print it base64")
    admit.add_argument("--peer-id", required=True, help="the admitted peer's ID (12D3KooW...)")
    admit.add_argument("--expires", default="24h", help="duration (30m, 24h, 7d) or ISO-8601 time; default 24h")
    admit.add_argument("--roles", "--role", default="", help="comma-separated allowed roles (default: any)")
    admit.add_argument("--identity", required=True, help="the coordinator's Ed25519 key file")
    admit.add_argument("--run-id", required=True)

    from node.revoke_cli import add_parser as add_revoke
    add_revoke(sub)

    demo = sub.add_parser("demo", help="run a whole local swarm on 127.0.0.1")
    demo.add_argument("--role", default=None, help="worker role (default: noloco when installed, else bootstrap)")
    demo.add_argument("--nodes", type=int, default=None, help="number of worker nodes besides the bootstrap")
    demo.add_argument("--steps", type=int, default=None,
                      help="steps per worker (training roles; a NoLoCo inner step, a pipeline iteration, a GRPO round)")
    demo.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    demo.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config for every node")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            if not args.role and not args.config:
                from node.config import installed_roles
                print(f"swarmnode run: pass --role ({', '.join(installed_roles())}) or a --config that sets role",
                      file=sys.stderr)
                return 2
            return cmd_run(args, None)
        if args.cmd == "bootstrap":
            return cmd_run(args, "bootstrap")
        if args.cmd == "identity":
            return cmd_identity(args)
        if args.cmd == "admit":
            from security.admission import cmd_admit
            return cmd_admit(args)
        if args.cmd == "revoke":
            from node.revoke_cli import cmd_revoke
            return cmd_revoke(args)
        if args.cmd == "status":
            from node.status import cmd_status
            return cmd_status(args)
        if args.cmd == "demo":
            from node.demo import cmd_demo
            return cmd_demo(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - map known errors to exit codes with their message
        code = getattr(exc, "exit_code", None)
        if code is None:
            raise
        print(f"swarmnode: {exc}", file=sys.stderr)
        return int(code)
    return 2


if __name__ == "__main__":
    sys.exit(main())
