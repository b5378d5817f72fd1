"""Command line: `fleetcuda apply` and `fleetcuda verify`.

Exit codes: 0 success; 1 a target failed (or drifted, for verify); 2 bad input (inventory,
recipe, arguments); 3 a target unreachable (and none failed); 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import signal
import sys
import traceback
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from fleetcuda import __version__
from fleetcuda.connectors.base import LocalTransport, Transport, TransportPool
from fleetcuda.errors import FleetcudaError, HostKeyError, InputError, UnreachableError
from fleetcuda.plan.inventory import Inventory, Target, load_inventory
from fleetcuda.plan.planner import base_values, make_plan, pending_facts
from fleetcuda.plan.recipe import Recipe, load_recipe, parse_var_overrides
from fleetcuda.redact import Redactor
from fleetcuda.remote.framing import new_nonce
from fleetcuda.reports.formats import RunInfo, render_table, to_json, to_junit, to_prometheus, write_atomically
from fleetcuda.reports.history import (
    HistoryError,
    changes,
    check_output_path,
    check_state_dir,
    default_history_path,
    recent_runs,
    record,
    render_history,
)
from fleetcuda.reports.live import PlainReporter, Reporter, RichReporter, summary
from fleetcuda.results import ExitStatus
from fleetcuda.run import doctor
from fleetcuda.run.engine import Engine, exit_code, make_run_dir, state_dir
from fleetcuda.run.locks import TargetLock, run_owner
from fleetcuda.run.schedule import (
    ScheduleError,
    cron_line,
    install_cron,
    install_systemd,
    remove_cron,
    remove_systemd,
    show_cron,
    show_systemd,
)
from fleetcuda.run.wheelcache import CacheEntry, Problem, WheelCache, render_cache
from fleetcuda.run.wheelhouse import DEFAULT_DEST, files_of, plan_download, push, run_download, sha256

DEFAULT_INVENTORY = "inventories/example.yaml"
EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_UNREACHABLE, EXIT_INTERRUPTED = (
    ExitStatus.OK, ExitStatus.FAILED, ExitStatus.INPUT, ExitStatus.UNREACHABLE, ExitStatus.INTERRUPTED)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"fleetcuda: error: {message}", file=sys.stderr)
        sys.exit(EXIT_INPUT)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fleetcuda", description="Provision and verify CUDA build toolchains in Proxmox LXC "
                                              "containers over SSH.")
    p.add_argument("--version", action="version", version=f"fleetcuda {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("recipe", help="recipe file, e.g. recipes/gdn-fastpath.yaml")
        sp.add_argument("-i", "--inventory", default=os.environ.get("FLEETCUDA_INVENTORY", DEFAULT_INVENTORY),
                        help=f"inventory file (default {DEFAULT_INVENTORY})")
        sp.add_argument("--limit", help="targets: host, host/vmid, group, container name or glob; "
                                        "comma-separated; !pattern excludes")
        sp.add_argument("--var", action="append", default=[], metavar="K=V", help="override a variable")
        sp.add_argument("--forks", type=int, default=8, help="targets run at once (default 8)")
        sp.add_argument("--plain", action="store_true", help="plain timestamped lines even on a terminal")
        sp.add_argument("--show-output", action="store_true", help="stream remote output lines (plain mode)")

    ap = sub.add_parser("apply", help="converge targets to a recipe")
    common(ap)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="connect to nothing; print the exact commands")
    mode.add_argument("--check", action="store_true", help="run only the read-only checks; say what would change")
    ap.add_argument("--lock-wait", type=int, default=0, metavar="SECONDS",
                    help="wait this long for another apply's lock on a target (default: refuse at once)")

    vp = sub.add_parser("verify", help="run only checks and verifications (read-only); report drift")
    common(vp)
    vp.add_argument("--format", choices=["table", "json", "junit", "prometheus"], default="table",
                    help="report format (default: table); progress then goes to stderr")
    vp.add_argument("--output", help="write the report to this file (atomically) instead of stdout")
    vp.add_argument("--report", action="append", default=[], metavar="FORMAT=PATH",
                    help="also write a json, junit or prometheus report to PATH (repeatable)")
    vp.add_argument("--no-history", action="store_true", help="do not record this run in the history database")

    hp = sub.add_parser("history", help="recent verify runs, and what changed per target since the run before")
    hp.add_argument("--limit", help="targets: comma-separated globs; !glob excludes")
    hp.add_argument("--runs", type=int, default=10, help="how many recent runs to list (default 10)")
    hp.add_argument("--format", choices=["table", "json"], default="table")

    sp = sub.add_parser("schedule", help="install, show or remove the nightly `fleetcuda verify` job")
    sp.add_argument("action", choices=["install", "show", "remove"])
    sp.add_argument("recipe", nargs="?", help="recipe to verify (for install)")
    sp.add_argument("-i", "--inventory", default=os.environ.get("FLEETCUDA_INVENTORY", DEFAULT_INVENTORY))
    sp.add_argument("--limit")
    sp.add_argument("--name", default="nightly", help="job name, so several can coexist (default nightly)")
    sp.add_argument("--at", default="0 3 * * *", help="cron schedule (default: 03:00 every night)")
    sp.add_argument("--on-calendar", default="*-*-* 03:00:00", help="systemd OnCalendar (with --systemd)")
    sp.add_argument("--systemd", action="store_true", help="a systemd timer instead of a cron entry")
    sp.add_argument("--unit-dir", default="/etc/systemd/system")
    sp.add_argument("--reports-dir", help="where reports and the log go (default: the state directory)")

    wp = sub.add_parser("wheelhouse", help="stage wheels and sdists for offline targets, and put them there")
    wsub = wp.add_subparsers(dest="wheelhouse_command", required=True, parser_class=_Parser)
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
    wpush.add_argument("-i", "--inventory", default=os.environ.get("FLEETCUDA_INVENTORY", DEFAULT_INVENTORY))
    wpush.add_argument("--limit")
    wpush.add_argument("--dest", default=DEFAULT_DEST, help=f"directory on the targets (default {DEFAULT_DEST})")

    cp = sub.add_parser("cache", help="wheels built on targets and kept here, by ABI fingerprint: list or prune")
    csub = cp.add_subparsers(dest="cache_action", required=True)
    cl = csub.add_parser("list", help="every cached wheel: fingerprint, where and when it was built, its sha256")
    cl.add_argument("--package", help="only this package")
    cl.add_argument("--format", choices=["table", "json"], default="table")
    cr = csub.add_parser("prune", help="remove broken entries (and, with options, others)")
    cr.add_argument("--older-than", type=float, metavar="DAYS", help="also entries not installed for DAYS days")
    cr.add_argument("--package", help="also every entry of this package (with --older-than: only the old ones)")
    cr.add_argument("--all", action="store_true", help="empty the cache")
    cr.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")

    dp = sub.add_parser("doctor", help="per target: nvcc, torch, GPU, causal_conv1d, fla, transformers' fast path")
    dp.add_argument("-i", "--inventory", default=os.environ.get("FLEETCUDA_INVENTORY", DEFAULT_INVENTORY))
    dp.add_argument("--limit")
    dp.add_argument("--format", choices=["table", "json"], default="table")

    tp = sub.add_parser("trust", help="show a host's SSH key and record it in the inventory's known_hosts")
    tp.add_argument("host", help="a host name of the inventory")
    tp.add_argument("-i", "--inventory", default=os.environ.get("FLEETCUDA_INVENTORY", DEFAULT_INVENTORY))
    tp.add_argument("--fingerprint", help="record the key only if its SHA256 fingerprint is this one")
    tp.add_argument("--yes", action="store_true",
                    help="record without asking; only together with --fingerprint (never an unseen key)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The one error boundary: every exception of every command becomes an exit status here."""
    try:
        return int(_main(argv))
    except InputError as exc:  # bad inventory, recipe or argument, from any command: exit 2
        _say(f"fleetcuda: {exc}")
        return ExitStatus.INPUT
    except (UnreachableError, HostKeyError) as exc:
        _say(f"fleetcuda: {exc}")
        return ExitStatus.UNREACHABLE
    except FleetcudaError as exc:
        _say(f"fleetcuda: {exc}")
        return ExitStatus.FAILED
    except BrokenPipeError:  # `fleetcuda ... --dry-run | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitStatus.OK
    except KeyboardInterrupt:
        _say("fleetcuda: interrupted")
        return ExitStatus.INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:
        if os.environ.get("FLEETCUDA_DEBUG"):
            traceback.print_exc()
        _say(f"fleetcuda: internal error (a bug; FLEETCUDA_DEBUG=1 shows where): {type(exc).__name__}: {exc}")
        return ExitStatus.INTERNAL


