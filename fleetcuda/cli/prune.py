"""`fleetcuda prune`: remove old run logs (run directories under the state directory), keeping the newest."""

from __future__ import annotations

import argparse

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.errors import InputError
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    from fleetcuda.run.prune import KEEP_DAYS, KEEP_RUNS  # standard library only: --help stays light

    pp = sub.add_parser("prune", help=f"remove run logs older than {KEEP_DAYS} days (what every run does when it "
                                      f"ends), keeping the {KEEP_RUNS} newest")
    pp.add_argument("--older-than", type=float, metavar="DAYS",
                    help=f"age in days (default: $FLEETCUDA_KEEP_DAYS, else {KEEP_DAYS})")
    pp.add_argument("--keep", type=int, default=KEEP_RUNS, metavar="N",
                    help=f"never remove the N newest runs (default {KEEP_RUNS})")
    pp.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.run.prune import default_days, prune_runs

    days = args.older_than if args.older_than is not None else default_days(env.environ)
    if days < 0:
        raise InputError("--older-than", None, str(days), "must be 0 or more days")
    if args.keep < 0:
        raise InputError("--keep", None, str(args.keep), "must be 0 or more runs")
    state = common.check_state(env)
    removed = prune_runs(state, older_than_days=days, keep_runs=args.keep, dry_run=args.dry_run)
    for p in removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {p.path} ({p.age_days:.0f} days old)", file=env.stdout)
    print(f"{len(removed)} run(s) {'would be removed' if args.dry_run else 'removed'} from {state / 'runs'} "
          f"(older than {days:g} days; the {args.keep} newest are always kept)", file=env.stdout)
    return ExitStatus.OK
