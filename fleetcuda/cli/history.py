"""`fleetcuda history`: recent verify runs, and what changed per target since the run before. Reads the
history database only: no recipe, inventory or connection, so none of their modules are imported."""

from __future__ import annotations

import argparse
import dataclasses
import json

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    hp = sub.add_parser("history", help="recent verify runs, and what changed per target since the run before")
    hp.add_argument("--limit", help="targets: comma-separated globs; !glob excludes")
    hp.add_argument("--runs", type=int, default=10, help="how many recent runs to list (default 10)")
    hp.add_argument("--format", choices=["table", "json"], default="table")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.reports.history import HistoryError, changes, recent_runs, render_history

    common.check_state(env)
    path = env.history_path
    try:
        runs = recent_runs(path, limit=args.runs, target_pattern=args.limit)
        diffs = changes(path, target_pattern=args.limit)
    except HistoryError as exc:
        print(f"fleetcuda: {exc}", file=env.stderr)
        return ExitStatus.FAILED
    if args.format == "json":
        print(json.dumps({"history": str(path), "runs": [_plain(r) for r in runs],
                          "changes": [_plain(c) for c in diffs]}, indent=2, default=str), file=env.stdout)
        return ExitStatus.OK
    console = env.console()
    if not runs:
        console.print(f"no runs recorded in {path}", markup=False)
        return ExitStatus.OK
    render_history(runs, console, title=f"recent runs ({path})")
    render_history(diffs, console, title="changes since each target's previous verify")
    return ExitStatus.OK


def _plain(row: object) -> dict[str, object]:
    return dataclasses.asdict(row)  # type: ignore[call-overload]