def _say(text: str) -> None:
    """One line on stderr, 7-bit: whatever bytes a message carries, it cannot garble the terminal."""
    sys.stderr.write(text.encode("ascii", "backslashreplace").decode("ascii") + "\n")


def _main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "limit", None) is not None and not args.limit.strip(" ,\t"):
        # `--limit "$HOSTS"` with HOSTS unset must not mean every target.
        raise InputError("--limit", None, repr(args.limit), "is empty: name hosts, groups, containers or globs")
    # Commands that take no recipe; apply and verify follow.
    other = {"trust": trust, "wheelhouse": wheelhouse, "doctor": doctor_command, "history": show_history,
             "schedule": schedule_command, "cache": cache_command}.get(args.command)
    if other is not None:
        return other(args)
    if args.forks < 1:
        raise InputError("--forks", None, "", "must be at least 1")
    recipe = load_recipe(args.recipe)
    inventory = load_inventory(args.inventory)
    targets = inventory.select(args.limit)
    overrides = parse_var_overrides(args.var)
    if args.command == "apply" and args.dry_run:
        return dry_run(recipe, inventory, targets, overrides)
    # Plan every target now, so a recipe that cannot be rendered is bad input before anything runs.
    for t in targets:
        make_plan(recipe, t, base_values(recipe, t, overrides))
    check_state_dir()  # before anything runs: no run directory, history or report could be made
    reports = _report_targets(args) if args.command == "verify" else []
    mode = "verify" if args.command == "verify" else ("check" if args.check else "apply")
    return execute(recipe, inventory, targets, overrides, mode, args, reports)


