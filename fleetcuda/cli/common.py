"""What several commands share: their common options, loading a run's inputs, the transport factory, and
running the engine to the end (reports, history).

Module-level imports stay light (the parser is built from every command module, for `--help` too); what
loads recipes, connects or draws is imported by the functions that do it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleetcuda.cli.environment import Environment
from fleetcuda.errors import InputError
from fleetcuda.results import ExitStatus

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from rich.console import Console

    from fleetcuda.connectors.base import Transport
    from fleetcuda.plan.inventory import Inventory, Target
    from fleetcuda.plan.planner import RunPlan
    from fleetcuda.plan.recipe import Recipe
    from fleetcuda.reports.formats import RunInfo
    from fleetcuda.results import TargetResult
    from fleetcuda.run.engine import Engine

# Said in --help; the rule is fleetcuda.state.inventory_path (applied once, in cli._main).
INVENTORY_HELP = "inventory file (default $FLEETCUDA_INVENTORY, else ~/.config/fleetcuda/inventory.yaml)"


def reporters() -> dict[str, Callable[[RunInfo, list[TargetResult]], str]]:
    """The report formats of `verify --format/--report`, by name (imported when a verify needs them)."""
    from fleetcuda.reports.formats import to_json, to_junit, to_prometheus

    return {"json": to_json, "junit": to_junit, "prometheus": to_prometheus}


def add_inventory_option(sp: argparse.ArgumentParser, env: Environment, *, with_help: bool = False) -> None:
    if with_help:
        sp.add_argument("-i", "--inventory", default=None, help=INVENTORY_HELP)
    else:
        sp.add_argument("-i", "--inventory", default=None)


def add_run_options(sp: argparse.ArgumentParser, env: Environment) -> None:
    """The options of the commands that run a recipe on targets (apply, verify)."""
    sp.add_argument("recipe", help="recipe file, e.g. recipes/gdn-fastpath.yaml")
    add_inventory_option(sp, env, with_help=True)
    sp.add_argument("--limit", help="targets: host, host/vmid, group, container name or glob; "
                                    "comma-separated; !pattern excludes")
    sp.add_argument("--var", action="append", default=[], metavar="K=V", help="override a variable")
    sp.add_argument("--forks", type=int, default=8, help="targets run at once (default 8)")
    sp.add_argument("--plain", action="store_true", help="plain timestamped lines even on a terminal")
    sp.add_argument("--show-output", action="store_true", help="stream remote output lines (plain mode)")
    sp.add_argument("--table", action="store_true",
                    help="off a terminal or with --plain, print the full table too (default: drift, failures "
                         "and one summary line)")


@dataclass(frozen=True)
class RunInputs:
    """A run's recipe, inventory, the targets --limit selected, and the --var overrides."""

    recipe: Recipe
    inventory: Inventory
    targets: list[Target]
    overrides: dict[str, str]


def load_run_inputs(args: argparse.Namespace) -> RunInputs:
    """Load and check, in this order (the first bad one is the error shown): --forks, the recipe, the
    inventory, --limit, --var."""
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.recipe import load_recipe, parse_var_overrides

    if args.forks < 1:
        raise InputError("--forks", None, "", "must be at least 1")
    recipe = load_recipe(args.recipe)
    inventory = load_inventory(args.inventory)
    targets = inventory.select(args.limit)
    return RunInputs(recipe, inventory, targets, parse_var_overrides(args.var))


def plan_all(inputs: RunInputs, env: Environment) -> RunPlan:
    """Plan every target now, once: a recipe that cannot be rendered is bad input before anything runs, and the
    engine runs these plans (a target with `auto` facts is planned again once they are read)."""
    import secrets

    from fleetcuda.plan.planner import plan_run
    from fleetcuda.remote.framing import new_nonce

    return plan_run(inputs.recipe, inputs.targets, inputs.overrides, local_home(env), secrets.token_hex(4),
                    new_nonce())


