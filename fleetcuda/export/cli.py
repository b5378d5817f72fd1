"""`fleetcuda export ansible RECIPE [-i INVENTORY] [--limit P] [--var K=V] -o DIR`.

Wired into fleetcuda's CLI through add_parser() and run(); `python -m fleetcuda.export.cli ansible ...` runs
it on its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from fleetcuda.errors import InputError

INVENTORY_HELP = "inventory file (default $FLEETCUDA_INVENTORY, else ~/.config/fleetcuda/inventory.yaml)"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("recipe", help="recipe file, e.g. recipes/gdn-fastpath.yaml")
    ap.add_argument("-i", "--inventory", default=None, help=INVENTORY_HELP)
    ap.add_argument("--limit", help="targets: host, host/vmid, group, container name or glob; comma-separated; "
                                    "!pattern excludes")
    ap.add_argument("--var", action="append", default=[], metavar="K=V", help="override a variable")
    ap.add_argument("-o", "--output", required=True, metavar="DIR",
                    help="directory to write the Ansible project to (new, empty, or a previous export)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`export` with its one format, `ansible`; sets args.export_format."""
    ep = subparsers.add_parser("export", help="write a recipe and its targets as another tool's project")
    formats = ep.add_subparsers(dest="export_format", required=True, parser_class=type(ep))
    ap = formats.add_parser("ansible", help="an Ansible project (inventory, site.yml, verify.yml) for "
                                            "ansible-playbook or AWX")
    add_arguments(ap)
    return ep


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Raises InputError (exit 2 in fleetcuda's error boundary) for bad input; returns 0."""
    # Imported here: `fleetcuda --help` builds this parser and must not load pydantic or yaml.
    from fleetcuda.export.ansible import render_project
    from fleetcuda.export.writer import write_project
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.recipe import load_recipe, parse_var_overrides

    if args.limit is not None and not args.limit.strip(" ,\t"):
        raise InputError("--limit", None, repr(args.limit), "is empty: name hosts, groups, containers or globs")
    from fleetcuda.state import inventory_path

    args.inventory = inventory_path(args.inventory)  # (fleetcuda's CLI has resolved it already)
    recipe = load_recipe(args.recipe)
    inventory = load_inventory(args.inventory)
    targets = inventory.select(args.limit)
    files = render_project(recipe, inventory, targets, parse_var_overrides(args.var), args.recipe, args.inventory)
    dest = Path(args.output)
    write_project(dest, files)
    print(f"fleetcuda: exported {len(targets)} target(s) of {recipe.name} to {dest}: "
          f"ansible-playbook -i inventory.yml site.yml (see {dest / 'README.md'})", file=out or sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetcuda")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except InputError as exc:
        print(f"fleetcuda: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