REPORTERS = {"json": to_json, "junit": to_junit, "prometheus": to_prometheus}


def _report_targets(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(format, path or None for stdout) for each report this verify run writes."""
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
        if not sep or fmt not in REPORTERS or not path:
            shown = item[:60] if item[:60].isprintable() else ascii(item[:60])
            raise InputError("--report", None, shown, "expected FORMAT=PATH with FORMAT json, junit or prometheus")
        check_output_path("--report", path)
        out.append((fmt, path))
    check_state_dir()  # where the run's logs and history go
    return out


def trust(args: argparse.Namespace) -> int:
    """Record a host key after showing it: never silently, never from cron without a fingerprint."""
    from fleetcuda.connectors.trust import trust as trust_host  # paramiko: loaded only by the commands that connect

    return trust_host(args.inventory, args.host, expected=args.fingerprint, yes=args.yes)


def wheelhouse(args: argparse.Namespace) -> int:
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
            run_download(plan, print)
            for f in files_of(dest):
                print(f"{sha256(f)}  {f.name}")
            return EXIT_OK
        inventory = load_inventory(args.inventory)
        targets = inventory.select(args.limit)
        files = files_of(Path(args.dir))
    except InputError:
        raise  # reported by main(), exit 2
    except FleetcudaError as exc:
        print(f"fleetcuda: {exc}", file=sys.stderr)
        return EXIT_FAILED
    pool = TransportPool(_transport_factory(inventory))
    code = EXIT_OK
    try:
        for t in targets:
            try:
                push(t, pool.get(t.host), files, args.dest, print)
            except (UnreachableError, HostKeyError) as exc:
                print(f"fleetcuda: {t.id}: {exc}", file=sys.stderr)
                code = max(code, EXIT_UNREACHABLE) if code != EXIT_FAILED else code
            except FleetcudaError as exc:
                print(f"fleetcuda: {exc}", file=sys.stderr)
                code = EXIT_FAILED
    finally:
        pool.close()
    return code


def _home(target: Target) -> str | None:
    # A local target's HOME is this user's; containers and SSH hosts get theirs from the planner.
    if target.spec.kind == "local" and target.container is None:
        return str(Path.home())
    return None


def dry_run(recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: dict[str, str]) -> int:
    out = _AsciiWriter(sys.stdout)
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
    return EXIT_OK


class _AsciiWriter:
    """stdout for the dry-run: 7-bit whatever the locale (paths from non-UTF-8 bytes, names), so a paste
    survives any terminal."""

    def __init__(self, stream: object):
        self.stream = stream

    def write(self, text: str) -> None:
        self.stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))  # type: ignore[attr-defined]


def _transport_factory(inventory: Inventory):
    def factory(host: str) -> Transport:
        spec = inventory.spec.hosts[host]
        if spec.kind == "local":
            return LocalTransport()
        from fleetcuda.connectors.ssh import SshTransport  # paramiko: loaded only when a host needs it

        target = next(t for t in inventory.targets if t.host == host)
        assert target.chain.ssh is not None
        return SshTransport(target.chain.ssh)

    return factory


def execute(recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: dict[str, str], mode: str,
            args: argparse.Namespace, reports: list[tuple[str, str | None]]) -> int:
    # A report on stdout keeps stdout for itself: progress and the summary go to stderr then.
    to_stdout = any(path is None for _, path in reports)
    console = Console(stderr=to_stdout)
    reporter: Reporter
    if console.is_terminal and not args.plain:
        reporter = RichReporter(console)
    else:
        reporter = PlainReporter(stream=sys.stderr if to_stdout else sys.stdout, show_output=args.show_output)
    run_dir = make_run_dir(mode, recipe.name)
    pool = TransportPool(_transport_factory(inventory))
    lock = TargetLock(run_owner(), wait_s=getattr(args, "lock_wait", 0)) if mode == "apply" else None
    engine = Engine(recipe, targets, overrides, mode, pool, reporter, run_dir,  # type: ignore[arg-type]
                    forks=args.forks, home=_home, lock=lock)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    # Also when started with SIGINT ignored (a background job of a script): a run that is told to stop must
    # stop its remote steps and release its locks, never keep going, nor die without cleaning up.
    previous_int = signal.signal(signal.SIGINT, on_term)
    started = datetime.now(UTC)
    try:
        reporter.start(mode, recipe.path, [t.id for t in targets])
        try:
            results = engine.run()
        finally:
            reporter.stop()
        return _finish(engine, results, recipe, inventory, targets, mode, args, reports, console, started, run_dir)
    finally:
        # After an interruption the engine ignores further signals until the run is recorded: now it is.
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _finish(engine: Engine, results: list, recipe: Recipe, inventory: Inventory, targets: list[Target], mode: str,
            args: argparse.Namespace, reports: list[tuple[str, str | None]], console: Console, started: datetime,
            run_dir: Path) -> int:
    if engine.interrupted:
        console.print("[magenta]interrupted[/]: what had run, and what was stopped on each target:")
        for line in engine_results_snapshot(engine, targets):
            console.print(f"  {line}", markup=False, highlight=False)
    code = exit_code(results)
    info = RunInfo(mode=mode, recipe_path=recipe.path, recipe_name=recipe.name, inventory_path=inventory.path,
                   started_at=started, finished_at=datetime.now(UTC), exit_code=code, run_dir=str(run_dir))
    if mode == "verify" and args.format == "table":
        render_table(info, results, console)
    else:
        summary(results, console)
    # Each output is written whatever happened to the one before: a report that cannot be written must not
    # cost the history record, nor the history the report.
    for fmt, path in reports:
        text = REPORTERS[fmt](info, results)
        try:
            if path is None:
                sys.stdout.write(text)
            else:
                # node_exporter's textfile collector runs as another user: a metrics file must be readable.
                write_atomically(path, text, mode=0o644 if fmt == "prometheus" else 0o600)
        except OSError as exc:
            _say(f"fleetcuda: could not write the {fmt} report to {path}: {exc}")
            code = ExitStatus.FAILED if code == ExitStatus.OK else code
    if mode != "check" and not getattr(args, "no_history", False):
        try:
            record(default_history_path(), info, results)
        except Exception as exc:  # sqlite3.Error, OSError: the run's result stands; say what was not kept
            _say(f"fleetcuda: warning: this run was not recorded in {default_history_path()}: {exc}")
    if not (mode == "verify" and args.format == "table"):  # the table already says where the logs are
        console.print(f"logs: {run_dir}", markup=False, highlight=False)
    return code


def doctor_command(args: argparse.Namespace) -> int:
    inventory = load_inventory(args.inventory)
    targets = inventory.select(args.limit)
    pool = TransportPool(_transport_factory(inventory))
    reports: dict[str, dict] = {}
    code = EXIT_OK
    try:
        for t in targets:
            try:
                res = pool.get(t.host).run(doctor.command(t, _home(t)), timeout=300, on_line=lambda line: None)
                reports[t.id] = doctor.parse(res.output)
            except (UnreachableError, HostKeyError) as exc:
                reports[t.id] = {"error": str(exc)}
                code = EXIT_UNREACHABLE
    finally:
        pool.close()
    found = {tid: doctor.findings(r) for tid, r in reports.items()}
    if any(f.status == "fail" for items in found.values() for f in items) and code == EXIT_OK:
        code = EXIT_FAILED
    if args.format == "json":
        print(json.dumps({tid: {"report": reports[tid], "findings": [dataclasses.asdict(f) for f in items]}
                          for tid, items in found.items()}, indent=2))
    else:
        doctor.render(found, Console())
    return code


def show_history(args: argparse.Namespace) -> int:
    check_state_dir()
    path = default_history_path()
    try:
        runs = recent_runs(path, limit=args.runs, target_pattern=args.limit)
        diffs = changes(path, target_pattern=args.limit)
    except HistoryError as exc:
        print(f"fleetcuda: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.format == "json":
        print(json.dumps({"history": str(path), "runs": [_plain(r) for r in runs],
                          "changes": [_plain(c) for c in diffs]}, indent=2, default=str))
        return EXIT_OK
    console = Console()
    if not runs:
        console.print(f"no runs recorded in {path}", markup=False)
        return EXIT_OK
    render_history(runs, console, title=f"recent runs ({path})")
    render_history(diffs, console, title="changes since each target's previous verify")
    return EXIT_OK


def _plain(row: object) -> dict[str, object]:
    return dataclasses.asdict(row)  # type: ignore[call-overload]


def cache_command(args: argparse.Namespace) -> int:
    cache = WheelCache()
    if args.cache_action == "prune":
        if args.older_than is not None and args.older_than < 0:
            raise InputError("--older-than", None, str(args.older_than), "must be 0 or more days")
        removed = cache.prune(everything=args.all, older_than_days=args.older_than, package=args.package,
                              dry_run=args.dry_run)
        for path, why in removed:
            print(f"{'would remove' if args.dry_run else 'removed'} {path}: {why}")
        print(f"{len(removed)} entr{'y' if len(removed) == 1 else 'ies'} "
              f"{'would be removed' if args.dry_run else 'removed'} from {cache.root}")
        return EXIT_OK
    items = [i for i in cache.entries()
             if args.package is None or isinstance(i, Problem) or i.fingerprint.get("package") == args.package]
    if args.format == "json":
        print(json.dumps({"cache": str(cache.root), "entries": [
            {"path": str(i.path), "status": "ok", **i.provenance} if isinstance(i, CacheEntry)
            else {"path": str(i.path), "status": "broken", "why": i.why} for i in items]}, indent=2))
        return EXIT_OK
    render_cache(cache.root, items, Console())
    return EXIT_OK


def schedule_command(args: argparse.Namespace) -> int:
    if not args.systemd:
        check_state_dir()  # the crontab's lock, and install's reports, are kept there
    try:
        if args.action == "show":
            found = show_systemd(args.name, args.unit_dir) if args.systemd else show_cron(args.name)
            if not found:
                print(f"no fleetcuda verify job named {args.name!r} is installed")
                return EXIT_FAILED
            if isinstance(found, dict):
                for path, text in found.items():
                    print(f"# {path}\n{text}")
            else:
                print(found)
            return EXIT_OK
        if args.action == "remove":
            removed = remove_systemd(args.name, args.unit_dir) if args.systemd else remove_cron(args.name)
            print(f"removed {args.name!r}" if removed else f"no job named {args.name!r} was installed")
            return EXIT_OK
        if not args.recipe:
            raise InputError("schedule install", None, "recipe", "name the recipe to verify")
        load_recipe(args.recipe)
        load_inventory(args.inventory)
        check_state_dir()
        reports = Path(args.reports_dir) if args.reports_dir else state_dir() / "reports"
        if reports.exists() and not reports.is_dir():
            raise InputError("--reports-dir" if args.reports_dir else "FLEETCUDA_STATE_DIR", None, "",
                             f"{reports} is not a directory")
        argv = [_fleetcuda_executable(), "verify", str(Path(args.recipe).resolve()), "-i",
                str(Path(args.inventory).resolve()), "--plain",
                "--report", f"json={reports / (args.name + '.json')}",
                "--report", f"prometheus={reports / ('fleetcuda_' + args.name + '.prom')}"]
        if args.limit:
            argv += ["--limit", args.limit]
        reports.mkdir(parents=True, exist_ok=True, mode=0o700)
        if args.systemd:
            done = install_systemd(args.name, argv, args.unit_dir, on_calendar=args.on_calendar,
                                   working_directory=str(Path.cwd()))
            print(f"{'wrote' if done.changed else 'unchanged'}: {done.service_path}, {done.timer_path}")
            print(f"activate with: {done.activate_command}")
        else:
            line = cron_line(argv, log_path=str(reports / f"{args.name}.log"), at=args.at, name=args.name,
                             cwd=str(Path.cwd()))
            changed = install_cron(line, args.name)
            print(("installed: " if changed else "already installed: ") + line)
        return EXIT_OK
    except ValueError as exc:
        print(f"fleetcuda: schedule: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except (ScheduleError, OSError) as exc:
        print(f"fleetcuda: schedule: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _fleetcuda_executable() -> str:
    """Cron's PATH will not find a virtualenv's fleetcuda: name the one beside this Python, by absolute path."""
    beside = Path(sys.executable).parent / "fleetcuda"
    if beside.exists():
        return str(beside)
    found = shutil.which("fleetcuda")
    return str(Path(found).resolve()) if found else str(beside)


def engine_results_snapshot(engine: Engine, targets: list[Target]) -> list[str]:
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


if __name__ == "__main__":
    sys.exit(main())
