"""`fleetcuda verify`: run only checks and verifications (read-only), report drift, write reports and
record the run in the history."""

from __future__ import annotations

import argparse

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.errors import InputError
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    vp = sub.add_parser("verify", help="run only checks and verifications (read-only); report drift")
    common.add_run_options(vp, env)
    vp.add_argument("--format", choices=["table", "json", "junit", "prometheus"], default="table",
                    help="report format (default: table); progress then goes to stderr")
    vp.add_argument("--output", help="write the report to this file (atomically) instead of stdout")
    vp.add_argument("--report", action="append", default=[], metavar="FORMAT=PATH",
                    help="also write a json, junit or prometheus report to PATH (repeatable)")
    vp.add_argument("--no-history", action="store_true", help="do not record this run in the history database")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    inputs = common.load_run_inputs(args)
    planned = common.plan_all(inputs, env)
    common.check_state(env)  # before anything runs: no run directory, history or report could be made
    reports = report_targets(args, env)
    return common.execute(inputs, "verify", args, reports, env, planned)


def report_targets(args: argparse.Namespace, env: Environment) -> list[tuple[str, str | None]]:
    """(format, path or None for stdout) for each report this verify run writes."""
    from fleetcuda.reports.history import check_output_path

    out: list[tuple[str, str | None]] = []
    # Report paths are checked now: a report that cannot be written after the run is lost, and so is its history.
    if args.format != "table":
        if args.output:
            check_output_path("--output", args.output)
        out.append((args.format, args.output))
    elif args.output:
        raise InputError("--output", None, "", "needs --format json, junit or prometheus")
    for item in args.report:
        fmt, sep, path = item.partition("=")
        if not sep or fmt not in common.reporters() or not path:
            shown = item[:60] if item[:60].isprintable() else ascii(item[:60])
            raise InputError("--report", None, shown, "expected FORMAT=PATH with FORMAT json, junit or prometheus")
        check_output_path("--report", path)
        out.append((fmt, path))
    common.check_state(env)  # where the run's logs and history go
    return out