def check_state(env: Environment) -> Path:
    """The state directory, refused as bad input (named as the user set it) if no run directory, history or
    report could be made there."""
    from fleetcuda.reports.history import check_state_dir

    try:
        return check_state_dir(env.state_dir)
    except InputError as exc:
        raise InputError(env.state_dir_source, exc.line, exc.field, exc.message) from None


def local_home(env: Environment) -> Callable[[Target], str | None]:
    def home(target: Target) -> str | None:
        # A local target's HOME is this user's; containers and SSH hosts get theirs from the planner.
        if target.spec.kind == "local" and target.container is None:
            return str(env.home)
        return None

    return home


def transport_factory(inventory: Inventory) -> Callable[[str], Transport]:
    def factory(host: str) -> Transport:
        from fleetcuda.connectors.base import LocalTransport

        spec = inventory.spec.hosts[host]
        if spec.kind == "local":
            return LocalTransport()
        from fleetcuda.connectors.ssh import SshTransport  # paramiko: loaded only when a host needs it

        target = next(t for t in inventory.targets if t.host == host)
        assert target.chain.ssh is not None
        return SshTransport(target.chain.ssh)

    return factory


def execute(inputs: RunInputs, mode: str, args: argparse.Namespace, reports: list[tuple[str, str | None]],
            env: Environment, planned: RunPlan | None = None) -> ExitStatus:
    """Run the engine over the targets (mode apply, check or verify), then report and record the run."""
    import signal

    from fleetcuda.connectors.base import TransportPool
    from fleetcuda.reports.live import PlainReporter, Reporter, RichReporter
    from fleetcuda.run.engine import Engine, make_run_dir
    from fleetcuda.run.locks import TargetLock, run_owner
    from fleetcuda.run.rollout import batches

    recipe, targets = inputs.recipe, inputs.targets
    # A report on stdout keeps stdout for itself: progress and the summary go to stderr then.
    to_stdout = any(path is None for _, path in reports)
    console = env.console(stderr=to_stdout)
    reporter: Reporter
    if console.is_terminal and not args.plain:
        reporter = RichReporter(console)
    else:
        from fleetcuda.reports.plain import plain_console

        # Plain lines to the end (the summary too, with --plain on a terminal): unwrapped, stamped.
        stream = env.stderr if to_stdout else env.stdout
        console = plain_console(stream, env.environ, stderr=to_stdout, clock=env.clock)
        reporter = PlainReporter(stream=stream, show_output=args.show_output, brief=mode == "verify")
    run_dir = make_run_dir(mode, recipe.name, env.state_dir)
    pool = TransportPool(transport_factory(inputs.inventory))
    lock = TargetLock(run_owner(), wait_s=getattr(args, "lock_wait", 0)) if mode == "apply" else None
    canary, serial = getattr(args, "canary", None), getattr(args, "serial", None)  # apply's (run/rollout.py)
    rollout = batches(targets, canary, serial) if mode == "apply" else None
    engine = Engine(recipe, targets, inputs.overrides, mode, pool, reporter, run_dir,  # type: ignore[arg-type]
                    forks=args.forks, home=local_home(env), lock=lock, planned=planned, rollout=rollout)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Handlers can only be set from the main thread: the CLI's, as a command runs there.
    previous = signal.signal(signal.SIGTERM, on_term)
    # Also when started with SIGINT ignored (a background job of a script): a run that is told to stop must
    # stop its remote steps and release its locks, never keep going, nor die without cleaning up.
    previous_int = signal.signal(signal.SIGINT, on_term)
    # And when the terminal goes away (SIGHUP): by default Python just dies, leaving the lock and the step.
    previous_hup = signal.signal(signal.SIGHUP, on_term)
    started = env.clock()
    try:
        reporter.start(mode, recipe.path, [t.id for t in targets])
        try:
            results = engine.run()
        finally:
            reporter.stop()
        return finish(engine, results, inputs, mode, args, reports, console, started, run_dir, env)
    finally:
        # After an interruption the engine ignores further signals until the run is recorded: now it is.
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGHUP, previous_hup)


