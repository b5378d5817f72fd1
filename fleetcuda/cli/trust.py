"""`fleetcuda trust`: show a host's SSH key and record it in the inventory's known_hosts; never silently,
never from cron without a fingerprint."""

from __future__ import annotations

import argparse

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    tp = sub.add_parser("trust", help="show a host's SSH key and record it in the inventory's known_hosts")
    tp.add_argument("hosts", nargs="+", metavar="HOST", help="a host name of the inventory (several: each in turn)")
    common.add_inventory_option(tp, env)
    tp.add_argument("--fingerprint", help="record the key only if its SHA256 fingerprint is this one")
    tp.add_argument("--yes", action="store_true",
                    help="record without asking; only together with --fingerprint (never an unseen key)")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.connectors.trust import trust as trust_host  # paramiko: loaded only by the commands that connect
    from fleetcuda.errors import InputError

    hosts = list(dict.fromkeys(args.hosts))
    if args.fingerprint and len(hosts) > 1:
        raise InputError("--fingerprint", None, "", "is one host's key: give one HOST with it (or trust several "
                         "hosts interactively, each key shown and confirmed)")
    # Each host in turn (each key shown, and confirmed or matched); the worst outcome is the exit status.
    return ExitStatus(max(trust_host(args.inventory, host, expected=args.fingerprint, yes=args.yes,
                                     stdin=env.stdin, out=env.stdout, err=env.stderr) for host in hosts))
