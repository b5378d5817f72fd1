"""`fleetcuda apply`: converge targets to a recipe; `--check` runs only the read-only checks and says what
would change (`--detailed-exitcode`: exit 4 when something would); `--dry-run` connects to nothing and prints
what apply would do (`--verbose`: every exact command; `--format shell|json`). `--canary N` and `--serial K`
roll out in batches (run/rollout.py): a batch that does not fully succeed stops the rest."""

from __future__ import annotations

import argparse
import re
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
    mode.add_argument("--dry-run", action="store_true",
                      help="connect to nothing; print what apply would do, one line or a few per step (--verbose: "
                           "every exact command)")
    mode.add_argument("--check", action="store_true", help="run only the read-only checks; say what would change")
    ap.add_argument("--format", choices=["human", "shell", "json"], default=None,
                    help="with --dry-run: human (default: to review), shell (lines to paste into bash or zsh), "
                         "json (the plan as data, schema fleetcuda.plan/1; see docs/dry-run.md)")
    ap.add_argument("--detailed-exitcode", action="store_true",
                    help=f"with --check: exit {int(ExitStatus.WOULD_CHANGE)} when nothing failed and some step would "
                         "change (0: nothing would change), as terraform plan -detailed-exitcode")
    ap.add_argument("--verbose", action="store_true",
                    help="with --dry-run (human format): every round trip's full script, environment and label, "
                         "instead of one line per step")
    ap.add_argument("--lock-wait", type=int, default=0, metavar="SECONDS",
                    help="wait this long for another apply's lock on a target (default: refuse at once)")
    ap.add_argument("--canary", type=target_count, default=None, metavar="N",
                    help="converge the first N targets (inventory order, after --limit) first; if any of them does "
                         "not end ok or changed, start no other target")
    ap.add_argument("--serial", type=target_count, default=None, metavar="K",
                    help="converge at most K targets per batch (after the canary batch); a batch that does not "
                         "fully succeed stops the later ones")


def target_count(text: str) -> int:
    """--canary and --serial: a whole number of targets, at least 1 (argparse says which option was wrong)."""
    if not re.fullmatch(r"[0-9]{1,9}", text) or int(text) < 1:
        shown = text[:40] if text[:40].isprintable() else ascii(text[:40])
        raise argparse.ArgumentTypeError(f"expected a number of targets, 1 or more (got '{shown}')")
    return int(text)


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    rolling = rollout_option(args)
    if rolling and args.check:
        raise InputError(rolling, None, "", "does not go with --check: a check changes nothing, so there is "
                                            "nothing to roll out (--dry-run shows the batches)")
    if rolling and args.dry_run and args.format == "json":
        raise InputError(rolling, None, "", "with --dry-run, the batches are shown by --format human or shell, "
                                            "not json")
    if args.detailed_exitcode and not args.check:
        raise InputError("--detailed-exitcode", None, "", "only goes with --check (apply changes what would change; "
                                                         "a dry-run contacts nothing)")
    if args.verbose and not (args.dry_run and args.format in (None, "human")):
        raise InputError("--verbose", None, "", "only goes with --dry-run's human format (shell and json are "
                                                "complete already)")
    inputs = common.load_run_inputs(args)
    if args.dry_run:
        return dry_run(inputs.recipe, inputs.inventory, inputs.targets, inputs.overrides, env,
                       args.format or "human", args.lock_wait, args.canary, args.serial, verbose=args.verbose)
    if args.format is not None:
        raise InputError("--format", None, args.format, "only goes with --dry-run")
    planned = common.plan_all(inputs, env)
    common.check_state(env)  # before anything runs: no run directory, history or report could be made
    return common.execute(inputs, "check" if args.check else "apply", args, [], env, planned)


def rollout_option(args: argparse.Namespace) -> str | None:
    """The rollout options given, as the user wrote them ("--canary", "--canary/--serial"), else None."""
    given = [name for name in ("--canary", "--serial") if getattr(args, name[2:]) is not None]
    return "/".join(given) or None


def rollout_header(targets: list[Target], canary: int | None, serial: int | None) -> list[str]:
    """The dry-run's lines that say which targets apply converges in which batch (nothing without the options)."""
    from fleetcuda.plan.view import ascii_line, wrap
    from fleetcuda.run.rollout import batches

    if canary is None and serial is None:
        return []
    plan = batches(targets, canary, serial)
    options = " ".join(f"--{name} {n}" for name, n in (("canary", canary), ("serial", serial)) if n is not None)
    lines = [f"# Rollout ({options}): {len(plan)} batch(es), in this order; a batch starts only once every",
             "# target of the one before ended ok or changed, else the targets of the later batches are not-run."]
    for batch in plan:
        lines += wrap("#   ", ascii_line(f"{batch.name}: {', '.join(t.id for t in batch.targets)}"), "#     ")
    return lines


def summary_width(env: Environment) -> int:
    """The summary's line width: the terminal's (60 to 120 columns) when stdout is one, else 100."""
    import os

    if env.stdout_is_terminal:
        try:
            columns = os.get_terminal_size(env.stdout.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        if columns:
            return max(60, min(120, columns))
    return 100


def dry_run(recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: dict[str, str],
            env: Environment, fmt: str = "human", lock_wait_s: int = 0, canary: int | None = None,
            serial: int | None = None, *, verbose: bool = False) -> ExitStatus:
    # The planner, not the engine: a dry-run imports nothing that connects (no paramiko), runs or draws.
    import secrets

    from fleetcuda.plan import view
    from fleetcuda.remote import catalog
    from fleetcuda.remote.framing import new_nonce
    from fleetcuda.run.locks import run_owner

    programs = {name: program.text for name, program in catalog().items()}
    # render() returns 7-bit ASCII and redacts every secret of every target.
    text = view.render(fmt, recipe, inventory, targets, overrides, common.local_home(env),  # type: ignore[arg-type]
                       programs, run_id=secrets.token_hex(4), nonce=new_nonce(), lock_owner=run_owner(),
                       lock_wait_s=lock_wait_s, verbose=verbose, width=summary_width(env))
    rollout = rollout_header(targets, canary, serial)
    if rollout:  # at the end of the header (its first blank line): `#` comments, in the shell format too
        head, blank, rest = text.partition("\n\n")
        text = head + "\n" + "\n".join(rollout) + blank + rest
    env.stdout.write(text)
    return ExitStatus.OK
