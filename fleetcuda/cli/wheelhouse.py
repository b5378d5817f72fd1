"""`fleetcuda wheelhouse`: stage wheels and sdists for offline targets (build), and put them there (push)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.errors import FleetcudaError, HostKeyError, InputError, UnreachableError
from fleetcuda.results import ExitStatus
from fleetcuda.run.wheelhouse import DEFAULT_DEST


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    wp = sub.add_parser("wheelhouse", help="stage wheels and sdists for offline targets, and put them there")
    wsub = wp.add_subparsers(dest="wheelhouse_command", required=True, parser_class=type(wp))
    wb = wsub.add_parser("build", help="pip download the recipe's `wheelhouse:` packages into DIR")
    wb.add_argument("recipe")
    wb.add_argument("dir")
    wb.add_argument("--var", action="append", default=[], metavar="K=V")
    wb.add_argument("--python", default=sys.executable, help="interpreter that runs pip (needs torch for sdists)")
    wb.add_argument("--python-version", help="the targets' Python, e.g. 3.12 (default: this one's)")
    wb.add_argument("--platform", action="append", default=[], help="e.g. manylinux_2_28_x86_64 (repeatable)")
    wb.add_argument("--pip-arg", action="append", default=[], help="extra pip argument (repeatable)")
    wpush = wsub.add_parser("push", help="copy DIR's wheels and sdists onto the targets")
    wpush.add_argument("dir")
    common.add_inventory_option(wpush, env)
    wpush.add_argument("--limit")
    wpush.add_argument("--dest", default=DEFAULT_DEST, help=f"directory on the targets (default {DEFAULT_DEST})")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.connectors.base import TransportPool
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.recipe import load_recipe, parse_var_overrides
    from fleetcuda.run.wheelhouse import files_of, plan_download, push, run_download, sha256

    def echo(line: str) -> None:
        print(line, file=env.stdout)

    try:
        if args.wheelhouse_command == "build":
            recipe = load_recipe(args.recipe)
            values = {**recipe.defaults, **parse_var_overrides(args.var)}
            dest = Path(args.dir)
            if dest.exists() and not dest.is_dir():
                raise InputError("wheelhouse build", None, "DIR", f"{dest} is not a directory")
            dest.mkdir(parents=True, exist_ok=True)
            plan = plan_download(recipe, values, dest, python=args.python, python_version=args.python_version,
                                 platforms=args.platform, pip_args=args.pip_arg)
            run_download(plan, echo)
            for f in files_of(dest):
                echo(f"{sha256(f)}  {f.name}")
            return ExitStatus.OK
        inventory = load_inventory(args.inventory)
        targets = inventory.select(args.limit)
        files = files_of(Path(args.dir))
    except InputError:
        raise  # reported by main(), exit 2
    except FleetcudaError as exc:
        print(f"fleetcuda: {exc}", file=env.stderr)
        return ExitStatus.FAILED
    pool = TransportPool(common.transport_factory(inventory))
    code = ExitStatus.OK
    try:
        for t in targets:
            try:
                push(t, pool.get(t.host), files, args.dest, echo)
            except (UnreachableError, HostKeyError) as exc:
                print(f"fleetcuda: {t.id}: {exc}", file=env.stderr)
                code = max(code, ExitStatus.UNREACHABLE) if code != ExitStatus.FAILED else code
            except FleetcudaError as exc:
                print(f"fleetcuda: {exc}", file=env.stderr)
                code = ExitStatus.FAILED
    finally:
        pool.close()
    return code