def finish(engine: Engine, results: list[TargetResult], inputs: RunInputs, mode: str, args: argparse.Namespace,
           reports: list[tuple[str, str | None]], console: Console, started: datetime, run_dir: Path,
           env: Environment) -> ExitStatus:
    """What a run ends with: the interrupted targets, the table or summary, each report, the history record
    and where the logs are; the exit status (a report that could not be written fails an ok run)."""
    from fleetcuda.redact import printable
    from fleetcuda.reports.formats import RunInfo, render_table, summary_line, write_atomically
    from fleetcuda.reports.history import record
    from fleetcuda.reports.live import summary
    from fleetcuda.results import exit_code
    from fleetcuda.run.prune import prune_after_run

    render_report = reporters()
    recipe, inventory = inputs.recipe, inputs.inventory
    if engine.interrupted:
        console.print("[magenta]interrupted[/]: what had run, and what was stopped on each target:")
        for line in engine_results_snapshot(engine, inputs.targets):
            console.print(f"  {printable(line)}", markup=False, highlight=False)  # its log's words: data
    code = exit_code(results, detailed=mode == "check" and getattr(args, "detailed_exitcode", False))
    info = RunInfo(mode=mode, recipe_path=recipe.path, recipe_name=recipe.name, inventory_path=inventory.path,
                   started_at=started, finished_at=env.clock(), exit_code=code, run_dir=str(run_dir))
    # Off a terminal (cron, a pipe, --plain): drift, failures and one summary line; the table with --table.
    plain = not console.is_terminal
    table = not plain or args.table
    if mode == "verify" and args.format == "table":
        render_table(info, results, console, table=table)
    else:
        summary(results, console, table=table)
    # Each output is written whatever happened to the one before: a report that cannot be written must not
    # cost the history record, nor the history the report.
    for fmt, path in reports:
        text = render_report[fmt](info, results)
        try:
            if path is None:
                env.stdout.write(text)
            else:
                # node_exporter's textfile collector runs as another user: a metrics file must be readable.
                write_atomically(path, text, mode=0o644 if fmt == "prometheus" else 0o600)
        except OSError as exc:
            env.say(f"fleetcuda: could not write the {fmt} report to {path}: {exc}")
            code = ExitStatus.FAILED if code in (ExitStatus.OK, ExitStatus.WOULD_CHANGE) else code
    if mode != "check" and not getattr(args, "no_history", False):
        try:
            record(env.history_path, info, results, on_error=lambda m: env.say(f"fleetcuda: warning: {m}"))
        except Exception as exc:  # sqlite3.Error, OSError: the run's result stands; say what was not kept
            env.say(f"fleetcuda: warning: this run was not recorded in {env.history_path}: {exc}")
    if mode == "verify" and args.format == "table":
        pass  # the table's summary line already says where the logs are
    elif plain:
        console.print(summary_line(info, results), markup=False, highlight=False)
    else:
        console.print(f"logs: {run_dir}", markup=False, highlight=False, soft_wrap=True)
    # Run-log retention: the runs directory does not grow without end (a nightly job applies it every night).
    for note in prune_after_run(env.state_dir, keep=run_dir, environ=env.environ):
        env.say(f"fleetcuda: {note}")
    return code


def engine_results_snapshot(engine: Engine, targets: list[Target]) -> list[str]:
    """Per target: the last step its log says was started, and what the engine stopped."""
    lines = []
    for t in targets:
        log = engine.run_dir / (t.id.replace("/", "_") + ".log")
        done = []
        if log.exists():
            text = log.read_text().splitlines()
            done = [ln[3:].strip() for ln in text if ln.startswith("## ") and " exit " not in ln]
        last = f"last started: {done[-1]}" if done else "nothing ran"
        lines.append(f"{t.id}: {last}" + (f"; {engine.stopped[t.id]}" if t.id in engine.stopped else ""))
    return lines
