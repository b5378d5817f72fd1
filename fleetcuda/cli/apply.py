"""`fleetcuda apply`: converge targets to a recipe; `--check` runs only the read-only checks and says what
would change; `--dry-run` connects to nothing and prints the exact commands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.errors import InputError
from fleetcuda.results import ExitStatus

if TYPE_CHECKING:
    from fleetcuda.plan.inventory import Inventory, Target
    from fleetcuda.plan.recipe import Recipe


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    ap = sub.add_parser("apply", help="converge targets to a recipe")
    common.add_run_options(ap, env)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="connect to nothing; print the exact commands")
    mode.add_argument("--check", action="store_true", help="run only the read-only checks; say what would change")
    ap.add_argument("--format", choices=["human", "shell", "json"], default=None,
                    help="with --dry-run: human (default: to review), shell (lines to paste into bash or zsh), "
                         "json (the plan as data, schema fleetcuda.plan/1; see docs/dry-run.md)")
    ap.add_argument("--lock-wait", type=int, default=0, metavar="SECONDS",
                    help="wait this long for another apply's lock on a target (default: refuse at once)")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    inputs = common.load_run_inputs(args)
    if args.dry_run:
        return dry_run(inputs.recipe, inputs.inventory, inputs.targets, inputs.overrides, env,
                       args.format or "human", args.lock_wait)
    if args.format is not None:
        raise InputError("--format", None, args.format, "only goes with --dry-run")
    planned = common.plan_all(inputs, env)
    common.check_state(env)  # before anything runs: no run directory, history or report could be made
    return common.execute(inputs, "check" if args.check else "apply", args, [], env, planned)


def dry_run(recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: dict[str, str],
            env: Environment, fmt: str = "human", lock_wait_s: int = 0) -> ExitStatus:
    # The planner, not the engine: a dry-run imports nothing that connects (no paramiko), runs or draws.
    import secrets

    from fleetcuda.plan import view
    from fleetcuda.remote import catalog
    from fleetcuda.remote.framing import new_nonce
    from fleetcuda.run.locks import run_owner

    programs = {name: program.text for name, program in catalog().items()}
    # render() returns 7-bit ASCII and redacts every secret of every target.
    env.stdout.write(view.render(fmt, recipe, inventory, targets, overrides, common.local_home(env),  # type: ignore[arg-type]
                                 programs, run_id=secrets.token_hex(4), nonce=new_nonce(), lock_owner=run_owner(),
                                 lock_wait_s=lock_wait_s))
    return ExitStatus.OK
