"""`fleetcuda apply`: converge targets to a recipe; `--check` runs only the read-only checks and says what
would change; `--dry-run` connects to nothing and prints the exact commands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
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
    ap.add_argument("--lock-wait", type=int, default=0, metavar="SECONDS",
                    help="wait this long for another apply's lock on a target (default: refuse at once)")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    inputs = common.load_run_inputs(args)
    if args.dry_run:
        return dry_run(inputs.recipe, inputs.inventory, inputs.targets, inputs.overrides, env)
    common.plan_all(inputs)
    common.check_state(env)  # before anything runs: no run directory, history or report could be made
    return common.execute(inputs, "check" if args.check else "apply", args, [], env)


def dry_run(recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: dict[str, str],
            env: Environment) -> ExitStatus:
    # The planner, not the engine: a dry-run imports nothing that connects (no paramiko), runs or draws.
    import secrets

    from fleetcuda.plan.planner import base_values, make_plan, pending_facts
    from fleetcuda.redact import Redactor
    from fleetcuda.remote.framing import new_nonce

    _home = common.local_home(env)
    out = _AsciiWriter(env.stdout)
    out.write(f"# fleetcuda apply {recipe.path} --dry-run: {len(targets)} target(s) from {inventory.path}\n")
    out.write("# Each command line below can be pasted into bash or zsh; apply sends exactly these, but for the\n"
              "# run id in labels (@...) and the frame nonce, which are new each run. Secrets are read from stdin.\n")
    run_id, nonce = secrets.token_hex(4), new_nonce()
    for t in targets:
        values = base_values(recipe, t, overrides)
        plan = make_plan(recipe, t, values, _home(t), run_id=run_id, nonce=nonce)
        redact = Redactor(plan.secrets)
        out.write(f"\n# target {t.id}{f' ({t.name})' if t.name else ''}\n")
        for name in pending_facts(recipe, values):
            out.write(f"# {name}=auto is read from the target at run time; commands below show it as 'auto'"
                      f" (pass --var {name}=X, or use --check to see them resolved)\n")
        total = len(plan.steps)
        for step in plan.steps:
            head = f"# step {step.index + 1}/{total} {step.name} ({step.kind})"
            if step.skipped:
                out.write(f"{head}: skipped ({step.skipped})\n")
                continue
            phases = [("check", step.check, "exit 0 means already satisfied")]
            if step.shared is not None:
                phases.append(("fingerprint", step.shared.fingerprint,
                               "read-only, if the check fails: the target's ABI fingerprint. A wheel cached for it "
                               "is pushed and installed instead of the apply below; otherwise the first target of "
                               "a fingerprint runs the apply (a wheel build) and the others wait for its wheel"))
            phases += [("apply", step.apply, "runs only if the check fails"),
                       ("verify", step.verify, "must pass after apply")]
            for phase, cmd, note in phases:
                if cmd is not None:
                    out.write(f"{head}: {phase} ({note})\n{redact(cmd.display)}\n")
    return ExitStatus.OK


class _AsciiWriter:
    """stdout for the dry-run: 7-bit whatever the locale (paths from non-UTF-8 bytes, names), so a paste
    survives any terminal."""

    def __init__(self, stream: object):
        self.stream = stream

    def write(self, text: str) -> None:
        self.stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))  # type: ignore[attr-defined]
